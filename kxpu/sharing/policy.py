"""Scoring: which device a container should get, and how good a node is for a pod.

Both scores rest on one number, a device's *utilization*: the mean of its three used
fractions — memory granted / memory capacity, cores granted / core capacity, containers
/ split count — so a device is "full" by whichever runs out and "busy" by all three
(HAMi sums the same three fractions, times 10).

- Device level: ``binpack`` gives a container the devices whose utilization *after* the
  grant is highest (filling partly used devices, keeping whole ones free for big or
  exclusive requests); ``spread`` the lowest (less contention for cores and memory
  bandwidth). Ties go to the lower device index, so answers are deterministic.
  (``fit.fit_container`` inlines this ranking: it is the extender's hot loop.)
- Node level: the node's utilization after placing the pod is the mean over its devices
  of the families the pod asks for (unhealthy devices excluded). ``binpack`` scores it
  ``10 x U``, ``spread`` ``10 x (1 - U)``: 0-10, kube-scheduler's extender scale
  (it multiplies by the extender's weight and by 10 to reach its own 0-100). Every node
  that fits gets a score, so kube-scheduler can still weigh its own plugins (affinity,
  taints, balance of CPU and memory) instead of being handed a single node.
"""

from __future__ import annotations

from kxpu.sharing.model import Policy

MAX_SCORE = 10
_BINPACK = Policy.BINPACK  # read once: reading an enum member off its class costs ~0.1 µs (Python 3.11)


def utilization(
    memory: int, memory_capacity: int, cores: int, core_capacity: int, slots: int, split: int
) -> float:
    """Mean used fraction of memory, cores and slots (0 = idle, 1 = full)."""
    total = 0.0
    total += memory / memory_capacity if memory_capacity > 0 else 1.0
    total += cores / core_capacity if core_capacity > 0 else 1.0
    total += slots / split if split > 0 else 1.0
    return total / 3.0


def node_score(util_after: float, policy: Policy) -> float:
    """0-10: how much this node suits the pod under ``policy`` (see the module docstring)."""
    # clamped with comparisons, not min(max()): this runs for every node of every filter
    if util_after < 0.0:
        util_after = 0.0
    elif util_after > 1.0:
        util_after = 1.0
    return MAX_SCORE * (util_after if policy is _BINPACK else 1.0 - util_after)

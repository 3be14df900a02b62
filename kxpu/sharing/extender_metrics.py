"""Prometheus metrics of the scheduler extender (``kxpu scheduler``).

Names are documented in the README; the Grafana dashboard test checks that
``deploy/grafana/kxpu-scheduler.json`` uses only names listed in METRIC_NAMES. What is
allocated per node and device is not kept in gauges that could drift from the cache: a
collector reads ClusterState at scrape time (on the event loop, like every other reader).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kxpu.sharing.state import ClusterState

# kube-scheduler's default extender timeout is 5 s; filter over 1,000 nodes takes milliseconds.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

REQUEST_SECONDS = Histogram(
    "kxpu_scheduler_request_duration_seconds",
    "Extender request handling time, by verb (filter, prioritize, bind)",
    ["verb"],
    buckets=_LATENCY_BUCKETS,
)
DECISIONS = Counter(
    "kxpu_scheduler_decisions",
    "Filter verdicts per node (fit, no-fit) and bind results per pod (bound, bind-failed)",
    ["outcome"],
)
LOCK_WAIT_SECONDS = Histogram(
    "kxpu_scheduler_lock_wait_seconds",
    "Time to take a node lock at bind (compare-and-swap round trips), taken or not",
    buckets=_LATENCY_BUCKETS,
)
LOCK_BUSY = Counter(
    "kxpu_scheduler_lock_busy", "Binds refused because another pod held the node lock (not yet admitted)"
)
LOCK_TAKEOVERS = Counter(
    "kxpu_scheduler_lock_takeovers",
    "Node locks taken over (at a bind) or released (by the sweeper) from a pod that no longer holds them, "
    "by cause (expired, recovered)",
    ["cause"],
)
CACHE_SYNCED = "kxpu_scheduler_cache_synced"
NODE_MEMORY = "kxpu_scheduler_node_memory_allocated_mib"
NODE_CORES = "kxpu_scheduler_node_cores_allocated"
DEVICE_MEMORY = "kxpu_scheduler_device_memory_allocated_mib"
DEVICE_MEMORY_CAPACITY = "kxpu_scheduler_device_memory_capacity_mib"
DEVICE_CORES = "kxpu_scheduler_device_cores_allocated"
DEVICE_CORE_CAPACITY = "kxpu_scheduler_device_core_capacity"
DEVICE_SLOTS = "kxpu_scheduler_device_slots_allocated"

# Label names of the collector's families (the dashboard test checks queries against them).
CACHE_LABELS: dict[str, tuple[str, ...]] = {
    CACHE_SYNCED: (),
    NODE_MEMORY: ("node", "resource"),
    NODE_CORES: ("node", "resource"),
    DEVICE_MEMORY: ("node", "resource", "device"),
    DEVICE_MEMORY_CAPACITY: ("node", "resource", "device"),
    DEVICE_CORES: ("node", "resource", "device"),
    DEVICE_CORE_CAPACITY: ("node", "resource", "device"),
    DEVICE_SLOTS: ("node", "resource", "device"),
}
_HELP = {
    CACHE_SYNCED: "1 once the node and pod caches have synced (the extender is ready)",
    NODE_MEMORY: "Device memory granted on the node (MiB), assigned and assumed pods",
    NODE_CORES: "Compute granted on the node, in percent of one device (200 = two whole devices)",
    DEVICE_MEMORY: "Memory granted on the device (MiB)",
    DEVICE_MEMORY_CAPACITY: "Memory that may be granted on the device (MiB; physical x memoryScaling)",
    DEVICE_CORES: "Compute granted on the device, in percent",
    DEVICE_CORE_CAPACITY: "Compute that may be granted on the device, in percent (100 x coreScaling)",
    DEVICE_SLOTS: "Containers sharing the device",
}

METRIC_NAMES = frozenset(
    {
        "kxpu_scheduler_request_duration_seconds",
        "kxpu_scheduler_decisions",
        "kxpu_scheduler_lock_wait_seconds",
        "kxpu_scheduler_lock_busy",
        "kxpu_scheduler_lock_takeovers",
        *CACHE_LABELS,
    }
)


def takeover_cause(reason: str) -> str:
    """``expired``: the holder never got admitted in time; ``recovered``: its pod is gone or done."""
    return "expired" if reason.startswith(("it expired", "the kubelet never")) else "recovered"


class CacheCollector(Collector):
    """The allocation gauges, read from the extender's ClusterState at scrape time."""

    def __init__(self) -> None:
        self.state: ClusterState | None = None
        self.ready: Callable[[], bool] = lambda: False

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, _HELP[name], labels=labels) for name, labels in CACHE_LABELS.items()
        }
        families[CACHE_SYNCED].add_metric([], 1.0 if self.ready() else 0.0)
        state = self.state
        for node in state.node_names if state is not None else ():
            node_state = state.node(node) if state is not None else None
            if node_state is None:
                continue
            for resource, devices in node_state.families.items():
                families[NODE_MEMORY].add_metric([node, resource], sum(d.memory for d in devices))
                families[NODE_CORES].add_metric([node, resource], sum(d.cores for d in devices))
                for d in devices:
                    labels = [node, resource, d.device.id]
                    families[DEVICE_MEMORY].add_metric(labels, d.memory)
                    families[DEVICE_MEMORY_CAPACITY].add_metric(labels, d.device.memory_capacity_mib)
                    families[DEVICE_CORES].add_metric(labels, d.cores)
                    families[DEVICE_CORE_CAPACITY].add_metric(labels, d.device.core_capacity)
                    families[DEVICE_SLOTS].add_metric(labels, d.slots)
        yield from families.values()


CACHE = CacheCollector()
REGISTRY.register(CACHE)

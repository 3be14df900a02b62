"""The scheduler's bookkeeping: every node's devices and what assigned pods use, kept incrementally.

Fed by watch events (``kxpu.kube.sharing.informer``) or directly by tests and benchmarks;
never by listing the API per request. Usage of a node is the sum of the assignments of
its live pods (not Succeeded/Failed, not gone) plus *assumed* assignments: decisions made
at bind whose pod update the watch has not delivered yet, so two binds in a row never
count the same free memory twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kxpu.logs import get_logger
from kxpu.sharing import inventory
from kxpu.sharing.fit import NodeState
from kxpu.sharing.lock import LOCK_PROTOCOL_ANNOTATION, lock_key
from kxpu.sharing.model import Assignment, NodeInventory
from kxpu.sharing.placement import NodeFacts

log = get_logger("kxpu.sharing.state")


@dataclass(slots=True)
class _NodeEntry:
    state: NodeState
    raw: dict[str, str]  # resource → annotation text last decoded
    seen: dict[str, float]  # resource → monotonic time the annotation last changed
    oldest: float = math.inf  # the earliest of ``seen``: no inventory can be stale before it is

    def saw(self, resource: str, now: float) -> None:
        self.seen[resource] = now
        self.oldest = min(self.seen.values())

    def unsee(self, resource: str) -> None:
        """A dropped inventory cannot go stale: it must not keep the node on the slow staleness path."""
        self.seen.pop(resource, None)
        self.oldest = min(self.seen.values(), default=math.inf)


class ClusterState:
    def __init__(
        self,
        resources: Iterable[str],
        stale_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.resources = tuple(resources)
        self._keys = {r: inventory.annotation_key(r) for r in self.resources}
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._nodes: dict[str, _NodeEntry] = {}
        self._pods: dict[str, Assignment] = {}  # uid → assignment of a live pod
        self._assumed: dict[str, Assignment] = {}
        self._by_node: dict[str, set[str]] = {}  # node → uids in _pods or _assumed
        self._lock_keys = {r: lock_key(r) for r in self.resources}
        self._locked: set[str] = set()  # nodes whose lock (any family) a pod holds between bind and Allocate
        self._locks: dict[str, dict[str, str]] = {}  # node → resource → lock text, as last seen
        self._versions: dict[str, str] = {}  # node → the Node object's resourceVersion, as last seen
        self._lease_nodes: set[str] = set()  # nodes whose daemon reads lock Leases (kxpu.io/lock-protocol)
        # node → resource → (the lock Lease's resourceVersion, lock text or None), as last seen
        self._leases: dict[str, dict[str, tuple[str, str | None]]] = {}
        # node → labels, taints, cordon, as the node watch last saw them (bind checks the pod may run there)
        self._facts: dict[str, NodeFacts] = {}
        self.generation = 0  # moves on every change of any node's devices or usage
        self._retired_version = 0  # the highest version a removed node reached

    # -- nodes ---------------------------------------------------------------------------------

    def set_node(
        self, name: str, annotations: Mapping[str, str], resource_version: str | None = None
    ) -> None:
        """A node was added or changed: decode the inventories whose annotation text changed."""
        if resource_version is None:
            self._versions.pop(name, None)
        else:
            self._versions[name] = resource_version
        locks = {r: annotations[key] for r, key in self._lock_keys.items() if key in annotations}
        if annotations.get(LOCK_PROTOCOL_ANNOTATION) == "lease":
            self._lease_nodes.add(name)
        else:
            self._lease_nodes.discard(name)
        if locks:
            self._locked.add(name)
            self._locks[name] = locks
        elif not self._lease_held(name):
            self._locked.discard(name)
            self._locks.pop(name, None)
        else:
            self._locks.pop(name, None)
        entry = self._entry(name)
        changed = False
        for resource, key in self._keys.items():
            text = annotations.get(key)
            if text == entry.raw.get(resource):
                continue
            entry.saw(resource, self.clock())
            if text is None:
                entry.raw.pop(resource, None)
                entry.unsee(resource)
                entry.state.drop_inventory(resource)
                changed = True
                continue
            entry.raw[resource] = text
            try:
                decoded = inventory.decode(text, resource)
            except inventory.InventoryError as exc:
                log.warning(
                    "ignoring a bad inventory annotation", node=name, resource=resource, error=str(exc)
                )
                entry.state.drop_inventory(resource)
                changed = True
                continue
            old = entry.state.families.get(resource)
            if old is not None and [s.device for s in old] == list(decoded.devices):
                continue  # only the timestamp moved (a heartbeat)
            entry.state.set_inventory(decoded)
            changed = True
        if changed:
            self._recount(name)
            self.generation += 1

    def set_inventory(self, name: str, inv: NodeInventory) -> None:
        """Tests and benchmarks: install an inventory without the annotation round trip."""
        entry = self._entry(name)
        entry.state.set_inventory(inv)
        entry.saw(inv.resource, self.clock())
        self._recount(name)
        self.generation += 1

    def _entry(self, name: str) -> _NodeEntry:
        """The node's entry, created with versions above every removed node's.

        Caches key results by (node, version) (the scheduler's fit memo): a node deleted and
        re-created under its name must never show a version its predecessor had.
        """
        entry = self._nodes.get(name)
        if entry is None:
            entry = self._nodes[name] = _NodeEntry(NodeState(name, version=self._retired_version + 1), {}, {})
        return entry

    def set_node_facts(self, name: str, facts: NodeFacts) -> None:
        self._facts[name] = facts

    def node_facts(self, name: str) -> NodeFacts | None:
        """The node's labels, taints and cordon; None if the node is unknown (never seen, or gone).

        A node given only an inventory (tests, benchmarks) has no labels, taints or cordon."""
        facts = self._facts.get(name)
        if facts is None and name in self._nodes:
            return NodeFacts()
        return facts

    def remove_node(self, name: str) -> None:
        self._facts.pop(name, None)
        entry = self._nodes.pop(name, None)
        if entry is not None:
            self._retired_version = max(self._retired_version, entry.state.version)
        self._locks.pop(name, None)
        if not self._lease_held(name):
            self._locked.discard(name)
        self._lease_nodes.discard(name)
        self._versions.pop(name, None)
        self.generation += 1

    def node(self, name: str) -> NodeState | None:
        """The node's state, without inventories not refreshed within ``stale_after_s``."""
        return self.nodes((name,))[0]

    def nodes(self, names: Iterable[str]) -> list[NodeState | None]:
        """``node`` for many names at one instant: filter and prioritize ask it for every node.

        One clock read for all, and one comparison with a node's oldest refresh settles the
        usual case, that none of its inventories is stale.
        """
        get = self._nodes.get
        limit = self.stale_after_s
        if limit is None:
            return [None if (e := get(n)) is None else e.state for n in names]
        now = self.clock()
        return [
            None if (e := get(n)) is None else e.state if now - e.oldest <= limit else self._fresh(e, now)
            for n in names
        ]

    def _fresh(self, entry: _NodeEntry, now: float) -> NodeState:
        """A copy (version -1) of a state with a stale-looking inventory, without those stale at ``now``."""
        limit = self.stale_after_s
        assert limit is not None  # nodes() asks only when a limit is set and the oldest refresh passed it
        stale = [r for r in entry.state.families if now - entry.seen.get(r, now) > limit]
        if not stale:
            return entry.state
        fresh = NodeState(entry.state.name, {r: s for r, s in entry.state.families.items() if r not in stale})
        fresh.version = -1
        return fresh

    def locked(self, name: str) -> bool:
        """Whether a pod holds the node's lock, as last seen (a bind there would wait for its Allocate)."""
        return name in self._locked

    def lock_view(self, name: str, resource: str) -> tuple[str, str | None] | None:
        """(resourceVersion, lock text or None) of the node as last seen; None if unknown.

        Lets the extender take a free lock with one compare-and-swap instead of a read first;
        a stale view only costs a 409 and the read.
        """
        version = self._versions.get(name)
        if version is None:
            return None
        return version, self._locks.get(name, {}).get(resource)

    def held_locks(self) -> list[tuple[str, str, str]]:
        """(node, resource, lock text) of every node lock as last seen: what the lock sweeper checks."""
        return [(node, r, text) for node, locks in self._locks.items() for r, text in locks.items()]

    def lease_node(self, name: str) -> bool:
        """Whether the node's daemon reads lock Leases (it announces kxpu.io/lock-protocol: lease)."""
        return name in self._lease_nodes

    def _lease_held(self, name: str) -> bool:
        return any(text is not None for _, text in self._leases.get(name, {}).values())

    def set_lease(self, node: str, resource: str, version: str | None, text: str | None) -> None:
        """A lock Lease as the Lease watch shows it (version None: deleted)."""
        if version is None:
            self._leases.get(node, {}).pop(resource, None)
        else:
            self._leases.setdefault(node, {})[resource] = (version, text)
        if self._lease_held(node) or node in self._locks:
            self._locked.add(node)
        else:
            self._locked.discard(node)

    def lease_view(self, node: str, resource: str) -> tuple[str, str | None] | None:
        """(resourceVersion, lock text or None) of the node's lock Lease as last seen; None if unknown."""
        return self._leases.get(node, {}).get(resource)

    def held_leases(self) -> list[tuple[str, str, str]]:
        """(node, resource, lock text) of every lock held in a Lease as last seen."""
        return [
            (node, r, text)
            for node, leases in self._leases.items()
            for r, (_, text) in leases.items()
            if text
        ]

    def lease_keys(self) -> set[tuple[str, str]]:
        return {(node, r) for node, leases in self._leases.items() for r in leases}

    def mark_locked(self, name: str) -> None:
        """We just took the node's lock: count it before the node watch shows it."""
        self._locked.add(name)

    @property
    def node_names(self) -> list[str]:
        return list(self._nodes)

    def _recount(self, name: str) -> None:
        entry = self._nodes.get(name)
        if entry is None:
            return
        state = entry.state
        for resource in list(state.families):
            state.set_inventory(NodeInventory(resource, tuple(s.device for s in state.families[resource])))
        for uid in self._by_node.get(name, ()):
            assignment = self._assumed.get(uid) or self._pods.get(uid)
            if assignment is not None:
                state.apply(assignment)

    # -- pods ----------------------------------------------------------------------------------

    def _apply(self, assignment: Assignment, sign: int) -> None:
        entry = self._nodes.get(assignment.node)
        if entry is not None:
            entry.state.apply(assignment, sign)

    def _current(self, uid: str) -> Assignment | None:
        return self._assumed.get(uid) or self._pods.get(uid)

    def _replace(self, uid: str, pods: Assignment | None, assumed: Assignment | None) -> None:
        before = self._current(uid)
        if pods is None:
            self._pods.pop(uid, None)
        else:
            self._pods[uid] = pods
        if assumed is None:
            self._assumed.pop(uid, None)
        else:
            self._assumed[uid] = assumed
        after = self._current(uid)
        if before == after:
            return
        self.generation += 1
        if before is not None:
            self._apply(before, -1)
            self._by_node.get(before.node, set()).discard(uid)
        if after is not None:
            self._apply(after, 1)
            self._by_node.setdefault(after.node, set()).add(uid)

    def set_pod(self, uid: str, assignment: Assignment | None) -> None:
        """A pod's live assignment as the API shows it (None: none, or the pod finished)."""
        assumed = self._assumed.get(uid)
        if assumed is not None and assignment == assumed:
            assumed = None  # the watch caught up with our own bind
        self._replace(uid, assignment, assumed)

    def remove_pod(self, uid: str) -> None:
        self._replace(uid, None, None)

    def assume(self, assignment: Assignment) -> None:
        """Count a decision made at bind before the watch shows it on the pod."""
        self._replace(assignment.pod_uid, self._pods.get(assignment.pod_uid), assignment)

    def forget(self, uid: str) -> None:
        """A bind failed: drop its assumed assignment."""
        self._replace(uid, self._pods.get(uid), None)

    def pod_uids(self) -> set[str]:
        return set(self._pods)

    def assignment(self, uid: str) -> Assignment | None:
        return self._current(uid)

    def assignments_on(self, node: str) -> list[Assignment]:
        return [a for uid in self._by_node.get(node, ()) if (a := self._current(uid)) is not None]

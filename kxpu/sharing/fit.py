"""Does a pod fit a node, and on which devices: pure functions over a node's device usage.

A node's state is its inventory (per family) plus what the assignments of the pods bound
to it use. ``fit_pod`` places the pod's containers one by one in spec order, each on
``count`` distinct devices, counting what earlier containers of the same pod took; it
never changes the state it is given. A device takes a container only if it is healthy,
accepted by the pod's type/UUID filter, below its split count, has the memory and cores
left, and is not held exclusively — and an exclusive request (100 cores) needs a device
nobody uses. With NUMA binding a container's devices all come from one NUMA node.

``fit_scorer`` gives filter and prioritize ``fit_pod``'s verdict and score without the
placement, for the common pod from a per-node summary of each device family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kxpu.sharing.model import (
    EXCLUSIVE_CORES,
    Assignment,
    ContainerAssignment,
    ContainerRequest,
    DeviceFilter,
    DeviceGrant,
    NodeInventory,
    PodRequest,
    Policy,
    SharedDevice,
)
from kxpu.sharing.policy import node_score, utilization


@dataclass(slots=True)
class DeviceState:
    device: SharedDevice
    memory: int = 0
    cores: int = 0
    slots: int = 0
    exclusive: int = 0  # containers holding the device exclusively (0 or 1 unless overcommitted)
    # copies of the device's facts and reciprocals of its capacities (0 for a zero capacity):
    # the hot loop reads one object's slots and multiplies
    usable: bool = field(init=False, default=True)
    index: int = field(init=False, default=0)
    memory_mib: int = field(init=False, default=0)
    memory_capacity: int = field(init=False, default=0)
    core_capacity: int = field(init=False, default=0)
    split: int = field(init=False, default=0)
    inv_memory: float = field(init=False, default=0.0)
    inv_cores: float = field(init=False, default=0.0)
    inv_split: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        d = self.device
        self.usable = d.healthy
        self.index = d.index
        self.memory_mib = d.memory_mib
        self.memory_capacity = d.memory_capacity_mib
        self.core_capacity = d.core_capacity
        self.split = d.split_count
        self.inv_memory = 1.0 / d.memory_capacity_mib if d.memory_capacity_mib > 0 else 0.0
        self.inv_cores = 1.0 / d.core_capacity if d.core_capacity > 0 else 0.0
        self.inv_split = 1.0 / d.split_count if d.split_count > 0 else 0.0

    def utilization(self) -> float:
        d = self.device
        return utilization(
            self.memory, d.memory_capacity_mib, self.cores, d.core_capacity, self.slots, d.split_count
        )


@dataclass(slots=True)
class NodeState:
    """One node's devices per family and their usage; ``version`` moves on every change."""

    name: str
    families: dict[str, list[DeviceState]] = field(default_factory=dict)
    version: int = 0
    # resource → (version, sum of healthy devices' utilization, healthy devices)
    _util: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    # (resource, policy) → (version, usable devices in preference order), for homogeneous families only
    _order: dict[tuple[str, Policy], tuple[int, list[DeviceState] | None]] = field(default_factory=dict)
    # resource → (version, the family's summary, None for a mixed or missing family)
    _summary: dict[str, tuple[int, FamilySummary | None]] = field(default_factory=dict)

    def set_inventory(self, inventory: NodeInventory) -> None:
        self.families[inventory.resource] = [DeviceState(d) for d in inventory.devices]
        self.version += 1

    def drop_inventory(self, resource: str) -> None:
        self.families.pop(resource, None)
        self.version += 1

    def utilization_sum(self, resource: str) -> tuple[float, int]:
        cached = self._util.get(resource)
        if cached is not None and cached[0] == self.version:
            return cached[1], cached[2]
        total, healthy = 0.0, 0
        for state in self.families.get(resource, ()):
            if state.device.healthy:
                total += state.utilization()
                healthy += 1
        self._util[resource] = (self.version, total, healthy)
        return total, healthy

    def preference_order(self, resource: str, policy: Policy) -> list[DeviceState] | None:
        """Usable devices from most to least preferred under ``policy``, if the family is homogeneous.

        When every device has the same capacities and split count, a grant adds the same
        amount to each device's utilization, so the order after a grant is the order now:
        the first devices of this list that can take a request are the ones
        ``fit_container`` would choose. None for mixed families (they take the full scan).
        """
        cached = self._order.get((resource, policy))
        if cached is not None and cached[0] == self.version:
            return cached[1]
        states = self.families.get(resource, [])
        order: list[DeviceState] | None = None
        if _homogeneous(states):
            usable = [s for s in states if s.usable]
            sign = -1.0 if policy is Policy.BINPACK else 1.0

            def key(s: DeviceState) -> tuple[float, int]:
                util = s.memory * s.inv_memory + s.cores * s.inv_cores + s.slots * s.inv_split
                return (sign * util, s.index)

            order = sorted(usable, key=key)
        self._order[(resource, policy)] = (self.version, order)
        return order

    def summary(self, resource: str) -> FamilySummary | None:
        """The family reduced to what decides a one-container fit (see ``FamilySummary``), if homogeneous."""
        cached = self._summary.get(resource)
        if cached is not None and cached[0] == self.version:
            return cached[1]
        states = self.families.get(resource, [])
        summary: FamilySummary | None = None
        if _homogeneous(states):
            total, healthy = self.utilization_sum(resource)
            takers: list[tuple[int, int, int]] = []
            closed: dict[str, int] = {}
            for s in states:
                # as _reason, in its order, for what does not depend on the request (usable: healthy)
                why = (
                    "unhealthy"
                    if not s.usable
                    else "held exclusively"
                    if s.exclusive
                    else "split count reached"
                    if s.slots >= s.split
                    else ""
                )
                if why:
                    closed[why] = closed.get(why, 0) + 1
                else:
                    takers.append((s.memory_capacity - s.memory, s.core_capacity - s.cores, s.slots))
            first = states[0]
            summary = FamilySummary(
                tuple(sorted(takers, reverse=True)),  # most free memory first: usually settles a fit at once
                tuple(closed.items()),
                first.memory_mib,
                first.inv_memory,
                first.inv_cores,
                first.inv_split,
                total,
                healthy,
            )
        self._summary[resource] = (self.version, summary)
        return summary

    def apply(self, assignment: Assignment | Iterable[ContainerAssignment], sign: int = 1) -> None:
        """Add (sign 1) or remove (sign -1) what an assignment uses; unknown devices are skipped."""
        containers = assignment.containers if isinstance(assignment, Assignment) else assignment
        for container in containers:
            states = self.families.get(container.resource)
            if states is None:
                continue
            by_id = {s.device.id: s for s in states}
            for grant in container.devices:
                state = by_id.get(grant.device)
                if state is None:
                    continue
                state.memory += sign * grant.memory_mib
                state.cores += sign * grant.cores
                state.slots += sign
                if grant.cores >= EXCLUSIVE_CORES:
                    state.exclusive += sign
        self.version += 1


def _homogeneous(states: Sequence[DeviceState]) -> bool:
    """Whether a family's devices all have the same capacities and split count (and there are some)."""
    return len({(s.memory_mib, s.memory_capacity, s.core_capacity, s.split) for s in states}) == 1


@dataclass(frozen=True, slots=True)
class FamilySummary:
    """A homogeneous family at one node version, reduced to what decides a one-container fit and its score.

    When every device has the same capacities and split count, a grant adds the same
    utilization whichever device takes it, so whether a container fits, and the node's
    score after it, depend only on how many devices have room for it, never on which
    ones ``fit_container`` would pick: ``fit_scorer`` answers from this without ranking
    devices or building a ``Placement``. A node without room is rejected as quickly, and
    its misfit reason counted from ``closed`` and the few ``takers``, not device by device.
    """

    # (free memory, free cores, containers) of each device that may take one more container, most memory first
    takers: tuple[tuple[int, int, int], ...]
    # why the others take none ("unhealthy", "held exclusively", "split count reached") and how many
    closed: tuple[tuple[str, int], ...]
    memory_mib: int  # physical memory of each device (what a percentage is of)
    inv_memory: float
    inv_cores: float
    inv_split: float
    utilization: float  # sum over healthy devices, as ``NodeState.utilization_sum``
    healthy: int


class Placement:
    """Where a pod's containers go and the node's score (0-10, see ``kxpu.sharing.policy``).

    The extender builds one per node and pod but needs the grants only for the node it
    binds to, so a placement keeps its raw choice and builds ``containers`` on first use.
    """

    __slots__ = ("_built", "_parts", "score")

    def __init__(
        self,
        parts: list[tuple[str, ContainerRequest, list[tuple[DeviceState, int]]]],
        score: float,
    ) -> None:
        self._parts = parts
        self._built: tuple[ContainerAssignment, ...] | None = None
        self.score = score

    @property
    def containers(self) -> tuple[ContainerAssignment, ...]:
        if self._built is None:
            self._built = tuple(
                ContainerAssignment(
                    req.container,
                    resource,
                    tuple(DeviceGrant(s.device.id, s.device.uuid, memory, req.cores) for s, memory in chosen),
                )
                for resource, req, chosen in self._parts
            )
        return self._built

    def __repr__(self) -> str:
        return f"Placement(score={self.score:.2f}, containers={self.containers!r})"


@dataclass(frozen=True, slots=True)
class Misfit:
    reason: str


# Tentative usage by earlier containers of the same pod: device id → [memory, cores, slots, exclusive].
_Extra = dict[str, list[int]]
_Candidate = tuple[float, int, DeviceState, int]  # (rank, index, state, memory granted)


def _reason(state: DeviceState, req: ContainerRequest, device_filter: DeviceFilter, extra: _Extra) -> str:
    """Why a device cannot take ``req`` (only called to explain a misfit)."""
    d = state.device
    more = extra.get(d.id, (0, 0, 0, 0))
    memory, cores, slots = state.memory + more[0], state.cores + more[1], state.slots + more[2]
    if not d.healthy:
        return "unhealthy"
    if not device_filter.empty and not device_filter.accepts(d):
        return "excluded by type/uuid"
    if state.exclusive + more[3]:
        return "held exclusively"
    if slots >= d.split_count:
        return "split count reached"
    if req.cores >= EXCLUSIVE_CORES and slots:
        return "in use (exclusive request)"
    if memory + req.memory_for(d) > d.memory_capacity_mib:
        return "not enough memory"
    if cores + req.cores > d.core_capacity:
        return "not enough cores"
    return "fits"


def fit_container(
    states: Sequence[DeviceState],
    req: ContainerRequest,
    device_filter: DeviceFilter,
    numa_bind: bool,
    policy: Policy,
    extra: _Extra,
) -> list[tuple[DeviceState, int]] | str:
    """The devices (with the memory each grants) for one container, or why none fit.

    The hot loop of the extender (every node, every device, every pod): checks are
    inlined and ranking is the utilization after the grant (see ``policy``), negated for
    binpack so that the smallest key is always the preferred device.
    """
    cores_req = req.cores
    fixed = req.memory_mib
    pct = req.memory_percentage or 0
    exclusive_req = cores_req >= EXCLUSIVE_CORES
    filtering = not device_filter.empty
    sign = -1.0 if policy is Policy.BINPACK else 1.0
    single = req.count == 1
    best: _Candidate | None = None
    found = 0
    candidates: list[_Candidate] = []
    for state in states:
        if not state.usable or (filtering and not device_filter.accepts(state.device)):
            continue
        memory, cores, slots, exclusive = state.memory, state.cores, state.slots, state.exclusive
        if extra:
            more = extra.get(state.device.id)
            if more is not None:
                memory += more[0]
                cores += more[1]
                slots += more[2]
                exclusive += more[3]
        if exclusive or slots >= state.split or (exclusive_req and slots):
            continue
        wanted = fixed if fixed is not None else state.memory_mib * pct // 100
        memory += wanted
        cores += cores_req
        if memory > state.memory_capacity or cores > state.core_capacity:
            continue
        rank = sign * (memory * state.inv_memory + cores * state.inv_cores + (slots + 1) * state.inv_split)
        found += 1
        if single:
            if best is None or rank < best[0] or (rank == best[0] and state.index < best[1]):
                best = (rank, state.index, state, wanted)
        else:
            candidates.append((rank, state.index, state, wanted))
    if single and best is not None:
        return [(best[2], best[3])]
    count = req.count
    if found < count:
        return _shortfall(states, req, device_filter, extra, found)
    candidates.sort(key=_rank)
    if not numa_bind:
        return [(c[2], c[3]) for c in candidates[:count]]
    groups: dict[int | None, list[_Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(candidate[2].device.numa, []).append(candidate)
    chosen: list[_Candidate] | None = None
    chosen_key: tuple[float, int] | None = None
    for members in groups.values():
        if len(members) < count:
            continue
        key = (sum(c[0] for c in members[:count]), min(c[1] for c in members[:count]))
        if chosen_key is None or key < chosen_key:
            chosen, chosen_key = members[:count], key
    if chosen is None:
        return f"container {req.container!r} needs {count} devices on one NUMA node, none has them"
    return [(c[2], c[3]) for c in chosen]


def _shortfall(
    states: Sequence[DeviceState],
    req: ContainerRequest,
    device_filter: DeviceFilter,
    extra: _Extra,
    found: int,
) -> str:
    """The misfit reason when only ``found`` devices can take ``req``: how many fail on each count."""
    reasons: dict[str, int] = {}
    for state in states:
        why = _reason(state, req, device_filter, extra)
        if why != "fits":
            reasons[why] = reasons.get(why, 0) + 1
    return _shortfall_text(req, found, reasons)


def _shortfall_text(req: ContainerRequest, found: int, reasons: Mapping[str, int]) -> str:
    detail = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "no devices"
    return f"container {req.container!r} needs {req.count}, {found} fit ({detail})"


def _rank(candidate: _Candidate) -> tuple[float, int]:
    return (candidate[0], candidate[1])


def fit_pod(
    requests: Sequence[PodRequest],
    node: NodeState,
    node_policy: Policy = Policy.BINPACK,
    device_policy: Policy = Policy.SPREAD,
) -> Placement | Misfit:
    """Place every container of ``requests`` on ``node``; the per-pod policies override the defaults."""
    if len(requests) == 1 and len(requests[0].containers) == 1:
        return _fit_one(requests[0], node, node_policy, device_policy)
    extras: dict[str, _Extra] = {}
    placed: list[tuple[str, ContainerRequest, list[tuple[DeviceState, int]]]] = []
    chosen_node_policy = node_policy
    touched: dict[str, dict[str, DeviceState]] = {}
    for pod_request in requests:
        states = node.families.get(pod_request.resource)
        if not states:
            return Misfit(f"no {pod_request.resource} devices")
        policy = pod_request.device_policy or device_policy
        extra = extras.setdefault(pod_request.resource, {})
        mine = touched.setdefault(pod_request.resource, {})
        chosen_node_policy = pod_request.node_policy or chosen_node_policy
        for req in pod_request.containers:
            result = fit_container(
                states, req, pod_request.device_filter, pod_request.numa_bind, policy, extra
            )
            if isinstance(result, str):
                return Misfit(result)
            for state, memory in result:
                d = state.device
                more = extra.get(d.id)
                if more is None:
                    more = extra[d.id] = [0, 0, 0, 0]
                    mine[d.id] = state
                more[0] += memory
                more[1] += req.cores
                more[2] += 1
                more[3] += 1 if req.exclusive else 0
            placed.append((pod_request.resource, req, result))
    total = 0.0
    counted = 0
    for resource, mine in touched.items():
        base, healthy = node.utilization_sum(resource)
        total += base
        counted += healthy
        extra = extras[resource]
        for device_id, state in mine.items():
            more = extra[device_id]
            if state.device.healthy:  # utilization is linear: add what this pod adds
                total += (
                    more[0] * state.inv_memory + more[1] * state.inv_cores + more[2] * state.inv_split
                ) / 3
    util = total / counted if counted else 0.0
    return Placement(placed, node_score(util, chosen_node_policy))


def _fit_one(
    pod_request: PodRequest, node: NodeState, node_policy: Policy, device_policy: Policy
) -> Placement | Misfit:
    """``fit_pod`` for the common pod: one container of one family (no bookkeeping between containers)."""
    states = node.families.get(pod_request.resource)
    if not states:
        return Misfit(f"no {pod_request.resource} devices")
    req = pod_request.containers[0]
    policy = pod_request.device_policy or device_policy
    result: list[tuple[DeviceState, int]] | str | None = None
    if req.count == 1 or not pod_request.numa_bind:
        order = node.preference_order(pod_request.resource, policy)
        if order is not None:
            result = _first_fitting(order, req, pod_request.device_filter)
    if result is None:
        result = fit_container(states, req, pod_request.device_filter, pod_request.numa_bind, policy, {})
    if isinstance(result, str):
        return Misfit(result)
    total, healthy = node.utilization_sum(pod_request.resource)
    cores = req.cores
    for state, memory in result:
        if state.usable:
            total += (memory * state.inv_memory + cores * state.inv_cores + state.inv_split) / 3
    util = total / healthy if healthy else 0.0
    return Placement(
        [(pod_request.resource, req, result)], node_score(util, pod_request.node_policy or node_policy)
    )


def _first_fitting(
    order: Sequence[DeviceState], req: ContainerRequest, device_filter: DeviceFilter
) -> list[tuple[DeviceState, int]] | None:
    """The first ``req.count`` devices of a preference order that can take ``req`` (None: too few)."""
    chosen: list[tuple[DeviceState, int]] = []
    cores_req = req.cores
    exclusive_req = cores_req >= EXCLUSIVE_CORES
    filtering = not device_filter.empty
    for state in order:
        if filtering and not device_filter.accepts(state.device):
            continue
        slots = state.slots
        if state.exclusive or slots >= state.split or (exclusive_req and slots):
            continue
        wanted = req.memory_for(state.device)
        if state.memory + wanted > state.memory_capacity or state.cores + cores_req > state.core_capacity:
            continue
        chosen.append((state, wanted))
        if len(chosen) == req.count:
            return chosen
    return None


def fit_scorer(
    requests: Sequence[PodRequest],
    node_policy: Policy = Policy.BINPACK,
    device_policy: Policy = Policy.SPREAD,
) -> Callable[[NodeState], float | Misfit]:
    """``fit_pod``'s score, or its Misfit, for one pod on node after node: what filter and prioritize need.

    They ask about every node but use no grants (bind fits again), so the common pod —
    one container of one family, no type/UUID filter, NUMA binding only for one device —
    is answered from the node's ``FamilySummary``: no device ranking, no Placement, nothing
    for the collector to track. Other pods, and mixed families, take ``fit_pod``. The
    answers are ``fit_pod``'s to the bit (tests/test_sharing_core.py checks it).
    """

    def full(node: NodeState) -> float | Misfit:
        result = fit_pod(requests, node, node_policy, device_policy)
        return result.score if isinstance(result, Placement) else result

    if len(requests) != 1 or len(requests[0].containers) != 1:
        return full
    pod_request = requests[0]
    req = pod_request.containers[0]
    count, fixed, pct, cores = req.count, req.memory_mib, req.memory_percentage or 0, req.cores
    if not pod_request.device_filter.empty or (count > 1 and pod_request.numa_bind):
        return full
    resource = pod_request.resource
    exclusive_req = cores >= EXCLUSIVE_CORES
    policy = pod_request.node_policy or node_policy

    def quick(node: NodeState) -> float | Misfit:
        summary = node.summary(resource)
        if summary is None:
            return full(node)
        wanted = fixed if fixed is not None else summary.memory_mib * pct // 100
        found = 0
        for free_memory, free_cores, slots in summary.takers:
            if wanted <= free_memory and cores <= free_cores and not (exclusive_req and slots):
                found += 1
                if found == count:
                    break
        else:
            return Misfit(_quick_shortfall(summary, req, wanted, found))
        # as _fit_one adds each granted device's share, in the same float operations
        total = summary.utilization
        grant = (wanted * summary.inv_memory + cores * summary.inv_cores + summary.inv_split) / 3
        for _ in range(count):
            total += grant
        return node_score(total / summary.healthy if summary.healthy else 0.0, policy)

    return quick


def _quick_shortfall(summary: FamilySummary, req: ContainerRequest, wanted: int, found: int) -> str:
    """``_shortfall``'s reason for a one-container request, counted from a family's summary."""
    reasons = dict(summary.closed)
    exclusive_req = req.cores >= EXCLUSIVE_CORES
    for free_memory, free_cores, slots in summary.takers:
        # as _reason, in its order, for what depends on the request
        if exclusive_req and slots:
            why = "in use (exclusive request)"
        elif wanted > free_memory:
            why = "not enough memory"
        elif req.cores > free_cores:
            why = "not enough cores"
        else:
            continue
        reasons[why] = reasons.get(why, 0) + 1
    return _shortfall_text(req, found, reasons)


def usage_of(assignments: Iterable[Assignment], inventories: Mapping[str, NodeInventory]) -> NodeState:
    """A node state built from scratch (tests and recovery); the cache keeps one incrementally."""
    node = NodeState("")
    for inventory in inventories.values():
        node.set_inventory(inventory)
    for assignment in assignments:
        node.apply(assignment)
    return node

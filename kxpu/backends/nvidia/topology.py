"""Interconnect between GPUs, measured once through NVML, and the choice of the best-connected set.

Scoring, for a candidate set of GPUs, summed over every pair in it and compared in order:

1. **NVLink links** between the pair. Links whose remote end is another GPU count directly;
   links that end on an NVSwitch (a remote PCI address that is not a GPU) connect every two
   GPUs reaching the same switch, counted as the smaller of their link counts to it. More
   links means more peer bandwidth for collectives, which is what multi-GPU jobs need most.
2. **PCIe proximity** from ``nvmlDeviceGetTopologyCommonAncestor``: same board (5), one
   PCIe switch (4), several switches (3), one host bridge (2), one NUMA node (1), across
   the CPU interconnect (0). It decides between sets NVLink cannot tell apart.
3. **NUMA**: pairs on the same known NUMA node, so host memory stays local.

Sets are compared lexicographically on these three sums, so a single NVLink outweighs any
PCIe advantage, and NUMA only breaks ties. Sets are enumerated exactly when that is cheap
(≤ 5000 combinations, e.g. any request on an 8-GPU node) and grown greedily otherwise.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import uuid as uuidlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kxpu.backends.links import link_groups
from kxpu.backends.nvidia.discovery import GpuInfo, linux_pci_address
from kxpu.backends.nvidia.nvml import Nvml, describe, text
from kxpu.logs import get_logger

log = get_logger("kxpu.backends.nvidia")

MAX_EXACT_COMBINATIONS = 5000
PairScore = tuple[int, int, int]


@dataclass
class Topology:
    nvlinks: dict[frozenset[str], int] = field(default_factory=dict)
    pcie: dict[frozenset[str], int] = field(default_factory=dict)
    numa: dict[str, int | None] = field(default_factory=dict)

    def pair(self, a: str, b: str) -> PairScore:
        key = frozenset((a, b))
        na, nb = self.numa.get(a), self.numa.get(b)
        return (self.nvlinks.get(key, 0), self.pcie.get(key, 0), int(na is not None and na == nb))


def _pcie_scores(nvml: Nvml) -> dict[int, int]:
    levels = [
        ("NVML_TOPOLOGY_INTERNAL", 5),
        ("NVML_TOPOLOGY_SINGLE", 4),
        ("NVML_TOPOLOGY_MULTIPLE", 3),
        ("NVML_TOPOLOGY_HOSTBRIDGE", 2),
        ("NVML_TOPOLOGY_NODE", 1),
        ("NVML_TOPOLOGY_SYSTEM", 0),
    ]
    return {int(getattr(nvml, name)): score for name, score in levels if hasattr(nvml, name)}


def _links(nvml: Nvml, gpu: GpuInfo) -> Counter[str]:
    """Active NVLinks of one GPU by remote PCI address (lower case)."""
    remotes: Counter[str] = Counter()
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if int(nvml.nvmlDeviceGetNvLinkState(gpu.handle, link)) != int(nvml.NVML_FEATURE_ENABLED):
                continue
            remotes[text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(gpu.handle, link).busId).lower()] += 1
        except nvml.NVMLError:
            continue  # NOT_SUPPORTED / INVALID_ARGUMENT: no such link on this GPU (asked once, at start)
    return remotes


def measure(nvml: Nvml, gpus: Sequence[GpuInfo]) -> Topology:
    """Ask NVML for every pair once; a query that fails leaves that pair unscored."""
    topo = Topology(numa={g.uuid: g.numa_node for g in gpus})
    usable = [g for g in gpus if g.error is None and g.handle is not None]
    gpu_by_bus = {g.pci_bus_id.lower(): g.uuid for g in usable if g.pci_bus_id}
    links = {g.uuid: _links(nvml, g) for g in usable}
    pcie = _pcie_scores(nvml)
    for a, b in itertools.combinations(usable, 2):
        key = frozenset((a.uuid, b.uuid))
        la, lb = links[a.uuid], links[b.uuid]
        direct = max(la.get((b.pci_bus_id or "").lower(), 0), lb.get((a.pci_bus_id or "").lower(), 0))
        switched = sum(min(la[r], lb[r]) for r in la.keys() & lb.keys() if r not in gpu_by_bus)
        if direct + switched:
            topo.nvlinks[key] = direct + switched
        try:
            level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(a.handle, b.handle))
            topo.pcie[key] = pcie.get(level, 0)
        except nvml.NVMLError as exc:
            log.debug("no PCIe topology for a GPU pair", a=a.uuid, b=b.uuid, error=describe(exc))
    return topo


def link_domains(nvml: Nvml, gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """GPU UUID → its NVLink island on this node (``nvlink-<lowest PCI address in it>``): GPUs joined by
    NVLink, directly or through one NVSwitch, transitively. A GPU with no NVLink to another is in none."""
    usable = [g for g in gpus if g.error is None and g.handle is not None and g.pci_bus_id]
    address = {g.uuid: linux_pci_address(g.pci_bus_id or "") for g in usable}
    gpu_by_bus = {a: u for u, a in address.items()}

    def nvlink_pairs() -> Iterator[tuple[str, str]]:
        switch_members: dict[str, str] = {}  # remote (NVSwitch) address → the first GPU seen on it
        for gpu in usable:
            for remote in _links(nvml, gpu):
                remote_address = linux_pci_address(remote) if ":" in remote else remote
                yield (
                    gpu.uuid,
                    gpu_by_bus.get(remote_address) or switch_members.setdefault(remote_address, gpu.uuid),
                )

    by_address = sorted(usable, key=lambda g: address[g.uuid])  # the lowest PCI address names an island
    groups = link_groups([g.uuid for g in by_address], nvlink_pairs())
    return {u: f"nvlink-{address[first]}" for u, first in groups.items()}


def fabric_clique(nvml: Nvml, gpu: GpuInfo) -> str | None:
    """The GPU's NVLink fabric clique, ``<cluster UUID>.<clique ID>``, as NVIDIA's GPU feature discovery and
    DRA driver name it (``nvidia.com/gpu.clique``): GPUs of one clique share a multi-node NVLink domain.
    None where the fabric is not supported, not (yet) registered, or has no cluster (single-node NVLink)."""
    getter = getattr(nvml, "nvmlDeviceGetGpuFabricInfo", None)
    struct = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if getter is None or struct is None or gpu.handle is None or gpu.error is not None:
        return None
    info = struct()
    try:
        getter(gpu.handle, ctypes.byref(info))
    except nvml.NVMLError as exc:
        log.debug("no NVLink fabric info", gpu=gpu.uuid, error=describe(exc))
        return None
    completed = int(getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3))
    if int(info.state) != completed or int(info.status) != int(nvml.NVML_SUCCESS):
        return None
    cluster = bytes(info.clusterUuid)
    if not any(cluster):
        return None
    return f"{uuidlib.UUID(bytes=cluster)}.{int(info.cliqueId)}"


def set_score(members: Sequence[str], pair: Callable[[str, str], PairScore]) -> PairScore:
    total = [0, 0, 0]
    for a, b in itertools.combinations(members, 2):
        for i, value in enumerate(pair(a, b)):
            total[i] += value
    return (total[0], total[1], total[2])


def best_set(
    available: Sequence[str], must_include: Sequence[str], size: int, pair: Callable[[str, str], PairScore]
) -> list[str]:
    """The ``size`` IDs, containing ``must_include``, whose pairs score best (ties: earliest in ``available``)."""
    chosen = list(dict.fromkeys(must_include))
    candidates = [i for i in dict.fromkeys(available) if i not in set(chosen)]
    need = min(size - len(chosen), len(candidates))
    if need <= 0:
        return chosen[:size] if size < len(chosen) else chosen
    if math.comb(len(candidates), need) <= MAX_EXACT_COMBINATIONS:
        best: tuple[str, ...] = ()
        best_score: PairScore | None = None
        for combo in itertools.combinations(candidates, need):
            score = set_score([*chosen, *combo], pair)
            if best_score is None or score > best_score:
                best, best_score = combo, score
        return [*chosen, *best]
    # Greedy: add the candidate that raises the score most, seeding from the best pair if nothing is fixed.
    pool = list(candidates)
    while len(chosen) < size and pool:
        if not chosen:
            a, b = max(itertools.combinations(pool, 2), key=lambda ab: pair(ab[0], ab[1]))
            chosen += [a, b][: size - len(chosen)]
            pool = [p for p in pool if p not in (a, b)]
            continue
        nxt = max(pool, key=lambda c: set_score([*chosen, c], pair))
        chosen.append(nxt)
        pool.remove(nxt)
    return chosen

"""Choosing devices for a container: pure functions over device lists, shared by backends."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from kxpu.model.device import Device


def numa_packed(available: Sequence[Device], must_include: Sequence[Device], size: int) -> list[str]:
    """Pick ``size`` IDs that include ``must_include`` and span as few NUMA nodes as possible.

    Devices are grouped by their NUMA nodes; the groups that already hold a required
    device come first, then the groups that can hold the most of what is left (so a
    request that fits one node lands on one node), ties broken by the lowest NUMA id
    and then by the available order, which keeps answers deterministic.
    """
    chosen: list[str] = []
    for device in must_include:
        if device.id not in chosen:
            chosen.append(device.id)
    if len(chosen) >= size:
        return chosen
    chosen_set = set(chosen)
    groups: dict[tuple[int, ...], list[Device]] = defaultdict(list)
    for device in available:
        if device.id not in chosen_set:
            groups[device.numa_nodes].append(device)
    required_nodes = {node for d in must_include for node in d.numa_nodes}
    needed = size - len(chosen)

    def rank(key: tuple[int, ...]) -> tuple[int, int, int, tuple[int, ...]]:
        members = len(groups[key])
        touches_required = 0 if required_nodes & set(key) else 1
        if members >= needed:
            return (touches_required, 0, members, key)  # smallest group that fits: keep big ones whole
        return (touches_required, 1, -members, key)  # else the biggest first: fewest nodes spanned

    for key in sorted(groups, key=rank):
        for device in groups[key]:
            if len(chosen) == size:
                return chosen
            chosen.append(device.id)
    return chosen

"""Link domains: devices joined by a vendor's device-to-device links (NVLink, HCCS, NeuronLink), transitively.

Every vendor asks its own library which pairs are linked; the grouping that follows is the same for all
of them, so it lives here once. A domain is named after its first member in an order the backend picks
(the lowest PCI address, the lowest index), so the name is stable across restarts and nodes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def link_groups(ordered: Sequence[K], links: Iterable[tuple[K, K]]) -> dict[K, K]:
    """Member → the first member (in ``ordered``'s order) of its group: members joined by ``links``,
    directly or through others. A member with no link to another member is in none; a link to itself
    or to something not in ``ordered`` joins nothing. ``links`` is read once, in order."""
    parent = {m: m for m in ordered}

    def find(x: K) -> K:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    linked: set[K] = set()
    for a, b in links:
        if a == b or a not in parent or b not in parent:
            continue
        parent[find(a)] = find(b)
        linked |= {a, b}
    first: dict[K, K] = {}
    for member in ordered:
        if member in linked:
            first.setdefault(find(member), member)
    return {m: first[find(m)] for m in linked}

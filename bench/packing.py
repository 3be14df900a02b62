"""Packing bounds for one-device shares, computed offline over a whole workload: what an online placer is judged by.

Each item is ``(memory, cores)`` on devices of ``memory`` and ``cores`` capacity (any units, the same for all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def first_fit_decreasing(items: Sequence[tuple[int, int]], memory: int, cores: int = 100) -> int:
    """Devices used by first-fit-decreasing: items sorted by memory (then cores), largest first, each on the
    first device where both fit; devices unbounded. An item larger than a device is an error."""
    bins: list[list[int]] = []
    for m, c in sorted(items, key=lambda s: (-s[0], -s[1])):
        if m > memory or c > cores:
            raise ValueError(
                f"an item of {m} memory / {c} cores is larger than a device ({memory} / {cores})"
            )
        for b in bins:
            if b[0] + m <= memory and b[1] + c <= cores:
                b[0] += m
                b[1] += c
                break
        else:
            bins.append([m, c])
    return len(bins)


def lower_bound(items: Sequence[tuple[int, int]], memory: int, cores: int = 100) -> int:
    """No placement uses fewer devices: the total of each dimension over one device's capacity, rounded up."""
    return max(math.ceil(sum(m for m, _ in items) / memory), math.ceil(sum(c for _, c in items) / cores))

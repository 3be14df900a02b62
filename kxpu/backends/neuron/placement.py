"""Choosing contiguous runs of Neuron devices or NeuronCores: pure functions over integer positions.

The Neuron runtime takes only contiguous device and core sets ("Neuron cores are not contiguous",
"MLA logical Ids must be contiguous": aws-neuron-sdk deploy/troubleshooting.rst; the resulting
NEURON_RT_VISIBLE_CORES range "must be contiguous": nrt-developer-guide.rst), and AWS's own
device plugin leaves that to a separate scheduler extension (aws-neuron-sdk#392, deploy/faq.rst).
A position is a device index, or a global NeuronCore index (device index x cores per device + the
core's index on its device), so one rule serves both resources.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def is_contiguous(positions: Iterable[int]) -> bool:
    ordered = sorted(set(positions))
    return not ordered or ordered[-1] - ordered[0] == len(ordered) - 1


def compact(positions: Iterable[int]) -> str:
    """``0-3``, ``5``, or runs joined by commas (``0-1,4``): NEURON_RT_VISIBLE_CORES's syntax."""
    ordered = sorted(set(positions))
    runs: list[str] = []
    start = prev = None
    for p in [*ordered, None]:
        if p is not None and prev is not None and p == prev + 1:
            prev = p
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = p
    return ",".join(runs)


def contiguous_run(
    available: Sequence[int], must_include: Sequence[int], size: int, block: int
) -> list[int] | None:
    """The best ``size`` consecutive positions among ``available`` that hold every ``must_include``.

    ``block`` is positions per device (cores per device; 1 for whole devices). Preferred, in order:
    a run on as few devices as possible; one aligned to its own size (so free space stays in
    aligned blocks, the 1/4/8/16-device groups AWS's scheduler hands out on Trn1's torus); the
    tightest free stretch that fits (a lone free core before a whole free device); the lowest
    start. None when no contiguous run exists.
    """
    free = set(available) | set(must_include)
    required = set(must_include)
    if size < 1 or len(required) > size:
        return None
    best: tuple[tuple[int, int, int, int], int] | None = None
    for start in sorted(free):
        window = range(start, start + size)
        if not required <= set(window) or any(p not in free for p in window):
            continue
        stretch_start, stretch_end = start, start + size - 1
        while stretch_start - 1 in free:
            stretch_start -= 1
        while stretch_end + 1 in free:
            stretch_end += 1
        devices = len({p // block for p in window})
        score = (devices, 0 if start % size == 0 else 1, stretch_end - stretch_start + 1, start)
        if best is None or score < best[0]:
            best = (score, start)
    return None if best is None else list(range(best[1], best[1] + size))

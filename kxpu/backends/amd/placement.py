"""AMD's best-effort placement (k8s-device-plugin ``internal/pkg/allocator``), reimplemented.

A pair of devices costs: 10 on the same GPU else 20, plus 10 over XGMI (KFD link type 11), 40
over PCIe (type 2), 50 over any other link, plus 10 on one NUMA node else 20. AMD's plugin costs a
pair KFD lists no link for at 0, the best; here such a pair costs ``NO_LINK``, the worst: nothing
says the two can reach each other. The set with the lowest total wins; candidates grow greedily
from one start per GPU, GPUs with the fewest free devices first (fill partially used GPUs before
breaking up whole ones, the plugin's order), so ties go to the fuller GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kxpu.backends.amd.sysfs import LINK_PCIE, LINK_XGMI, Unit

NO_LINK = 1000


def pair_weight(a: Unit, b: Unit, links: Mapping[tuple[int, int], int]) -> int:
    if a.kfd is None or b.kfd is None:
        return NO_LINK
    kind = links.get((min(a.kfd.index, b.kfd.index), max(a.kfd.index, b.kfd.index)))
    if kind is None:
        return NO_LINK
    weight = 10 if a.gpu.bdf == b.gpu.bdf else 20
    weight += 10 if kind == LINK_XGMI else 40 if kind == LINK_PCIE else 50
    weight += 10 if a.gpu.numa_node == b.gpu.numa_node else 20
    return weight


def best_effort(
    available: Sequence[Unit],
    required: Sequence[Unit],
    size: int,
    links: Mapping[tuple[int, int], int],
    per_gpu_total: Mapping[str, int],
) -> list[str]:
    chosen_required = list(dict.fromkeys(required))
    need = size - len(chosen_required)
    pool = [u for u in dict.fromkeys(available) if u not in chosen_required]
    if need <= 0 or len(pool) < need:
        return [u.id for u in chosen_required][:size] + [u.id for u in pool][: max(0, need)]
    free: dict[str, int] = {}
    for unit in pool:
        free[unit.gpu.bdf] = free.get(unit.gpu.bdf, 0) + 1

    def order(unit: Unit) -> tuple[int, int, str, int]:
        # fewest free first, then the most used, then address and partition order
        used = per_gpu_total.get(unit.gpu.bdf, 0) - free[unit.gpu.bdf]
        return (free[unit.gpu.bdf], -used, unit.gpu.bdf, unit.partition)

    pool.sort(key=order)
    starts = [u for i, u in enumerate(pool) if i == 0 or u.gpu.bdf != pool[i - 1].gpu.bdf]
    best: tuple[int, list[Unit]] | None = None
    for start in starts:
        picked = [*chosen_required, start]
        cost = sum(pair_weight(start, r, links) for r in chosen_required)
        added = {id(u): sum(pair_weight(u, p, links) for p in picked) for u in pool if u is not start}
        rest = [u for u in pool if u is not start]
        while len(picked) < size:
            nxt = min(rest, key=lambda u: added[id(u)])  # stable: ties keep the pool's order
            cost += added[id(nxt)]
            rest.remove(nxt)
            picked.append(nxt)
            for u in rest:
                added[id(u)] += pair_weight(u, nxt, links)
        if best is None or cost < best[0]:
            best = (cost, picked)
    assert best is not None
    return [u.id for u in best[1]]

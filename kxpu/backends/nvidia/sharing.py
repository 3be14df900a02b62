"""Time-slicing replicas: which replicas a container should get.

The device plugin API never says what is allocated, only what the kubelet still offers.
So, as NVIDIA's plugin does, a GPU's allocated count is its replica total minus the
replicas offered as available; replicas this request must include or has already picked
count as allocated too. ``distributed`` then takes the next replica from the GPU with the
fewest allocated (spreading load), ``packed`` from the one with the most (keeping whole
GPUs free); ties go to the GPU this request has touched least, then to offer order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

Policy = Literal["distributed", "packed"]


def pick_replicas(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    gpu_of: Mapping[str, str],
    replicas_per_gpu: Mapping[str, int],
    policy: Policy,
) -> list[str]:
    chosen = list(dict.fromkeys(must_include))
    taken = set(chosen)
    remaining: dict[str, list[str]] = {}
    for device_id in available:
        if device_id not in taken and device_id in gpu_of:
            remaining.setdefault(gpu_of[device_id], []).append(device_id)
    order = {gpu: n for n, gpu in enumerate(remaining)}
    picked: dict[str, int] = {}
    for device_id in chosen:
        gpu = gpu_of.get(device_id)
        if gpu is not None:
            picked[gpu] = picked.get(gpu, 0) + 1

    def allocated(gpu: str) -> int:
        return replicas_per_gpu.get(gpu, 1) - len(remaining[gpu])

    while len(chosen) < size:
        open_gpus = [g for g, ids in remaining.items() if ids]
        if not open_gpus:
            break
        sign = 1 if policy == "distributed" else -1
        gpu = min(open_gpus, key=lambda g: (sign * allocated(g), picked.get(g, 0), order[g]))
        chosen.append(remaining[gpu].pop(0))
        picked[gpu] = picked.get(gpu, 0) + 1
    return chosen

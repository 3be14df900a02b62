"""MIG-style partitions of a device: the whole device, or any aligned run of its slices.

A device of ``slices`` slices is offered whole and as partitions of each profile size ``k``
(``k`` slices, starting at a multiple of ``k``: 7 slices give seven 1-slice, three 2-slice and two
3-slice placements). Each draws one unit from every slice it covers, out of the device's counter set
(``s0`` … ``s<n-1>``), so DRA's scheduler never hands out two that overlap, nor the whole device with a
part of it. Partition IDs are ``<device>-<k>g-<start>``; a partition's memory is its share of the
device's. Every one of them, the whole device too (profile ``<slices>g``), has the attributes
``profile``, ``placement`` and ``parent``.
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field, field_validator, model_validator

from kxpu.backends.registry import BackendConfig
from kxpu.model import CounterSet, Device
from kxpu.model.device import MAX_DEVICE_ID_LENGTH


class PartitionLayout(BackendConfig):
    slices: int = Field(default=7, ge=2, le=32, description="slices a device is cut into")
    profiles: list[int] = Field(default_factory=lambda: [1, 2, 3], description="partition sizes, in slices")

    @field_validator("profiles")
    @classmethod
    def _sizes(cls, value: list[int]) -> list[int]:
        if not value or any(k < 1 for k in value) or len(set(value)) != len(value):
            raise ValueError("profiles must be distinct sizes of at least 1 slice")
        return sorted(value)

    @model_validator(mode="after")
    def _fit(self) -> PartitionLayout:
        too_big = [k for k in self.profiles if k >= self.slices]
        if too_big:
            raise ValueError(f"profiles {too_big} are not smaller than the device's {self.slices} slices")
        return self


def counter_set(whole: Device, layout: PartitionLayout) -> CounterSet:
    """The slices of ``whole``, one unit each; named after the device."""
    return CounterSet(whole.id, {f"s{i}": 1 for i in range(layout.slices)})


def partition_devices(whole: Device, layout: PartitionLayout) -> list[Device]:
    """The whole device (drawing every slice) and every placement of every profile."""
    name = whole.id
    # The whole device is the largest profile: every device has the same attributes, so selectors on them
    # never meet a device without one.
    out = [
        replace(
            whole,
            extra={**whole.extra, "parent": whole.id, "profile": f"{layout.slices}g", "placement": 0},
            consumes={name: {f"s{i}": 1 for i in range(layout.slices)}},
        )
    ]
    for size in layout.profiles:
        for start in range(0, layout.slices - size + 1, size):
            device_id = f"{whole.id}-{size}g-{start}"
            if len(device_id) > MAX_DEVICE_ID_LENGTH:
                raise ValueError(f"partition ID {device_id} is longer than {MAX_DEVICE_ID_LENGTH} characters")
            out.append(
                replace(
                    whole,
                    id=device_id,
                    uuid=f"{whole.uuid}-{size}g-{start}" if whole.uuid else None,
                    memory_mib=None if whole.memory_mib is None else whole.memory_mib * size // layout.slices,
                    extra={**whole.extra, "parent": whole.id, "profile": f"{size}g", "placement": start},
                    consumes={name: {f"s{i}": 1 for i in range(start, start + size)}},
                )
            )
    return out

"""MIG-style partitions of a device: the whole device, or any aligned run of its slices.

A device of ``slices`` slices is offered whole and as partitions of each profile size ``k``
(``k`` slices, starting at a multiple of ``k``: 7 slices give seven 1-slice, three 2-slice and two
3-slice placements). Each draws one unit from every slice it covers, out of the device's counter set
(``s0`` … ``s<n-1>``), so DRA's scheduler never hands out two that overlap, nor the whole device with a
part of it. Partition IDs are ``<device>-<k>g-<start>``; a partition's memory is its share of the
device's. Every one of them, the whole device too (profile ``<slices>g``), has the attributes
``profile``, ``placement`` and ``parent``.

With ``hardwareFile`` the partitions are dynamic, as MIG instances are: ``PartitionTable`` keeps the ones
made in that file (it outlives the daemon, as a GPU's instances do), ``realize`` makes them and refuses one
that overlaps a partition that exists, ``release`` and ``reclaim`` destroy them. ``holdFile`` is a fault
injection for tests: while it exists, making a partition stops half-way (made, not yet returned), so that a
test can kill the daemon at exactly that point.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from kxpu.atomicfile import write_atomically
from kxpu.backends.registry import BackendConfig
from kxpu.logs import get_logger
from kxpu.model import BackendError, CounterSet, Device
from kxpu.model.device import MAX_DEVICE_ID_LENGTH


class PartitionLayout(BackendConfig):
    slices: int = Field(default=7, ge=2, le=32, description="slices a device is cut into")
    profiles: list[int] = Field(default_factory=lambda: [1, 2, 3], description="partition sizes, in slices")
    hardware_file: Path | None = Field(
        default=None,
        alias="hardwareFile",
        description="dynamic partitions: made when a claim is prepared, kept in this file as hardware keeps them",
    )
    hold_file: Path | None = Field(
        default=None,
        alias="holdFile",
        description="tests only: while this file exists, making a partition stops after it is made",
    )

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


log = get_logger("kxpu.backends.partitions")

# How long a held ``realize`` waits for its hold file to go before giving up (tests remove it in seconds).
HOLD_SECONDS = 600.0


class PartitionTable:
    """Dynamic partitions in a file: ``{"<partition ID>": {"parent": "<counter set>", "slices": ["s0", …]}}``.

    Each partition occupies the slices it draws from its device's counter set (``Device.consumes``); making
    one that shares a slice with a partition that exists is refused, as the hardware refuses it."""

    def __init__(self, path: Path, hold: Path | None = None) -> None:
        self.path = path
        self.hold = hold
        self._lock = threading.Lock()

    def read(self) -> dict[str, dict[str, Any]]:
        try:
            raw = json.loads(self.path.read_text() or "{}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise BackendError(f"partition table {self.path} is unreadable: {exc}") from None
        if not isinstance(raw, dict):
            raise BackendError(f"partition table {self.path} must hold a JSON object")
        return raw

    def _write(self, table: Mapping[str, object]) -> None:
        write_atomically(self.path, json.dumps(table, indent=1, sort_keys=True) + "\n", durable=True)

    @staticmethod
    def _occupies(device: Device) -> tuple[str, set[str]]:
        ((parent, counters),) = device.consumes.items()
        return parent, set(counters)

    def make(self, devices: Sequence[Device]) -> list[tuple[Device, dict[str, str | int]]]:
        """Make each device's partition, all or none; the handle names it."""
        made: list[tuple[Device, dict[str, str | int]]] = []
        with self._lock:
            table = self.read()
            for device in devices:
                parent, slices = self._occupies(device)
                overlaps = sorted(
                    pid
                    for pid, entry in table.items()
                    if isinstance(entry, dict)
                    and entry.get("parent") == parent
                    and slices & set(entry.get("slices") or ())
                )
                if overlaps:
                    raise BackendError(f"{device.id}: cannot make the partition: {overlaps} overlaps it")
                table[device.id] = {"parent": parent, "slices": sorted(slices)}
                made.append((device, {"id": device.id}))
            self._write(table)
        if self.hold is not None and self.hold.exists():
            log.warning(
                "holding a made partition before returning it (holdFile)", partitions=[d.id for d in devices]
            )
            deadline = time.monotonic() + HOLD_SECONDS
            while self.hold.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return made

    def destroy(self, ids: Sequence[str]) -> list[str]:
        """Destroy these partitions; the ones that existed, in order (one already gone is not an error)."""
        with self._lock:
            table = self.read()
            gone = [i for i in ids if table.pop(i, None) is not None]
            if gone:
                self._write(table)
        return gone

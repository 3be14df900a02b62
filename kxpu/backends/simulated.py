"""Simulated devices for demos, tests and clusters without hardware.

Health and presence come from an optional JSON state file (``{"sim-npu-1": "Unhealthy",
"sim-npu-2": "Absent"}``; unlisted devices are healthy), watched with inotify so that a
change reaches the kubelet at once. A broken state file is logged and ignored: the last
good state stays in force.

Telemetry (for tests and demos of the daemon's telemetry): ``sample()`` reports every present device,
idle unless the optional ``telemetryFile`` says otherwise, read at each sample:
``{"sim-npu-0": {"utilization": 0.4, "memoryUsedMiB": 1024, "processes": [{"pid": 4242,
"memoryMiB": 1024, "utilization": 0.4}]}}``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from kxpu.backends.mounts import MountConfig
from kxpu.backends.partitions import PartitionLayout, PartitionTable, counter_set, partition_devices
from kxpu.backends.registry import BackendConfig, register_backend
from kxpu.backends.templates import EnvTemplates, render_env
from kxpu.fswatch import directory_changes
from kxpu.logs import get_logger
from kxpu.model import (
    MAX_DEVICE_ID_LENGTH,
    MAX_NUMA_NODE,
    Backend,
    BackendError,
    ContainerEdits,
    CounterSet,
    Device,
    DeviceUsage,
    Health,
    ProcessUsage,
    TelemetrySample,
    check_device_id,
    numa_packed,
)

log = get_logger("kxpu.backends.simulated")

_UUID_NAMESPACE = uuid.UUID("6f1c3a52-8f53-4d1e-9a43-2f7c5b0e9d10")
_STATES = {"Healthy", "Unhealthy", "Absent"}
_MIB = 1024 * 1024
# A state file lists at most a few thousand devices; anything much bigger is not one.
MAX_STATE_FILE_BYTES = 1024 * 1024


class SimulatedDevice(BackendConfig):
    """What one device has that differs from the rest (a node with mixed models, for demos and tests)."""

    model: str | None = None
    memory_mib: int | None = Field(default=None, ge=1, alias="memoryMiB")
    cores: int | None = Field(default=None, ge=1)


class SimulatedConfig(BackendConfig):
    count: int = Field(ge=1, le=4096)
    model: str = "sim"
    memory_mib: int | None = Field(default=None, ge=1, alias="memoryMiB")
    cores: int | None = Field(default=None, ge=1)
    numa_nodes: list[int] | None = None
    state_file: Path | None = None
    telemetry_file: Path | None = None
    env: EnvTemplates = Field(default_factory=lambda: {"KXPU_VISIBLE_DEVICES": "{ids}"})
    mounts: list[MountConfig] = Field(default_factory=list)
    # Per device index: a different model, memory or core count (IDs stay <model>-<index>).
    devices: dict[int, SimulatedDevice] = Field(default_factory=dict)
    # Each device also offered as MIG-style partitions (kxpu.backends.partitions): DRA only.
    partitions: PartitionLayout | None = None

    def dra_only(self) -> str | None:
        return None if self.partitions is None else "simulated.partitions offers overlapping partitions"

    @field_validator("model")
    @classmethod
    def _id_safe(cls, value: str) -> str:
        check_device_id(f"{value}-0")
        return value

    @model_validator(mode="after")
    def _numa_per_device(self) -> SimulatedConfig:
        if self.numa_nodes is not None and len(self.numa_nodes) != self.count:
            raise ValueError(f"numaNodes has {len(self.numa_nodes)} entries for {self.count} devices")
        bad = [n for n in self.numa_nodes or () if not 0 <= n <= MAX_NUMA_NODE]
        if bad:
            raise ValueError(
                f"numaNodes entries must be between 0 and {MAX_NUMA_NODE} (the kubelet's topology manager "
                f"supports 64 NUMA nodes); found {bad[0]}"
            )
        outside = sorted(i for i in self.devices if not 0 <= i < self.count)
        if outside:
            raise ValueError(f"devices: indexes {outside} are outside 0..{self.count - 1}")
        return self

    @model_validator(mode="after")
    def _last_id_fits(self) -> SimulatedConfig:
        last = f"{self.model}-{self.count - 1}"
        if self.partitions is not None:  # the longest partition ID: the biggest profile at its last placement
            size = self.partitions.profiles[-1]
            last += f"-{size}g-{(self.partitions.slices - size) // size * size}"
        try:
            check_device_id(last)
        except ValueError:
            raise ValueError(
                f"model {self.model!r} with count {self.count} makes device IDs up to {last!r} "
                f"({len(last)} characters); the kubelet takes at most {MAX_DEVICE_ID_LENGTH}: shorten the model"
            ) from None
        return self


@register_backend("simulated", SimulatedConfig)
class SimulatedBackend(Backend):
    def __init__(self, config: SimulatedConfig) -> None:
        self.config = config
        self._physical = [self._make(i) for i in range(config.count)]
        layout = config.partitions
        self._all = (
            self._physical
            if layout is None
            else [p for whole in self._physical for p in partition_devices(whole, layout)]
        )
        self._states: dict[str, str] = {}
        self._table = (
            PartitionTable(layout.hardware_file, layout.hold_file)
            if layout is not None and layout.hardware_file is not None
            else None
        )

    def _make(self, index: int) -> Device:
        cfg = self.config
        device_id = f"{cfg.model}-{index}"
        own = cfg.devices.get(index, SimulatedDevice())
        return Device(
            id=device_id,
            model=own.model or cfg.model,
            uuid=f"SIM-{uuid.uuid5(_UUID_NAMESPACE, device_id)}",
            index=index,
            memory_mib=own.memory_mib or cfg.memory_mib,
            cores=own.cores or cfg.cores,
            numa_nodes=(cfg.numa_nodes[index],) if cfg.numa_nodes else (),
        )

    def discover(self) -> list[Device]:
        self._read_state()
        out = []
        for device in self._all:
            # A partition is as healthy as the device it is cut from (the state file names devices).
            state = self._states.get(str(device.extra.get("parent", device.id)), "Healthy")
            if state == "Absent":
                continue
            out.append(device.with_health(Health(state), reason="state-file"))
        return out

    def _read_state(self) -> None:
        path = self.config.state_file
        if path is None:
            return
        try:
            with path.open("rb") as f:
                data = f.read(MAX_STATE_FILE_BYTES + 1)
            if len(data) > MAX_STATE_FILE_BYTES:
                raise ValueError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
            raw = json.loads(data or b"{}")
        except FileNotFoundError:
            self._states = {}
            return
        except (OSError, ValueError, RecursionError) as exc:  # a directory, not UTF-8, not JSON, nested deep
            error = (
                exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
            )
            log.warning("state file unreadable, keeping the last good state", path=str(path), error=error)
            return
        if not isinstance(raw, dict):
            log.warning("state file must hold a JSON object, keeping the last good state", path=str(path))
            return
        known = {d.id for d in self._physical}
        states: dict[str, str] = {}
        for device_id, state in raw.items():
            if device_id not in known:
                log.warning("state file names an unknown device", path=str(path), device=device_id)
            elif not isinstance(state, str) or state not in _STATES:
                log.warning(
                    "state file has an unknown state", path=str(path), device=device_id, state=str(state)
                )
            else:
                states[device_id] = state
        self._states = states

    async def watch(self) -> AsyncIterator[list[Device]]:
        path = self.config.state_file
        if path is None:
            yield self.discover()
            return
        path = path.absolute()
        async for _ in directory_changes(lambda: [path.parent], lambda p: p == path):
            yield self.discover()

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(
            env=render_env(self.config.env, devices),
            mounts=[m.to_mount() for m in self.config.mounts],
        )

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)

    # Partitioner: static partitions always exist, so realizing and releasing change nothing; dynamic ones
    # (partitions.hardwareFile) are made and destroyed in their table, as MIG instances are on a GPU.
    def counter_sets(self) -> list[CounterSet]:
        layout = self.config.partitions
        return [] if layout is None else [counter_set(whole, layout) for whole in self._physical]

    def realize(self, devices: Sequence[Device]) -> list[tuple[Device, dict[str, str | int]]]:
        if self._table is None:
            return [(device, {}) for device in devices]
        return self._table.make(devices)

    def release(self, handles: Sequence[Mapping[str, str | int]]) -> None:
        if self._table is not None:
            self._table.destroy([str(h["id"]) for h in handles if h.get("id")])

    def reclaim(self, devices: Sequence[Device]) -> list[str]:
        """PartitionReclaimer: destroy what exists of these devices' partitions."""
        if self._table is None:
            return []
        return self._table.destroy([d.id for d in devices])

    def sample(self) -> TelemetrySample:
        figures = self._read_telemetry()
        devices, processes = [], []
        for device in self.discover():
            uuid_ = device.uuid or device.id
            entry = figures.get(device.id, {})
            memory_mib = self.config.memory_mib
            try:
                utilization = float(entry.get("utilization", 0.0))
                used = int(entry.get("memoryUsedMiB", 0)) * _MIB
            except (TypeError, ValueError) as exc:
                raise BackendError(
                    f"telemetryFile {self.config.telemetry_file}: {device.id}: {exc}"
                ) from None
            devices.append(
                DeviceUsage(
                    uuid=uuid_,
                    index=device.index,
                    model=device.model,
                    vendor="simulated",
                    compute_utilization=utilization,
                    memory_used_bytes=used,
                    memory_total_bytes=None if memory_mib is None else memory_mib * _MIB,
                )
            )
            try:
                for proc in entry.get("processes", []):
                    memory = proc.get("memoryMiB")
                    compute = proc.get("utilization")
                    processes.append(
                        ProcessUsage(
                            uuid_,
                            int(proc["pid"]),
                            None if memory is None else int(memory) * _MIB,
                            None if compute is None else float(compute),
                        )
                    )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise BackendError(
                    f"telemetryFile {self.config.telemetry_file}: {device.id}: processes need a pid and numbers "
                    f"({exc!r})"
                ) from None
        return TelemetrySample(tuple(devices), tuple(processes))

    def _read_telemetry(self) -> dict[str, dict[str, Any]]:
        path = self.config.telemetry_file
        if path is None:
            return {}
        try:
            raw = json.loads(path.read_text() or "{}")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise BackendError(f"telemetryFile {path}: {exc}") from None
        if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
            raise BackendError(f"telemetryFile {path}: must map device IDs to objects")
        return raw

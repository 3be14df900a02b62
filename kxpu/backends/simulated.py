"""Simulated devices for demos, tests and clusters without hardware.

Health and presence come from an optional JSON state file (``{"sim-npu-1": "Unhealthy",
"sim-npu-2": "Absent"}``; unlisted devices are healthy), watched with inotify so that a
change reaches the kubelet at once. A broken state file is logged and ignored: the last
good state stays in force.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from kxpu.backends.mounts import MountConfig
from kxpu.backends.registry import BackendConfig, register_backend
from kxpu.backends.templates import EnvTemplates, render_env
from kxpu.fswatch import directory_changes
from kxpu.logs import get_logger
from kxpu.model import (
    MAX_DEVICE_ID_LENGTH,
    MAX_NUMA_NODE,
    Backend,
    ContainerEdits,
    Device,
    Health,
    check_device_id,
    numa_packed,
)

log = get_logger("kxpu.backends.simulated")

_UUID_NAMESPACE = uuid.UUID("6f1c3a52-8f53-4d1e-9a43-2f7c5b0e9d10")
_STATES = {"Healthy", "Unhealthy", "Absent"}
# A state file lists at most a few thousand devices; anything much bigger is not one.
MAX_STATE_FILE_BYTES = 1024 * 1024


class SimulatedConfig(BackendConfig):
    count: int = Field(ge=1, le=4096)
    model: str = "sim"
    memory_mib: int | None = Field(default=None, ge=1, alias="memoryMiB")
    cores: int | None = Field(default=None, ge=1)
    numa_nodes: list[int] | None = None
    state_file: Path | None = None
    env: EnvTemplates = Field(default_factory=lambda: {"KXPU_VISIBLE_DEVICES": "{ids}"})
    mounts: list[MountConfig] = Field(default_factory=list)

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
        return self

    @model_validator(mode="after")
    def _last_id_fits(self) -> SimulatedConfig:
        last = f"{self.model}-{self.count - 1}"
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
        self._all = [self._make(i) for i in range(config.count)]
        self._states: dict[str, str] = {}

    def _make(self, index: int) -> Device:
        cfg = self.config
        device_id = f"{cfg.model}-{index}"
        return Device(
            id=device_id,
            model=cfg.model,
            uuid=f"SIM-{uuid.uuid5(_UUID_NAMESPACE, device_id)}",
            index=index,
            memory_mib=cfg.memory_mib,
            cores=cfg.cores,
            numa_nodes=(cfg.numa_nodes[index],) if cfg.numa_nodes else (),
        )

    def discover(self) -> list[Device]:
        self._read_state()
        out = []
        for device in self._all:
            state = self._states.get(device.id, "Healthy")
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
        known = {d.id for d in self._all}
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

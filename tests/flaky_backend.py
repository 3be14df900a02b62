"""Third-party-style backends for tests, loaded with --import: one that fails on demand, one with pre-start."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kxpu import Backend, BackendConfig, BackendError, ContainerEdits, Device, register_backend


class FlakyConfig(BackendConfig):
    fail_while: Path
    count: int = 2


@register_backend("flaky", FlakyConfig)
class FlakyBackend(Backend):
    def __init__(self, config: FlakyConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        if self.config.fail_while.exists():
            raise BackendError(f"device library not ready ({self.config.fail_while} exists)")
        return [Device(id=f"flaky-{i}") for i in range(self.config.count)]

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(env={"FLAKY": ",".join(d.id for d in devices)})


class PreStartConfig(BackendConfig):
    record: Path


@register_backend("prestart", PreStartConfig)
class PreStartBackend(Backend):
    """Needs a step before each container starts: records the devices it prepared."""

    def __init__(self, config: PreStartConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        return [Device(id="ps-0"), Device(id="ps-1")]

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits()

    def pre_start(self, devices: Sequence[Device]) -> None:
        with self.config.record.open("a") as f:
            f.write(",".join(d.id for d in devices) + "\n")

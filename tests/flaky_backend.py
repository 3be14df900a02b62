"""A third-party-style backend for tests: fails while a marker file exists (loaded with --import)."""

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

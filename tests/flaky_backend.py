"""Third-party-style backends for tests, loaded with --import: one that fails on demand, one with pre-start,
one that breaks while serving."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from kxpu import Backend, BackendConfig, BackendError, ContainerEdits, Device, register_backend
from kxpu.fswatch import directory_changes


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


class BreakingConfig(BackendConfig):
    """``breakWhen``: while this file exists, the backend's watch fails (after its first list);
    ``marker``: a line is appended to it each time it fails, so a test can act at that moment."""

    break_when: Path
    marker: Path | None = None
    count: int = 2


@register_backend("breaking", BreakingConfig)
class BreakingBackend(Backend):
    """Serves fine, then loses its devices while serving: the resource is torn down and retried."""

    def __init__(self, config: BreakingConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        return [Device(id=f"brk-{i}") for i in range(self.config.count)]

    async def watch(self) -> AsyncIterator[list[Device]]:
        path = self.config.break_when.absolute()
        first = True
        async for _ in directory_changes(lambda: [path.parent], lambda p: p == path):
            if first:
                first = False
                yield self.discover()
            if path.exists():
                if self.config.marker is not None:
                    with self.config.marker.open("a") as out:
                        out.write("failing\n")
                raise BackendError(f"device library lost its devices ({path} exists)")

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(env={"BREAKING": ",".join(d.id for d in devices)})


class StubbornConfig(BackendConfig):
    count: int = 1


@register_backend("stubborn", StubbornConfig)
class StubbornBackend(Backend):
    """A hostile backend whose watch ignores cancellation: its resource can never be stopped."""

    def __init__(self, config: StubbornConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        return [Device(id=f"stubborn-{i}") for i in range(self.config.count)]

    async def watch(self) -> AsyncIterator[list[Device]]:
        yield self.discover()
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits()


class ListedConfig(BackendConfig):
    """Exactly the devices a test asks for, including what a buggy vendor library might report."""

    count: int = 1
    id_prefix: str = "listed-"
    numa: int | None = None  # every device's NUMA node, unchecked (a driver's garbage)
    env_bytes: int = 0  # the size of one env value Allocate answers with


@register_backend("listed", ListedConfig)
class ListedBackend(Backend):
    def __init__(self, config: ListedConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        numa = () if self.config.numa is None else (self.config.numa,)
        return [Device(id=f"{self.config.id_prefix}{i}", numa_nodes=numa) for i in range(self.config.count)]

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(
            env={"LISTED": ",".join(d.id for d in devices), "BULK": "x" * self.config.env_bytes}
        )


class HangingConfig(BackendConfig):
    seconds: float = 60.0


@register_backend("hanging", HangingConfig)
class HangingBackend(Backend):
    """Discovery that does not return (a vendor library stuck on a device that fell off the bus)."""

    def __init__(self, config: HangingConfig) -> None:
        self.config = config

    def discover(self) -> list[Device]:
        time.sleep(self.config.seconds)
        return []

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits()

"""ResourceRunner in-process: lifecycle edges that a daemon process cannot show from outside."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

from kxpu.config import parse_config
from kxpu.daemon import ResourceRunner
from kxpu.model import Backend, ContainerEdits, Device


class SlowToBuild(Backend):
    def __init__(self) -> None:
        self.closed = threading.Event()

    def discover(self) -> list[Device]:
        return [Device(id="d0")]

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits()

    def close(self) -> None:
        self.closed.set()


async def test_a_backend_built_after_its_resource_stopped_is_closed(plugin_dir: Path) -> None:
    release = threading.Event()
    built: list[SlowToBuild] = []

    def build(_: object) -> Backend:
        release.wait(10)  # a slow vendor library initialising
        built.append(SlowToBuild())
        return built[0]

    config = parse_config(
        {"version": "v1", "resources": [{"name": "example.com/x", "simulated": {"count": 1}}]}
    )
    runner = ResourceRunner(config.resources[0], plugin_dir, build)
    task = asyncio.create_task(runner.run())
    await asyncio.sleep(0)  # let it start building
    task.cancel()
    release.set()
    await asyncio.gather(task, return_exceptions=True)
    deadline = asyncio.get_running_loop().time() + 5
    while not (built and built[0].closed.is_set()):
        assert asyncio.get_running_loop().time() < deadline, "the late backend was never closed"
        await asyncio.sleep(0.01)

"""ResourceRunner in-process: lifecycle edges that a daemon process cannot show from outside."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kxpu.config import parse_config
from kxpu.daemon import Daemon, Phase, ResourceRunner
from kxpu.daemon.resource import RETRY_INITIAL_SECONDS
from kxpu.model import Backend, BackendError, ContainerEdits, Device
from kxpu.testing import KubeletStandIn


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


class Faults:
    """What the next backends the runner builds do, as a test asks: every way a backend fails."""

    def __init__(self) -> None:
        self.discover_failures = 0  # discover raises this many more times
        self.commands: asyncio.Queue[str] = asyncio.Queue()  # to the running watch: "fail" or "end"
        self.discovered: list[float] = []  # when each discover was called (time.monotonic)
        self.hang = asyncio.Event()  # set: allocate never answers
        self.watch_ended = asyncio.Event()


class Scripted(Backend):
    """A backend with a watch, failing on the test's command. Mirrors ``kxpu.model.Backend`` with ``Watcher``
    and ``AsyncAllocator`` as a vendor backend implements them."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def discover(self) -> list[Device]:
        self.faults.discovered.append(time.monotonic())
        if self.faults.discover_failures:
            self.faults.discover_failures -= 1
            raise BackendError("device library not ready")
        return [Device(id="s-0"), Device(id="s-1")]

    async def watch(self) -> AsyncIterator[list[Device]]:
        yield [Device(id="s-0"), Device(id="s-1")]
        command = await self.faults.commands.get()
        if command == "fail":
            raise BackendError("device library lost its devices")
        self.faults.watch_ended.set()  # "end": the device list is static from now on (not a failure)

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return ContainerEdits(env={"S": ",".join(d.id for d in devices)})

    async def allocate_async(self, devices: Sequence[Device]) -> ContainerEdits:
        if self.faults.hang.is_set():
            await asyncio.Event().wait()  # an API server that never answers
        return self.allocate(devices)

    async def preferred_allocation_async(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return [d.id for d in available][:size]


SCRIPTED = "example.com/scripted"


@pytest.fixture
async def scripted(plugin_dir: Path, kubelet: KubeletStandIn) -> AsyncIterator[tuple[Daemon, Faults]]:
    """An in-process daemon serving one scripted resource to the kubelet stand-in over real sockets."""
    faults = Faults()
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            "resources": [{"name": SCRIPTED, "simulated": {"count": 2}}],
        }
    )
    daemon = Daemon(config, lambda: config, lambda _: Scripted(faults))
    task = asyncio.create_task(daemon.run())
    yield daemon, faults
    daemon.stop()
    assert await asyncio.wait_for(task, 10) == 0


async def allocated(kubelet: KubeletStandIn) -> str:
    answer = await kubelet.allocate(SCRIPTED, ["s-1"])
    return answer.container_responses[0].envs["S"]


async def test_a_backend_whose_watch_raises_is_retried_and_serves_again(
    scripted: tuple[Daemon, Faults], kubelet: KubeletStandIn
) -> None:
    """On Python 3.11 and 3.12 the failed TaskGroup left the runner's task 'cancelling', which was read as a
    stop: the resource stayed stopped and the node's allocatable dropped to 0 for good."""
    daemon, faults = scripted
    await kubelet.wait_registered(SCRIPTED)
    assert await allocated(kubelet) == "s-1"
    for times in (2, 3):  # twice: a resource that served again starts its backoff over
        faults.commands.put_nowait("fail")
        await kubelet.wait_registered(SCRIPTED, times=times)
        await kubelet.wait_devices(SCRIPTED, lambda d: d == {"s-0": "Healthy", "s-1": "Healthy"})
        assert await allocated(kubelet) == "s-1"
    assert daemon.readiness()[0]


async def test_a_failing_discover_is_retried_with_backoff(plugin_dir: Path, kubelet: KubeletStandIn) -> None:
    faults = Faults()
    faults.discover_failures = 2
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            "resources": [{"name": SCRIPTED, "simulated": {"count": 2}}],
        }
    )
    runner = ResourceRunner(config.resources[0], plugin_dir, lambda _: Scripted(faults))
    task = asyncio.create_task(runner.run())
    try:
        await kubelet.wait_registered(SCRIPTED, timeout=15)
        first, second, third = faults.discovered[:3]
        assert second - first >= RETRY_INITIAL_SECONDS * 0.9
        assert third - second >= 2 * RETRY_INITIAL_SECONDS * 0.9, "the second retry did not back off"
        assert await allocated(kubelet) == "s-1"
    finally:
        runner.stop()
        await asyncio.gather(task, return_exceptions=True)
    assert runner.phase is Phase.STOPPED


async def test_a_watch_that_ends_leaves_the_resource_serving(
    scripted: tuple[Daemon, Faults], kubelet: KubeletStandIn
) -> None:
    daemon, faults = scripted
    await kubelet.wait_registered(SCRIPTED)
    faults.commands.put_nowait("end")
    await faults.watch_ended.wait()
    assert await allocated(kubelet) == "s-1"
    assert daemon.runners[0].registrations == 1 and daemon.readiness()[0]


async def test_a_hanging_allocate_does_not_stop_the_resource_nor_its_stop(
    scripted: tuple[Daemon, Faults], kubelet: KubeletStandIn
) -> None:
    _, faults = scripted
    await kubelet.wait_registered(SCRIPTED)
    faults.hang.set()
    hung = asyncio.create_task(allocated(kubelet))
    faults.commands.put_nowait("fail")  # a failure while the call hangs: retried all the same
    await kubelet.wait_registered(SCRIPTED, times=2)
    faults.hang.clear()
    assert await allocated(kubelet) == "s-1"
    hung.cancel()
    await asyncio.gather(hung, return_exceptions=True)


async def test_a_stop_during_a_failure_is_not_retried(plugin_dir: Path, kubelet: KubeletStandIn) -> None:
    """The other side of telling a stop from a failure: a stop that lands while a failure is torn down ends
    the runner (it used to register again after 'stopping' and never end)."""
    faults = Faults()
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            "resources": [{"name": SCRIPTED, "simulated": {"count": 2}}],
        }
    )
    runner = ResourceRunner(config.resources[0], plugin_dir, lambda _: Scripted(faults))
    task = asyncio.create_task(runner.run())
    await kubelet.wait_registered(SCRIPTED)
    faults.commands.put_nowait("fail")
    runner.stop()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    assert runner.phase is Phase.STOPPED and runner.registrations == 1

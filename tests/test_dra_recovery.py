"""A DRA resource whose backend fails while claims are prepared comes back as after a first start: registered,
its slices published, prepare and unprepare served. Over real unix sockets, to the kubelet's stand-in."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

import tests.flaky_backend  # noqa: F401  (registers the `breaking` backend)
from kxpu.config import Config, parse_config
from kxpu.daemon import Daemon, Phase
from tests.test_dra_daemon import DRIVER, NODE, NPU, Rig, eventually, result


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    rig = Rig(root)
    await rig.kubelet.start()
    yield rig
    await rig.stop()
    await rig.kubelet.stop()
    shutil.rmtree(root, ignore_errors=True)


def breaking(rig: Rig) -> Config:
    """Four devices, ``brk-0..3``; the backend's watch fails while ``root/break`` exists (on every retry too),
    adding a line to ``root/failures`` each time."""
    entry: dict[str, Any] = {
        "name": NPU,
        "breaking": {"breakWhen": str(rig.root / "break"), "marker": str(rig.root / "failures"), "count": 4},
        "serve": "dra",
        "dra": {"nodeName": NODE, "cdiSpecDir": str(rig.cdi)},
    }
    return parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(rig.root / "dp"),
            "kubeletPluginsDir": str(rig.plugins),
            "pluginsRegistryDir": str(rig.registry),
            "resources": [entry],
        }
    )


def failures(root: Path) -> int:
    try:
        return (root / "failures").read_text().count("failing")
    except FileNotFoundError:
        return 0


def brk(device: str) -> dict[str, Any]:
    return {**result(device), "device": device}


async def test_a_failed_watch_is_retried_and_the_driver_serves_as_after_a_start(rig: Rig) -> None:
    daemon = await rig.start(breaking(rig))
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: daemon.readiness()[0])
    held = rig.api.add_claim("held", [brk("brk-1")])
    assert (await rig.kubelet.prepare(DRIVER, held)).claims[held.uid].error == ""
    spec = rig.cdi / f"kxpu-dra-{DRIVER}-{held.uid}.json"
    assert spec.exists()

    (rig.root / "break").touch()
    await eventually(lambda: failures(rig.root) >= 1)
    assert spec.exists(), "a backend failure must not touch a prepared claim"
    (rig.root / "break").unlink()

    # Retried with backoff: registered again (the stand-in saw the registration socket anew) and ready.
    await rig.kubelet.wait_registered(DRIVER, times=2, timeout=15)
    await eventually(lambda: daemon.readiness()[0], timeout=15)
    assert daemon.status()["resources"][NPU]["phase"] == Phase.REGISTERED
    assert sorted(d["name"] for d in rig.pool()) == ["brk-0", "brk-1", "brk-2", "brk-3"]
    # The prepared claim is still known (its pod's deletion unprepares it) and its device still taken.
    taken = rig.api.add_claim("taken", [brk("brk-1")])
    assert "already prepared" in (await rig.kubelet.prepare(DRIVER, taken)).claims[taken.uid].error
    assert (await rig.kubelet.unprepare(DRIVER, held)).claims[held.uid].error == ""
    assert not spec.exists()
    fresh = rig.api.add_claim("fresh", [brk("brk-1")])
    assert (await rig.kubelet.prepare(DRIVER, fresh)).claims[fresh.uid].error == ""


async def test_slices_wiped_while_the_driver_was_down_are_published_again(rig: Rig) -> None:
    """The kubelet deletes a driver's slices 30 s after losing it: a driver back after a longer failure (the
    backoff grows to 30 s) publishes them again."""
    daemon = await rig.start(breaking(rig))
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    (rig.root / "break").touch()
    await eventually(lambda: failures(rig.root) >= 1)
    rig.api.delete_node_slices(NODE, DRIVER)
    (rig.root / "break").unlink()
    await rig.kubelet.wait_registered(DRIVER, times=2, timeout=15)
    await eventually(lambda: len(rig.pool()) == 4 and daemon.readiness()[0], timeout=15)
    claim = rig.api.add_claim("c", [brk("brk-2")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""


async def test_a_driver_that_served_again_starts_its_backoff_over(rig: Rig) -> None:
    """A DRA resource counts as having served once the kubelet accepted its registration: each failure after
    that is retried after the first delay again, not after ever longer ones (0.5, 1, 2 ... up to 30 s)."""
    daemon = await rig.start(breaking(rig))
    await rig.kubelet.wait_registered(DRIVER)
    for times in (2, 3, 4):
        before = failures(rig.root)
        (rig.root / "break").touch()
        await eventually(lambda: failures(rig.root) > before)  # noqa: B023  (awaited in this iteration)
        (rig.root / "break").unlink()
        failed_at = asyncio.get_running_loop().time()
        await rig.kubelet.wait_registered(DRIVER, times=times, timeout=15)
        back_after = asyncio.get_running_loop().time() - failed_at
    assert back_after < 1.5, f"the third retry waited {back_after:.1f} s: the backoff was never reset"
    await eventually(lambda: daemon.readiness()[0])


async def test_a_prepare_hanging_in_the_backend_holds_up_no_other_claim(rig: Rig) -> None:
    """A backend whose allocate never answers (an API server that does not): the kubelet's call ends at its
    deadline, and the node's other prepares and unprepares go on (the claim lock is not held for good)."""
    from kxpu.api.dra.v1 import api_pb2 as dra_pb
    from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig

    hang = asyncio.Event()

    class Hanging(SimulatedBackend):
        async def allocate_async(self, devices: Any) -> Any:
            if hang.is_set():
                await asyncio.Event().wait()
            return self.allocate(devices)

        async def preferred_allocation_async(self, available: Any, must_include: Any, size: int) -> list[str]:
            return [d.id for d in available][:size]

    config = rig.config()
    daemon = Daemon(
        config, lambda: config, lambda r: Hanging(cast(SimulatedConfig, r.backend_config)), dra=rig.factory
    )
    task = asyncio.create_task(daemon.run())
    try:
        driver = await rig.kubelet.wait_registered(DRIVER)
        before = rig.api.add_claim("before", [result("sim-0")])
        assert (await rig.kubelet.prepare(DRIVER, before)).claims[before.uid].error == ""
        hang.set()
        stuck = rig.api.add_claim("stuck", [result("sim-1")])
        request = dra_pb.NodePrepareResourcesRequest(
            claims=[dra_pb.Claim(namespace=stuck.namespace, uid=stuck.uid, name=stuck.name)]
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await dra_grpc.DRAPluginStub(driver.channel).NodePrepareResources(request, timeout=1)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        hang.clear()
        unprepared = await asyncio.wait_for(rig.kubelet.unprepare(DRIVER, before), 5)
        assert unprepared.claims[before.uid].error == ""
        after = rig.api.add_claim("after", [result("sim-2")])
        prepared = await asyncio.wait_for(rig.kubelet.prepare(DRIVER, after), 5)
        assert prepared.claims[after.uid].error == ""
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 10)


async def test_a_failing_discover_is_retried_until_the_driver_serves(rig: Rig) -> None:
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(rig.root / "dp"),
            "kubeletPluginsDir": str(rig.plugins),
            "pluginsRegistryDir": str(rig.registry),
            "resources": [
                {
                    "name": NPU,
                    "flaky": {"failWhile": str(rig.root / "not-ready"), "count": 2},
                    "serve": "dra",
                    "dra": {"nodeName": NODE, "cdiSpecDir": str(rig.cdi)},
                }
            ],
        }
    )
    (rig.root / "not-ready").touch()
    daemon = await rig.start(config)
    await eventually(lambda: daemon.readiness()[1]["resources"].get(NPU) == Phase.FAILED)
    assert not rig.pool() and DRIVER not in rig.kubelet.drivers
    (rig.root / "not-ready").unlink()
    await rig.kubelet.wait_registered(DRIVER, timeout=15)
    await eventually(lambda: daemon.readiness()[0] and len(rig.pool()) == 2, timeout=15)
    claim = rig.api.add_claim("c", [result("flaky-1")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""


async def test_a_watch_that_ends_leaves_the_driver_serving(rig: Rig) -> None:
    """Without a state file the simulated backend's watch yields once and ends: the device list is static from
    then on, not a failure (the driver neither stops nor restarts)."""
    config = rig.config(simulated={"count": 2, "model": "sim"})
    daemon = await rig.start(config)
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: daemon.readiness()[0] and len(rig.pool()) == 2)
    claim = rig.api.add_claim("c", [result("sim-1")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
    assert rig.kubelet.registrations == 1 and daemon.readiness()[0]

"""A restart with a config that no longer serves a resource through DRA while claims are prepared for it: the
driver keeps serving their unprepare (and only that), and their devices are never offered through the device
plugin until released. Over real sockets: the kubelet's DRA side and its device-plugin side, both stand-ins."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kxpu.cli import _build
from kxpu.config import Config, ResourceConfig, parse_config
from kxpu.daemon import Daemon
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.leftover import Leftovers, NoDevices, leftovers_for
from kxpu.dra.plugin import DraPlugin
from kxpu.testing import KubeletStandIn
from tests.test_dra_daemon import DRIVER, NODE, NPU, Rig, eventually, result, rig  # noqa: F401


@pytest.fixture
async def dp_kubelet(rig: Rig) -> AsyncIterator[KubeletStandIn]:  # noqa: F811
    kubelet = KubeletStandIn(rig.root / "dp")
    await kubelet.start()
    yield kubelet
    await kubelet.stop()


def leftovers(rig: Rig, config: Config) -> Leftovers | None:  # noqa: F811
    def make(driver: str, resource: ResourceConfig | None) -> DraPlugin:
        settings = resource.dra if resource is not None else config.resources[0].dra
        return DraPlugin(
            resource.name if resource is not None else driver,
            driver,
            NODE,
            NoDevices(),
            DeviceSnapshot(),
            rig.plugins,
            rig.registry,
            rig.api,
            rig.api,
            settings,
        )

    return leftovers_for(config, NODE, make)


async def restart(rig: Rig, config: Config, http: str | None = None) -> Daemon:  # noqa: F811
    await rig.stop()
    rig.daemon = Daemon(
        config, lambda: config, _build, http_address=http, dra=rig.factory, leftovers=leftovers(rig, config)
    )
    rig.task = asyncio.create_task(rig.daemon.run())
    return rig.daemon


async def prepared(rig: Rig, name: str, *devices: str) -> Any:  # noqa: F811
    claim = rig.api.add_claim(name, [result(d) for d in devices])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
    return claim


async def test_a_restart_serving_the_resource_through_the_device_plugin_never_offers_claimed_devices(
    rig: Rig,  # noqa: F811
    dp_kubelet: KubeletStandIn,
) -> None:
    """Before: within a second the device plugin offered all four devices, two of which DRA pods held."""
    from kxpu.status import format_table, node_status
    from kxpu.testing.process import free_port

    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    first = await prepared(rig, "first", "sim-0")
    second = await prepared(rig, "second", "sim-1")

    port = free_port()
    as_device_plugin = rig.config(serve="devicePlugin")
    await restart(rig, as_device_plugin, f"127.0.0.1:{port}")
    view = await dp_kubelet.wait_registered(NPU)
    # Every device list the kubelet was ever sent kept the claimed devices out.
    devices = await dp_kubelet.wait_devices(NPU, lambda d: len(d) == 4)
    assert devices == {"sim-0": "Unhealthy", "sim-1": "Unhealthy", "sim-2": "Healthy", "sim-3": "Healthy"}
    assert all(h.devices["sim-0"] == h.devices["sim-1"] == "Unhealthy" for h in view.history)
    assert rig.daemon is not None
    draining = rig.daemon.status()["drainingDrivers"][DRIVER]
    assert draining["resource"] == NPU
    assert sorted(c["claim"] for c in draining["claims"].values()) == ["default/first", "default/second"]
    status = await node_status(rig.root / "no-kubelet.sock", f"http://127.0.0.1:{port}")
    assert {d.id: d.holders for d in status.devices}["sim-0"] == ["claim default/first (draining)"]
    assert f"DRA driver {DRIVER} is draining" in format_table(status)

    # The driver is registered again, for unprepare only.
    await rig.kubelet.wait_registered(DRIVER, times=2)
    new = rig.api.add_claim("new", [result("sim-2")])
    error = (await rig.kubelet.prepare(DRIVER, new)).claims[new.uid].error
    assert "no longer served through DRA" in error and "\n" not in error
    assert (await rig.kubelet.prepare(DRIVER, first)).claims[
        first.uid
    ].error == ""  # asked again: same answer

    assert (await rig.kubelet.unprepare(DRIVER, first)).claims[first.uid].error == ""
    await dp_kubelet.wait_devices(NPU, lambda d: d["sim-0"] == "Healthy" and d["sim-1"] == "Unhealthy")
    assert (await rig.kubelet.unprepare(DRIVER, second)).claims[second.uid].error == ""
    await dp_kubelet.wait_devices(NPU, lambda d: set(d.values()) == {"Healthy"})
    # Drained: the driver's sockets go and its slices are withdrawn; /status no longer lists it.
    await eventually(lambda: not (rig.plugins / DRIVER / "dra.sock").exists())
    await eventually(lambda: not rig.api.slices)
    assert "drainingDrivers" not in rig.daemon.status()


async def test_a_claim_orphaned_by_removing_the_resource_is_still_unprepared(rig: Rig) -> None:  # noqa: F811
    """Before: nothing served the unprepare, the pod stayed Terminating and its CDI spec was left behind."""
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    claim = await prepared(rig, "c", "sim-2")
    spec = rig.cdi / f"kxpu-dra-{DRIVER}-{claim.uid}.json"
    assert spec.exists()
    base = rig.config()
    other = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(rig.root / "dp"),
            "kubeletPluginsDir": str(rig.plugins),
            "pluginsRegistryDir": str(rig.registry),
            "resources": [{"name": "example.com/other", "simulated": {"count": 1}}],
        }
    )
    assert base.kubelet_plugins_dir == other.kubelet_plugins_dir
    await restart(rig, other)
    await rig.kubelet.wait_registered(DRIVER, times=2)
    await eventually(lambda: not any(s["spec"].get("devices") for s in rig.api.slices.values()))
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    assert not spec.exists()
    checkpoint = json.loads((rig.plugins / DRIVER / "checkpoint.json").read_text())
    assert checkpoint["claims"] == {}
    await eventually(lambda: not (rig.plugins / DRIVER / "dra.sock").exists())
    await eventually(lambda: not (rig.registry / f"{DRIVER}-reg.sock").exists())


async def test_a_reload_serving_the_driver_through_dra_again_takes_the_claims_back(rig: Rig) -> None:  # noqa: F811
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    claim = await prepared(rig, "c", "sim-0")
    current = [rig.config(serve="devicePlugin")]
    await rig.stop()
    rig.daemon = Daemon(
        current[0],
        lambda: current[0],
        _build,
        dra=rig.factory,
        leftovers=leftovers(rig, current[0]),
    )
    rig.task = asyncio.create_task(rig.daemon.run())
    await rig.kubelet.wait_registered(DRIVER, times=2)
    current[0] = rig.config()
    await rig.daemon.reload()
    await rig.kubelet.wait_registered(DRIVER, times=3)
    await eventually(lambda: len(rig.pool()) == 4)
    other = rig.api.add_claim("d", [result("sim-0")])
    assert "already prepared" in (await rig.kubelet.prepare(DRIVER, other)).claims[other.uid].error
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    assert (await rig.kubelet.prepare(DRIVER, other)).claims[other.uid].error == ""


def test_only_kxpu_checkpoints_of_their_own_driver_count(tmp_path: Path) -> None:
    from kxpu.dra.leftover import find_leftovers

    (tmp_path / "gpu.nvidia.com").mkdir()
    (tmp_path / "gpu.nvidia.com" / "checkpoint.json").write_text(
        '{"checksum": 1, "v": {"claims": {"x": {}}}}'
    )
    (tmp_path / "a.example.com").mkdir()
    (tmp_path / "a.example.com" / "checkpoint.json").write_text(
        json.dumps({"version": "v1", "driver": "a.example.com", "claims": {"u": {}}})
    )
    (tmp_path / "b.example.com").mkdir()
    (tmp_path / "b.example.com" / "checkpoint.json").write_text(
        json.dumps({"version": "v1", "driver": "b.example.com", "claims": {}})
    )
    assert find_leftovers(tmp_path, set()) == ["a.example.com"]
    assert find_leftovers(tmp_path, {"a.example.com"}) == []
    # Another vendor's file is neither used nor moved aside.
    assert (tmp_path / "gpu.nvidia.com" / "checkpoint.json").exists()
    # A driver another live process serves (a second daemon, an update's other pod) is left to it.
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(tmp_path / "a.example.com" / "dra.sock"))
        live.listen()
        assert find_leftovers(tmp_path, set()) == []


async def test_a_renamed_driver_never_prepares_what_the_old_ones_claims_hold(rig: Rig) -> None:  # noqa: F811
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    old = await prepared(rig, "old", "sim-0")
    renamed = rig.config(dra={"nodeName": NODE, "cdiSpecDir": str(rig.cdi), "driverName": "npu2.example.com"})
    await rig.stop()
    drained = leftovers(rig, renamed)
    assert drained is not None
    original = rig.factory

    def wired(resource: ResourceConfig, backend: Any, snapshot: DeviceSnapshot) -> DraPlugin:
        plugin = original(resource, backend, snapshot)
        plugin.preparer.elsewhere = lambda: drained.withheld_from(resource.name)
        return plugin

    rig.factory = wired  # type: ignore[method-assign]
    rig.daemon = Daemon(renamed, lambda: renamed, _build, dra=rig.factory, leftovers=drained)
    rig.task = asyncio.create_task(rig.daemon.run())
    await rig.kubelet.wait_registered("npu2.example.com")

    def new_claim(name: str, device: str) -> Any:
        return rig.api.add_claim(
            name, [{"request": "npu", "driver": "npu2.example.com", "pool": NODE, "device": device}]
        )

    taken, free = new_claim("taken", "sim-0"), new_claim("free", "sim-1")
    answer = await rig.kubelet.prepare("npu2.example.com", taken, free)
    assert f"held by DRA claim default/old of driver {DRIVER}" in answer.claims[taken.uid].error
    assert answer.claims[free.uid].error == ""
    await rig.kubelet.wait_registered(DRIVER, times=2)
    assert (await rig.kubelet.unprepare(DRIVER, old)).claims[old.uid].error == ""
    assert (await rig.kubelet.prepare("npu2.example.com", taken)).claims[taken.uid].error == ""

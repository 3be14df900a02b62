"""The node daemon serving a resource through DRA, over real unix sockets, to a stand-in of the kubelet's DRA
side (plugin registration, DRAPlugin v1 and v1beta1, resource health), with an in-memory API server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kxpu.cli import _build
from kxpu.config import Config, ResourceConfig, parse_config
from kxpu.daemon import Daemon, Phase
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.plugin import DraPlugin
from kxpu.model import Backend
from kxpu.testing.dra import DraKubeletStandIn, FakeDraApi

NPU = "example.com/npu"
DRIVER = "npu.example.com"
NODE = "node-a"


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.registry = root / "registry"
        self.plugins = root / "plugins"
        self.cdi = root / "cdi"
        self.state = root / "state.json"
        self.api = FakeDraApi({NODE: "uid-a"})
        self.kubelet = DraKubeletStandIn(self.registry, self.api, NODE)
        self.daemon: Daemon | None = None
        self.task: asyncio.Task[int] | None = None

    def config(self, **resource: Any) -> Config:
        entry = {
            "name": NPU,
            "simulated": {"count": 4, "model": "sim", "memoryMiB": 16384, "stateFile": str(self.state)},
            "serve": "dra",
            "dra": {"nodeName": NODE, "cdiSpecDir": str(self.cdi)},
            **resource,
        }
        return parse_config(
            {
                "version": "v1",
                "devicePluginDir": str(self.root / "dp"),
                "kubeletPluginsDir": str(self.plugins),
                "pluginsRegistryDir": str(self.registry),
                "resources": [entry],
            }
        )

    def factory(self, resource: ResourceConfig, backend: Backend, snapshot: DeviceSnapshot) -> DraPlugin:
        return DraPlugin(
            resource.name,
            resource.dra_driver,
            resource.dra.node_name or NODE,
            backend,
            snapshot,
            self.plugins,
            self.registry,
            self.api,
            self.api,
            resource.dra,
            status_api=self.api,
        )

    async def start(self, config: Config | None = None, reload: Callable[[], Config] | None = None) -> Daemon:
        config = config or self.config()
        self.daemon = Daemon(config, reload or (lambda: config), _build, dra=self.factory)
        self.task = asyncio.create_task(self.daemon.run())
        return self.daemon

    async def stop(self) -> None:
        if self.daemon is not None and self.task is not None:
            self.daemon.stop()
            await asyncio.wait_for(self.task, 10)
            self.daemon = self.task = None

    def pool(self) -> list[dict[str, Any]]:
        return self.api.pool(DRIVER, NODE)


async def eventually(check: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    rig = Rig(root)
    await rig.kubelet.start()
    yield rig
    await rig.stop()
    await rig.kubelet.stop()
    shutil.rmtree(root, ignore_errors=True)


def result(device: str, request: str = "npu") -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device}


async def test_registers_publishes_prepares_and_reports_health(rig: Rig) -> None:
    daemon = await rig.start()
    driver = await rig.kubelet.wait_registered(DRIVER)
    assert driver.service == "v1.DRAPlugin"
    assert driver.endpoint == str(rig.plugins / DRIVER / "dra.sock")
    assert stat.S_IMODE((rig.plugins / DRIVER).stat().st_mode) == 0o750  # created so: no one else gets in
    await eventually(lambda: len(rig.pool()) == 4)
    assert rig.pool()[0]["attributes"]["model"] == {"string": "sim"}
    assert rig.pool()[0]["capacity"] == {"memory": {"value": "16Gi"}}
    await eventually(lambda: daemon.readiness()[0])

    claim = rig.api.add_claim("c", [result("sim-1"), result("sim-2")])
    answer = (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid]
    assert answer.error == ""
    assert [d.device_name for d in answer.devices] == ["sim-1", "sim-2"]
    assert list(answer.devices[0].cdi_device_ids) == [f"{DRIVER}/claim={claim.uid}-npu"]
    spec = json.loads((rig.cdi / f"kxpu-dra-{DRIVER}-{claim.uid}.json").read_text())
    assert spec["devices"][0]["containerEdits"]["env"] == ["KXPU_VISIBLE_DEVICES=sim-1,sim-2"]
    dra_status = daemon.status()["resources"][NPU]["dra"]
    assert dra_status["driver"] == DRIVER and dra_status["registered"]
    assert dra_status["claims"] == {claim.uid: {"claim": "default/c", "devices": ["sim-1", "sim-2"]}}

    # Health: a flip reaches the kubelet's health stream and taints the device in the pool.
    report = await rig.kubelet.wait_health(DRIVER, lambda r: len(r.devices) == 4)
    assert all(d.health == 1 for d in report.devices)
    rig.state.write_text(json.dumps({"sim-2": "Unhealthy"}))
    report = await rig.kubelet.wait_health(
        DRIVER, lambda r: any(d.device.device_name == "sim-2" and d.health == 2 for d in r.devices)
    )
    await eventually(lambda: any(d.get("taints") for d in rig.pool()))
    tainted = [d for d in rig.pool() if d.get("taints")]
    assert [(d["name"], d["taints"][0]["value"]) for d in tainted] == [("sim-2", "state-file")]

    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    assert not list(rig.cdi.glob("*.json"))


async def test_daemon_restart_keeps_prepared_claims_and_unprepare_still_works(rig: Rig) -> None:
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    claim = rig.api.add_claim("c", [result("sim-0")])
    first = (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid]
    await rig.stop()
    assert not (rig.plugins / DRIVER / "dra.sock").exists(), "sockets are removed on stop"
    generation = max(s["spec"]["pool"]["generation"] for s in rig.api.slices.values())
    writes = rig.api.writes
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER, times=2)  # the new process's socket: registered anew
    again = (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid]
    assert again == first  # from the checkpoint: same devices, same CDI IDs
    # The same devices are not republished: the scheduler's view does not churn over a restart.
    await eventually(lambda: rig.daemon is not None and rig.daemon.readiness()[0])
    assert rig.api.writes == writes
    assert max(s["spec"]["pool"]["generation"] for s in rig.api.slices.values()) == generation
    other = rig.api.add_claim("d", [result("sim-0")])
    assert "already prepared" in (await rig.kubelet.prepare(DRIVER, other)).claims[other.uid].error
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""


async def test_kubelet_restart_and_a_removed_socket_register_again(rig: Rig) -> None:
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    started = asyncio.get_running_loop().time()
    await rig.kubelet.restart()
    await rig.kubelet.wait_registered(DRIVER, times=2, timeout=5)
    assert asyncio.get_running_loop().time() - started < 1.0
    (rig.registry / f"{DRIVER}-reg.sock").unlink()  # someone cleans the registry directory
    await rig.kubelet.wait_registered(DRIVER, times=3, timeout=5)
    assert (rig.registry / f"{DRIVER}-reg.sock").is_socket()
    claim = rig.api.add_claim("c", [result("sim-3")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""


async def test_slices_come_back_after_a_kubelet_restart_wipes_them(rig: Rig) -> None:
    """The kubelet deletes every ResourceSlice of its node when it starts (and a driver's 30 s after losing
    it); an admin may delete them too: the driver publishes them again, within a second."""
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    await rig.kubelet.restart()
    await rig.kubelet.wait_registered(DRIVER, times=2, timeout=5)
    await eventually(lambda: len(rig.pool()) == 4, timeout=1.5)
    assert rig.api.delete_node_slices(NODE, DRIVER)  # by hand, with the driver registered
    await eventually(lambda: len(rig.pool()) == 4, timeout=1.5)


async def test_a_recreated_node_gets_slices_it_owns(rig: Rig) -> None:
    """The Node object deleted and created again (same name, new UID): the garbage collector removes the slices
    the old Node owned, and the driver publishes new ones owned by the new Node."""
    await rig.start()
    await eventually(lambda: len(rig.pool()) == 4)
    rig.api.nodes[NODE] = "uid-a2"
    for name, obj in list(rig.api.slices.items()):  # the garbage collector, for the old owner
        if obj["metadata"]["ownerReferences"][0]["uid"] == "uid-a":
            await rig.api.delete_slice(name)
    await eventually(lambda: len(rig.pool()) == 4, timeout=1.5)
    owners = {o["metadata"]["ownerReferences"][0]["uid"] for o in rig.api.slices.values()}
    assert owners == {"uid-a2"}


async def test_v1beta1_kubelets_are_served(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kxpu.testing.dra.KUBELET_SERVICES", ("v1beta1.DRAPlugin",))
    await rig.start()
    driver = await rig.kubelet.wait_registered(DRIVER)
    assert driver.service == "v1beta1.DRAPlugin"
    claim = rig.api.add_claim("c", [result("sim-0")])
    answer = (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid]
    assert answer.error == "" and answer.devices[0].device_name == "sim-0"
    spec = rig.cdi / f"kxpu-dra-{DRIVER}-{claim.uid}.json"
    assert spec.exists()
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    assert not spec.exists()


async def test_api_errors_are_retried_and_readiness_waits_for_the_slices(rig: Rig) -> None:
    rig.api.fail_next = ConnectionError("connection refused")
    daemon = await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    await eventually(lambda: daemon.readiness()[0])
    assert daemon.readiness()[1]["resources"][NPU] == Phase.REGISTERED


async def test_taints_fall_back_to_withdrawal_when_the_api_drops_them(rig: Rig) -> None:
    rig.api.taints = False
    rig.state.write_text(json.dumps({"sim-0": "Unhealthy"}))
    await rig.start()
    await eventually(lambda: [d["name"] for d in rig.pool()] == ["sim-1", "sim-2", "sim-3"])
    rig.state.write_text("{}")
    await eventually(lambda: len(rig.pool()) == 4)


async def test_reload_that_drops_dra_withdraws_the_slices(rig: Rig) -> None:
    current = [rig.config()]
    await rig.start(current[0], reload=lambda: current[0])
    await eventually(lambda: len(rig.pool()) == 4)
    current[0] = rig.config(serve="devicePlugin", dra={"nodeName": NODE, "cdiSpecDir": str(rig.cdi)})
    assert rig.daemon is not None
    await rig.daemon.reload()
    await eventually(lambda: not rig.api.slices)


def test_config_rules_for_dra() -> None:
    from kxpu.config import ConfigError

    base = {"name": NPU, "simulated": {"count": 1}, "serve": "dra"}
    with pytest.raises(ConfigError, match="cdi: applies to the device plugin"):
        parse_config({"version": "v1", "resources": [{**base, "cdi": {"enabled": True}}]})
    with pytest.raises(ConfigError, match="DRA driver names must be unique"):
        parse_config(
            {
                "version": "v1",
                "resources": [base, {**base, "name": "example.com/gpu", "dra": {"driverName": DRIVER}}],
            }
        )
    with pytest.raises(
        ConfigError, match=r"resources\[0\].dra.driverName: Value error|lowercase DNS subdomain"
    ):
        parse_config({"version": "v1", "resources": [{**base, "dra": {"driverName": "Bad_Name"}}]})
    long_dir = "/" + "x" * 90
    with pytest.raises(ConfigError, match="unix sockets allow 107"):
        parse_config({"version": "v1", "pluginsRegistryDir": long_dir, "resources": [base]})
    assert os.environ.get("KXPU_NEVER_SET") is None


@pytest.mark.parametrize("held_id", ["sim-2", "sim-2::3"])
async def test_devices_held_through_the_device_plugin_are_kept_out_until_released(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, held_id: str
) -> None:
    """A node moving from kxpu's device plugin to DRA: a running pod's device (from the kubelet's PodResources
    API) is tainted and never prepared until that pod is gone; a slot of it (``sim-2::3``: a pod the extender
    shared it with, a replica) holds the whole device too, so DRA shares never land beside it."""
    from kxpu.testing import KubeletStandIn

    monkeypatch.setattr("kxpu.dra.plugin.HELD_POLL_SECONDS", 0.1)
    socket = rig.root / "podres" / "kubelet.sock"
    dp_kubelet = KubeletStandIn(rig.root / "dp", pod_resources_socket=socket)
    await dp_kubelet.start()
    dp_kubelet.assignments[("default", "old", "main")] = [(NPU, [held_id])]
    original = rig.factory

    def with_pod_resources(resource: ResourceConfig, backend: Backend, snapshot: DeviceSnapshot) -> DraPlugin:
        plugin = original(resource, backend, snapshot)
        plugin.pod_resources = socket
        return plugin

    rig.factory = with_pod_resources  # type: ignore[method-assign]
    try:
        await rig.start()
        await rig.kubelet.wait_registered(DRIVER)
        await eventually(lambda: [d["name"] for d in rig.pool() if d.get("taints")] == ["sim-2"])
        held = next(d for d in rig.pool() if d["name"] == "sim-2")["taints"][0]
        assert held == {
            "key": "kxpu.io/held-by-device-plugin",
            "value": "true",
            "effect": "NoSchedule",
            "timeAdded": held["timeAdded"],
        }
        claim = rig.api.add_claim("c", [result("sim-2")])
        answer = (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid]
        assert "still used by a pod that got it through the device plugin" in answer.error
        del dp_kubelet.assignments[("default", "old", "main")]  # the old pod ends
        await eventually(lambda: not any(d.get("taints") for d in rig.pool()))
        assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
    finally:
        await dp_kubelet.stop()


async def test_kxpu_status_shows_claims_and_their_shares(rig: Rig) -> None:
    from kxpu.status import format_table, node_status
    from kxpu.testing.process import free_port

    port = free_port()
    config = rig.config(dra={"nodeName": NODE, "cdiSpecDir": str(rig.cdi), "shares": {}})
    rig.daemon = Daemon(config, lambda: config, _build, http_address=f"127.0.0.1:{port}", dra=rig.factory)
    rig.task = asyncio.create_task(rig.daemon.run())
    await rig.kubelet.wait_registered(DRIVER)
    share = {**result("sim-1"), "shareID": "7f1c", "consumedCapacity": {"memory": "4Gi", "cores": "25"}}
    claim = rig.api.add_claim("c", [share])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
    status = await node_status(rig.root / "no-kubelet.sock", f"http://127.0.0.1:{port}")
    holders = {d.id: d.holders for d in status.devices}
    assert holders["sim-1"] == ["claim default/c (4096 MiB, 25%)"]
    assert "claim default/c (4096 MiB, 25%)" in format_table(status)


async def test_a_standby_process_publishes_nothing_and_takes_over_with_the_current_checkpoint(
    rig: Rig,
) -> None:
    """A second process on the same node (an update's new pod before the old one stops) stands by: it writes
    no ResourceSlice, and when the first is gone it serves the claims the first prepared meanwhile."""
    from prometheus_client import REGISTRY

    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
    from kxpu.dra.config import DraConfig
    from kxpu.dra.metrics import DRIVER_REGISTERED as REGISTERED
    from kxpu.dra.plugin import DraPhase

    def plugin(api: FakeDraApi) -> tuple[DraPlugin, DeviceSnapshot]:
        backend = SimulatedBackend(SimulatedConfig(count=4, model="sim"))
        snapshot = DeviceSnapshot()
        return (
            DraPlugin(
                NPU,
                DRIVER,
                NODE,
                backend,
                snapshot,
                rig.plugins,
                rig.registry,
                api,
                api,
                DraConfig(cdi_spec_dir=rig.cdi),
            ),
            snapshot,
        )

    first, snap = plugin(rig.api)
    await snap.update(first.backend.discover())
    first_task = asyncio.create_task(first.run())
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    second_api = FakeDraApi({NODE: "uid-a"})
    second, snap2 = plugin(second_api)
    await snap2.update(second.backend.discover())
    second_task = asyncio.create_task(second.run())
    try:
        await eventually(lambda: second.phase is DraPhase.STANDBY)
        # One process per node in life: the standby one says it is not registered.
        assert REGISTERED.labels(DRIVER)._value.get() == 0
        claim = rig.api.add_claim("c", [result("sim-0")])
        second_api.claims = rig.api.claims
        assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
        await asyncio.sleep(0.3)  # a standby publisher would have written by now
        assert second_api.slices == {}
        first_task.cancel()
        await asyncio.gather(first_task, return_exceptions=True)
        await rig.kubelet.wait_registered(DRIVER, times=2)
        await eventually(lambda: second.phase is DraPhase.REGISTERED)
        # from the checkpoint the second reloaded, as /metrics reads it
        assert REGISTRY.get_sample_value("kxpu_dra_claims_prepared", {"driver": DRIVER}) == 1
        await eventually(lambda: len(second_api.pool(DRIVER, NODE)) == 4)
        other = rig.api.add_claim("d", [result("sim-0")])
        assert "already prepared" in (await rig.kubelet.prepare(DRIVER, other)).claims[other.uid].error
        spec = rig.cdi / f"kxpu-dra-{DRIVER}-{claim.uid}.json"
        assert spec.exists()
        assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
        assert not spec.exists()
    finally:
        for task in (first_task, second_task):
            task.cancel()
        await asyncio.gather(first_task, second_task, return_exceptions=True)


async def test_reload_that_drops_dra_is_refused_while_claims_are_prepared(rig: Rig) -> None:
    """Prepared claims could no longer be unprepared (pods stuck Terminating) and the device plugin would offer
    devices DRA containers hold: the reload is refused until the claims are gone, then applied."""
    current = [rig.config()]
    await rig.start(current[0], reload=lambda: current[0])
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    claim = rig.api.add_claim("c", [result("sim-0")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
    current[0] = rig.config(serve="devicePlugin", dra={"nodeName": NODE, "cdiSpecDir": str(rig.cdi)})
    assert rig.daemon is not None
    await rig.daemon.reload()
    assert rig.daemon.config is not current[0], "the reload was applied"
    assert len(rig.pool()) == 4
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    await rig.daemon.reload()
    assert rig.daemon.config is current[0]
    await eventually(lambda: not rig.api.slices)


async def test_a_stopped_plugin_closes_its_api_client(rig: Rig) -> None:
    """Each start of a resource's DRA half makes a new API client (cli._dra): the old one's connections are
    closed when it stops, not leaked on every restart of the runner."""
    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig

    closed: list[bool] = []

    async def close() -> None:
        closed.append(True)

    snapshot = DeviceSnapshot()
    backend = SimulatedBackend(SimulatedConfig(count=1, model="sim"))
    await snapshot.update(backend.discover())
    plugin = DraPlugin(
        NPU, DRIVER, NODE, backend, snapshot, rig.plugins, rig.registry, rig.api, rig.api, close=close
    )
    task = asyncio.create_task(plugin.run())
    await rig.kubelet.wait_registered(DRIVER)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert closed == [True]


async def test_a_socket_grpc_cannot_bind_is_retried_not_fatal(rig: Rig) -> None:
    """gRPC reports a bind failure as RuntimeError("Failed to bind"), not OSError: the driver logs it and
    retries (the directory may be fixed), rather than the whole resource failing on it."""
    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
    from kxpu.dra.plugin import DraPhase

    deep = rig.root / ("d" * 100)  # past what a unix socket address holds, even for the short private name
    snapshot = DeviceSnapshot()
    backend = SimulatedBackend(SimulatedConfig(count=1, model="sim"))
    await snapshot.update(backend.discover())
    plugin = DraPlugin(NPU, DRIVER, NODE, backend, snapshot, deep, rig.registry, rig.api, rig.api)
    task = asyncio.create_task(plugin.run())
    done, _ = await asyncio.wait([task], timeout=1.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not done, f"the plugin stopped: {task.exception() if task.done() and not task.cancelled() else ''}"
    assert plugin.phase is DraPhase.STARTING


async def test_prepares_do_not_wake_the_socket_check_but_a_removed_dra_socket_does(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint lives beside the DRA socket and is rewritten on every prepare and unprepare: those writes
    must not wake the driver's socket check (a wake-up per kubelet call is CPU on every claim), while the
    socket itself removed still brings it back and registers it again."""
    wakes: list[int] = []
    poke = DraPlugin.poke

    def counted(self: DraPlugin) -> None:
        wakes.append(1)
        poke(self)

    monkeypatch.setattr(DraPlugin, "poke", counted)
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    before = len(wakes)
    for n in range(20):
        claim = rig.api.add_claim(f"c{n}", [result(f"sim-{n % 4}")])
        assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""
        assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    (rig.plugins / DRIVER / "dra.sock").unlink()
    await rig.kubelet.wait_registered(DRIVER, times=2, timeout=5)
    assert (rig.plugins / DRIVER / "dra.sock").is_socket()
    # The removal, the socket served again and the registration: a few wake-ups, none per prepare.
    assert len(wakes) - before <= 6, f"{len(wakes) - before} wake-ups for 20 prepares and one removed socket"


async def test_a_driver_stopped_while_it_loads_its_checkpoint_lets_go_of_its_metrics(rig: Rig) -> None:
    """A reload or SIGTERM while the driver starts: its prepared-claims series stops reading the stopped driver's
    preparer (which is freed) and keeps the count it had."""
    import gc
    import threading
    import weakref

    from prometheus_client import REGISTRY

    config = rig.config()
    resource = config.resources[0]
    plugin = rig.factory(resource, _build(resource), DeviceSnapshot())
    loading, release = threading.Event(), threading.Event()
    real_load = plugin.checkpoint.load

    def slow_load() -> None:
        loading.set()
        release.wait(10)
        real_load()

    plugin.checkpoint.load = slow_load  # type: ignore[method-assign]
    task = asyncio.create_task(plugin.run())
    await asyncio.to_thread(loading.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    assert REGISTRY.get_sample_value("kxpu_dra_claims_prepared", {"driver": resource.dra_driver}) == 0
    gone = weakref.ref(plugin.preparer)
    del plugin, task
    for _ in range(50):  # the loading thread lets go of the checkpoint once it returns
        gc.collect()
        if gone() is None:
            break
        await asyncio.sleep(0.02)
    assert gone() is None

"""The Cambricon backend over the fake libcndev and fake /dev: the cndev calls and their error codes,
discovery, the exact Allocate edits Cambricon's plugin gives, env-share copies, health as cndev
reports it (polled), a library that cannot start, hot-plug, and the daemon as a separate process."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kxpu.backends.cambricon import CambriconBackend, CambriconConfig
from kxpu.backends.cambricon import cndev as c
from kxpu.backends.cambricon.cndev import Cndev, CndevError, load_library
from kxpu.backends.host import Host
from kxpu.cli import main
from kxpu.config import ConfigError, load_config
from kxpu.model import BackendError, Device, DeviceNode, Mount
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_cambricon import FakeCambricon, FakeLibcndev

MLU = "cambricon.com/mlu"


@pytest.fixture
def machines() -> Iterator[Callable[[str], FakeCambricon]]:
    made: list[FakeCambricon] = []

    def make(profile: str) -> FakeCambricon:
        made.append(FakeCambricon(profile))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def backend(fake: FakeCambricon, **config: Any) -> CambriconBackend:
    section = CambriconConfig.model_validate({"hostRoot": str(fake.root), **config})
    return CambriconBackend(section, library=fake.library, host=Host(fake.root))


def by_slot(devices: list[Device]) -> dict[int, Device]:
    return {d.index: d for d in devices if d.index is not None}


async def next_list(stream: AsyncGenerator[list[Device]], timeout: float = 5.0) -> list[Device]:
    return await asyncio.wait_for(anext(stream), timeout)


# ---------------------------------------------------------------------------------------------- cndev


def test_the_fake_answers_with_cndevs_codes(machines: Callable[[str], FakeCambricon]) -> None:
    lib = machines("mlu370-x8-4x").library
    info = c.cndevCardInfo_t(version=c.CNDEV_VERSION_6)
    assert lib.cndevGetDeviceCount(ctypes.byref(info)) == c.CNDEV_ERROR_UNINITIALIZED
    assert lib.cndevInit(0) == c.CNDEV_SUCCESS
    assert lib.cndevGetDeviceCount(ctypes.byref(info)) == c.CNDEV_SUCCESS and info.number == 4
    unversioned = c.cndevCardInfo_t()  # version left 0: cndev refuses the structure
    assert lib.cndevGetDeviceCount(ctypes.byref(unversioned)) == c.CNDEV_ERROR_UNSUPPORTED_API_VERSION
    state = c.cndevCardHealthState_t(version=c.CNDEV_VERSION_6)
    assert lib.cndevGetCardHealthState(ctypes.pointer(state), 9) == c.CNDEV_ERROR_INVALID_DEVICE_ID
    assert lib.cndevGetErrorString(18) == b"CNDEV_ERROR_IN_PROBLEM"


def test_cndev_errors_carry_the_call_the_code_and_a_short_reason(
    machines: Callable[[str], FakeCambricon],
) -> None:
    cndev = Cndev(machines("mlu370-x8-4x").library)
    with pytest.raises(CndevError, match=r"cndevGetDeviceCount: CNDEV_ERROR_UNINITIALIZED") as info:
        cndev.device_count()
    assert info.value.reason == "cndev-uninitialized"
    cndev.init()
    card = cndev.card(2, cndev.handle(2))
    assert (card.model, card.memory_mib, card.numa_node, card.pci_bus_id, card.cores) == (
        "MLU370-X8",
        49152,
        1,
        "0000:3d:00.0",
        32,
    )
    assert card.uuid.startswith("MLU-") and len(card.uuid) == 40
    assert cndev.versions(cndev.handle(0)) == ("v1.1.4", "v5.10.22")


def test_a_real_library_without_cndevs_symbols_answers_not_supported() -> None:
    libc = ctypes.util.find_library("c")
    assert libc is not None
    cndev = Cndev(load_library(libc))  # a real CDLL: every cndev symbol is absent
    with pytest.raises(CndevError, match="cndevInit: CNDEV_ERROR_NOT_SUPPORTED"):
        cndev.init()
    with pytest.raises(OSError):
        load_library("/nonexistent/libcndev.so")


# ---------------------------------------------------------------------------------------------- discovery


def test_discovery_names_mlus_as_the_plugin_does(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu590-8x")
    b = backend(fake)
    devices = b.discover()
    assert [d.id for d in devices] == [fake.uuid(i) for i in range(8)]
    d7 = devices[7]
    assert (d7.model, d7.index, d7.memory_mib, d7.numa_nodes, d7.cores) == ("MLU590", 7, 81920, (1,), 48)
    assert d7.extra["path"] == "/dev/cambricon_dev7" and d7.extra["serialNumber"] == "3700000007"
    assert b.node_labels() == {"Model": "MLU590", "DriverVersion": "v5.10.22", "MCUVersion": "v1.1.4"}


def test_env_share_copies_and_their_preferred_spread(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    b = backend(fake, mode="env-share", virtualizationNum=3)
    devices = b.discover()
    assert len(devices) == 12 and devices[4].id == f"{fake.uuid(1)}-_-2"
    taken = {f"{fake.uuid(0)}-_-1", f"{fake.uuid(0)}-_-2"}
    free = [d for d in devices if d.id not in taken]
    chosen = b.preferred_allocation(free, [], 2)
    assert chosen == [f"{fake.uuid(1)}-_-1", f"{fake.uuid(2)}-_-1"]  # the emptiest MLUs, one copy each
    edits = b.allocate([d for d in devices if d.id in (f"{fake.uuid(3)}-_-1", f"{fake.uuid(3)}-_-3")])
    assert [n.container_path for n in edits.device_nodes] == [
        "/dev/cambricon_ctl",
        "/dev/cambricon_ipcm3",
        "/dev/cambricon_dev3",
    ]


# ---------------------------------------------------------------------------------------------- allocation


def test_default_mode_gives_the_plugins_device_nodes(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu590-8x")
    fake.fake.device_node("/dev/ttyMS5", 4, 70)
    b = backend(fake)
    devices = by_slot(b.discover())
    edits = b.allocate([devices[5], devices[4]])
    assert edits.device_nodes == [
        DeviceNode(p, str(fake.root / p.lstrip("/")), "rw")
        for p in (
            "/dev/cambricon_ctl",
            "/dev/cambricon_gdr",
            "/dev/cambricon_ipcm4",
            "/dev/cambricon_dev4",
            "/dev/cambricon_ipcm5",
            "/dev/cambricon_dev5",
        )
    ]
    assert edits.env == {} and edits.mounts == []
    console = backend(fake, enableConsole=True, mountRPMsg=True, cnmonPath="/usr/bin/cnmon")
    edits = console.allocate([by_slot(console.discover())[5]])
    assert "/dev/ttyMS5" in [n.container_path for n in edits.device_nodes]
    assert edits.mounts == [
        Mount("/dev/cambricon/", str(fake.root / "dev/cambricon")),
        Mount("/usr/bin/cnmon", str(fake.root / "usr/bin/cnmon"), read_only=True),
    ]


def test_use_runtime_gives_only_the_slots(machines: Callable[[str], FakeCambricon]) -> None:
    b = backend(machines("mlu370-x8-4x"), useRuntime=True, env={"MLU_EXTRA": "{count}"})
    devices = by_slot(b.discover())
    edits = b.allocate([devices[3], devices[1]])
    assert edits.env == {"CAMBRICON_VISIBLE_DEVICES": "1,3", "MLU_EXTRA": "2"}
    assert edits.device_nodes == [] and edits.mounts == []
    with pytest.raises(BackendError, match="not an MLU of this resource: MLU-nope"):
        b.allocate([Device("MLU-nope")])


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    def load(section: dict[str, Any]) -> None:
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({"version": "v1", "resources": [{"name": MLU, "cambricon": section}]}))
        load_config(path)

    with pytest.raises(ConfigError, match="cnmonPath 'usr/bin/cnmon' must be an absolute path"):
        load({"cnmonPath": "usr/bin/cnmon"})
    with pytest.raises(ConfigError, match="hostRoot host must be an absolute path"):
        load({"hostRoot": "host"})
    with pytest.raises(ConfigError, match="mode"):
        load({"mode": "mim"})
    with pytest.raises(ConfigError, match=r"uses \{slot\}"):
        load({"env": {"X": "{slot}"}})


# ---------------------------------------------------------------------------------------------- health


async def test_health_is_polled_and_recovers(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    stream = backend(fake, pollSeconds=0.05).watch()
    assert all(d.healthy for d in await next_list(stream))
    fake.set_health(2, False)
    assert by_slot(await next_list(stream))[2].health_reason == "device-in-problem"
    fake.set_health(2, False, driver_state=5)
    assert by_slot(await next_list(stream))[2].health_reason == "driver-boot-error"
    fake.set_health(2, True)
    fake.set_compute_mode(0, 2)  # PROHIBITED: no context may run there, so the plugin calls it unhealthy
    devices = by_slot(await next_list(stream))
    assert devices[2].healthy and devices[0].health_reason == "compute-mode-prohibited"
    fake.set_compute_mode(0, None)  # the call stops being supported: ignored from then on, as the plugin does
    assert by_slot(await next_list(stream))[0].healthy
    await stream.aclose()


def test_health_checks_can_be_turned_off(
    machines: Callable[[str], FakeCambricon], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = machines("mlu370-x8-4x")
    fake.set_health(1, False)
    assert by_slot(backend(fake).discover())[1].health_reason == "device-in-problem"
    assert by_slot(backend(fake, disableHealthCheck=True).discover())[1].healthy
    monkeypatch.setenv("DP_DISABLE_HEALTHCHECKS", "all")
    assert by_slot(backend(fake).discover())[1].healthy


def test_a_library_that_cannot_start_makes_every_mlu_unhealthy_then_recovers(
    machines: Callable[[str], FakeCambricon],
) -> None:
    fake = machines("mlu370-x8-4x")
    missing = CambriconBackend(
        CambriconConfig.model_validate({"library": "/nonexistent/libcndev.so"}), host=Host(fake.root)
    )
    devices = missing.discover()  # the real loader, no library: the cards are known from /dev only
    assert [(d.id, d.health_reason) for d in devices] == [
        (f"cambricon_dev{i}", "no-libcndev") for i in range(4)
    ]
    fake.state["init_error"] = 1  # CNDEV_ERROR_NO_DRIVER from cndevInit
    fake._save()
    b = backend(fake)
    assert {d.health_reason for d in b.discover()} == {"cndev-no-driver"}
    fake.state["init_error"] = None
    fake._save()
    assert [d.id for d in b.discover() if d.healthy] == [fake.uuid(i) for i in range(4)]


async def test_a_lost_mlu_and_a_driver_going_away(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    stream = backend(fake, pollSeconds=3600).watch()  # only inotify on /dev wakes it in this test's time
    assert len(await next_list(stream)) == 4
    fake.lose(1)
    assert by_slot(await next_list(stream))[1].health_reason == "cndev-in-problem"
    fake.restore(1)
    devices = await next_list(stream)
    while not all(d.healthy for d in devices):  # its nodes may arrive one wake-up at a time
        devices = await next_list(stream)
    fake.unload_driver()
    devices = await next_list(stream)
    while devices:
        devices = await next_list(stream)
    await stream.aclose()


def test_a_failing_cndev_call_names_the_mlu_and_the_code(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    fake.fail_call(2, "cndevGetUUID", c.CNDEV_ERROR_UNKNOWN)  # at start: cndev cannot name MLU 2
    fake.fail_call(3, "cndevGetCardHealthState", 99)  # a code cndev.h does not list
    b = backend(fake)
    devices = by_slot(b.discover())
    assert (devices[2].id, devices[2].health_reason) == ("cambricon_dev2", "cndev-unknown")
    assert devices[3].health_reason == "cndev-99" and devices[0].healthy
    fake.fail_call(2, "cndevGetUUID", None)
    fake.fail_call(3, "cndevGetCardHealthState", None)
    assert [d.id for d in b.discover() if d.healthy] == [fake.uuid(i) for i in range(4)]


def test_no_driver_profile_has_no_mlus(machines: Callable[[str], FakeCambricon]) -> None:
    assert backend(machines("no-driver")).discover() == []


# ---------------------------------------------------------------------------------------------- the daemon


async def test_daemon_serves_mlus_and_reports_a_health_flip(
    kubelet: KubeletStandIn,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    machines: Callable[[str], FakeCambricon],
) -> None:
    fake = machines("mlu370-x8-4x")
    config = write_config([{"name": MLU, "cambricon": {"pollSeconds": 0.1}}])
    await daemons(config, env={"KXPU_FAKE_CAMBRICON": str(fake.root)})
    view = await kubelet.wait_registered(MLU)
    assert view.devices == {fake.uuid(i): "Healthy" for i in range(4)}
    response = await kubelet.allocate(MLU, [fake.uuid(2)])
    container = response.container_responses[0]
    assert [(d.container_path, d.host_path) for d in container.devices] == [
        (p, str(fake.root / p.lstrip("/")))
        for p in ("/dev/cambricon_ctl", "/dev/cambricon_ipcm2", "/dev/cambricon_dev2")
    ]
    assert dict(container.envs) == {}
    fake.set_health(3, False)
    await kubelet.wait_devices(MLU, lambda d: d[fake.uuid(3)] == "Unhealthy")
    fake.set_health(3, True)
    await kubelet.wait_devices(MLU, lambda d: d[fake.uuid(3)] == "Healthy")


def test_kxpu_devices_over_a_fake_named_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "cambricon.yaml"
    monkeypatch.setenv("KXPU_FAKE_CAMBRICON", "mlu590-8x")
    result = CliRunner().invoke(main, ["devices", "--config", str(example), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert len(doc[MLU]["devices"]) == 8 and doc[MLU]["labels"]["Model"] == "MLU590"
    monkeypatch.setenv("KXPU_FAKE_CAMBRICON", "/nonexistent")
    bad = CliRunner().invoke(main, ["devices", "--config", str(example)])
    assert bad.exit_code == 1 and "KXPU_FAKE_CAMBRICON=/nonexistent: no fake machine there" in bad.output


def test_a_fake_library_per_process_reads_the_shared_state(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    first, second = FakeLibcndev(fake.root), FakeLibcndev(fake.root)
    assert first.cndevInit(0) == second.cndevInit(0) == c.CNDEV_SUCCESS
    fake.set_health(0, False)
    for lib in (first, second):
        state = c.cndevCardHealthState_t(version=c.CNDEV_VERSION_6)
        assert lib.cndevGetCardHealthState(ctypes.byref(state), 0) == c.CNDEV_SUCCESS and state.health == 0


def test_the_hardware_check_script_passes_over_a_fake_machine() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "cambricon-check"
    run = subprocess.run(
        [sys.executable, str(script), "--fake", "mlu370-x8-4x", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "cambricon-check: everything matches" in run.stdout


async def test_kxpu_sharing_wraps_the_backend_under_hamis_names(
    machines: Callable[[str], FakeCambricon],
) -> None:
    """Placement and accounting work over MLUs; what a shared container gets is the MLU's own nodes plus the
    configured limit variables (which nothing in a Cambricon container enforces: docs/vendor-cambricon.md)."""
    from kxpu.sharing import inventory as inv
    from kxpu.sharing import signing
    from kxpu.sharing.config import SharingConfig
    from kxpu.sharing.node import SharingBackend, parent_id
    from kxpu.sharing.requests import ResourceFamily
    from kxpu.sharing.scheduler import Scheduler
    from kxpu.sharing.state import ClusterState
    from kxpu.testing.sharing import FakeCluster, pod

    vmlu = "cambricon.com/vmlu"
    family = ResourceFamily.derived(
        vmlu, memory="cambricon.com/mlu.smlu.vmemory", cores="cambricon.com/mlu.smlu.vcore"
    )
    fake = machines("mlu370-x8-4x")
    cluster = FakeCluster()
    link = cluster.link("node-a")
    config = SharingConfig.model_validate({"signingKey": {"file": "/dev/null"}, "splitCount": 4})
    shared = SharingBackend(backend(fake), vmlu, config, lambda: link, "node-a")
    slots = shared.discover()
    assert len(slots) == 16 and slots[5].id == f"{fake.uuid(1)}::1" and slots[5].memory_mib == 49152
    state = ClusterState([vmlu])
    state.set_node("node-a", {inv.annotation_key(vmlu): inv.encode(shared.inventory())})
    scheduler = Scheduler(state, [family], keys=lambda: cluster.keyring, api=cluster)
    cluster.add_pod(
        pod("infer", [{vmlu: 1, "cambricon.com/mlu.smlu.vmemory": 8192, "cambricon.com/mlu.smlu.vcore": 25}])
    )
    assert (
        await scheduler.bind(
            "default", "infer", cluster.pods[("default", "infer")]["metadata"]["uid"], "node-a"
        )
        == ""
    )
    annotations = cluster.pods[("default", "infer")]["metadata"]["annotations"]
    (grant,) = signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).containers[0].devices
    chosen = await shared.preferred_allocation_async(slots, [], 1)
    assert [parent_id(i) for i in chosen] == [grant.device]
    edits = await shared.allocate_async([d for d in slots if d.id == chosen[0]])
    slot = next(i for i in range(4) if fake.uuid(i) == grant.device)
    assert [n.container_path for n in edits.device_nodes] == [
        "/dev/cambricon_ctl",
        f"/dev/cambricon_ipcm{slot}",
        f"/dev/cambricon_dev{slot}",
    ]
    assert edits.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "8192m" and edits.env["CUDA_DEVICE_SM_LIMIT"] == "25"
    await shared.settled()

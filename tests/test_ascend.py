"""The ``ascend`` backend over the fake DCMI: discovery, health and recovery, hot-plug, the exact edits of
Huawei's and HAMi's plugins, labels, bad input; and the daemon as a separate process over the fake."""

from __future__ import annotations

import asyncio
import ctypes
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kxpu.backends.ascend import AscendBackend, AscendConfig
from kxpu.backends.ascend.dcmi import DcmiSource
from kxpu.cli import main
from kxpu.config import ConfigError, load_config
from kxpu.model import BackendError, Device, DeviceShare
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_dcmi import FAKE_DCMI_ENV, FakeDcmi

NPU = "huawei.com/Ascend910"


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Callable[[str], FakeDcmi]]:
    made: list[FakeDcmi] = []

    def make(profile: str) -> FakeDcmi:
        fake = FakeDcmi(profile, tmp_path / f"root-{len(made)}")
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.cleanup()


def backend(fake: FakeDcmi, resource: str = NPU, **config: Any) -> AscendBackend:
    cfg = AscendConfig.model_validate({"hostRoot": str(fake.root), **config})
    cfg.resource_name(resource)
    return AscendBackend(cfg, DcmiSource(fake.root, fake))


async def next_list(
    updates: AsyncIterator[list[Device]], predicate: Callable[[list[Device]], bool], timeout: float = 5.0
) -> list[Device]:
    async def find() -> list[Device]:
        while True:
            devices = await anext(updates)
            if predicate(devices):
                return devices

    return await asyncio.wait_for(find(), timeout)


def health(devices: list[Device]) -> dict[str, str | None]:
    return {d.id: d.health_reason for d in devices}


# ---------------------------------------------------------------------------------------- discovery


def test_discovers_eight_910b_with_what_dcmi_says(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    devices = backend(fake).discover()
    assert [d.id for d in devices] == [f"Ascend910-{n}" for n in range(8)]
    first = devices[0]
    assert first.healthy and first.model == "Ascend910B3" and first.memory_mib == 65536 and first.cores == 20
    assert first.uuid == "2B3C0910-10000000-0A5A5A5A-00C0FFEE-00000001"  # VDIE words, %08X joined by '-'
    assert first.pci_bus_id == "0000:C1:00.0" and first.index == 0
    assert [d.numa_nodes for d in devices] == [(0,)] * 4 + [(1,)] * 4  # from sysfs numa_node
    assert dict(first.extra) == {
        "physicalID": 0,
        "logicID": 0,
        "cardID": 0,
        "deviceID": 0,
        "chipName": "910B3",
        "chipType": "Ascend",
        "chipVersion": "V1",
        "aiCoreCount": 20,
        "driverVersion": "24.1.rc2",
    }


def test_310p_cards_with_two_chips_and_ddr_memory(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("310p-4x")
    devices = backend(fake, "huawei.com/Ascend310P").discover()
    assert [d.id for d in devices] == [f"Ascend310P-{n}" for n in range(4)]
    assert [(d.extra["cardID"], d.extra["deviceID"]) for d in devices] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert {d.memory_mib for d in devices} == {21527}  # no HBM on 310P: memory_info_v3
    assert {d.model for d in devices} == {"Ascend310P3"}


def test_physical_not_logical_ids_name_the_devices(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    for chip in fake.profile.chips:  # logical IDs compacted differently from the physical numbering
        chip.logic = 7 - chip.phy
    devices = backend(fake).discover()
    assert [(d.id, d.extra["logicID"]) for d in devices][:2] == [("Ascend910-0", 7), ("Ascend910-1", 6)]
    edits = backend(fake).allocate(devices[1:3])
    assert edits.env["ASCEND_VISIBLE_DEVICES"] == "1,2"


def test_chip_names_select_what_the_resource_serves(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("310p-4x")
    assert backend(fake, chipNames=["910B3"]).discover() == []
    assert len(backend(fake, chipNames=["310P3"]).discover()) == 4


def test_device_id_prefix_comes_from_the_resource_or_config(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    assert backend(fake, "huawei.com/Ascend910B3").discover()[0].id == "Ascend910B3-0"
    assert backend(fake, deviceIDPrefix="npu").discover()[0].id == "npu-0"


# ---------------------------------------------------------------------------------------- health


def test_a_dropped_card_is_unhealthy_with_dcmi_8012(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x-one-dropped")
    devices = backend(fake).discover()
    assert {k: v for k, v in health(devices).items() if v} == {"Ascend910-3": "dcmi-8012"}


async def test_a_card_unhealthy_at_start_comes_back_when_it_recovers(
    machine: Callable[[str], FakeDcmi],
) -> None:
    """HAMi ascend-device-plugin#129: a device unhealthy when the plugin started was never republished."""
    fake = machine("910b-8x-one-dropped")
    updates = backend(fake, pollSeconds=0.05).watch()
    first = await anext(updates)
    assert health(first)["Ascend910-3"] == "dcmi-8012"
    fake.recover(3)
    healed = await next_list(updates, lambda ds: all(d.healthy for d in ds))
    assert healed[3].model == "Ascend910B3"  # fully described again
    await updates.aclose()


async def test_health_flips_both_ways(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    updates = backend(fake, pollSeconds=0.05).watch()
    assert all(d.healthy for d in await anext(updates))
    fake.set_health(5, 2, errors=[0x80E01801])
    sick = await next_list(updates, lambda ds: not ds[5].healthy)
    assert health(sick)["Ascend910-5"] == "dcmi-health-2"
    assert sum(d.healthy for d in sick) == 7
    fake.set_health(5, 0)
    await next_list(updates, lambda ds: all(d.healthy for d in ds))
    fake.drop(6)
    dropped = await next_list(updates, lambda ds: not ds[6].healthy)
    assert dropped[6].health_reason == "dcmi-8012"
    await updates.aclose()


def test_healthy_states_are_configurable(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    fake.set_health(1, 1)  # a minor alarm
    assert not backend(fake).discover()[1].healthy
    assert backend(fake, health={"healthyStates": [0, 1]}).discover()[1].healthy


async def test_a_lost_chip_leaves_at_once_and_returns(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    updates = backend(fake, pollSeconds=3600).watch()  # no polling: /dev inotify must carry it
    assert len(await anext(updates)) == 8
    fake.lose(2)
    gone = await next_list(updates, lambda ds: len(ds) == 7)
    assert "Ascend910-2" not in {d.id for d in gone}
    fake.restore(2)
    await next_list(updates, lambda ds: len(ds) == 8 and all(d.healthy for d in ds))
    await updates.aclose()


def test_a_chip_without_its_device_node_is_unhealthy(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    fake.host.remove("/dev/davinci4")
    assert health(backend(fake).discover())["Ascend910-4"] == "device-node-missing"


def test_without_dcmi_every_davinci_node_is_unhealthy_until_the_driver_returns(
    machine: Callable[[str], FakeDcmi],
) -> None:
    fake = machine("910b-8x")
    fake.remove_driver()
    npus = backend(fake)
    devices = npus.discover()
    assert [d.id for d in devices] == [f"Ascend910-{n}" for n in range(8)]
    assert {d.health_reason for d in devices} == {"dcmi-unavailable"}
    fake.install_driver()
    assert all(d.healthy for d in npus.discover())


def test_dcmi_init_failing_marks_every_node_and_heals(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    fake.fail_init(-8005)
    npus = backend(fake)
    assert {d.health_reason for d in npus.discover()} == {"dcmi-unavailable"}
    fake.fail_init(None)
    assert all(d.healthy for d in npus.discover())


def test_no_driver_and_no_nodes_is_an_empty_node(machine: Callable[[str], FakeDcmi]) -> None:
    assert backend(machine("no-driver")).discover() == []


# ---------------------------------------------------------------------------------------- allocation


def test_ascend_docker_runtime_gets_env_only(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    npus = backend(fake)
    devices = npus.discover()
    edits = npus.allocate([devices[4], devices[3]])
    assert edits.env == {
        "ASCEND_VISIBLE_DEVICES": "3,4",  # physical IDs, for the runtime on the host
        "ASCEND_RT_VISIBLE_DEVICES": "0,1",  # the container's own numbering (HAMi#1894)
        "ASCEND_RUNTIME_OPTIONS": "",
    }
    assert edits.device_nodes == [] and edits.mounts == []


def test_without_the_runtime_device_nodes_and_driver_mounts(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    npus = backend(fake, useAscendDocker=False)
    edits = npus.allocate(npus.discover()[6:8])
    assert edits.env == {"ASCEND_VISIBLE_DEVICES": "6,7", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    nodes = ["/dev/davinci6", "/dev/davinci7", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
    assert [(n.container_path, n.host_path, n.permissions) for n in edits.device_nodes] == [
        (p, str(fake.host.path(p)), "rw") for p in nodes
    ]
    mounts = [
        "/usr/local/Ascend/driver/lib64/driver",
        "/usr/local/Ascend/driver/version.info",
        "/usr/local/bin/npu-smi",
        "/etc/ascend_install.info",
    ]
    assert [(m.container_path, m.host_path, m.read_only) for m in edits.mounts] == [
        (p, str(fake.host.path(p)), True) for p in mounts
    ]


def test_missing_management_node_is_a_clear_error(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    fake.host.remove("/dev/davinci_manager")
    npus = backend(fake, useAscendDocker=False)
    with pytest.raises(BackendError, match="/dev/davinci_manager is missing"):
        npus.allocate(npus.discover()[:1])


def test_unknown_device_is_refused(machine: Callable[[str], FakeDcmi]) -> None:
    npus = backend(machine("910b-8x"))
    with pytest.raises(BackendError, match="not an Ascend NPU of this resource: Ascend910-99"):
        npus.allocate([Device("Ascend910-99")])


@pytest.mark.parametrize(
    ("memory", "template"),
    [(8000, "vir05_1c_16g"), (16384, "vir05_1c_16g"), (20000, "vir10_3c_32g"), (40000, None)],
)
def test_a_shared_chip_gets_hamis_vnpu_template(
    machine: Callable[[str], FakeDcmi], memory: int, template: str | None
) -> None:
    npus = backend(machine("910b-8x"))
    device = npus.discover()[0]
    edits = npus.allocate_shares([DeviceShare(device, memory, 25)])
    assert edits.env.get("ASCEND_VNPU_SPECS") == template
    assert "ASCEND_VNPU_SPECS" not in npus.allocate([device]).env


def test_preferred_allocation_keeps_one_numa_node(machine: Callable[[str], FakeDcmi]) -> None:
    npus = backend(machine("910b-8x"))
    devices = npus.discover()
    chosen = npus.preferred_allocation(devices[2:], [], 4)
    assert sorted(chosen) == [f"Ascend910-{n}" for n in range(4, 8)]


# ---------------------------------------------------------------------------------------- labels, config


def test_labels(machine: Callable[[str], FakeDcmi]) -> None:
    assert backend(machine("910b-8x")).node_labels() == {
        "huawei.com/npu.product": "Ascend910B3",
        "huawei.com/npu.chip": "910B3",
        "huawei.com/npu.count": "8",
        "huawei.com/npu.memory": "65536",
        "huawei.com/npu.aicore": "20",
        "huawei.com/npu.driver-version": "24.1.rc2",
    }


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"dcmiLibrary": ["libdcmi.so"]}, "'libdcmi.so' must be an absolute path"),
        ({"deviceIDPrefix": "a/b"}, "deviceIDPrefix 'a/b'"),
        ({"useAscendDocker": "maybe"}, "useAscendDocker"),
        (
            {"vnpuTemplates": [{"name": "big", "memory": 1, "aiCore": 1}]},
            r"vnpuTemplates\[0\]\.name: String should match pattern",
        ),
        ({"hostRoot": "relative"}, "hostRoot relative must be an absolute path"),
        ({"pollSecond": 1}, "pollSecond"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"version": "v1", "resources": [{"name": NPU, "ascend": section}]}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_fake_checks_argument_types_as_ctypes_would(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    with pytest.raises(ctypes.ArgumentError):
        fake.dcmi_get_device_health(0, 0, ctypes.byref(ctypes.c_int()))  # unsigned int *health
    count, ids = ctypes.c_int(), (ctypes.c_int * 2)()
    assert fake.dcmi_get_card_list(ctypes.byref(count), ids, 2) == -8001  # 8 cards do not fit
    assert fake.dcmi_get_device_num_in_card(42, ctypes.byref(count)) == -8008


def test_kxpu_devices_over_the_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    monkeypatch.setenv(FAKE_DCMI_ENV, "910b-8x-one-dropped")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps({"version": "v1", "resources": [{"name": NPU, "ascend": {"hostRoot": str(root)}}]})
    )
    result = CliRunner().invoke(main, ["devices", "--config", str(config), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)[NPU]
    assert [d["id"] for d in doc["devices"]] == [f"Ascend910-{n}" for n in range(8)]
    assert doc["labels"]["huawei.com/npu.count"] == "7"
    assert (root / "dev" / "davinci7").exists()  # the fake machine was written where hostRoot points


# ---------------------------------------------------------------------------------------- the daemon


async def test_daemon_serves_npus_and_follows_a_dropped_card(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    fake = FakeDcmi("910b-8x", workdir / "root")
    config = write_config([{"name": NPU, "ascend": {"hostRoot": str(fake.root), "pollSeconds": 0.2}}])
    await daemons(config, env={FAKE_DCMI_ENV: "910b-8x"})
    view = await kubelet.wait_registered(NPU)
    assert view.devices == {f"Ascend910-{n}": "Healthy" for n in range(8)}
    response = await kubelet.allocate(NPU, ["Ascend910-5", "Ascend910-4"])
    assert dict(response.container_responses[0].envs) == {
        "ASCEND_VISIBLE_DEVICES": "4,5",
        "ASCEND_RT_VISIBLE_DEVICES": "0,1",
        "ASCEND_RUNTIME_OPTIONS": "",
    }
    fake.drop(2)  # the daemon's fake shares this machine's state file
    devices = await kubelet.wait_devices(NPU, lambda d: d.get("Ascend910-2") == "Unhealthy")
    assert sum(h == "Healthy" for h in devices.values()) == 7
    fake.recover(2)
    await kubelet.wait_devices(NPU, lambda d: d.get("Ascend910-2") == "Healthy")


# ---------------------------------------------------------------------------------------- sharing


async def test_sharing_with_hamis_names_hands_the_grant_to_the_backend(
    machine: Callable[[str], FakeDcmi],
) -> None:
    """kxpu's sharing over an Ascend chip: HAMi's resource names, and the vNPU template for the grant."""
    from kxpu.sharing import inventory
    from kxpu.sharing.config import SharingConfig
    from kxpu.sharing.node import SharingBackend, parent_id
    from kxpu.sharing.requests import ResourceFamily
    from kxpu.sharing.scheduler import Scheduler
    from kxpu.sharing.state import ClusterState
    from kxpu.testing.sharing import FakeCluster, pod

    resource, node = "huawei.com/Ascend910B3", "node-a"
    family = ResourceFamily.derived(resource, memory=f"{resource}-memory", cores=f"{resource}-core")
    cluster = FakeCluster()
    link = cluster.link(node)
    config = SharingConfig.model_validate(
        {"signingKey": {"file": "/dev/null"}, "splitCount": 4, "allocateTimeoutSeconds": 0.3}
    )
    shared = SharingBackend(backend(machine("910b-8x"), resource), resource, config, lambda: link, node)
    slots = {d.id: d for d in shared.discover()}
    state = ClusterState([resource])
    state.set_node(node, {inventory.annotation_key(resource): inventory.encode(shared.inventory())})
    assert {d.memory_mib for d in shared.inventory().devices} == {65536}
    scheduler = Scheduler(state, [family], keys=lambda: cluster.keyring, api=cluster)
    cluster.add_pod(pod("infer", [{resource: 1, f"{resource}-memory": 16384, f"{resource}-core": 25}]))
    assert (
        await scheduler.bind("default", "infer", cluster.pods[("default", "infer")]["metadata"]["uid"], node)
        == ""
    )

    chosen = await shared.preferred_allocation_async(list(slots.values()), [], 1)
    edits = await shared.allocate_async([slots[i] for i in chosen])
    physical = parent_id(chosen[0]).removeprefix("Ascend910B3-")
    assert edits.env["ASCEND_VISIBLE_DEVICES"] == physical
    assert edits.env["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert edits.env["ASCEND_VNPU_SPECS"] == "vir05_1c_16g"  # 16 GiB fits HAMi's smallest 910B3 template
    await shared.settled()


# ---------------------------------------------------------------------------------------- hack/ascend-check


NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc2                 Version: 24.1.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 94.8        44                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          4495 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | Critical      | 99.7        45                0    / 0             |
| 0                         | 0000:01:00.0  | 0           0    / 0          3333 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 1234          | python                   | 4000                    |
+===========================+===============+====================================================+
"""


def _check_script() -> Any:
    import importlib.machinery
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "hack" / "ascend-check"
    loader = importlib.machinery.SourceFileLoader("ascend_check", str(path))
    spec = importlib.util.spec_from_loader("ascend_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_check_script_parses_npu_smi_tables() -> None:
    script = _check_script()
    assert script.parse_info(NPU_SMI_INFO) == [
        {"npu": "0", "name": "910B3", "health": "OK", "chip": "0", "bus": "0000:C1:00.0", "memory": 65536},
        {
            "npu": "1",
            "name": "910B3",
            "health": "Critical",
            "chip": "0",
            "bus": "0000:01:00.0",
            "memory": 65536,
        },
    ]
    mapping = "        NPU ID   Chip ID   Chip Logic ID   Chip Name\n        0   0   0   Ascend 910B3\n        0   1   -   Mcu\n"
    assert script.parse_map(mapping) == [{"card": 0, "chip": 0, "logic": 0, "name": "Ascend 910B3"}]


@pytest.mark.parametrize("profile", ["910b-8x", "310p-4x"])
def test_check_script_passes_over_a_fake_machine(profile: str) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "ascend-check"
    result = subprocess.run(
        [sys.executable, str(script), "--fake", profile, "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout and "FAIL" not in result.stdout


def test_check_script_reports_a_dropped_card() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "ascend-check"
    result = subprocess.run(
        [sys.executable, str(script), "--fake", "910b-8x-one-dropped", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "FAIL Ascend910-3" in result.stdout, result.stdout


def test_garbage_in_sysfs_costs_the_numa_hint_not_the_device(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    fake.host.write_attribute("/sys/bus/pci/devices/0000:c1:00.0/numa_node", "zero")
    devices = backend(fake).discover()
    assert devices[0].healthy and devices[0].numa_nodes == () and devices[1].numa_nodes == (0,)


def test_a_chip_that_stops_answering_stays_in_the_resource_its_name_chose(
    machine: Callable[[str], FakeDcmi],
) -> None:
    fake = machine("310p-4x")
    npus = backend(fake, "huawei.com/Ascend310P", chipNames=["310P3"])
    assert len(npus.discover()) == 4
    fake.drop(1)
    assert health(npus.discover())["Ascend310P-1"] == "dcmi-8012"
    # A daemon that never heard the chip's name keeps it, unhealthy, rather than hide a fault.
    fresh = backend(fake, "huawei.com/Ascend310P", chipNames=["310P3"])
    assert health(fresh.discover()) == {
        f"Ascend310P-{n}": ("dcmi-8012" if n == 1 else None) for n in range(4)
    }


async def test_daemon_without_dcmi_serves_unhealthy_nodes_until_the_driver_arrives(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    fake = FakeDcmi("910b-8x", workdir / "root")
    fake.remove_driver()
    config = write_config([{"name": NPU, "ascend": {"hostRoot": str(fake.root), "pollSeconds": 0.2}}])
    daemon = await daemons(config, env={FAKE_DCMI_ENV: "910b-8x"})
    view = await kubelet.wait_registered(NPU)
    assert view.devices == {f"Ascend910-{n}": "Unhealthy" for n in range(8)}
    fake.install_driver()
    await kubelet.wait_devices(NPU, lambda d: set(d.values()) == {"Healthy"})
    assert "DCMI unavailable" in daemon.log_text() and "Traceback" not in daemon.log_text()

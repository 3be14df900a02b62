"""The ``amd`` and ``hygon`` backends over generated amdgpu machines (kxpu.testing.fake_amd) and a fake amdsmi."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from kxpu.backends.amd import AmdBackend, AmdConfig, HygonBackend, HygonConfig
from kxpu.backends.amd.placement import NO_LINK, pair_weight
from kxpu.cli import main
from kxpu.config import ConfigError, load_config
from kxpu.model import BackendError, Device, DeviceNode, Mount
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_amd import DRI_MAJOR, KFD_MAJOR, PROFILES, FakeAmd
from kxpu.testing.fake_amdsmi import (
    AMDSMI_STATUS_DRIVER_NOT_LOADED,
    AMDSMI_STATUS_INIT_ERROR,
    AmdSmiLibraryException,
    FakeAmdSmi,
)
from tests.nvidia_support import next_list

GPU = "amd.com/gpu"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def machines() -> Iterator[Callable[[str], FakeAmd]]:
    made: list[FakeAmd] = []

    def make(profile: str) -> FakeAmd:
        made.append(FakeAmd(profile))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def amd(fake: FakeAmd, library: Any = None, **config: Any) -> AmdBackend:
    return AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root), **config}), amdsmi=library)


def hygon(fake: FakeAmd, **config: Any) -> HygonBackend:
    return HygonBackend(HygonConfig.model_validate({"hostRoot": str(fake.root), **config}))


def by_id(devices: list[Device]) -> dict[str, Device]:
    return {d.id: d for d in devices}


def reasons(devices: list[Device]) -> dict[str, str | None]:
    return {d.id: d.health_reason for d in devices if not d.healthy}


# ---------------------------------------------------------------------------------------------- discovery


@pytest.mark.parametrize("profile", [p for p in PROFILES if not p.startswith("hygon")])
def test_every_profile_lists_what_amds_plugin_lists(machines: Callable[[str], FakeAmd], profile: str) -> None:
    fake = machines(profile)
    devices = amd(fake).discover()
    assert [d.id for d in devices] == (fake.device_ids() if fake.driver else [])
    assert all(d.healthy for d in devices)
    expected = {
        "mi300x-8x-spx": 8,
        "mi300x-8x-cpx": 64,
        "mi210-4x-xgmi": 4,
        "mixed-partitions": 18,
        "no-driver": 0,
    }
    assert len(devices) == expected[profile]


def test_a_cpx_partition_is_a_whole_device_model(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    devices = by_id(amd(fake).discover())
    xcp = devices["amdgpu_xcp_8"]  # GPU 1's third device (partition 2): xcp 7*1 + 2 - 1
    assert xcp.pci_bus_id == "0000:22:00.0" and xcp.numa_nodes == (0,)
    assert xcp.memory_mib == 192 * 1024 // 4 and xcp.cores == 304 // 8
    assert xcp.extra["computePartition"] == "cpx" and xcp.extra["partition"] == 2
    assert xcp.model == "AMD Instinct MI300X OAM"
    # amd-smi's UUID: device ID, partition index, then the ASIC serial (KFD unique_id)
    serial = fake.unique_id(1)
    assert (
        xcp.uuid
        == f"{(serial >> 56) << 24 | 2 << 16 | 0x74A1:08x}-0000-1000-80{(serial >> 48) & 0xFF:02x}-"
        + (f"{(serial >> 32) & 0xFFFF:04x}{serial & 0xFFFFFFFF:08x}")
    )
    assert devices["0000:22:00.0"].uuid != xcp.uuid


def test_whole_gpus_carry_amd_smis_whole_gpu_uuid(machines: Callable[[str], FakeAmd]) -> None:
    gpu = by_id(amd(machines("mi300x-8x-spx")).discover())["0000:0c:00.0"]
    assert gpu.uuid is not None and gpu.uuid.split("-")[0][2:4] == "ff"  # index 0xff: not a partition
    assert gpu.memory_mib == 192 * 1024 and gpu.cores == 304


def test_xcp_devices_without_a_kfd_node_are_not_partitions(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    assert fake.fake.path("/sys/devices/platform/amdgpu_xcp_0/drm").is_dir()  # present in SPX, as on hardware
    assert not any(d.id.startswith("amdgpu_xcp") for d in amd(fake).discover())


def test_partition_type_serves_one_mode_under_its_mixed_name(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mixed-partitions")
    cpx = amd(fake, partitionType="cpx_nps4").discover()
    spx = amd(fake, partitionType="spx_nps1").discover()
    assert len(cpx) == 16 and {d.pci_bus_id for d in cpx} == {fake.bdf(0), fake.bdf(1)}
    assert [d.id for d in spx] == [fake.bdf(2), fake.bdf(3)]
    assert amd(fake, partitionType="qpx_nps1").discover() == []


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nresources:\n- name: amd.com/gpu\n  amd: {partitionType: cpx-nps4}\n")
    with pytest.raises(ConfigError, match="partitionType"):
        load_config(path)
    path.write_text("version: v1\nresources:\n- name: amd.com/gpu\n  amd: {amdsmi: maybe}\n")
    with pytest.raises(ConfigError, match="amdsmi"):
        load_config(path)


def test_hygon_dcus_by_serial_and_amd_ignores_them(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("hygon-dcu-8x")
    devices = hygon(fake).discover()
    assert [d.id for d in devices] == [f"DCU-{fake.serial(g)}" for g in range(8)]
    assert all(d.healthy for d in devices) and devices[0].memory_mib == 32 * 1024
    assert amd(fake).discover() == []  # vendor 0x1d94 is not AMD's
    assert hygon(machines("mi300x-8x-spx")).discover() == []


# ---------------------------------------------------------------------------------------------- allocation


def test_allocate_gives_kfd_and_the_partitions_nodes_rw_and_no_env(
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi300x-8x-cpx")
    backend = amd(fake)
    devices = by_id(backend.discover())
    edits = backend.allocate([devices["amdgpu_xcp_8"], devices["0000:0c:00.0"]])
    root = fake.root
    assert edits.device_nodes == [
        DeviceNode("/dev/kfd", str(root / "dev/kfd"), "rw"),
        DeviceNode("/dev/dri/card11", str(root / "dev/dri/card11"), "rw"),
        DeviceNode("/dev/dri/renderD138", str(root / "dev/dri/renderD138"), "rw"),
        DeviceNode("/dev/dri/card1", str(root / "dev/dri/card1"), "rw"),
        DeviceNode("/dev/dri/renderD128", str(root / "dev/dri/renderD128"), "rw"),
    ]
    assert edits.env == {} and edits.mounts == []
    stranger = Device(id="amdgpu_xcp_99")
    with pytest.raises(BackendError, match="amdgpu_xcp_99"):
        backend.allocate([stranger])


def test_hygon_allocate_adds_mkfd_rwm_and_hyhal_read_only(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("hygon-dcu-8x")
    backend = hygon(fake)
    dcu = backend.discover()[2]
    edits = backend.allocate([dcu])
    root = fake.root
    assert edits.device_nodes == [
        DeviceNode("/dev/kfd", str(root / "dev/kfd"), "rwm"),
        DeviceNode("/dev/mkfd", str(root / "dev/mkfd"), "rwm"),
        DeviceNode("/dev/dri/card17", str(root / "dev/dri/card17"), "rw"),
        DeviceNode("/dev/dri/renderD144", str(root / "dev/dri/renderD144"), "rw"),
    ]
    assert edits.mounts == [Mount("/opt/hyhal", str(root / "opt/hyhal"), True)] and edits.env == {}


def test_fake_nodes_are_real_char_devices_as_root(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    st = os.stat(fake.root / "dev/dri/renderD138")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (DRI_MAJOR, 138)
    st = os.stat(fake.root / "dev/kfd")
    assert os.major(st.st_rdev) == KFD_MAJOR


def test_cdi_spec_holds_each_partitions_nodes(machines: Callable[[str], FakeAmd], tmp_path: Path) -> None:
    from kxpu.cdi import with_cdi
    from kxpu.cdi.spec import validate_spec

    fake = machines("mi300x-8x-cpx")
    backend = with_cdi(amd(fake), GPU, "kxpu.amd.com/gpu", tmp_path)
    devices = backend.discover()
    [path] = tmp_path.glob("*.json")
    spec = json.loads(path.read_text())
    assert validate_spec(spec) == [] and len(spec["devices"]) == 64
    entry = next(d for d in spec["devices"] if "xcp_8" in d["name"])
    assert {n["path"] for n in entry["containerEdits"]["deviceNodes"]} >= {
        "/dev/dri/card11",
        "/dev/dri/renderD138",
    }
    response = backend.allocate([d for d in devices if d.id == "amdgpu_xcp_8"])
    assert len(response.cdi_devices) == 1 and response.env == {}
    backend.close()


# ---------------------------------------------------------------------------------------------- placement


def test_partitions_of_one_gpu_go_together_and_used_gpus_fill_first(
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi300x-8x-cpx")
    backend = amd(fake)
    devices = backend.discover()
    assert {by_id(devices)[i].pci_bus_id for i in backend.preferred_allocation(devices, [], 4)} == {
        fake.bdf(0)
    }
    # GPU 3 has two partitions in use: its six free ones are taken before a whole GPU is broken up
    taken = {fake.bdf(3), "amdgpu_xcp_21"}
    free = [d for d in devices if d.id not in taken]
    chosen = backend.preferred_allocation(free, [], 6)
    assert {by_id(devices)[i].pci_bus_id for i in chosen} == {fake.bdf(3)}
    # more than one GPU holds: the rest comes from the same NUMA node
    chosen = backend.preferred_allocation(devices, [], 12)
    assert {by_id(devices)[i].numa_nodes for i in chosen} == {(0,)}


def test_whole_gpus_prefer_xgmi_then_pcie_and_no_link_is_worst(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    backend = amd(fake)
    devices = backend.discover()
    assert backend.preferred_allocation(devices, [], 2) == [fake.bdf(0), fake.bdf(1)]  # XGMI
    # without GPU 1: GPU 0 reaches GPU 2 over PCIe and GPU 3 not at all
    rest = [d for d in devices if d.id != fake.bdf(1)]
    assert backend.preferred_allocation(rest, [by_id(devices)[fake.bdf(0)]], 2) == [fake.bdf(0), fake.bdf(2)]
    units = {u.id: u for u in backend._units.values()}
    links = backend.reader.links([u.kfd.index for u in units.values() if u.kfd])
    assert pair_weight(units[fake.bdf(0)], units[fake.bdf(3)], links) == NO_LINK
    assert pair_weight(units[fake.bdf(0)], units[fake.bdf(1)], links) == 20 + 10 + 10


# ---------------------------------------------------------------------------------------------- labels


def test_labels_like_amds_labeller(machines: Callable[[str], FakeAmd]) -> None:
    labels = amd(machines("mi300x-8x-cpx")).node_labels()
    assert labels["amd.com/gpu.family"] == "AI" and labels["beta.amd.com/gpu.family.AI"] == "8"
    assert labels["amd.com/gpu.device-id"] == "74a1" and labels["amd.com/gpu.vram"] == "192G"
    assert labels["amd.com/gpu.compute-memory-partition"] == "cpx_nps4"
    assert labels["amd.com/gpu.compute-partitioning-mode"] == "cpx"
    assert labels["amd.com/gpu.compute-partitioning-supported"] == "true"
    assert labels["amd.com/gpu.driver-version"] == "6.10.5"
    mixed = amd(machines("mixed-partitions")).node_labels()
    assert "amd.com/gpu.compute-memory-partition" not in mixed  # only on homogeneous nodes
    mi210 = amd(machines("mi210-4x-xgmi")).node_labels()
    assert (
        mi210["amd.com/gpu.compute-partitioning-supported"] == "false"
        and mi210["amd.com/gpu.cu-count"] == "104"
    )
    dcu = hygon(machines("hygon-dcu-8x")).node_labels()
    assert dcu["beta.dcu/gpu.device-id.6320"] == "8" and dcu["beta.dcu/gpu.vram.32G"] == "8"
    assert not any(k.startswith("amd.com/") for k in dcu)
    assert amd(machines("no-driver")).node_labels() == {}


def test_kxpu_devices_shows_a_fake_named_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KXPU_FAKE_AMD", "mi300x-8x-cpx")
    result = CliRunner().invoke(main, ["devices", "--config", str(ROOT / "examples/amd.yaml"), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert len(doc[GPU]["devices"]) == 64
    assert doc[GPU]["labels"]["amd.com/gpu.compute-memory-partition"] == "cpx_nps4"
    monkeypatch.setenv("KXPU_FAKE_AMD", "hygon-dcu-8x")
    result = CliRunner().invoke(
        main, ["devices", "--config", str(ROOT / "examples/hygon.yaml"), "-o", "json"]
    )
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["hygon.com/dcunum"]["devices"]) == 8
    monkeypatch.setenv("KXPU_FAKE_AMD", "mi400-huge")
    bad = CliRunner().invoke(main, ["devices", "--config", str(ROOT / "examples/amd.yaml")])
    assert bad.exit_code == 1 and "unknown fake AMD profile 'mi400-huge'" in bad.output


# ---------------------------------------------------------------------------------------------- bad trees


def test_garbage_in_one_gpus_files_costs_that_gpu_only(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    fake.fake.set_attribute(f"/sys/devices/pci0000:00/{fake.bdf(2)}/numa_node", "zero")
    fake.fake.set_attribute(f"/sys/devices/pci0000:00/{fake.bdf(5)}/ras/umc_err_count", "garbage")
    with capture_logs() as logs:
        devices = amd(fake).discover()
    assert reasons(devices) == {fake.bdf(2): "bad-sysfs", fake.bdf(5): "bad-sysfs"}
    errors = [e.get("error") or "" for e in logs if e.get("reason") == "bad-sysfs"]
    assert any("numa_node: expected an integer, found 'zero'" in e for e in errors), logs
    assert any("umc_err_count: expected 'ue: <count>'" in e for e in errors), logs


def test_a_broken_or_missing_kfd_node_costs_one_gpu(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    top = "/sys/class/kfd/kfd/topology/nodes"
    fake.fake.set_attribute(f"{top}/3/properties", "simd_count\nbroken line")  # GPU 1's node
    fake.fake.remove(f"{top}/5")  # GPU 3's node
    with capture_logs() as logs:
        devices = amd(fake).discover()
    assert reasons(devices) == {fake.bdf(1): "no-kfd-node", fake.bdf(3): "no-kfd-node"}
    assert any("nodes/3/properties: line 1 is not 'key value'" in (e.get("error") or "") for e in logs), logs


def test_missing_device_nodes_make_gpus_unhealthy(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    fake.fake.remove("/dev/dri/renderD138")
    devices = amd(fake).discover()
    assert reasons(devices) == {"amdgpu_xcp_8": "no-device-node"}
    fake.fake.remove("/dev/kfd")
    assert set(reasons(amd(fake).discover()).values()) == {"no-kfd"}


def test_an_unreadable_tree_never_raises(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    fake.fake.write_file(f"/sys/devices/pci0000:00/{fake.bdf(0)}/drm/card1/dev", b"\xff\xfe")
    fake.fake.remove(f"/sys/devices/pci0000:00/{fake.bdf(4)}/current_compute_partition")
    fake.fake.write_file("/sys/class/kfd/kfd/topology/nodes/9/io_links/0/properties", "type x")
    backend = amd(fake)
    devices = backend.discover()
    assert len(devices) >= 57
    backend.preferred_allocation(devices, [], 9)  # a broken link file is skipped, not raised


# ---------------------------------------------------------------------------------------------- live changes


async def test_a_ras_change_is_found_only_by_polling_and_recovers_after_quiet(
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi300x-8x-spx")
    quiet = amd(fake, pollSeconds=3600).watch()  # inotify only
    assert len(await next_list(quiet)) == 8
    fake.set_ras(4, "umc", 1)
    with pytest.raises(TimeoutError):
        await next_list(quiet, timeout=0.5)  # a value change raises no inotify event, as on sysfs
    await quiet.aclose()

    polled = amd(fake, pollSeconds=0.05, rasRecoverySeconds=0.5).watch()
    devices = await next_list(polled)
    assert reasons(devices) == {fake.bdf(4): "ras-uncorrectable-umc"}
    fake.set_ras(6, "gfx", 2)
    devices = await next_list(polled, lambda ds: fake.bdf(6) in reasons(ds))
    assert reasons(devices)[fake.bdf(6)] == "ras-uncorrectable-gfx"
    devices = await next_list(polled, lambda ds: not reasons(ds), timeout=5)  # no new errors: both recover
    fake.set_ras(6, "gfx", 3)  # rising again: unhealthy again
    await next_list(polled, lambda ds: fake.bdf(6) in reasons(ds))
    await polled.aclose()


async def test_without_recovery_an_error_stays(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    fake.set_ras(1, "umc", 1)
    backend = amd(fake)
    assert reasons(backend.discover()) == {fake.bdf(1): "ras-uncorrectable-umc"}
    await asyncio.sleep(0)
    assert reasons(backend.discover()) == {fake.bdf(1): "ras-uncorrectable-umc"}
    fake.set_ras(1, "umc", 0)  # counters cleared (driver reload)
    assert reasons(backend.discover()) == {}


async def test_repartition_cpx_to_spx_and_back_without_a_restart(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    stream = amd(fake, pollSeconds=0.1).watch()
    assert len(await next_list(stream)) == 64
    fake.repartition("spx_nps1")
    devices = await next_list(stream, lambda ds: len(ds) == 8)
    assert [d.id for d in devices] == [fake.bdf(g) for g in range(8)] and all(d.healthy for d in devices)
    fake.repartition("cpx_nps4", [0, 1])
    devices = await next_list(stream, lambda ds: len(ds) == 22)
    assert all(d.healthy for d in devices)
    await stream.aclose()


async def test_repartition_moves_devices_between_mixed_resources(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mixed-partitions")
    cpx = amd(fake, partitionType="cpx_nps4", pollSeconds=0.1).watch()
    assert len(await next_list(cpx)) == 16
    fake.repartition("cpx_nps4", [2])
    await next_list(cpx, lambda ds: len(ds) == 24)
    await cpx.aclose()


async def test_a_lost_gpu_and_a_hot_plugged_one(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-cpx")
    stream = amd(fake, pollSeconds=3600).watch()  # directories and nodes: inotify wakes it
    assert len(await next_list(stream)) == 64
    fake.lose(5)
    devices = await next_list(stream, lambda ds: len(ds) == 56)
    assert fake.bdf(5) not in by_id(devices) and all(d.healthy for d in devices)
    fake.restore(5)
    devices = await next_list(stream, lambda ds: len(ds) == 64 and all(d.healthy for d in ds))
    await stream.aclose()


async def test_driver_unload_and_reload(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    stream = amd(fake, pollSeconds=0.2).watch()
    assert len(await next_list(stream)) == 8
    with capture_logs() as logs:
        fake.unload_driver()
        assert await next_list(stream, lambda ds: not ds) == []
        fake.load_driver()
        devices = await next_list(stream, lambda ds: len(ds) == 8 and all(d.healthy for d in ds))
    events = [e["event"] for e in logs]
    assert (
        events.count(
            "amdgpu driver not loaded (no /sys/module/amdgpu/drivers); serving no AMD GPUs until it loads"
        )
        == 1
    )
    assert "amdgpu driver loaded" in events
    assert len(devices) == 8
    await stream.aclose()


async def test_a_node_with_no_driver_starts_serving_when_it_loads(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    fake.unload_driver()  # the machine has GPUs; the driver is not loaded yet
    stream = amd(fake, pollSeconds=0.2).watch()
    assert await next_list(stream) == []
    fake.load_driver()
    assert len(await next_list(stream, lambda ds: len(ds) == 4)) == 4
    await stream.aclose()


# ---------------------------------------------------------------------------------------------- amdsmi


def test_amdsmi_is_never_imported_with_the_backend() -> None:
    code = "import sys, kxpu.backends.amd; print('amdsmi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_amdsmi_ecc_makes_a_gpu_unhealthy(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    smi = FakeAmdSmi(fake.root)
    backend = amd(fake, smi, amdsmi="optional")
    assert reasons(backend.discover()) == {} and smi.initialized
    smi.ecc_override = {fake.bdf(7): 4}
    assert reasons(backend.discover()) == {fake.bdf(7): "ecc-uncorrectable"}
    backend.close()
    assert not smi.initialized


def test_amdsmi_that_cannot_start_fails_gpus_only_when_required(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi300x-8x-spx")
    smi = FakeAmdSmi(fake.root)
    smi.init_error = AMDSMI_STATUS_INIT_ERROR
    with capture_logs() as logs:
        optional = amd(fake, smi, amdsmi="optional").discover()
        required_backend = amd(fake, smi, amdsmi="required")
        required = required_backend.discover()
        required_backend.discover()
    assert reasons(optional) == {}
    assert set(reasons(required).values()) == {"amdsmi-unavailable"} and len(reasons(required)) == 8
    errors = [e["event"] for e in logs if e["log_level"] == "error"]
    assert len(errors) == 2, errors  # one line per backend, not one per poll
    assert "err_code 18" in errors[1] or "AMDSMI_STATUS_INIT_ERROR" in errors[1]
    smi.init_error = None  # it starts at a later poll: the GPUs come back
    assert reasons(required_backend.discover()) == {}


def test_amdsmi_failing_mid_run_is_retried(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    smi = FakeAmdSmi(fake.root)
    backend = amd(fake, smi, amdsmi="required")
    assert reasons(backend.discover()) == {}
    smi.call_error["amdsmi_get_processor_handles"] = AMDSMI_STATUS_DRIVER_NOT_LOADED
    assert set(reasons(backend.discover()).values()) == {"amdsmi-unavailable"}
    del smi.call_error["amdsmi_get_processor_handles"]
    assert reasons(backend.discover()) == {}


def test_the_fake_amdsmi_keeps_the_librarys_errors(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    smi = FakeAmdSmi(fake.root)
    with pytest.raises(AmdSmiLibraryException) as raised:
        smi.amdsmi_get_processor_handles()
    assert raised.value.err_code == 32  # AMDSMI_STATUS_NOT_INIT
    smi.amdsmi_init()
    [handle, *_] = smi.amdsmi_get_processor_handles()
    assert smi.amdsmi_get_gpu_device_bdf(handle) == fake.bdf(0)
    assert set(smi.amdsmi_get_gpu_total_ecc_count(handle)) == {
        "correctable_count",
        "uncorrectable_count",
        "deferred_count",
    }


def test_an_uninstalled_amdsmi_is_one_line_and_no_failure(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    with capture_logs() as logs:
        devices = amd(fake, amdsmi="optional").discover()  # the real import: no ROCm here
    assert reasons(devices) == {}
    assert next(e["event"] for e in logs if e["log_level"] == "error").startswith("amdsmi cannot start")


# ---------------------------------------------------------------------------------------------- the fake from a shell


def test_the_fake_changes_from_a_shell(tmp_path: Path) -> None:
    root = tmp_path / "amd"
    run = [sys.executable, "-m", "kxpu.testing.fake_amd"]
    subprocess.run([*run, "write", "mi300x-8x-cpx", str(root)], check=True, capture_output=True)
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(root)}))
    assert len(backend.discover()) == 64
    out = subprocess.run(
        [*run, "change", str(root), "repartition", "spx_nps1"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "devices now: 8" in out.stdout, out.stderr
    subprocess.run([*run, "change", str(root), "ras", "2", "umc", "5"], check=True, capture_output=True)
    assert reasons(backend.discover()) == {"0000:38:00.0": "ras-uncorrectable-umc"}
    bad = subprocess.run([*run, "change", str(tmp_path), "lose", "1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "not a fake AMD machine" in bad.stderr
    FakeAmd.open(root).cleanup()


# ---------------------------------------------------------------------------------------------- the daemon


async def test_daemon_registers_64_cpx_partitions_and_follows_a_repartition(
    kubelet: KubeletStandIn,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi300x-8x-cpx")
    config = write_config([{"name": GPU, "amd": {"hostRoot": str(fake.root), "pollSeconds": 0.2}}])
    daemon = await daemons(config)
    view = await kubelet.wait_registered(GPU)
    assert len(view.devices) == 64 and view.options.get_preferred_allocation_available
    free = [i for i in fake.device_ids() if i not in (fake.bdf(0), "amdgpu_xcp_0")]
    chosen = await kubelet.preferred(GPU, free, [], 2)
    assert chosen == ["amdgpu_xcp_1", "amdgpu_xcp_2"]  # GPU 0's free partitions, before a fresh GPU
    response = await kubelet.allocate(GPU, ["amdgpu_xcp_1"])
    container = response.container_responses[0]
    assert dict(container.envs) == {}
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/kfd", str(fake.root / "dev/kfd"), "rw"),
        ("/dev/dri/card3", str(fake.root / "dev/dri/card3"), "rw"),
        ("/dev/dri/renderD130", str(fake.root / "dev/dri/renderD130"), "rw"),
    ]
    fake.set_ras(7, "umc", 1)
    await kubelet.wait_devices(GPU, lambda d: sum(v == "Unhealthy" for v in d.values()) == 8)
    fake.repartition("spx_nps1")
    await kubelet.wait_devices(GPU, lambda d: len(d) == 8 and d[fake.bdf(7)] == "Unhealthy")
    assert daemon.process.returncode is None  # the same daemon, no restart


# ---------------------------------------------------------------------------------------------- sharing


async def test_hygon_dcus_share_under_hamis_names(machines: Callable[[str], FakeAmd]) -> None:
    """kxpu's fractional sharing over DCUs under HAMi's names: the extender places a pod asking
    dcunum/dcumem/dcucores; its container gets the DCU's nodes, /opt/hyhal and the limit variables."""
    from kxpu.sharing import inventory as inv
    from kxpu.sharing import signing
    from kxpu.sharing.config import SharingConfig
    from kxpu.sharing.node import SharingBackend, parent_id
    from kxpu.sharing.requests import ResourceFamily
    from kxpu.sharing.scheduler import Scheduler
    from kxpu.sharing.state import ClusterState
    from kxpu.testing.sharing import FakeCluster, pod

    dcunum, dcumem, dcucores = "hygon.com/dcunum", "hygon.com/dcumem", "hygon.com/dcucores"
    family = ResourceFamily.derived(dcunum, memory=dcumem, cores=dcucores)
    fake = machines("hygon-dcu-8x")
    cluster = FakeCluster()
    link = cluster.link("node-a")
    config = SharingConfig.model_validate({"signingKey": {"file": "/dev/null"}, "splitCount": 4})
    shared = SharingBackend(hygon(fake), dcunum, config, lambda: link, "node-a")
    slots = shared.discover()
    assert len(slots) == 32 and slots[5].id == f"DCU-{fake.serial(1)}::1" and slots[5].memory_mib == 32768
    state = ClusterState([dcunum])
    state.set_node("node-a", {inv.annotation_key(dcunum): inv.encode(shared.inventory())})
    scheduler = Scheduler(state, [family], keys=lambda: cluster.keyring, api=cluster)
    cluster.add_pod(pod("infer", [{dcunum: 1, dcumem: 8192, dcucores: 30}]))
    uid = cluster.pods[("default", "infer")]["metadata"]["uid"]
    assert await scheduler.bind("default", "infer", uid, "node-a") == ""
    annotations = cluster.pods[("default", "infer")]["metadata"]["annotations"]
    (grant,) = signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).containers[0].devices
    chosen = await shared.preferred_allocation_async(slots, [], 1)
    assert [parent_id(i) for i in chosen] == [grant.device]
    edits = await shared.allocate_async([d for d in slots if d.id == chosen[0]])
    g = next(i for i in range(8) if f"DCU-{fake.serial(i)}" == grant.device)
    assert [n.container_path for n in edits.device_nodes] == [
        "/dev/kfd",
        "/dev/mkfd",
        f"/dev/dri/card{fake.card(g)}",
        f"/dev/dri/renderD{fake.render(g)}",
    ]
    assert [m.container_path for m in edits.mounts] == ["/opt/hyhal"]
    assert edits.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "8192m" and edits.env["CUDA_DEVICE_SM_LIMIT"] == "30"
    await shared.settled()


@pytest.mark.parametrize("args", [["--fake", "mixed-partitions"], ["--hygon", "--fake", "hygon-dcu-8x"]])
def test_the_hardware_check_script_passes_over_a_fake_machine(args: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "hack" / "amd-check"), *args, "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "amd-check: everything matches" in run.stdout


async def test_daemon_on_a_node_without_the_driver_serves_once_it_loads(
    kubelet: KubeletStandIn,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi210-4x-xgmi")
    fake.unload_driver()
    config = write_config([{"name": GPU, "amd": {"hostRoot": str(fake.root), "pollSeconds": 0.2}}])
    daemon = await daemons(config)
    view = await kubelet.wait_registered(GPU)
    assert view.devices == {}
    fake.load_driver()
    await kubelet.wait_devices(GPU, lambda d: len(d) == 4 and set(d.values()) == {"Healthy"})
    log = daemon.log_text()
    assert log.count("amdgpu driver not loaded") == 1 and "Traceback" not in log

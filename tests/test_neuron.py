"""The AWS Neuron backend over the fake Neuron machine: discovery in both sysfs layouts, health and
hot-plug as the driver changes them, the exact edits AWS's plugin gives, contiguous placement,
bad trees, and the daemon as a separate process."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from structlog.testing import capture_logs

from kxpu.backends.host import HostFileError
from kxpu.backends.neuron import NeuronBackend, NeuronConfig
from kxpu.backends.neuron.placement import compact, contiguous_run, is_contiguous
from kxpu.cli import main
from kxpu.config import ConfigError, load_config
from kxpu.model import BackendError, Device, DeviceNode
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_neuron import FAKE_MAJOR, FakeNeuron

CORE = "aws.amazon.com/neuroncore"
DEVICE = "aws.amazon.com/neuron"


@pytest.fixture
def machines() -> Iterator[Callable[[str], FakeNeuron]]:
    made: list[FakeNeuron] = []

    def make(profile: str) -> FakeNeuron:
        made.append(FakeNeuron(profile))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def backend(fake: FakeNeuron, **config: Any) -> NeuronBackend:
    return NeuronBackend(NeuronConfig.model_validate({"hostRoot": str(fake.root), **config}))


def by_id(devices: list[Device]) -> dict[str, Device]:
    return {d.id: d for d in devices}


async def next_list(stream: AsyncGenerator[list[Device]], timeout: float = 5.0) -> list[Device]:
    return await asyncio.wait_for(anext(stream), timeout)


# ---------------------------------------------------------------------------------------------- placement


def test_compact_and_contiguity() -> None:
    assert compact([3, 0, 1, 2]) == "0-3"
    assert compact([5]) == "5"
    assert compact([0, 1, 4, 6, 7]) == "0-1,4,6-7"
    assert is_contiguous([4, 2, 3]) and not is_contiguous([1, 3])


def test_contiguous_run_prefers_one_device_aligned_and_tight_stretches() -> None:
    # trn1 cores, 2 per device: a pair stays on one device even where a straddling pair exists.
    assert contiguous_run([1, 2, 3, 4, 5], [], 2, block=2) == [2, 3]
    # one core goes to the lone free core of a half-used device, not into a whole free device
    assert contiguous_run([1, 2, 3, 4, 5], [], 1, block=2) == [1]
    # devices: a run of 4 starts at a multiple of 4 when it can (Trn1's torus groups)
    assert contiguous_run(list(range(2, 16)), [], 4, block=1) == [4, 5, 6, 7]
    assert contiguous_run([0, 1, 2, 3, 4], [3], 2, block=1) == [2, 3]
    assert contiguous_run([0, 2, 4], [], 2, block=1) is None  # fragmented: no run exists
    assert contiguous_run([0, 1], [5], 2, block=1) is None


# ---------------------------------------------------------------------------------------------- discovery


@pytest.mark.parametrize("profile", ["trn1-32xl", "trn1-32xl-new-layout"])
def test_devices_in_both_sysfs_layouts(machines: Callable[[str], FakeNeuron], profile: str) -> None:
    fake = machines(profile)
    devices = backend(fake).discover()
    assert [d.id for d in devices] == [f"neuron{i}" for i in range(16)]
    d5 = devices[5]
    assert (d5.model, d5.index, d5.cores, d5.memory_mib, d5.uuid) == (
        "Trainium1",
        5,
        2,
        32 * 1024,
        fake.serial(5),
    )
    assert d5.healthy and d5.numa_nodes == () and d5.pci_bus_id is None  # no parent PCI device in sysfs
    assert d5.extra["connectedDevices"] == "1,4,9,6" and d5.extra["coreIds"] == "10-11"
    assert d5.extra["neuronDriverVersion"] == fake.profile.driver_version


def test_cores_number_globally_with_the_logical_core_config(machines: Callable[[str], FakeNeuron]) -> None:
    trn1 = backend(machines("trn1-32xl"), unit="core").discover()
    assert len(trn1) == 32 and trn1[11].id == "neuroncore11"
    assert (trn1[11].extra["deviceId"], trn1[11].extra["localCoreId"], trn1[11].cores) == (5, 1, 1)
    trn2 = backend(machines("trn2-48xl"), unit="core").discover()  # 8 physical cores, LNC 2 by default
    assert len(trn2) == 64 and trn2[5].extra["deviceId"] == 1 and trn2[5].extra["logicalCoreConfig"] == 2
    lnc1 = backend(machines("trn2-48xl-lnc1"), unit="core").discover()  # the node's file says 1
    assert len(lnc1) == 128
    forced = backend(machines("trn2-48xl-lnc1"), unit="core", logicalCoreConfig=2).discover()
    assert len(forced) == 64
    inf1 = backend(machines("inf1-6xl"), unit="core").discover()
    assert len(inf1) == 16 and inf1[7].extra["deviceId"] == 1


def test_no_driver_means_no_devices_and_a_clear_log(machines: Callable[[str], FakeNeuron]) -> None:
    with capture_logs() as logs:
        assert backend(machines("no-driver")).discover() == []
    assert [e["event"] for e in logs] == [
        "no Neuron devices: /sys/class/neuron_device is missing (is the driver loaded?)"
    ]


def test_logical_core_config_two_is_refused_off_trainium2(machines: Callable[[str], FakeNeuron]) -> None:
    with pytest.raises(BackendError, match="logical NeuronCore config 2 applies to Trainium2/Trainium3 only"):
        backend(machines("trn1-32xl"), logicalCoreConfig=2).discover()


# ---------------------------------------------------------------------------------------------- bad trees


def test_garbage_values_make_the_device_unhealthy_not_the_backend_fail(
    machines: Callable[[str], FakeNeuron],
) -> None:
    fake = machines("trn1-32xl")
    fake.fake.set_attribute(fake.attribute(2, "core_count"), "banana")
    fake.fake.set_attribute(fake.attribute(3, "connected_devices"), "1, x")
    fake.fake.write_file(fake.attribute(4, "reset"), b"\xff\xfe")
    devices = by_id(backend(fake, unit="core").discover())
    # device 2's cores (4, 5) still exist: their count comes from the neuron_core<K> directories
    assert devices["neuroncore4"].health_reason == devices["neuroncore5"].health_reason == "sysfs-unreadable"
    assert devices["neuroncore3"].healthy
    assert devices["neuroncore6"].health_reason == "sysfs-unreadable"  # device 3
    assert devices["neuroncore8"].health_reason == "sysfs-unreadable"  # device 4
    assert sum(d.healthy for d in devices.values()) == 32 - 6


def test_a_device_with_no_attributes_is_listed_unhealthy(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("inf2-48xl")
    fake.fake.remove("/sys/devices/virtual/neuron_device/neuron3")
    fake.fake.mkdir(
        "/sys/devices/virtual/neuron_device/neuron3"
    )  # the class link now leads to an empty directory
    devices = by_id(backend(fake).discover())
    assert devices["neuron3"].health_reason == "core-count-unknown" and devices["neuron3"].model is None
    assert devices["neuron2"].healthy
    assert "neuroncore6" not in by_id(backend(fake, unit="core").discover())  # no cores known: none served


def test_a_moved_attribute_found_twice_is_a_clear_error_until_pinned(
    machines: Callable[[str], FakeNeuron],
) -> None:
    fake = machines("trn1-32xl-new-layout")
    fake.fake.write_attribute("/sys/devices/virtual/neuron_device/neuron0/stats/core_count", 2)
    devices = by_id(backend(fake).discover())
    assert devices["neuron0"].health_reason == "sysfs-unreadable"
    pinned = by_id(backend(fake, sysfsPaths={"core_count": "info/core_count"}).discover())
    assert pinned["neuron0"].healthy


def test_garbage_logical_core_config_file_names_the_file(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("trn2-48xl")
    fake.fake.write_file("/opt/aws/neuron/logical_nc_config", "NEURON_LOGICAL_NC_CONFIG=3\n")
    with pytest.raises(
        HostFileError, match=r"/opt/aws/neuron/logical_nc_config: .* must be 1 or 2, found '3'"
    ):
        backend(fake).discover()


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    def load(resource: dict[str, Any]) -> None:
        path = tmp_path / "c.yaml"
        path.write_text(json.dumps({"version": "v1", "resources": [resource]}))
        load_config(path)

    with pytest.raises(ConfigError, match="counts whole devices; use unit: device"):
        load({"name": DEVICE, "neuron": {"unit": "core"}})
    with pytest.raises(ConfigError, match="counts NeuronCores; set unit: core"):
        load({"name": CORE, "neuron": {}})
    with pytest.raises(ConfigError, match="unknown Neuron attribute 'cores'"):
        load({"name": DEVICE, "neuron": {"sysfsPaths": {"cores": "x"}}})
    with pytest.raises(ValidationError):
        NeuronConfig.model_validate({"logicalCoreConfig": 3})


# ---------------------------------------------------------------------------------------------- allocation


def test_whole_devices_get_their_nodes_only(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("inf2-48xl")
    b = backend(fake)
    devices = by_id(b.discover())
    edits = b.allocate([devices["neuron4"], devices["neuron3"]])
    assert edits.device_nodes == [
        DeviceNode(f"/dev/neuron{i}", str(fake.root / f"dev/neuron{i}"), "rw") for i in (3, 4)
    ]
    assert edits.env == {} and edits.mounts == []


def test_cores_get_the_device_carrying_them_and_visible_cores(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("trn1-32xl")
    b = backend(fake, unit="core")
    devices = by_id(b.discover())
    edits = b.allocate([devices["neuroncore3"], devices["neuroncore2"]])
    assert [n.container_path for n in edits.device_nodes] == ["/dev/neuron1"]
    assert edits.env == {"NEURON_RT_VISIBLE_CORES": "2-3"}
    straddling = b.allocate([devices["neuroncore3"], devices["neuroncore4"]])
    assert [n.container_path for n in straddling.device_nodes] == ["/dev/neuron1", "/dev/neuron2"]
    with pytest.raises(BackendError, match="NeuronCores 2,4 are not contiguous"):
        b.allocate([devices["neuroncore2"], devices["neuroncore4"]])
    relaxed = backend(fake, unit="core", requireContiguous=False)
    relaxed_devices = by_id(relaxed.discover())
    assert relaxed.allocate([relaxed_devices["neuroncore2"], relaxed_devices["neuroncore4"]]).env == {
        "NEURON_RT_VISIBLE_CORES": "2,4"
    }


def test_trainium2_cores_carry_their_logical_core_config(machines: Callable[[str], FakeNeuron]) -> None:
    b = backend(machines("trn2-48xl"), unit="core")
    devices = by_id(b.discover())
    edits = b.allocate([devices["neuroncore4"]])
    assert edits.env == {"NEURON_RT_VISIBLE_CORES": "4", "NEURON_LOGICAL_NC_CONFIG": "2"}
    assert [n.container_path for n in edits.device_nodes] == ["/dev/neuron1"]


def test_preferred_allocation_keeps_runs_contiguous(machines: Callable[[str], FakeNeuron]) -> None:
    b = backend(machines("trn1-32xl"), unit="core")
    devices = b.discover()
    free = [d for d in devices if d.id not in ("neuroncore0", "neuroncore3")]
    assert b.preferred_allocation(free, [], 2) == ["neuroncore4", "neuroncore5"]
    assert b.preferred_allocation(free, [], 1) == ["neuroncore1"]
    whole = backend(machines("trn1-32xl"))
    all_devices = whole.discover()
    assert whole.preferred_allocation(all_devices[1:], [], 4) == [f"neuron{i}" for i in (4, 5, 6, 7)]


# ---------------------------------------------------------------------------------------------- live changes


async def test_health_values_are_polled_and_recover(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("trn1-32xl")
    stream = backend(fake, pollSeconds=0.05).watch()
    assert all(d.healthy for d in await next_list(stream))
    fake.set_ecc(6, "mem", 1)  # a value change: no inotify event, only polling sees it
    devices = by_id(await next_list(stream))
    assert devices["neuron6"].health_reason == "hbm-uncorrectable-error"
    fake.set_ecc(6, "mem", 0)
    fake.set_state(7, 2)
    devices = by_id(await next_list(stream))
    assert devices["neuron6"].healthy and devices["neuron7"].health_reason == "device-state-invalid"
    fake.set_state(7, 1)
    fake.set_ecc(1, "sram", 3)
    devices = by_id(await next_list(stream))
    assert devices["neuron7"].healthy and devices["neuron1"].health_reason == "sram-uncorrectable-error"
    await stream.aclose()


async def test_a_lost_device_and_the_driver_going_away_arrive_by_inotify(
    machines: Callable[[str], FakeNeuron],
) -> None:
    fake = machines("inf2-48xl")
    stream = backend(fake, pollSeconds=3600).watch()  # no polling in this test's time: only inotify wakes it
    assert len(await next_list(stream)) == 12
    fake.lose(4)
    assert "neuron4" not in by_id(await next_list(stream))
    fake.restore(4)
    devices = await next_list(stream)
    while len(devices) < 12:  # the class link and the device node may arrive as separate wake-ups
        devices = await next_list(stream)
    assert by_id(devices)["neuron4"].healthy
    fake.unload_driver()
    devices = await next_list(stream)
    while devices:
        devices = await next_list(stream)
    await stream.aclose()


async def test_a_missing_device_node_is_unhealthy(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("inf2-48xl")
    fake.fake.remove("/dev/neuron2")
    assert by_id(backend(fake).discover())["neuron2"].health_reason == "no-device-node"


# ---------------------------------------------------------------------------------------------- the daemon


async def test_daemon_serves_neuroncores_and_reports_a_health_flip(
    kubelet: KubeletStandIn,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    machines: Callable[[str], FakeNeuron],
) -> None:
    fake = machines("trn1-32xl")
    config = write_config(
        [
            {"name": CORE, "neuron": {"unit": "core", "hostRoot": str(fake.root), "pollSeconds": 0.1}},
            {"name": DEVICE, "neuron": {"hostRoot": str(fake.root), "pollSeconds": 0.1}},
        ]
    )
    await daemons(config)
    cores = await kubelet.wait_registered(CORE)
    await kubelet.wait_registered(DEVICE)
    assert len(cores.devices) == 32 and cores.options.get_preferred_allocation_available
    free = [f"neuroncore{i}" for i in range(32) if i not in (0, 3)]
    chosen = await kubelet.preferred(CORE, free, [], 2)
    assert chosen == ["neuroncore4", "neuroncore5"]
    response = await kubelet.allocate(CORE, chosen)
    container = response.container_responses[0]
    assert dict(container.envs) == {"NEURON_RT_VISIBLE_CORES": "4-5"}
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/neuron2", str(fake.root / "dev/neuron2"), "rw")
    ]
    fake.set_ecc(9, "mem", 2)
    await kubelet.wait_devices(CORE, lambda d: d["neuroncore18"] == d["neuroncore19"] == "Unhealthy")
    await kubelet.wait_devices(DEVICE, lambda d: d["neuron9"] == "Unhealthy")
    fake.lose(15)
    await kubelet.wait_devices(DEVICE, lambda d: "neuron15" not in d and len(d) == 15)


def test_kxpu_devices_over_a_fake_named_by_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "neuron.yaml"
    monkeypatch.setenv("KXPU_FAKE_NEURON", "inf2-48xl")
    result = CliRunner().invoke(main, ["devices", "--config", str(example), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [d["id"] for d in doc[DEVICE]["devices"]] == [f"neuron{i}" for i in range(12)]
    assert doc[DEVICE]["labels"]["kxpu.io/neuron.device-name"] == "Inferentia2"
    monkeypatch.setenv("KXPU_FAKE_NEURON", "inf3-huge")
    bad = CliRunner().invoke(main, ["devices", "--config", str(example)])
    assert bad.exit_code == 1 and "unknown fake Neuron profile 'inf3-huge'" in bad.output


def test_fake_device_nodes_are_char_devices_as_root(machines: Callable[[str], FakeNeuron]) -> None:
    fake = machines("inf1-6xl")
    st = os.stat(fake.root / "dev/neuron3")
    if os.geteuid() == 0:
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (FAKE_MAJOR, 3)


def test_the_hardware_check_script_passes_over_a_fake_machine() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "neuron-check"
    run = subprocess.run(
        [sys.executable, str(script), "--fake", "trn1-32xl-new-layout", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "neuron-check: everything matches" in run.stdout

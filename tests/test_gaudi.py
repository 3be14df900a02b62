"""The ``gaudi`` backend over the fake HLML: discovery, event health and recovery, a lost device, the exact
edits of Habana's plugin, labels, bad input; and the daemon as a separate process over the fake."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from kxpu.backends.gaudi import GaudiBackend, GaudiConfig
from kxpu.backends.gaudi.hlml import HlmlSource
from kxpu.cli import main
from kxpu.config import ConfigError, load_config
from kxpu.model import BackendError, Device
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_hlml import FAKE_HLML_CONTROL_ENV, FAKE_HLML_ENV, FakeHlml, send_control
from tests.waiting import wait_until

GAUDI = "habana.ai/gaudi"
SERIALS = [f"AM4000{9170 + i}" for i in range(8)]


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Callable[[str], FakeHlml]]:
    made: list[FakeHlml] = []

    def make(profile: str) -> FakeHlml:
        fake = FakeHlml(profile, tmp_path / f"root-{len(made)}")
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.cleanup()


@pytest.fixture
def backends() -> Iterator[Callable[..., GaudiBackend]]:
    made: list[GaudiBackend] = []

    def make(fake: FakeHlml, **config: Any) -> GaudiBackend:
        cfg = GaudiConfig.model_validate({"hostRoot": str(fake.root), **config})
        made.append(GaudiBackend(cfg, HlmlSource(fake, fake.types, fake.root, fake=True)))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


async def next_list(
    updates: AsyncIterator[list[Device]], predicate: Callable[[list[Device]], bool], timeout: float = 5.0
) -> list[Device]:
    async def find() -> list[Device]:
        while True:
            devices = await anext(updates)
            if predicate(devices):
                return devices

    return await asyncio.wait_for(find(), timeout)


def reasons(devices: list[Device]) -> dict[str, str | None]:
    return {d.id: d.health_reason for d in devices if d.health_reason}


FAST = {"health": {"eventWaitMs": 20}}


# ---------------------------------------------------------------------------------------- discovery


def test_discovers_eight_gaudi2_named_by_serial(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    devices = backends(machine("gaudi2-8x")).discover()
    assert [d.id for d in devices] == SERIALS
    first = devices[0]
    assert first.healthy and first.model == "HL-225" and first.memory_mib == 98304
    assert first.uuid == "01P0-HL2080A0-15-TNP2A6-00-07-09" and first.pci_bus_id == "0000:19:00.0"
    assert [d.numa_nodes for d in devices] == [(0,)] * 4 + [(1,)] * 4  # sysfs numa_node, as gohlml reads it
    assert dict(first.extra) == {
        "serial": SERIALS[0],
        "minor": 0,
        "moduleID": 2,
        "driverVersion": "1.16.0-94aac46",
    }


def test_a_device_lost_at_start_is_unhealthy(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    devices = backends(machine("gaudi2-8x-lost")).discover()
    assert len(devices) == 8 and reasons(devices) == {SERIALS[5]: "aip-lost"}


def test_without_hlml_every_sysfs_device_is_unhealthy(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    fake.profile.init_error = fake.types.HLML_RETURN.HLML_ERROR_DRIVER_NOT_LOADED
    fake.host.write_attribute(
        "/sys/class/accel/accel9/device/vendor", "0x8086"
    )  # another accel driver's device
    devices = backends(fake).discover()
    assert [d.id for d in devices] == SERIALS  # named by the driver's serial_number, Intel's NPU left out
    assert set(reasons(devices).values()) == {"hlml-unavailable"}
    assert devices[0].extra["moduleID"] == 2


def test_no_driver_is_an_empty_node(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    assert backends(machine("no-driver")).discover() == []


# ---------------------------------------------------------------------------------------- health


async def test_a_critical_event_takes_one_device_out(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    updates = backends(fake, **FAST).watch()
    assert all(d.healthy for d in await anext(updates))
    assert fake.inject_critical(3) == 1  # the backend registered for it
    sick = await next_list(updates, lambda ds: not ds[3].healthy)
    assert reasons(sick) == {SERIALS[3]: "hlml-critical"}
    fake.inject_double_bit_ecc(6)
    sick = await next_list(updates, lambda ds: not ds[6].healthy)
    assert reasons(sick)[SERIALS[6]] == "hlml-ecc-double-bit"
    await updates.aclose()


async def test_recovery_after_a_quiet_period(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    config = {"health": {"eventWaitMs": 20, "recovery": {"enabled": True, "quietPeriodSeconds": 0.3}}}
    gaudi = backends(fake, **config)
    updates = gaudi.watch()
    await anext(updates)
    fake.lose(2)  # stops answering: probes keep it unhealthy past the quiet period
    await next_list(updates, lambda ds: not ds[2].healthy)
    ticks = fake.calls.get("hlmlEventSetWait", 0)
    # ~0.8 s of quiet ticks, over twice the quiet period
    await wait_until(lambda: fake.calls.get("hlmlEventSetWait", 0) >= ticks + 40, what="40 event waits")
    assert reasons(gaudi.discover()) == {SERIALS[2]: "hlml-critical"}  # a lost device does not recover
    fake.restore(2)
    healed = await next_list(updates, lambda ds: all(d.healthy for d in ds))
    assert len(healed) == 8
    await updates.aclose()


async def test_without_recovery_a_fault_stays(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    gaudi = backends(fake, **FAST)
    updates = gaudi.watch()
    await anext(updates)
    fake.inject_critical(0)
    await next_list(updates, lambda ds: not ds[0].healthy)
    ticks = fake.calls.get("hlmlEventSetWait", 0)
    # ten quiet ticks with every probe answering
    await wait_until(lambda: fake.calls.get("hlmlEventSetWait", 0) >= ticks + 10, what="10 event waits")
    assert reasons(gaudi.discover()) == {SERIALS[0]: "hlml-critical"}
    await updates.aclose()


async def test_a_failing_event_wait_marks_every_device(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    updates = backends(fake, **FAST).watch()
    await anext(updates)
    fake.fail_event_wait()
    sick = await next_list(updates, lambda ds: not any(d.healthy for d in ds))
    assert set(reasons(sick).values()) == {"hlml-event-wait-failed"}
    await updates.aclose()


async def test_a_crashed_health_thread_is_one_line_and_every_device_unhealthy(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = machine("gaudi2-8x")
    with capture_logs() as logs:
        updates = backends(fake, **FAST).watch()
        await anext(updates)

        def broken(st: Any, timeout: int) -> Any:
            raise RuntimeError("a bug in the event loop")

        monkeypatch.setattr(fake, "hlmlEventSetWait", broken)
        sick = await next_list(updates, lambda ds: not any(d.healthy for d in ds))
        await updates.aclose()
    assert set(reasons(sick).values()) == {"health-thread-crashed"}
    crashed = [
        e for e in logs if e["log_level"] != "debug" and e["event"].startswith("health thread crashed")
    ]
    assert len(crashed) == 1 and crashed[0]["log_level"] == "error", crashed
    assert crashed[0]["error"] == "RuntimeError: a bug in the event loop"
    assert "exc_info" not in crashed[0], "the operator's log gets one line, not a traceback"


# ---------------------------------------------------------------------------------------- allocation


def test_allocate_gives_habanas_nodes_and_env(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    fake = machine("gaudi2-8x")
    gaudi = backends(fake)
    devices = gaudi.discover()
    edits = gaudi.allocate([devices[5], devices[4]])
    assert edits.env == {
        "HABANA_VISIBLE_DEVICES": "5,4",
        "HL_VISIBLE_DEVICES": "/dev/accel/accel5,/dev/accel/accel4",
        "HL_VISIBLE_DEVICES_UUID": f"{SERIALS[5]},{SERIALS[4]}",
        "HABANA_VISIBLE_MODULES": "7,6",
    }
    paths = [
        "/dev/accel/accel5",
        "/dev/accel/accel_controlD5",
        "/dev/accel/accel4",
        "/dev/accel/accel_controlD4",
    ]
    assert [(n.container_path, n.host_path, n.permissions) for n in edits.device_nodes] == [
        (p, str(fake.host.path(p)), "rw") for p in paths
    ]
    assert edits.mounts == []
    assert "HABANA_VISIBLE_MODULES" not in gaudi.allocate(devices).env  # all devices: as Habana's plugin


def test_unknown_or_undescribed_devices_are_refused(
    machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]
) -> None:
    gaudi = backends(machine("gaudi2-8x-lost"))
    with pytest.raises(BackendError, match="not a Gaudi device of this resource: AM1"):
        gaudi.allocate([Device("AM1")])
    with pytest.raises(BackendError, match=f"{SERIALS[5]}: its minor number and module ID are unknown"):
        gaudi.allocate([Device(SERIALS[5])])


def test_labels(machine: Callable[[str], FakeHlml], backends: Callable[..., GaudiBackend]) -> None:
    assert backends(machine("gaudi2-8x")).node_labels() == {
        "habana.ai/gaudi.product": "HL-225",
        "habana.ai/gaudi.count": "8",
        "habana.ai/gaudi.memory": "98304",
        "habana.ai/gaudi.driver-version": "1.16.0-94aac46",
    }


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"health": {"eventWaitMs": 0}}, r"health\.eventWaitMs: Input should be greater than or equal to 10"),
        ({"health": {"recovery": {"quietPeriodSeconds": -1}}}, "quietPeriodSeconds"),
        ({"hostRoot": "relative"}, "hostRoot relative must be an absolute path"),
        ({"visibleDevices": "all"}, "visibleDevices"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"version": "v1", "resources": [{"name": GAUDI, "gaudi": section}]}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_fake_takes_errors_and_shapes_from_pyhlml(machine: Callable[[str], FakeHlml]) -> None:
    import pyhlml.hlml_error as hlml_error

    fake = machine("gaudi2-8x")
    with pytest.raises(hlml_error.HLMLError) as before_init:
        fake.hlmlDeviceGetCount()
    assert type(before_init.value).__name__ == "HLMLError_Uninitialized"
    fake.hlmlInit()
    handle = fake.hlmlDeviceGetHandleByIndex(0)
    assert fake.hlmlDeviceGetSerial(handle) == SERIALS[0].encode()  # bytes, as pyhlml returns
    assert type(fake.hlmlDeviceGetPCIInfo(handle)).__name__ == "c_hlml_pci_info"
    es = fake.hlmlEventSetCreate()
    with pytest.raises(hlml_error.HLMLError) as timeout:
        fake.hlmlEventSetWait(es, 1)
    assert timeout.value.value == fake.types.HLML_RETURN.HLML_ERROR_TIMEOUT


def test_kxpu_devices_over_the_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    monkeypatch.setenv(FAKE_HLML_ENV, "gaudi2-8x")
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps({"version": "v1", "resources": [{"name": GAUDI, "gaudi": {"hostRoot": str(root)}}]})
    )
    result = CliRunner().invoke(main, ["devices", "--config", str(config), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)[GAUDI]
    assert [d["id"] for d in doc["devices"]] == SERIALS
    assert doc["labels"]["habana.ai/gaudi.product"] == "HL-225"


# ---------------------------------------------------------------------------------------- the daemon


async def test_daemon_serves_gaudi_and_reports_a_critical_event(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    control = workdir / "hlml.sock"
    root = workdir / "root"
    config = write_config([{"name": GAUDI, "gaudi": {"hostRoot": str(root), "health": {"eventWaitMs": 50}}}])
    await daemons(config, env={FAKE_HLML_ENV: "gaudi2-8x", FAKE_HLML_CONTROL_ENV: str(control)})
    view = await kubelet.wait_registered(GAUDI)
    assert view.devices == dict.fromkeys(SERIALS, "Healthy")
    response = await kubelet.allocate(GAUDI, [SERIALS[1]])
    container = response.container_responses[0]
    assert dict(container.envs) == {
        "HABANA_VISIBLE_DEVICES": "1",
        "HL_VISIBLE_DEVICES": "/dev/accel/accel1",
        "HL_VISIBLE_DEVICES_UUID": SERIALS[1],
        "HABANA_VISIBLE_MODULES": "3",
    }
    assert [d.container_path for d in container.devices] == [
        "/dev/accel/accel1",
        "/dev/accel/accel_controlD1",
    ]
    send_control(control, op="critical", index=7)
    devices = await kubelet.wait_devices(GAUDI, lambda d: d.get(SERIALS[7]) == "Unhealthy")
    assert sum(h == "Healthy" for h in devices.values()) == 7


def test_check_script_passes_over_a_fake_machine() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "gaudi-check"
    result = subprocess.run(
        [sys.executable, str(script), "--fake", "gaudi2-8x", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout and "FAIL" not in result.stdout

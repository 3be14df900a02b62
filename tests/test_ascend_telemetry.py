"""``sample()`` of the ``ascend`` backend over the fake DCMI: the calls' ctypes shapes and codes as the library has
them, figures a chip does not support left out, a failing call costing only its figure (logged once)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kxpu.backends.ascend import AscendBackend, AscendConfig, dcmi
from kxpu.backends.ascend.dcmi import DcmiSource
from kxpu.model import DeviceUsage
from kxpu.testing.fake_dcmi import FakeDcmi

MIB = 1024 * 1024


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Callable[[str], FakeDcmi]]:
    made: list[FakeDcmi] = []

    def make(profile: str) -> FakeDcmi:
        made.append(FakeDcmi(profile, tmp_path / f"root-{len(made)}"))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def backend(fake: FakeDcmi) -> AscendBackend:
    cfg = AscendConfig.model_validate({"hostRoot": str(fake.root)})
    cfg.resource_name("huawei.com/Ascend910")
    return AscendBackend(cfg, DcmiSource(fake.root, fake))


def by_index(usages: tuple[DeviceUsage, ...]) -> dict[int | None, DeviceUsage]:
    return {u.index: u for u in usages}


def test_a_910b_reports_utilization_hbm_power_health_and_processes(
    machine: Callable[[str], FakeDcmi],
) -> None:
    fake = machine("910b-8x")
    fake.set_usage(
        2,
        utilization={dcmi.UTILIZATION_NPU: 71, dcmi.UTILIZATION_AICORE: 64, 12: 30, 10: 45, 3: 5},
        power_tenths=2875,
        temperature=52,
        memory_used_mib=20480,
        processes=[(4242, 12 * 1024 * MIB), (4343, 8 * 1024 * MIB)],
    )
    npus = backend(fake)
    devices = {d.index: d for d in npus.discover()}
    sample = npus.sample()
    chip = by_index(sample.devices)[2]
    assert chip.uuid == devices[2].uuid and chip.vendor == "ascend" and chip.model == "Ascend910B3"
    assert chip.compute_utilization == 0.71 and chip.memory_bandwidth_utilization == 0.45
    assert chip.engines == {"aicore": 0.64, "aicpu": 0.05, "vectorcore": 0.30}
    assert (chip.memory_used_bytes, chip.memory_total_bytes) == (20480 * MIB, 65536 * MIB)
    assert chip.power_watts == 287.5 and chip.temperature_celsius == 52.0
    assert chip.temperatures_celsius == {"hbm": 40.0} and chip.health_code == 0
    assert chip.clocks_hz == {"aicore": 1650e6, "memory": 1600e6}
    assert {(p.pid, p.uuid, p.memory_used_bytes) for p in sample.processes} == {
        (4242, devices[2].uuid, 12 * 1024 * MIB),
        (4343, devices[2].uuid, 8 * 1024 * MIB),
    }
    assert len(sample.devices) == 8


def test_a_310p_without_hbm_reports_ddr_and_leaves_hbm_figures_out(
    machine: Callable[[str], FakeDcmi],
) -> None:
    fake = machine("310p-4x")
    fake.set_usage(1, utilization={dcmi.UTILIZATION_AICORE: 20}, memory_used_mib=4096)
    npus = backend(fake)
    npus.discover()
    chip = by_index(npus.sample().devices)[1]
    assert (chip.memory_used_bytes, chip.memory_total_bytes) == (4096 * MIB, 21527 * MIB)
    assert chip.memory_bandwidth_utilization is None  # HBM bandwidth: not supported there, so absent
    assert "hbm" not in chip.temperatures_celsius and "memory" not in chip.clocks_hz
    assert chip.engines["aicore"] == 0.2


def test_a_dropped_card_costs_its_figures_and_one_log_line(machine: Callable[[str], FakeDcmi]) -> None:
    fake = machine("910b-8x")
    npus = backend(fake)
    npus.discover()
    fake.drop(5)
    with capture_logs() as logs:
        first, second = npus.sample(), npus.sample()
    dropped, other = by_index(second.devices)[5], by_index(second.devices)[4]
    assert dropped.power_watts is None and dropped.memory_used_bytes is None and dropped.health_code is None
    assert other.power_watts == 85.1 and by_index(first.devices)[4] == other
    warned = [
        e["error"] for e in logs if e["event"] == "telemetry: a DCMI call failed; that figure is left out"
    ]
    assert warned and all("-8012" in w for w in warned) and len(warned) == len(set(warned)), warned

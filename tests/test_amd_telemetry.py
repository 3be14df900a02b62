"""``sample()`` of the ``amd`` and ``hygon`` backends over generated amdgpu trees: the driver's sysfs and hwmon
files per GPU, KFD's per-process VRAM, partitions, and files a GPU lacks or cannot read."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from kxpu.backends.amd import AmdBackend, AmdConfig, HygonBackend, HygonConfig
from kxpu.model import DeviceUsage, TelemetrySample
from kxpu.testing.fake_amd import GIB, FakeAmd


@pytest.fixture
def machines() -> Iterator[Callable[[str], FakeAmd]]:
    made: list[FakeAmd] = []

    def make(profile: str) -> FakeAmd:
        made.append(FakeAmd(profile))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def sampled(backend: AmdBackend) -> tuple[dict[str, DeviceUsage], TelemetrySample, dict[str, Any]]:
    devices = {d.id: d for d in backend.discover()}
    sample = backend.sample()
    by_uuid = {u.uuid: u for u in sample.devices}
    return {i: by_uuid[d.uuid or d.id] for i, d in devices.items()}, sample, devices


def test_a_whole_gpu_reports_every_figure_the_driver_keeps(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("mi210-4x-xgmi")
    fake.set_usage(0, busy=37, memBusy=12, vramUsed=5 * GIB, powerMicroW=250_000_000)
    fake.set_ras(0, "umc", 0, ce=3)
    fake.set_ras(0, "gfx", 0, ce=2)
    fake.run_process(4242, {(0, 0): 3 * GIB})
    fake.run_process(4343, {(0, 0): GIB, (1, 0): 2 * GIB})
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)}))
    usage, sample, devices = sampled(backend)
    gpu0 = usage[fake.bdf(0)]
    assert gpu0.vendor == "amd" and gpu0.model == "AMD Instinct MI210"
    assert (gpu0.compute_utilization, gpu0.memory_bandwidth_utilization) == (0.37, 0.12)
    assert (gpu0.memory_used_bytes, gpu0.memory_total_bytes) == (5 * GIB, 64 * GIB)
    assert gpu0.power_watts == 250.0  # power1_average, microwatts
    assert gpu0.temperature_celsius == 41.0
    assert gpu0.temperatures_celsius == {"junction": 47.0, "memory": 44.0}
    assert gpu0.clocks_hz == {"sm": 1700e6, "memory": 1300e6}  # the levels marked '*'
    assert gpu0.ecc_errors == {"corrected": 5, "uncorrected": 0}
    processes = {(p.pid, p.uuid): p.memory_used_bytes for p in sample.processes}
    uuid0, uuid1 = devices[fake.bdf(0)].uuid, devices[fake.bdf(1)].uuid
    assert processes == {(4242, uuid0): 3 * GIB, (4343, uuid0): GIB, (4343, uuid1): 2 * GIB}
    assert all(p.compute_utilization is None for p in sample.processes)  # KFD has no per-process share

    # A process that ends leaves KFD; a figure the GPU does not have is left out, not zero.
    fake.end_process(4242)
    fake.fake.remove(f"/sys/devices/pci0000:00/{fake.bdf(1)}/mem_busy_percent")
    usage, sample, _ = sampled(backend)
    assert {p.pid for p in sample.processes} == {4343}
    assert usage[fake.bdf(1)].memory_bandwidth_utilization is None
    assert usage[fake.bdf(1)].compute_utilization == 0.0


def test_a_gpu_whose_files_cannot_be_read_costs_that_gpu_and_one_log_line(
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi210-4x-xgmi")
    fake.fake.set_attribute(f"/sys/devices/pci0000:00/{fake.bdf(2)}/pp_dpm_sclk", "garbage")
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)}))
    with capture_logs() as logs:
        usage, _, _ = sampled(backend)
        usage, _, _ = sampled(backend)
    broken = usage[fake.bdf(2)]
    assert broken.compute_utilization is None and broken.power_watts is None
    assert usage[fake.bdf(3)].power_watts == 90.0
    warnings = [entry for entry in logs if entry["event"] == "telemetry: a GPU's figures cannot be read"]
    assert len(warnings) == 1 and "pp_dpm_sclk" in warnings[0]["error"], warnings


def test_partitions_report_their_own_memory_and_the_gpu_wide_figures_once(
    machines: Callable[[str], FakeAmd],
) -> None:
    fake = machines("mi300x-8x-cpx")
    fake.set_usage(0, busy=50, powerMicroW=600_000_000)
    fake.run_process(4242, {(0, 3): 7 * GIB})
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)}))
    devices = backend.discover()
    sample = backend.sample()
    of_gpu0 = [d for d in devices if d.pci_bus_id == fake.bdf(0)]
    assert len(of_gpu0) == 8
    figures = {u.uuid: u for u in sample.devices}
    first, fourth = (figures[d.uuid or d.id] for d in (of_gpu0[0], of_gpu0[3]))
    assert first.power_watts == 600.0 and first.compute_utilization == 0.5  # power1_input on MI300
    assert fourth.power_watts is None and fourth.compute_utilization is None
    assert fourth.memory_total_bytes == 192 * GIB // 4  # NPS4: KFD's size of the partition's memory
    assert fourth.memory_used_bytes == 7 * GIB and first.memory_used_bytes == 0
    (process,) = sample.processes
    assert process.uuid == of_gpu0[3].uuid and process.memory_used_bytes == 7 * GIB


def test_hygon_dcus_report_under_their_own_vendor(machines: Callable[[str], FakeAmd]) -> None:
    fake = machines("hygon-dcu-8x")
    fake.set_usage(5, busy=80, vramUsed=GIB)
    backend = HygonBackend(HygonConfig.model_validate({"hostRoot": str(fake.root)}))
    usage, _, devices = sampled(backend)
    dcu = next(i for i, d in devices.items() if d.pci_bus_id == fake.bdf(5))
    assert usage[dcu].vendor == "hygon" and usage[dcu].compute_utilization == 0.8
    assert usage[dcu].memory_used_bytes == GIB and usage[dcu].ecc_errors == {"corrected": 0, "uncorrected": 0}

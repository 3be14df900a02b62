"""What operators use dcgm-exporter for, from the nvidia backend over the fake NVML (pynvml's names and shapes):
energy, PCIe throughput, remapped rows, clock event reasons; absent where the GPU generation has no such figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pynvml

from tests.nvidia_support import make


def test_energy_pcie_remapped_rows_and_clock_reasons() -> None:
    backend, fake = make("a100-8x")
    try:
        gpu = fake.gpus[2]
        gpu.energy_mj, gpu.pcie_kbps, gpu.remapped_rows = 987_654_321, (2048, 512), (3, 1, 1, 0)
        gpu.clocks_event_reasons = (
            pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwSlowdown
        )
        usage = next(u for u in backend.sample().devices if u.index == 2)
        assert usage.energy_joules == 987_654.321
        assert usage.pcie_bytes_per_second == {"tx": 2048 * 1024, "rx": 512 * 1024}
        assert usage.remapped_rows == {"correctable": 3, "uncorrectable": 1}
        assert usage.row_remap == {"pending": True, "failure": False}
        held = {reason for reason, on in usage.clock_event_reasons.items() if on}
        assert held == {"sw_power_cap", "hw_slowdown"}
        assert len(usage.clock_event_reasons) == 9  # every reason reported, 0 when it does not hold
    finally:
        backend.close()


def test_a_volta_has_no_row_remapping_and_it_is_absent() -> None:
    backend, _ = make("v100-4x-nvlink")
    try:
        usage = backend.sample().devices[0]
        assert usage.remapped_rows == {} and usage.row_remap == {}  # NOT_SUPPORTED before Ampere
        assert usage.energy_joules is not None
    finally:
        backend.close()


def test_hopper_gpm_counters_between_two_samples_and_none_before_hopper() -> None:
    from kxpu.testing.fake_nvml import FakeNvml

    fake = FakeNvml("h100-mig-dynamic")
    fake.gpus[2].gpm = {2: 63.5, 5: 41.0, 10: 22.5, 1: 80.0}
    fake.gpus[2].gpm_unsupported = {3}  # SM occupancy NOT_SUPPORTED: absent, not 0
    backend, _ = make(fake, migStrategy="none")
    try:
        first = {u.uuid: u for u in backend.sample().devices}[fake.gpus[2].uuid]
        assert first.profiling == {}  # GPM needs two samples
        second = {u.uuid: u for u in backend.sample().devices}[fake.gpus[2].uuid]
        assert second.profiling == {
            "sm_active": 0.635,
            "tensor_active": 0.41,
            "dram_active": 0.225,
            "graphics_active": 0.8,
        }
        assert len(fake._gpm_samples) == 6  # two per GPU, kept between samples
    finally:
        backend.close()
    assert not fake._gpm_samples  # freed before NVML shut down
    volta, _ = make("v100-4x-nvlink")
    try:
        volta.sample()
        assert all(u.profiling == {} for u in volta.sample().devices)
    finally:
        volta.close()


def test_nvlink_data_bytes_summed_over_the_active_links() -> None:
    from kxpu.testing.fake_nvml import FakeNvml

    fake = FakeNvml("v100-4x-nvlink")
    gpu = fake.gpus[1]
    active = [n for n, remote in enumerate(gpu.nvlinks) if remote is not None]
    assert len(active) >= 2
    gpu.nvlink_kib = {link: (1000 * (n + 1), 10 * (n + 1)) for n, link in enumerate(active)}
    backend, _ = make(fake)
    try:
        usage = {u.uuid: u for u in backend.sample().devices}
        n = len(active)
        total = n * (n + 1) // 2
        assert usage[gpu.uuid].nvlink_bytes == {"tx": 1000 * total * 1024, "rx": 10 * total * 1024}
        assert usage[fake.gpus[0].uuid].nvlink_bytes == {}  # its links report no counter: absent, not 0
    finally:
        backend.close()
    a100, _ = make("a100-8x")  # no NVLink at all
    try:
        assert all(u.nvlink_bytes == {} for u in a100.sample().devices)
    finally:
        a100.close()


def test_field_ids_the_driver_does_not_know_are_invalid_and_gpm_answers_every_metric() -> None:
    """As driver 580 answered on an H200 (hack/gpu-telemetry-check): a field ID beyond NVML_FI_MAX is
    INVALID_ARGUMENT in its own nvmlReturn; every GPM metric NVML defines is answered, an undefined one is
    INVALID_ARGUMENT."""
    from kxpu.testing.fake_nvml import FakeNvml

    fake = FakeNvml("gb200-4x")
    fake.nvmlInit()
    try:
        h = fake.nvmlDeviceGetHandleByIndex(0)
        (unknown,) = fake.nvmlDeviceGetFieldValues(h, [99999])
        assert unknown.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT
        (replays,) = fake.nvmlDeviceGetFieldValues(h, [pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER])
        assert replays.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # known to NVML, not modelled here
        one, two = fake.nvmlGpmSampleAlloc(), fake.nvmlGpmSampleAlloc()
        fake.nvmlGpmSampleGet(h, one)
        fake.nvmlGpmSampleGet(h, two)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics, request.sample1, request.sample2 = (
            pynvml.NVML_GPM_METRICS_GET_VERSION,
            2,
            one,
            two,
        )
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
        request.metrics[1].metricId = 9999
        got = fake.nvmlGpmMetricsGet(request)
        assert got.metrics[0].nvmlReturn == pynvml.NVML_SUCCESS
        assert got.metrics[1].nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT
        fake.nvmlGpmSampleFree(one)
        fake.nvmlGpmSampleFree(two)
    finally:
        fake.nvmlShutdown()


def test_the_gpu_telemetry_check_runs_over_the_fake(tmp_path: Path) -> None:
    """hack/gpu-telemetry-check is meant for a GPU machine; over the fake it must still run every step and hold
    the fake to itself (a check that cannot pass over the fake would be useless on the GPU)."""
    script = Path(__file__).resolve().parent.parent / "hack" / "gpu-telemetry-check"
    env = {k: v for k, v in os.environ.items() if k != "KXPU_FAKE_NVML"}
    out = tmp_path / "telemetry.json"
    result = subprocess.run(
        [sys.executable, str(script), "--fake", "--seconds", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    results = {r["check"]: r["result"] for r in doc["checks"]}
    assert set(results.values()) <= {"PASS", "skip"}
    fidelity = [name for name in results if name.startswith("fake NVML ")]
    assert len(fidelity) >= 20 and all(results[name] == "PASS" for name in fidelity)
    assert set(doc["figures"]["phases"]) == {"idle", "tensor", "dram", "h2d", "d2h"}
    assert doc["figures"]["call_costs"]["nvmlDeviceGetTotalEnergyConsumption"]["outcome"] == "ok"

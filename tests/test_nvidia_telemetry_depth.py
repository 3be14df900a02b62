"""What operators use dcgm-exporter for, from the nvidia backend over the fake NVML (pynvml's names and shapes):
energy, PCIe throughput, remapped rows, clock event reasons; absent where the GPU generation has no such figure."""

from __future__ import annotations

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
    fake.gpus[2].gpm = {2: 63.5, 5: 41.0, 10: 22.5, 1: 80.0}  # no SM occupancy: NOT_SUPPORTED, so absent
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

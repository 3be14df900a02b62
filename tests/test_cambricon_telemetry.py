"""``sample()`` of the ``cambricon`` backend over the fake libcndev: cndev.h's structures and codes, per-process MLU
memory (KiB in cndev, asked again with more room on INSUFFICIENT_SPACE), a failing MLU costing its figures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from structlog.testing import capture_logs

from kxpu.backends.cambricon import CambriconBackend, CambriconConfig
from kxpu.backends.cambricon import cndev as c
from kxpu.backends.host import Host
from kxpu.testing.fake_cambricon import FakeCambricon

MIB = 1024 * 1024


@pytest.fixture
def machines() -> Iterator[Callable[[str], FakeCambricon]]:
    made: list[FakeCambricon] = []

    def make(profile: str) -> FakeCambricon:
        made.append(FakeCambricon(profile))
        return made[-1]

    yield make
    for fake in made:
        fake.cleanup()


def backend(fake: FakeCambricon) -> CambriconBackend:
    section = CambriconConfig.model_validate({"hostRoot": str(fake.root)})
    return CambriconBackend(section, library=fake.library, host=Host(fake.root))


def test_every_figure_and_each_processes_memory(machines: Callable[[str], FakeCambricon]) -> None:
    fake = machines("mlu370-x8-4x")
    many = [(5000 + n, 1024 * (n + 1)) for n in range(40)]  # more than the first ask has room for
    fake.set_usage(
        1, utilization=63, memory_used_mib=20000, power_w=140, temperatures=[36, 58, 49], processes=many
    )
    mlus = backend(fake)
    mlus.discover()
    sample = mlus.sample()
    usage = next(u for u in sample.devices if u.index == 1)
    assert usage.uuid == fake.uuid(1) and usage.vendor == "cambricon" and usage.model == "MLU370-X8"
    assert usage.compute_utilization == 0.63 and usage.power_watts == 140.0
    assert (usage.memory_used_bytes, usage.memory_total_bytes) == (20000 * MIB, 49152 * MIB)
    assert usage.temperature_celsius == 58.0 and usage.temperatures_celsius == {"board": 36.0, "memory": 49.0}
    assert usage.memory_bandwidth_utilization is None  # cndev's utilization call has no such figure
    listed = {(p.pid, p.uuid): p.memory_used_bytes for p in sample.processes}
    assert len(listed) == 40 and listed[(5039, fake.uuid(1))] == 40 * 1024 * 1024  # KiB → bytes
    mlus.close()


def test_unsupported_calls_are_absent_and_a_failing_mlu_is_one_log_line(
    machines: Callable[[str], FakeCambricon],
) -> None:
    fake = machines("mlu370-x8-4x")
    fake.fail_call(0, "cndevGetDevicePowerInfo", c.CNDEV_ERROR_NOT_SUPPORTED)
    fake.fail_call(2, "cndevGetTemperatureInfo", c.CNDEV_ERROR_UNKNOWN)
    mlus = backend(fake)
    mlus.discover()
    with capture_logs() as logs:
        mlus.sample()
        sample = mlus.sample()
    usage = {u.index: u for u in sample.devices}
    assert usage[0].power_watts is None and usage[0].compute_utilization == 0.0
    assert usage[2].memory_used_bytes is None and usage[2].power_watts is None
    assert usage[3].power_watts == 75.0
    warned = [e for e in logs if e["event"] == "telemetry: an MLU's figures cannot be read"]
    assert len(warned) == 1 and "cndevGetTemperatureInfo: CNDEV_ERROR_UNKNOWN" in warned[0]["error"], warned
    mlus.close()

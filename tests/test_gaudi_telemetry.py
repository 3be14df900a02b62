"""``sample()`` of the ``gaudi`` backend over the fake pyhlml: pyhlml's names, structures and units, an
unsupported call leaving its figure out, a failing device costing its figures and one log line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kxpu.backends.gaudi import GaudiBackend, GaudiConfig
from kxpu.backends.gaudi.hlml import HlmlSource
from kxpu.model import BackendError
from kxpu.testing.fake_hlml import FakeHlml

GIB = 1024**3


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[[str], tuple[FakeHlml, GaudiBackend]]]:
    made: list[tuple[FakeHlml, GaudiBackend]] = []

    def make(profile: str) -> tuple[FakeHlml, GaudiBackend]:
        fake = FakeHlml(profile, tmp_path / f"root-{len(made)}")
        cfg = GaudiConfig.model_validate({"hostRoot": str(fake.root)})
        made.append((fake, GaudiBackend(cfg, HlmlSource(fake, fake.types, fake.root, fake=True))))
        return made[-1]

    yield make
    for fake, backend in made:
        backend.close()
        fake.cleanup()


def test_every_figure_hlml_gives(rig: Callable[[str], tuple[FakeHlml, GaudiBackend]]) -> None:
    fake, backend = rig("gaudi2-8x")
    aip = fake.aips[3]
    aip.aip_util, aip.memory_used, aip.power_mw = 88, 40 * GIB, 450_000
    aip.ecc = {0: 12, 1: 0}
    devices = {d.uuid: d for d in backend.discover()}
    sample = backend.sample()
    usage = next(u for u in sample.devices if u.uuid == aip.uuid)
    assert aip.uuid in devices and usage.vendor == "gaudi" and usage.model == "HL-225" and usage.index == 3
    assert usage.compute_utilization == 0.88
    assert (usage.memory_used_bytes, usage.memory_total_bytes) == (40 * GIB, 96 * GIB)
    assert usage.power_watts == 450.0 and usage.energy_joules == 5400.0
    assert usage.temperature_celsius == 38.0 and usage.temperatures_celsius == {"board": 31.0, "hbm": 36.0}
    assert usage.clocks_hz == {"soc": 1600e6} and usage.ecc_errors == {"corrected": 12, "uncorrected": 0}
    assert not sample.processes  # HLML lists no processes
    assert len(sample.devices) == 8


def test_unsupported_is_absent_and_a_lost_device_is_one_log_line(
    rig: Callable[[str], tuple[FakeHlml, GaudiBackend]],
) -> None:
    fake, backend = rig("gaudi2-8x")
    fake.aips[0].unsupported = {"hlmlDeviceGetTotalEnergyConsumption", "hlmlDeviceGetPowerUsage"}
    fake.lose(6)
    with capture_logs() as logs:
        backend.sample()
        sample = backend.sample()
    usage = {u.index: u for u in sample.devices}
    assert (
        usage[0].power_watts is None and usage[0].energy_joules is None and usage[0].compute_utilization == 0
    )
    assert usage[6].compute_utilization is None and usage[6].memory_used_bytes is None
    assert usage[7].power_watts == 182.0
    warned = [e["error"] for e in logs if e["event"].startswith("telemetry: an HLML call failed")]
    assert warned and all("AipIsLost" in w or "AIP_IS_LOST" in w.upper() for w in warned), warned
    assert len(warned) == len(set(warned))  # once per call and error, not per sample
    backend.close()
    with pytest.raises(BackendError, match="HLML is not initialized"):
        backend.sample()

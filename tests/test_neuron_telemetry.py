"""``sample()`` of the ``neuron`` backend over the fake Neuron tree: the driver's per-core memory counters summed
per device and by category, uncorrectable ECC, figures the driver does not keep left out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from kxpu.backends.neuron import NeuronBackend, NeuronConfig
from kxpu.testing.fake_neuron import DEVICE_DIR, FakeNeuron

GIB = 1024**3
MIB = 1024**2


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


@pytest.mark.parametrize("unit", ["device", "core"])
def test_memory_by_category_summed_over_cores(machines: Callable[[str], FakeNeuron], unit: str) -> None:
    fake = machines("trn1-32xl")
    fake.set_memory(3, 0, {"tensors": 6 * GIB, "model_code": 300 * MIB})
    fake.set_memory(3, 1, {"tensors": 2 * GIB, "runtime_memory": 64 * MIB})
    fake.set_ecc(3, "mem", 2)
    neuron = backend(fake, unit=unit)
    devices = neuron.discover()
    sample = neuron.sample()
    assert len(sample.devices) == 16  # one per physical device, whichever unit is served
    usage = next(u for u in sample.devices if u.index == 3)
    assert usage.uuid == next(d.uuid for d in devices if d.extra["deviceId"] == 3)
    assert usage.vendor == "neuron" and usage.model == "Trainium1"
    assert usage.memory_used_bytes == 8 * GIB + 364 * MIB and usage.memory_total_bytes == 32 * GIB
    assert usage.memory_by_category["tensors"] == 8 * GIB
    assert usage.memory_by_category["model_code"] == 300 * MIB
    assert usage.memory_by_category["runtime_memory"] == 64 * MIB
    assert usage.ecc_errors == {"uncorrected": 2}
    # The driver keeps no busy time, power or temperature: those are absent, not zero.
    assert (
        usage.compute_utilization is None and usage.power_watts is None and usage.temperature_celsius is None
    )
    assert not sample.processes


def test_an_unreadable_counter_costs_that_device_and_one_log_line(
    machines: Callable[[str], FakeNeuron],
) -> None:
    fake = machines("inf2-48xl")
    fake.fake.set_attribute(
        f"{DEVICE_DIR}/neuron2/neuron_core1/stats/memory_usage/device_mem/tensors/present", "oops"
    )
    neuron = backend(fake)
    neuron.discover()
    with capture_logs() as logs:
        neuron.sample()
        sample = neuron.sample()
    usage = {u.index: u for u in sample.devices}
    assert usage[2].memory_used_bytes is None and usage[3].memory_used_bytes == 0
    warned = [e for e in logs if e["event"] == "telemetry: a Neuron device's counters cannot be read"]
    assert len(warned) == 1 and "tensors/present" in warned[0]["error"]


def test_a_sample_reads_counters_only_and_discovery_lists_again(
    machines: Callable[[str], FakeNeuron], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cores and categories are fixed while the driver is loaded: listed at the first sample after a
    discovery, not at every sample (which made Neuron the costliest backend to sample); the counters are read
    fresh each time."""
    from kxpu.backends.host import Host

    listed: list[str] = []
    listdir = Host.listdir

    def counted(self: Host, path: str) -> list[str]:
        listed.append(path)
        return listdir(self, path)

    monkeypatch.setattr(Host, "listdir", counted)
    fake = machines("inf2-48xl")
    neuron = backend(fake)
    neuron.discover()
    neuron.sample()
    first = len(listed)
    fake.set_memory(1, 0, {"tensors": 3 * GIB})
    usage = {u.index: u for u in neuron.sample().devices}
    assert len(listed) == first, listed[first:]
    assert usage[1].memory_by_category["tensors"] == 3 * GIB
    neuron.discover()
    listed.clear()
    neuron.sample()
    assert listed, "a new discovery lists the layout again"


def test_power_as_a_share_of_the_maximum_from_the_drivers_minute_stats(
    machines: Callable[[str], FakeNeuron],
) -> None:
    """``stats/power/utilization``: only a valid minute carries figures (the first minute after the driver loads
    reads "no data"); the average is taken, as a ratio; there are no watts."""
    fake = machines("trn1-32xl")
    fake.set_power(3, 42.5, low=10.0, high=80.25)
    fake.set_power(4, 0.0, status="INVALID")
    fake.set_memory(5, 0, {"tensors": GIB})
    fake.fake.set_attribute(f"{DEVICE_DIR}/neuron5/stats/power/utilization", "42")
    neuron = backend(fake)
    neuron.discover()
    with capture_logs() as logs:
        neuron.sample()
        usage = {u.index: u for u in neuron.sample().devices}
    assert usage[3].power_utilization == pytest.approx(0.425) and usage[3].power_watts is None
    assert usage[0].power_utilization is None  # POWER_STATUS_NO_DATA
    assert usage[4].power_utilization is None  # POWER_STATUS_INVALID
    # A line of another shape costs the power figure and one log line, not the device's memory.
    assert usage[5].power_utilization is None and usage[5].memory_used_bytes == GIB
    warned = [e for e in logs if e["event"] == "telemetry: a Neuron device's counters cannot be read"]
    assert len(warned) == 1 and "stats/power/utilization: expected" in warned[0]["error"]

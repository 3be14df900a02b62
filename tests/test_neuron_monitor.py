"""neuron-monitor as the ``neuron`` backend's second telemetry source, over the fake Neuron tree with the fake
neuron-monitor installed where aws-neuronx-tools puts it (a real child process printing AWS's JSON shape): NeuronCore
utilization per device and per core, each application's memory and compute, corrected ECC; a monitor that is absent,
dies or prints garbage costs one log line, never the sysfs figures, and is restarted with backoff."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kxpu.backends.neuron import NeuronBackend, NeuronConfig, monitor
from kxpu.backends.neuron.monitor import ReportError, monitor_config, read_report
from kxpu.model import DeviceUsage, TelemetrySample
from kxpu.testing import KubeletStandIn, fake_neuron_monitor
from kxpu.testing.fake_neuron import FakeNeuron
from tests.test_daemon_observability import metric
from tests.waiting import wait_until

GIB = 1024**3
MIB = 1024**2
NOT_REPORTING = (
    "telemetry: neuron-monitor is not reporting; NeuronCore utilization and per-process memory are absent until it "
    "does (the driver's sysfs figures are unaffected)"
)


@pytest.fixture
def machines() -> Iterator[Callable[..., tuple[FakeNeuron, NeuronBackend]]]:
    made: list[tuple[FakeNeuron, NeuronBackend]] = []

    def make(profile: str, **monitor: Any) -> tuple[FakeNeuron, NeuronBackend]:
        fake = FakeNeuron(profile)
        config = {"hostRoot": str(fake.root), "neuronMonitor": {"periodSeconds": 1, **monitor}}
        backend = NeuronBackend(NeuronConfig.model_validate(config))
        backend.discover()
        made.append((fake, backend))
        return made[-1]

    yield make
    for fake, backend in made:
        backend.close()
        fake.cleanup()


def by_index(sample: TelemetrySample) -> dict[int | None, DeviceUsage]:
    return {u.index: u for u in sample.devices}


async def sampled(
    backend: NeuronBackend, holds: Callable[[TelemetrySample], bool], what: str
) -> TelemetrySample:
    latest: list[TelemetrySample] = []

    def check() -> bool:
        latest[:] = [backend.sample()]
        return holds(latest[0])

    await wait_until(check, timeout=20, what=what)
    return latest[0]


async def test_core_utilization_processes_and_corrected_ecc_from_the_monitor(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]],
) -> None:
    fake, neuron = machines("trn1-32xl-tools")
    # One application on device 3's two cores (logical cores 6 and 7), another on device 5's first core.
    fake.run_app(4242, {6: (50.0, {"tensors": 2 * GIB}), 7: (100.0, {"model_code": 256 * MIB})})
    fake.run_app(4343, {10: (30.0, {"tensors": GIB})})
    fake.set_ecc_corrected(3, "mem", 5)
    fake.set_ecc_corrected(3, "sram", 2)
    fake.set_ecc(3, "mem", 1)
    sample = await sampled(neuron, lambda s: len(s.processes) == 2, "both applications reported")
    usage = by_index(sample)
    assert usage[3].compute_utilization == pytest.approx(0.75)
    assert usage[3].engines == {"neuroncore6": 0.5, "neuroncore7": 1.0}
    assert usage[5].compute_utilization == pytest.approx(0.15)
    assert usage[0].compute_utilization == 0.0  # no application there: idle, known
    assert usage[3].ecc_errors == {"corrected": 7, "uncorrected": 1}  # uncorrected: the driver's sysfs
    # The driver's counters keep flowing beside the monitor's figures.
    assert (
        usage[3].memory_used_bytes == 2 * GIB + 256 * MIB
        and usage[3].memory_by_category["tensors"] == 2 * GIB
    )
    uuid = {u.index: u.uuid for u in sample.devices}
    processes = {(p.uuid, p.pid): p for p in sample.processes}
    assert processes[(uuid[3], 4242)].memory_used_bytes == 2 * GIB + 256 * MIB
    assert processes[(uuid[3], 4242)].compute_utilization == pytest.approx(0.75)
    assert processes[(uuid[5], 4343)].memory_used_bytes == GIB
    assert processes[(uuid[5], 4343)].compute_utilization == pytest.approx(0.15)
    # neuron-monitor reports no power and no temperature: absent, not zero.
    assert usage[3].power_watts is None and usage[3].temperature_celsius is None

    fake.end_app(4242)
    sample = await sampled(neuron, lambda s: len(s.processes) == 1, "the ended application gone")
    assert by_index(sample)[3].compute_utilization == 0.0


async def test_logical_cores_are_numbered_per_device_as_the_monitor_numbers_them(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]],
) -> None:
    """Trainium2 at LNC 2: 4 logical cores per device, so logical core 5 is device 1's second."""
    fake, neuron = machines("trn2-48xl-tools")
    fake.run_app(7, {5: (80.0, {"tensors": GIB})})
    sample = await sampled(neuron, lambda s: bool(s.processes), "the application reported")
    usage = by_index(sample)
    assert usage[1].compute_utilization == pytest.approx(0.2)
    assert usage[1].engines["neuroncore5"] == 0.8 and len(usage[1].engines) == 4
    assert [(p.uuid, p.memory_used_bytes) for p in sample.processes] == [(usage[1].uuid, GIB)]


async def test_without_neuron_monitor_the_sysfs_figures_alone(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]],
) -> None:
    fake, neuron = machines("trn1-32xl")  # aws-neuronx-tools not installed
    fake.set_memory(2, 0, {"tensors": GIB})
    with capture_logs() as logs:
        sample = neuron.sample()
    assert by_index(sample)[2].memory_used_bytes == GIB
    assert by_index(sample)[2].compute_utilization is None and not sample.processes
    assert neuron._monitor is None and not logs  # auto: nothing to say where it is not installed


async def test_enabled_but_missing_or_disabled(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]],
) -> None:
    _, missing = machines("trn1-32xl", enabled=True)
    with capture_logs() as logs:
        missing.sample()
        missing.sample()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "telemetry: neuronMonitor.enabled is true but neuron-monitor is not installed (not at "
        "<hostRoot>/opt/aws/neuron/bin/neuron-monitor nor on PATH); set neuronMonitor.path. NeuronCore utilization "
        "and per-process memory are absent"
    ]
    fake, off = machines("trn1-32xl-tools", enabled=False)
    fake.run_app(1, {0: (10.0, {})})
    assert by_index(off.sample())[0].compute_utilization is None
    assert not fake_neuron_monitor.starts(fake.root)


@pytest.mark.parametrize("fault", ["exit", "garbage"])
async def test_a_failing_monitor_logs_once_keeps_sysfs_and_is_restarted(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(monitor, "RESTART_INITIAL_S", 0.2)
    fake, neuron = machines("trn1-32xl-tools")
    fake.run_app(4242, {0: (40.0, {"tensors": GIB})})
    await sampled(neuron, lambda s: by_index(s)[0].compute_utilization is not None, "a first report")
    with capture_logs() as logs:
        fake.monitor_fault(fault)  # type: ignore[arg-type]
        sample = await sampled(
            neuron, lambda s: by_index(s)[0].compute_utilization is None, "the monitor's figures dropped"
        )
        assert by_index(sample)[0].memory_used_bytes == GIB and not sample.processes  # sysfs still flows
        await wait_until(lambda: len(fake_neuron_monitor.starts(fake.root)) >= 3, timeout=20, what="restarts")
        fake.monitor_fault(None)
        sample = await sampled(neuron, lambda s: bool(s.processes), "reports again after the fault")
    assert by_index(sample)[0].compute_utilization == pytest.approx(0.2)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == [NOT_REPORTING], warnings  # one line, however many restarts
    # one line although each start's message differs (its PID): logged by the kind of problem
    expected = "exited with code 1: neuron-monitor[" if fault == "exit" else "not its JSON report"
    assert expected in warnings[0]["problem"]
    assert [e["event"] for e in logs if e["log_level"] == "info"] == [
        "telemetry: neuron-monitor reporting again"
    ]


async def test_a_monitor_that_cannot_start_is_one_line(
    machines: Callable[..., tuple[FakeNeuron, NeuronBackend]],
) -> None:
    with capture_logs() as logs:
        _, neuron = machines("trn1-32xl", path="/nonexistent/neuron-monitor")
        neuron.sample()
        await wait_until(lambda: any(e["log_level"] == "warning" for e in logs), what="the warning")
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["problem"] == "cannot be started: No such file or directory"
    assert by_index(neuron.sample())[0].memory_used_bytes == 0


async def test_close_stops_the_child(machines: Callable[..., tuple[FakeNeuron, NeuronBackend]]) -> None:
    fake, neuron = machines("trn1-32xl-tools")
    await sampled(neuron, lambda s: by_index(s)[0].compute_utilization is not None, "a first report")
    (pid,) = fake_neuron_monitor.starts(fake.root)
    neuron.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone and reaped
    assert by_index(neuron.sample())[0].compute_utilization is None  # a closed backend starts no new one
    assert len(fake_neuron_monitor.starts(fake.root)) == 1


def test_the_config_asks_for_the_groups_kxpu_reads() -> None:
    assert monitor_config(10) == {
        "period": "10s",
        "neuron_runtimes": [
            {"tag_filter": ".*", "metrics": [{"type": "neuroncore_counters"}, {"type": "memory_used"}]}
        ],
        "system_metrics": [{"type": "neuron_hw_counters"}],
    }


def test_reports_that_are_not_neuron_monitors_are_named() -> None:
    with pytest.raises(ReportError, match="no neuron_runtime_data list"):
        read_report({"hello": 1}, 2)
    bad = {"neuron_runtime_data": [{"pid": 3, "report": {"neuroncore_counters": {"neuroncores_in_use": []}}}]}
    with pytest.raises(ReportError, match="not an object keyed by NeuronCore index"):
        read_report(bad, 2)
    bad = {
        "neuron_runtime_data": [
            {
                "pid": 3,
                "report": {
                    "neuroncore_counters": {"neuroncores_in_use": {"0": {"neuroncore_utilization": "x"}}}
                },
            }
        ]
    }
    with pytest.raises(ReportError, match="not a number"):
        read_report(bad, 2)


def test_an_application_the_monitor_cannot_read_makes_utilization_unknown_not_zero() -> None:
    """A group with an error leaves out the figures it would have given: the devices the application holds (from
    its memory) have no utilization; with no memory known either, no device has one."""
    memory = {
        "neuron_runtime_used_bytes": {"usage_breakdown": {"neuroncore_memory_usage": {"2": {"tensors": 5}}}}
    }
    doc = {
        "neuron_runtime_data": [
            {
                "pid": 9,
                "error": "",
                "report": {"neuroncore_counters": {"error": "timeout"}, "memory_used": memory},
            }
        ]
    }
    figures = read_report(doc, 2)
    assert figures.utilization(1) is None and figures.utilization(0) == 0.0
    assert figures.processes == ((1, 9, 5, None),)
    unreadable = {"neuron_runtime_data": [{"pid": 0, "error": "failed to connect", "report": None}]}
    assert read_report(unreadable, 2).utilization(0) is None


async def test_the_daemon_exports_the_monitors_figures_and_stops_it_with_the_resource(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    """A daemon process over the fake tree (``--import kxpu.testing.fake_neuron``): /metrics carries NeuronCore
    utilization and the driver's power share with the neuron vendor label; on SIGTERM the monitor child goes too."""
    fake = FakeNeuron("trn1-32xl-tools")
    try:
        fake.run_app(4242, {6: (50.0, {"tensors": GIB}), 7: (100.0, {})})
        fake.set_power(3, 61.0)
        resource = {"name": "aws.amazon.com/neuron", "neuron": {"neuronMonitor": {"periodSeconds": 1}}}
        config = write_config(
            [resource],
            telemetry={"enabled": True, "intervalSeconds": 1, "hostRoot": str(workdir)},
            podResourcesSocket=str(workdir / "no-pod-resources.sock"),
        )
        daemon = await daemons(config, env={"KXPU_FAKE_NEURON": str(fake.root)})
        await kubelet.wait_registered("aws.amazon.com/neuron")
        uuid = fake.serial(3)
        labels = {"resource": "aws.amazon.com/neuron", "device": uuid, "uuid": uuid, "vendor": "neuron"}
        text = ""

        async def exported() -> bool:
            nonlocal text
            text = (await daemon.http_get("/metrics"))[1]
            return metric(text, "kxpu_device_compute_utilization_ratio", **labels) is not None

        deadline = asyncio.get_running_loop().time() + 30
        while not await exported():
            assert asyncio.get_running_loop().time() < deadline, daemon.log_text()[-3000:]
            await asyncio.sleep(0.1)
        assert metric(text, "kxpu_device_compute_utilization_ratio", **labels) == 0.75
        assert metric(text, "kxpu_device_engine_utilization_ratio", **labels, engine="neuroncore7") == 1.0
        assert metric(text, "kxpu_device_power_utilization_ratio", **labels) == 0.61
        assert metric(text, "kxpu_device_processes", **labels) == 1
        (child,) = fake_neuron_monitor.starts(fake.root)
        assert await daemon.stop() == 0
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        fake.cleanup()

"""neuron-monitor (aws-neuronx-tools) as a second, optional source of Neuron telemetry.

The driver's sysfs (``telemetry.py``) keeps memory and ECC counts, not how busy a NeuronCore is nor which process
holds what: those are the Neuron runtime's, inside each application, and only ``neuron-monitor`` collects them. Where
it is installed, the backend runs it as one long-lived child (``neuron-monitor -c <config>``) whose config asks for
the runtime groups ``neuroncore_counters`` and ``memory_used`` and the system group ``neuron_hw_counters`` at
``neuronMonitor.periodSeconds``; it prints one JSON report per line on stdout.

Facts (AWS, aws-neuron-sdk ``tools/neuron-sys-tools/neuron-monitor-user-guide.rst``): config keys ``period`` (``"1s"``),
``neuron_runtimes`` (``tag_filter``, ``metrics`` of ``{"type": …}``) and ``system_metrics``; a report has
``neuron_runtime_data`` (per application: ``pid``, ``neuron_runtime_tag``, ``error``, ``report`` with the runtime
groups), ``system_data`` (the system groups) and ``neuron_hardware_info`` (``neuroncore_per_device_count``, …); every
group carries ``period`` and ``error``. ``neuroncore_counters.neuroncores_in_use`` maps a NeuronCore index (logical,
numbered across devices) to ``neuroncore_utilization`` in percent over the period; ``memory_used.
neuron_runtime_used_bytes.usage_breakdown.neuroncore_memory_usage`` maps a core to device bytes by category;
``neuron_hw_counters.neuron_devices`` lists per device ``mem_ecc_corrected``, ``mem_ecc_uncorrected``,
``sram_ecc_corrected``, ``sram_ecc_uncorrected``. neuron-monitor reports no power and no temperature.

A child that cannot start, exits, or prints something that is not a report is logged on one line (once until it
reports again), stopped, and started again with backoff; meanwhile the sysfs figures keep flowing and the monitor's
figures are absent, never stale: a report older than a few periods is dropped.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from pydantic import Field

from kxpu.backends.registry import BackendConfig
from kxpu.backoff import Backoff
from kxpu.logs import get_logger

if TYPE_CHECKING:
    import subprocess

log = get_logger("kxpu.backends.neuron")

MONITOR_NAME = "neuron-monitor"
MONITOR_PATH = "/opt/aws/neuron/bin/neuron-monitor"  # where the aws-neuronx-tools package installs it
RUNTIME_GROUPS = ("neuroncore_counters", "memory_used")
SYSTEM_GROUPS = ("neuron_hw_counters",)
RESTART_INITIAL_S, RESTART_MAX_S = 1.0, 60.0  # backoff between starts of a child that failed
STALE_PERIODS = 3  # a report older than this many periods (and 10 s) is dropped: the child hangs


class NeuronMonitorConfig(BackendConfig):
    enabled: bool | Literal["auto"] = Field(
        default="auto",
        description="run neuron-monitor for NeuronCore utilization, per-process memory and corrected ECC counts; "
        "auto: when it is installed",
    )
    path: Path | None = Field(
        default=None,
        description="the neuron-monitor binary; default: <hostRoot>/opt/aws/neuron/bin/neuron-monitor, "
        "else neuron-monitor on PATH",
    )
    period_seconds: int = Field(
        default=10, ge=1, le=3600, description="its report period (match telemetry.intervalSeconds)"
    )


def monitor_config(period_seconds: int) -> dict[str, Any]:
    """The config file neuron-monitor is started with: the groups kxpu reads, for every application."""
    return {
        "period": f"{period_seconds}s",
        "neuron_runtimes": [{"tag_filter": ".*", "metrics": [{"type": t} for t in RUNTIME_GROUPS]}],
        "system_metrics": [{"type": t} for t in SYSTEM_GROUPS],
    }


def find_monitor(config: NeuronMonitorConfig, host_path: Callable[[str], Path]) -> str | None:
    """The binary to run, or None (off, or not installed). ``host_path`` maps a host path under hostRoot."""
    if config.enabled is False:
        return None
    if config.path is not None:
        return str(config.path)  # a pinned path that does not run is reported when it fails to start
    installed = host_path(MONITOR_PATH)
    if os.access(installed, os.X_OK):
        return str(installed)
    return shutil.which(MONITOR_NAME)


class ReportError(ValueError):
    """A line neuron-monitor printed that is not its JSON report."""


@dataclass(frozen=True, slots=True)
class MonitorFigures:
    """What one report says, per Neuron device index (ratios 0..1)."""

    cores_per_device: int
    core_utilization: Mapping[int, float] = field(
        default_factory=dict
    )  # global core index → ratio, cores in use
    unknown_devices: frozenset[int] | None = frozenset()  # utilization unknown there (None: everywhere)
    processes: tuple[
        tuple[int, int, int | None, float | None], ...
    ] = ()  # device, pid, memory bytes, compute
    ecc: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # device → corrected/uncorrected

    def utilization(self, device: int) -> float | None:
        if self.unknown_devices is None or device in self.unknown_devices:
            return None
        first = device * self.cores_per_device
        cores = range(first, first + self.cores_per_device)
        return sum(self.core_utilization.get(c, 0.0) for c in cores) / self.cores_per_device

    def cores(self, device: int) -> dict[int, float]:
        """Per NeuronCore of ``device`` (global index → ratio); empty where the device's utilization is unknown."""
        if self.utilization(device) is None:
            return {}
        first = device * self.cores_per_device
        return {c: self.core_utilization.get(c, 0.0) for c in range(first, first + self.cores_per_device)}


def _group(report: Mapping[str, Any], name: str, where: str) -> Mapping[str, Any] | None:
    """A metric group that was collected without error, else None."""
    group = report.get(name)
    if group is None:
        return None
    if not isinstance(group, dict):
        raise ReportError(f"{where}.{name} is {type(group).__name__}, not an object")
    return None if group.get("error") else group


def _index_map(value: object, where: str) -> dict[int, Any]:
    if not isinstance(value, dict):
        raise ReportError(f"{where} is {type(value).__name__}, not an object keyed by NeuronCore index")
    try:
        return {int(k): v for k, v in value.items()}
    except ValueError:
        raise ReportError(f"{where} has a key that is not a NeuronCore index: {sorted(value)[:3]}") from None


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReportError(f"{where} is {value!r}, not a number")
    return float(value)


def read_report(doc: object, cores_per_device: int) -> MonitorFigures:
    """Per-device figures from one parsed report. ``cores_per_device``: the backend's (logical NeuronCores per device),
    used where the report's ``neuron_hardware_info`` does not say. ReportError on a shape that is not neuron-monitor's."""
    if not isinstance(doc, dict) or not isinstance(doc.get("neuron_runtime_data"), list):
        raise ReportError("not a neuron-monitor report (no neuron_runtime_data list)")
    hardware = doc.get("neuron_hardware_info")
    per_device = hardware.get("neuroncore_per_device_count") if isinstance(hardware, dict) else None
    if isinstance(per_device, int) and not isinstance(per_device, bool) and per_device > 0:
        cores_per_device = per_device
    busy: dict[int, float] = {}
    unknown: set[int] | None = set()
    per_process: dict[tuple[int, int], list[float | None]] = {}  # (device, pid) → [memory, compute]
    for n, entry in enumerate(doc["neuron_runtime_data"]):
        where = f"neuron_runtime_data[{n}]"
        if not isinstance(entry, dict):
            raise ReportError(f"{where} is {type(entry).__name__}, not an object")
        pid = entry.get("pid")
        report = entry.get("report")
        if not isinstance(report, dict) or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            if unknown is not None and entry.get("error"):
                unknown = None  # an application the monitor could not read: whose cores it holds is unknown
            continue
        memory_devices: set[int] = set()
        if (used := _group(report, "memory_used", f"{where}.report")) is not None:
            breakdown = (used.get("neuron_runtime_used_bytes") or {}).get("usage_breakdown") or {}
            cores = _index_map(breakdown.get("neuroncore_memory_usage", {}), f"{where}.memory_used")
            for core, categories in cores.items():
                if not isinstance(categories, dict):
                    raise ReportError(f"{where}.memory_used core {core} is not an object of categories")
                device = core // cores_per_device
                total = sum(int(_number(v, f"{where}.memory_used core {core}")) for v in categories.values())
                slot = per_process.setdefault((device, pid), [None, None])
                slot[0] = (slot[0] or 0) + total
                memory_devices.add(device)
        counters = _group(report, "neuroncore_counters", f"{where}.report")
        if counters is None:
            if "neuroncore_counters" in report and unknown is not None:
                unknown |= (
                    memory_devices  # its counters failed: the devices it holds have no known utilization
                )
                if not memory_devices:
                    unknown = None
            continue
        in_use = _index_map(counters.get("neuroncores_in_use", {}), f"{where}.neuroncore_counters")
        for core, data in in_use.items():
            if not isinstance(data, dict):
                raise ReportError(f"{where}.neuroncore_counters core {core} is not an object")
            ratio = min(
                max(_number(data.get("neuroncore_utilization", 0), f"core {core} utilization"), 0.0), 100.0
            )
            busy[core] = min(busy.get(core, 0.0) + ratio / 100, 1.0)
            slot = per_process.setdefault((core // cores_per_device, pid), [None, None])
            slot[1] = (slot[1] or 0.0) + ratio / 100 / cores_per_device
    ecc: dict[int, dict[str, int]] = {}
    system = doc.get("system_data")
    if isinstance(system, dict) and (hw := _group(system, "neuron_hw_counters", "system_data")) is not None:
        for n, counts in enumerate(hw.get("neuron_devices") or []):
            if not isinstance(counts, dict) or not isinstance(counts.get("neuron_device_index"), int):
                raise ReportError(f"neuron_hw_counters.neuron_devices[{n}] has no neuron_device_index")
            figures = {}
            for kind in ("corrected", "uncorrected"):
                keys = [k for k in (f"mem_ecc_{kind}", f"sram_ecc_{kind}") if k in counts]
                if keys:
                    figures[kind] = sum(int(_number(counts[k], f"neuron_hw_counters {k}")) for k in keys)
            ecc[counts["neuron_device_index"]] = figures
    processes = tuple(
        (device, pid, None if m is None else int(m), c)
        for (device, pid), (m, c) in sorted(per_process.items())
    )
    return MonitorFigures(
        cores_per_device, busy, None if unknown is None else frozenset(unknown), processes, ecc
    )


class NeuronMonitor:
    """One neuron-monitor child, kept running by a thread; ``latest()`` is its last report's figures, if fresh."""

    def __init__(self, binary: str, period_seconds: int, cores_per_device: Callable[[], int]) -> None:
        self.binary = binary
        self.period_seconds = period_seconds
        self.cores_per_device = cores_per_device
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._figures: MonitorFigures | None = None
        self._at = 0.0
        self._process: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._dir: str | None = None
        self._reported: str | None = None  # the kind of problem last logged, until a report arrives again
        self._reporting = False

    def start(self) -> None:
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="kxpu-neuron-monitor-")
        Path(self._dir, "monitor.conf").write_text(json.dumps(monitor_config(self.period_seconds)))
        self._thread = threading.Thread(target=self._supervise, name="kxpu-neuron-monitor", daemon=True)
        self._thread.start()

    def latest(self) -> MonitorFigures | None:
        with self._lock:
            fresh = time.monotonic() - self._at <= max(STALE_PERIODS * self.period_seconds, 10.0)
            return self._figures if fresh else None

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
        if self._thread is not None:
            self._thread.join(10)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _supervise(self) -> None:
        backoff = Backoff(initial=RESTART_INITIAL_S, maximum=RESTART_MAX_S)
        while not self._stop.is_set():
            try:
                problem = self._run_once(backoff)
            except Exception as exc:  # never let a surprise end the supervision: the next start may do better
                problem = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._figures = None
            if self._stop.is_set():
                return
            delay = backoff.next_delay()
            kind = problem.split(":", 1)[0].split(" with code")[0]  # its message may vary from run to run
            if kind != self._reported:
                self._reported, self._reporting = kind, False
                log.warning(
                    "telemetry: neuron-monitor is not reporting; NeuronCore utilization and per-process memory "
                    "are absent until it does (the driver's sysfs figures are unaffected)",
                    monitor=self.binary,
                    problem=problem,
                    retry_in_s=delay,
                )
            self._stop.wait(delay)

    def _run_once(self, backoff: Backoff) -> str:
        """Run one child until it ends or misbehaves; returns the one-line problem."""
        import subprocess

        assert self._dir is not None
        errors = Path(self._dir, "stderr")
        with errors.open("wb") as stderr:
            try:
                process = subprocess.Popen(
                    [self.binary, "-c", str(Path(self._dir, "monitor.conf"))],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                )
            except OSError as exc:
                return f"cannot be started: {exc.strerror or exc}"
        with self._lock:
            self._process = process
        if self._stop.is_set():  # closed while it was starting: close() did not see this child
            process.terminate()
        try:
            problem = self._read(process.stdout, backoff)  # type: ignore[arg-type]
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
            if process.stdout is not None:
                process.stdout.close()
        if problem is None:
            tail = errors.read_bytes()[-400:].decode(errors="replace").strip().splitlines()
            problem = f"exited with code {process.returncode}" + (f": {tail[-1][:200]}" if tail else "")
        return problem

    def _read(self, stdout: IO[bytes], backoff: Backoff) -> str | None:
        for line in stdout:
            if self._stop.is_set():
                return "stopped"
            if not line.strip():
                continue
            try:
                figures = read_report(json.loads(line), self.cores_per_device())
            except (ValueError, TypeError, AttributeError) as exc:
                return f"printed something that is not its JSON report: {str(exc)[:200]}"
            with self._lock:
                self._figures, self._at = figures, time.monotonic()
            backoff.reset()
            if not self._reporting:
                self._reporting = True
                if self._reported is not None:
                    log.info("telemetry: neuron-monitor reporting again", monitor=self.binary)
                else:
                    log.info(
                        "telemetry: reading NeuronCore utilization from neuron-monitor", monitor=self.binary
                    )
                self._reported = None
        return None

"""Telemetry on /metrics: device and per-container figures from the sampler's latest snapshot.

The gauges are produced at scrape time by one collector from one immutable snapshot, so a device or
container that is gone simply stops being exported (nothing stale to remove). Names and labels are
listed in METRIC_NAMES and LABELS for the Grafana dashboard's test. Per-container series carry
``namespace``, ``pod`` and ``container`` labels (as kube-state-metrics and dcgm-exporter do): scrape
with ``honorLabels: true`` so Prometheus keeps them rather than renaming them ``exported_*``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kxpu.daemon.telemetry_snapshot import Snapshot

# `device` is the physical device's UUID (telemetry measures devices, not the kubelet's IDs for their replicas or
# shares); `uuid` repeats it under the name kxpu_device_health also carries beside its kubelet device ID, so that
# health and telemetry join: `kxpu_device_health * on (resource, uuid) group_left (model) kxpu_device_info`.
DEVICE = ["resource", "device", "uuid", "vendor"]
CONTAINER = ["resource", "device", "uuid", "namespace", "pod", "container", "claim"]
HOLDER = ["resource", "device", "uuid", "namespace", "pod", "container", "claim"]


def series(key: Sequence[str]) -> list[str]:
    """The label values of a ``(resource, device UUID, ...)`` key in the order above (``uuid`` third)."""
    return [key[0], key[1], key[1], *key[2:]]


ERRORS = Counter("kxpu_telemetry_errors", "Telemetry sources that could not be read, by source", ["source"])
SAMPLE_SECONDS = Histogram(
    "kxpu_telemetry_sample_duration_seconds",
    "Time one telemetry tick took (every backend sampled, processes tied to pods)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
)
EXCEEDED = Counter(
    "kxpu_container_grant_exceeded",
    "Times a container went above its grant (memory, compute) on a device",
    [*CONTAINER, "kind"],
)

# name → (help, type, labels) of what the collector yields
FAMILIES: dict[str, tuple[str, str, list[str]]] = {
    "kxpu_device_info": ("A device the daemon samples (value 1)", "gauge", [*DEVICE, "index", "model"]),
    "kxpu_device_compute_utilization_ratio": (
        "Share of the last sample period a kernel ran on the device",
        "gauge",
        DEVICE,
    ),
    "kxpu_device_memory_bandwidth_utilization_ratio": (
        "Share of the last sample period device memory was read or written",
        "gauge",
        DEVICE,
    ),
    "kxpu_device_memory_used_bytes": ("Device memory in use", "gauge", DEVICE),
    "kxpu_device_memory_total_bytes": ("Device memory in total", "gauge", DEVICE),
    "kxpu_device_power_watts": ("Power draw", "gauge", DEVICE),
    "kxpu_device_power_utilization_ratio": (
        "Power draw as a share of the device's maximum, where the driver reports no watts (Neuron)",
        "gauge",
        DEVICE,
    ),
    "kxpu_device_temperature_celsius": ("Temperature", "gauge", DEVICE),
    "kxpu_device_clock_hertz": ("Current clock frequency", "gauge", [*DEVICE, "clock"]),
    "kxpu_device_ecc_errors": ("ECC errors since the driver loaded", "counter", [*DEVICE, "type"]),
    "kxpu_device_xid_errors": ("Xid errors seen since the backend started", "counter", [*DEVICE, "xid"]),
    "kxpu_device_sensor_temperature_celsius": (
        "Other temperature sensors of the device (junction, memory, …)",
        "gauge",
        [*DEVICE, "sensor"],
    ),
    "kxpu_device_engine_utilization_ratio": (
        "Share of the last sample period an engine of the device was busy (vendor-specific engines)",
        "gauge",
        [*DEVICE, "engine"],
    ),
    "kxpu_device_memory_category_bytes": (
        "Device memory in use by category (vendor-specific: code, tensors, …)",
        "gauge",
        [*DEVICE, "category"],
    ),
    "kxpu_device_health_code": ("The vendor's own health value (Ascend DCMI: 0 is healthy)", "gauge", DEVICE),
    "kxpu_device_energy_joules": ("Energy the device used since the driver loaded", "counter", DEVICE),
    "kxpu_device_pcie_throughput_bytes_per_second": (
        "PCIe throughput over the driver's last short sample (direction: tx, rx)",
        "gauge",
        [*DEVICE, "direction"],
    ),
    "kxpu_device_remapped_rows": (
        "Memory rows remapped since the driver loaded (cause: correctable, uncorrectable errors)",
        "gauge",
        [*DEVICE, "cause"],
    ),
    "kxpu_device_row_remap": (
        "1 while a row remap is pending, or has failed (state)",
        "gauge",
        [*DEVICE, "state"],
    ),
    "kxpu_device_nvlink_bytes": (
        "Data bytes over the device's active NVLinks since the driver loaded (direction: tx, rx)",
        "counter",
        [*DEVICE, "direction"],
    ),
    "kxpu_device_profiling_ratio": (
        "Profiling counters over the last sample period, 0..1 (counter: sm_active, tensor_active, dram_active, …)",
        "gauge",
        [*DEVICE, "counter"],
    ),
    "kxpu_device_clock_event_reason": (
        "1 while this reason holds the device's clocks down (reason: sw_power_cap, hw_slowdown, …)",
        "gauge",
        [*DEVICE, "reason"],
    ),
    "kxpu_device_processes": ("Processes with a context on the device", "gauge", DEVICE),
    "kxpu_device_holder_info": (
        "A container holding the device, through the device plugin or a DRA claim (value 1)",
        "gauge",
        HOLDER,
    ),
    "kxpu_container_processes": ("A container's processes on a device", "gauge", CONTAINER),
    "kxpu_container_memory_used_bytes": ("Device memory a container's processes use", "gauge", CONTAINER),
    "kxpu_container_compute_utilization_ratio": (
        "Share of the device's compute a container's processes used in the last sample period",
        "gauge",
        CONTAINER,
    ),
    "kxpu_container_memory_granted_bytes": ("Device memory the container was granted", "gauge", CONTAINER),
    "kxpu_container_compute_granted_ratio": (
        "Share of the device's compute the container was granted",
        "gauge",
        CONTAINER,
    ),
    "kxpu_container_over_grant": (
        "1 while a container uses more than its grant (kind: memory, compute)",
        "gauge",
        [*CONTAINER, "kind"],
    ),
}

METRIC_NAMES = frozenset(
    {
        *FAMILIES,
        "kxpu_telemetry_errors",
        "kxpu_telemetry_sample_duration_seconds",
        "kxpu_container_grant_exceeded",
    }
)
LABELS = {name: labels for name, (_, _, labels) in FAMILIES.items()}


class TelemetryCollector(Collector):
    def __init__(self) -> None:
        self.source: Callable[[], Snapshot] | None = None  # the running sampler's latest snapshot

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Any] = {
            name: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=labels)
            for name, (text, kind, labels) in FAMILIES.items()
        }
        snap = self.source() if self.source is not None else None
        if snap is not None:
            self._fill(families, snap)
        yield from families.values()

    @staticmethod
    def _fill(f: dict[str, Any], snap: Snapshot) -> None:
        processes: dict[tuple[str, str], int] = {}
        for view in snap.processes:
            key = (view.resource, view.usage.uuid)
            processes[key] = processes.get(key, 0) + 1
        for resource, d in snap.devices:
            labels = series([resource, d.uuid, d.vendor or ""])
            f["kxpu_device_info"].add_metric(
                [*labels, "" if d.index is None else str(d.index), d.model or ""], 1
            )
            for name, value in (
                ("kxpu_device_compute_utilization_ratio", d.compute_utilization),
                ("kxpu_device_memory_bandwidth_utilization_ratio", d.memory_bandwidth_utilization),
                ("kxpu_device_memory_used_bytes", d.memory_used_bytes),
                ("kxpu_device_memory_total_bytes", d.memory_total_bytes),
                ("kxpu_device_power_watts", d.power_watts),
                ("kxpu_device_power_utilization_ratio", d.power_utilization),
                ("kxpu_device_temperature_celsius", d.temperature_celsius),
            ):
                if value is not None:
                    f[name].add_metric(labels, value)
            for sensor, celsius in sorted(d.temperatures_celsius.items()):
                f["kxpu_device_sensor_temperature_celsius"].add_metric([*labels, sensor], celsius)
            for engine, ratio in sorted(d.engines.items()):
                f["kxpu_device_engine_utilization_ratio"].add_metric([*labels, engine], ratio)
            for category, size in sorted(d.memory_by_category.items()):
                f["kxpu_device_memory_category_bytes"].add_metric([*labels, category], size)
            if d.health_code is not None:
                f["kxpu_device_health_code"].add_metric(labels, d.health_code)
            if d.energy_joules is not None:
                f["kxpu_device_energy_joules"].add_metric(labels, d.energy_joules)
            for direction, rate in sorted(d.pcie_bytes_per_second.items()):
                f["kxpu_device_pcie_throughput_bytes_per_second"].add_metric([*labels, direction], rate)
            for cause, rows in sorted(d.remapped_rows.items()):
                f["kxpu_device_remapped_rows"].add_metric([*labels, cause], rows)
            for state, on in sorted(d.row_remap.items()):
                f["kxpu_device_row_remap"].add_metric([*labels, state], int(on))
            for direction, size in sorted(d.nvlink_bytes.items()):
                f["kxpu_device_nvlink_bytes"].add_metric([*labels, direction], size)
            for counter, ratio in sorted(d.profiling.items()):
                f["kxpu_device_profiling_ratio"].add_metric([*labels, counter], ratio)
            for reason, on in sorted(d.clock_event_reasons.items()):
                f["kxpu_device_clock_event_reason"].add_metric([*labels, reason], int(on))
            for clock, hz in sorted(d.clocks_hz.items()):
                f["kxpu_device_clock_hertz"].add_metric([*labels, clock], hz)
            for kind, count in sorted(d.ecc_errors.items()):
                f["kxpu_device_ecc_errors"].add_metric([*labels, kind], count)
            for xid, count in sorted(d.xid_errors.items()):
                f["kxpu_device_xid_errors"].add_metric([*labels, str(xid)], count)
            f["kxpu_device_processes"].add_metric(labels, processes.get((resource, d.uuid), 0))
        for h in snap.holders:
            for uuid in sorted(h.uuids):
                f["kxpu_device_holder_info"].add_metric(
                    series([h.resource, uuid, h.namespace, h.pod, h.container, h.claim]), 1
                )
        for c in snap.containers:
            labels = series(c.key)
            f["kxpu_container_processes"].add_metric(labels, len(c.pids))
            if c.memory_used_bytes is not None:
                f["kxpu_container_memory_used_bytes"].add_metric(labels, c.memory_used_bytes)
            if c.compute_utilization is not None:
                f["kxpu_container_compute_utilization_ratio"].add_metric(labels, c.compute_utilization)
            if c.grant is not None and c.grant.memory_bytes is not None:
                f["kxpu_container_memory_granted_bytes"].add_metric(labels, c.grant.memory_bytes)
            if c.grant is not None and c.grant.compute_ratio is not None:
                f["kxpu_container_compute_granted_ratio"].add_metric(labels, c.grant.compute_ratio)
            if c.grant is not None:
                for kind in ("memory", "compute"):
                    f["kxpu_container_over_grant"].add_metric(
                        [*labels, kind], int((c.key, kind) in snap.over)
                    )


def count_exceeded(key: tuple[str, str, str, str, str, str], kind: str) -> None:
    EXCEEDED.labels(*series(key), kind).inc()


def forget_exceeded(key: tuple[str, str, str, str, str, str], kind: str) -> None:
    with contextlib.suppress(KeyError):
        EXCEEDED.remove(*series(key), kind)


COLLECTOR = TelemetryCollector()
REGISTRY.register(COLLECTOR)

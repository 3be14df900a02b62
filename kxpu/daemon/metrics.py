"""Prometheus metrics of the node daemon. Names are documented in the README; the Grafana
dashboard test checks it uses only names listed in METRIC_NAMES. Made once the daemon has registered
(``kxpu.daemon.late_metrics``): what they are given before that is kept and replayed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from kxpu.daemon.late_metrics import LateMetric
from kxpu.model import Device

# Allocate is sub-millisecond when healthy; the tail matters.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# `device` is the kubelet's device ID; `uuid` the physical device's (its UUID, else the ID), the label telemetry
# series carry too, so that the two join on (resource, uuid) (docs/telemetry.md).
DEVICE_HEALTH = LateMetric(
    "Gauge", "kxpu_device_health", "1 if the device is healthy, 0 if not", ["resource", "device", "uuid"]
)
RESOURCE_DEVICES = LateMetric(
    "Gauge", "kxpu_resource_devices", "Devices of a resource as the kubelet sees them", ["resource", "state"]
)
RESOURCE_REGISTERED = LateMetric(
    "Gauge", "kxpu_resource_registered", "1 while registered with the kubelet", ["resource"]
)
REGISTRATIONS = LateMetric(
    "Counter", "kxpu_registrations", "Successful registrations with the kubelet", ["resource"]
)
KUBELET_RESTARTS = LateMetric("Counter", "kxpu_kubelet_restarts", "Times kubelet.sock was seen re-created")
ALLOCATE_SECONDS = LateMetric(
    "Histogram",
    "kxpu_allocate_duration_seconds",
    "Allocate handling time",
    ["resource"],
    buckets=_LATENCY_BUCKETS,
)
ALLOCATE_ERRORS = LateMetric(
    "Counter", "kxpu_allocate_errors", "Allocate calls refused or failed", ["resource", "code"]
)
PREFERRED_SECONDS = LateMetric(
    "Histogram",
    "kxpu_preferred_allocation_duration_seconds",
    "GetPreferredAllocation handling time",
    ["resource"],
    buckets=_LATENCY_BUCKETS,
)
HEALTH_EVENTS = LateMetric(
    "Counter",
    "kxpu_health_events",
    "Devices that turned unhealthy or disappeared, by cause",
    ["resource", "cause"],
)
RESOURCE_FAILURES = LateMetric(
    "Counter", "kxpu_resource_failures", "Backend or server failures (retried)", ["resource"]
)

METRIC_NAMES = frozenset(
    {
        "kxpu_device_health",
        "kxpu_resource_devices",
        "kxpu_resource_registered",
        "kxpu_registrations",
        "kxpu_kubelet_restarts",
        "kxpu_allocate_duration_seconds",
        "kxpu_allocate_errors",
        "kxpu_preferred_allocation_duration_seconds",
        "kxpu_health_events",
        "kxpu_resource_failures",
    }
)


def observe_devices(resource: str, devices: Iterable[Device], previous: Mapping[str, Device]) -> None:
    """Update device gauges after a snapshot change, and count what turned bad."""
    current = {d.id: d for d in devices}
    for device_id, device in current.items():
        before = previous.get(device_id)
        if before is not None and _uuid(before) != _uuid(device):
            _forget_health(resource, before)
        DEVICE_HEALTH.labels(resource, device_id, _uuid(device)).set(1 if device.healthy else 0)
        if not device.healthy and (before is None or before.healthy):
            HEALTH_EVENTS.labels(resource, device.health_reason or "unknown").inc()
    for device_id in previous.keys() - current.keys():
        _forget_health(resource, previous[device_id])
        HEALTH_EVENTS.labels(resource, "removed").inc()
    RESOURCE_DEVICES.labels(resource, "capacity").set(len(current))
    RESOURCE_DEVICES.labels(resource, "allocatable").set(sum(d.healthy for d in current.values()))


def _uuid(device: Device) -> str:
    return device.uuid or device.id


def _forget_health(resource: str, device: Device) -> None:
    with contextlib.suppress(KeyError):
        DEVICE_HEALTH.remove(resource, device.id, _uuid(device))


def forget_resource(resource: str, devices: Mapping[str, Device]) -> None:
    """A stopped resource exports nothing stale."""
    for device in devices.values():
        _forget_health(resource, device)
    for state in ("capacity", "allocatable"):
        with contextlib.suppress(KeyError):
            RESOURCE_DEVICES.remove(resource, state)
    RESOURCE_REGISTERED.labels(resource).set(0)

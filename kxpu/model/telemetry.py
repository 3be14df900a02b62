"""What devices and the processes on them are doing, as plain records; and what a container was granted.

A backend that can measure its devices implements ``TelemetrySource.sample()`` (``kxpu.model.backend``)
and returns a ``TelemetrySample``; the daemon samples it in a worker thread on an interval, joins the
processes with the pods that hold the devices, and exports the figures. Every figure is optional: a
backend fills what its interface tells (``None`` means "not known", never zero).

Devices are named by ``uuid``: the ``Device.uuid`` of every allocatable unit cut from that device (its
slots and replicas included), or the device ID where a backend sets no UUID. A process on a MIG
device is reported under the MIG device's UUID.

A *grant* is the share of a device kxpu gave one container: memory and compute, decided by the
sharing extender or by equal replicas. It travels in the Allocate response as the annotation
``kxpu.io/grants``, so the kubelet keeps it in its device checkpoint with the container: the daemon
reads it back from there (after its own restarts too) to compare what a container uses with what
it was granted. The container runtime receives it as an annotation as well, harmlessly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GRANT_ANNOTATION = "kxpu.io/grants"
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One device's figures at one sample. Ratios are 0..1 of the device."""

    uuid: str
    index: int | None = None
    model: str | None = None
    compute_utilization: float | None = None  # share of the last sample period a kernel ran
    memory_bandwidth_utilization: float | None = None  # share of it device memory was read or written
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    clocks_hz: Mapping[str, float] = field(default_factory=dict)  # e.g. {"sm": .., "memory": ..}
    ecc_errors: Mapping[str, int] = field(default_factory=dict)  # {"corrected": n, "uncorrected": n}
    xid_errors: Mapping[int, int] = field(default_factory=dict)  # Xid → times seen since the backend started
    vendor: str | None = None  # the ``vendor`` label: nvidia, amd, hygon, ascend, gaudi, neuron, cambricon, …
    # Vendor-specific extras, each one metric family with a label (docs/telemetry.md lists them per vendor):
    temperatures_celsius: Mapping[str, float] = field(
        default_factory=dict
    )  # other sensors: junction, memory, …
    engines: Mapping[str, float] = field(
        default_factory=dict
    )  # per engine utilization 0..1: aicore, vector, …
    memory_by_category: Mapping[str, int] = field(default_factory=dict)  # bytes by what holds them (Neuron)
    health_code: int | None = None  # the vendor's own health value (Ascend DCMI: 0 healthy)
    energy_joules: float | None = None  # since the driver loaded
    pcie_bytes_per_second: Mapping[str, float] = field(default_factory=dict)  # {"tx": .., "rx": ..}
    remapped_rows: Mapping[str, int] = field(default_factory=dict)  # {"correctable": n, "uncorrectable": n}
    row_remap: Mapping[str, bool] = field(default_factory=dict)  # {"pending": .., "failure": ..}
    clock_event_reasons: Mapping[str, bool] = field(default_factory=dict)  # why clocks are held down now
    nvlink_bytes: Mapping[str, int] = field(
        default_factory=dict
    )  # {"tx": .., "rx": ..} since the driver loaded
    # profiling counters, 0..1 over the last period: sm_active, tensor_active, …
    profiling: Mapping[str, float] = field(default_factory=dict)
    # power draw as a share of the device's maximum, 0..1, where the driver gives no watts (Neuron: the average over
    # the driver's last minute, idle baseline backed out)
    power_utilization: float | None = None


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """One process using one device. ``pid`` is in the host's PID namespace (as drivers report it)."""

    uuid: str
    pid: int
    memory_used_bytes: int | None = None
    compute_utilization: float | None = None  # share of the device's compute over the last period


@dataclass(frozen=True, slots=True)
class TelemetrySample:
    devices: tuple[DeviceUsage, ...] = ()
    processes: tuple[ProcessUsage, ...] = ()


@dataclass(frozen=True, slots=True)
class Grant:
    """What one container may use of one device; ``None`` where that part is not limited."""

    uuid: str
    memory_bytes: int | None = None
    compute_ratio: float | None = None  # 0..1 of the device's compute


class GrantError(ValueError):
    """A grants annotation that is not what kxpu writes."""


def encode_grants(grants: Sequence[Grant]) -> str:
    """``[{"uuid": "GPU-…", "memoryMiB": 3000, "cores": 30}]``: MiB and percent, as the scheduler grants them."""
    doc = []
    for g in grants:
        entry: dict[str, str | int] = {"uuid": g.uuid}
        if g.memory_bytes is not None:
            entry["memoryMiB"] = g.memory_bytes // MIB
        if g.compute_ratio is not None:
            entry["cores"] = round(g.compute_ratio * 100)
        doc.append(entry)
    return json.dumps(doc, separators=(",", ":"))


def decode_grants(text: str) -> list[Grant]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise GrantError(f"{GRANT_ANNOTATION} is not JSON: {exc}") from None
    if not isinstance(doc, list):
        raise GrantError(f"{GRANT_ANNOTATION} must be a JSON list, not {type(doc).__name__}")
    grants = []
    for entry in doc:
        if not isinstance(entry, dict) or not isinstance(entry.get("uuid"), str) or not entry["uuid"]:
            raise GrantError(f"{GRANT_ANNOTATION}: each entry needs a uuid string, got {entry!r}")
        memory, cores = entry.get("memoryMiB"), entry.get("cores")
        for name, value in (("memoryMiB", memory), ("cores", cores)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise GrantError(f"{GRANT_ANNOTATION}: {name} must be a non-negative integer, got {value!r}")
        grants.append(
            Grant(
                entry["uuid"],
                None if memory is None else memory * MIB,
                None if cores is None else cores / 100,
            )
        )
    return grants

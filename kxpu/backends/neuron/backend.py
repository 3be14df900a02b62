"""AWS Neuron devices (Inferentia, Trainium) as whole devices or as NeuronCores, read from sysfs.

Served as AWS's Neuron device plugin serves them (aws-neuron-sdk deploy/ docs: its image is
closed source): ``aws.amazon.com/neuron`` (older ``aws.amazon.com/neurondevice``) gives a
container ``/dev/neuron<N>`` per device, each carrying all its cores;
``aws.amazon.com/neuroncore`` gives the device nodes that carry the chosen cores plus
``NEURON_RT_VISIBLE_CORES`` naming them (``--device=/dev/neuron1 --env NEURON_RT_VISIBLE_CORES=2,3``
in AWS's scheduler flow). Unlike AWS's plugin, kxpu keeps the sets contiguous itself
(GetPreferredAllocation) instead of needing a scheduler extension, and refuses a set the runtime
would reject.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field, field_validator

from kxpu.backends.host import Host, HostBackendConfig, chosen_host, host_changes
from kxpu.backends.links import link_groups
from kxpu.backends.neuron.monitor import (
    MONITOR_PATH,
    MonitorFigures,
    NeuronMonitor,
    NeuronMonitorConfig,
    find_monitor,
)
from kxpu.backends.neuron.placement import compact, contiguous_run, is_contiguous
from kxpu.backends.neuron.sysfs import (
    CLASS_DIR,
    LEGACY_PATHS,
    LNC_DEVICES,
    MEMORY_GIB,
    SEAM,
    NeuronDevice,
    NeuronHost,
    NeuronReader,
)
from kxpu.backends.neuron.telemetry import Layout, sample_devices
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import register_backend
from kxpu.logs import get_logger
from kxpu.model import (
    Backend,
    BackendError,
    ContainerEdits,
    Device,
    DeviceNode,
    Health,
    ProcessUsage,
    TelemetrySample,
    numa_packed,
)

log = get_logger("kxpu.backends.neuron")

VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
DEVICE_NAMES = ("aws.amazon.com/neuron", "aws.amazon.com/neurondevice")
CORE_NAMES = ("aws.amazon.com/neuroncore",)


def neuronlink_domains(devices: Sequence[NeuronDevice]) -> dict[int, str]:
    """Device index → its NeuronLink domain (``neuronlink-<lowest index in it>``): devices joined through
    ``connected_devices`` (a trn's torus, an inf2's ring), transitively; a device with no link is in none."""
    links = ((dev.index, other) for dev in devices for other in dev.connected)
    groups = link_groups(sorted({d.index for d in devices}), links)
    return {i: f"neuronlink-{lowest}" for i, lowest in groups.items()}


class NeuronConfig(HostBackendConfig):
    unit: Literal["device", "core"] = Field(default="device", description="whole devices or NeuronCores")
    logical_core_config: Literal["auto", 1, 2] = Field(
        default="auto",
        description="physical cores per logical NeuronCore (Trn2/Trn3); auto: the node's "
        "/opt/aws/neuron/logical_nc_config, else 2 on Trainium2/3 and 1 elsewhere",
    )
    require_contiguous: bool = Field(
        default=True, description="refuse device or core sets the Neuron runtime rejects as not contiguous"
    )
    sysfs_paths: dict[str, str] = Field(
        default_factory=dict, description="attribute → path under neuron<N>/, where the driver moved it"
    )
    neuron_monitor: NeuronMonitorConfig = Field(
        default_factory=NeuronMonitorConfig,
        description="neuron-monitor as a telemetry source (NeuronCore utilization, per-process memory)",
    )

    @field_validator("sysfs_paths")
    @classmethod
    def _known(cls, value: dict[str, str]) -> dict[str, str]:
        for key, rel in value.items():
            if key not in LEGACY_PATHS:
                raise ValueError(f"unknown Neuron attribute {key!r}; known: {', '.join(LEGACY_PATHS)}")
            if rel.startswith("/") or ".." in rel.split("/"):
                raise ValueError(f"{key}: {rel!r} must be a path inside the device's directory")
        return value

    def resource_name(self, configured: str) -> str:
        if self.unit == "core" and configured in DEVICE_NAMES:
            raise ValueError(
                f"{configured} counts whole devices; use unit: device, or name it {CORE_NAMES[0]}"
            )
        if self.unit == "device" and configured in CORE_NAMES:
            raise ValueError(f"{configured} counts NeuronCores; set unit: core")
        return configured


def with_monitor(sample: TelemetrySample, figures: MonitorFigures, uuids: dict[int, str]) -> TelemetrySample:
    """The sysfs sample with neuron-monitor's figures: device and per-core utilization, corrected ECC (the driver
    counts uncorrectable errors only), and each application's memory and compute per device."""
    devices = []
    for usage in sample.devices:
        index = usage.index if usage.index is not None else -1
        ecc = {**figures.ecc.get(index, {}), **usage.ecc_errors}
        cores = {f"neuroncore{core}": ratio for core, ratio in figures.cores(index).items()}
        devices.append(
            replace(usage, compute_utilization=figures.utilization(index), ecc_errors=ecc, engines=cores)
        )
    processes = tuple(
        ProcessUsage(uuids[device], pid, memory, compute)
        for device, pid, memory, compute in figures.processes
        if device in uuids
    )
    return TelemetrySample(tuple(devices), sample.processes + processes)


@dataclass(frozen=True, slots=True)
class Unit:
    """One allocatable unit: a device (position = device index) or a core (position = global core index)."""

    id: str
    position: int
    device: NeuronDevice


@register_backend("neuron", NeuronConfig)
class NeuronBackend(Backend):
    def __init__(self, config: NeuronConfig, host: Host | None = None) -> None:
        self.config = config
        self.host = chosen_host(config, host, SEAM)
        self.reader = NeuronReader(self.host, config.sysfs_paths)
        self._units: dict[str, Unit] = {}
        self._reported: dict[int, tuple[str, ...]] | None = None  # what was last logged per device
        self._snapshot: NeuronHost | None = None
        self._placement = PlacementReader(self.host)
        self._domains: dict[int, str] = {}
        self._lnc = 1
        self._block = 1
        self._sample_errors: set[str] = set()
        self._layout: Layout = {}  # each device's cores and memory categories, listed once per discovery
        self._monitor: NeuronMonitor | None = None  # started by the first sample(): telemetry is on
        self._monitor_lock = threading.Lock()
        self._monitor_state: str = "unchecked"  # unchecked, running, absent, closed

    # ------------------------------------------------------------------ telemetry
    def sample(self) -> TelemetrySample:
        """The driver's sysfs counters for the devices of the last discovery (``telemetry.py``), one per physical
        device in either unit; an unreadable device costs its figures and one log line. Where neuron-monitor runs
        (``monitor.py``), its last report adds NeuronCore utilization, each process's memory and corrected ECC."""
        host = self._snapshot
        devices = [(d.serial or f"neuron{d.index}", d) for d in (host.devices if host else ())]
        errors: list[str] = []
        sample = sample_devices(self.host, devices, errors, self._layout)
        for error in errors:
            if error not in self._sample_errors:
                self._sample_errors.add(error)
                log.warning("telemetry: a Neuron device's counters cannot be read", error=error)
        monitor = self._running_monitor()
        figures = monitor.latest() if monitor is not None else None
        if figures is None:
            return sample
        return with_monitor(sample, figures, {d.index: uuid for uuid, d in devices})

    def _running_monitor(self) -> NeuronMonitor | None:
        """The neuron-monitor child, started at the first sample (so only with telemetry on)."""
        with self._monitor_lock:
            if self._monitor_state == "unchecked":
                settings = self.config.neuron_monitor
                binary = find_monitor(settings, self.host.path)
                if binary is None:
                    self._monitor_state = "absent"
                    if settings.enabled is True:
                        log.warning(
                            "telemetry: neuronMonitor.enabled is true but neuron-monitor is not installed "
                            f"(not at <hostRoot>{MONITOR_PATH} nor on PATH); set neuronMonitor.path. NeuronCore "
                            "utilization and per-process memory are absent"
                        )
                else:
                    self._monitor = NeuronMonitor(binary, settings.period_seconds, lambda: self._block)
                    self._monitor.start()
                    self._monitor_state = "running"
            return self._monitor

    def close(self) -> None:
        """Stop neuron-monitor, if this backend started it."""
        with self._monitor_lock:
            monitor, self._monitor, self._monitor_state = self._monitor, None, "closed"
        if monitor is not None:
            monitor.close()

    # ------------------------------------------------------------------ discovery
    def _logical_core_config(self, devices: Sequence[NeuronDevice]) -> int:
        if not devices:
            return 1
        names = {d.device_name for d in devices}
        capable = bool(names) and names <= set(LNC_DEVICES)
        setting = self.config.logical_core_config
        lnc = setting if setting != "auto" else (self.reader.logical_core_config() or (2 if capable else 1))
        if lnc != 1 and not capable:
            raise BackendError(
                f"logical NeuronCore config {lnc} applies to {'/'.join(LNC_DEVICES)} only, "
                f"this node has {', '.join(sorted(n or '?' for n in names))}"
            )
        return lnc

    def _log_changes(self, host: NeuronHost) -> None:
        seen = {d.index: d.problems for d in host.devices}
        reported = self._reported or {}
        for device in host.devices:
            if reported.get(device.index) != device.problems:
                if device.problems:
                    log.warning(
                        "Neuron device unhealthy",
                        device=f"neuron{device.index}",
                        reasons=",".join(device.problems),
                        errors="; ".join(device.errors) or None,
                    )
                elif device.index in reported:
                    log.info("Neuron device healthy again", device=f"neuron{device.index}")
        if not host.devices and self._reported != seen:
            log.warning(
                "no Neuron devices"
                + (
                    ""
                    if self.reader.driver_present()
                    else f": {CLASS_DIR} is missing (is the driver loaded?)"
                )
            )
        self._reported = seen

    def discover(self) -> list[Device]:
        host = self.reader.read()
        self._log_changes(host)
        lnc = self._logical_core_config(host.devices)
        per_device = {d.physical_cores // lnc for d in host.devices if d.physical_cores}
        if len(per_device) > 1:
            raise BackendError(
                f"Neuron devices differ in cores per device ({sorted(per_device)}); not supported"
            )
        block = per_device.pop() if per_device else 1
        self._domains = neuronlink_domains(host.devices)
        units: dict[str, Unit] = {}
        devices: list[Device] = []
        for dev in host.devices:
            if self.config.unit == "device":
                unit = Unit(f"neuron{dev.index}", dev.index, dev)
                units[unit.id] = unit
                devices.append(self._device(unit, host, lnc, block))
                continue
            for local in range(block if dev.physical_cores else 0):
                unit = Unit(f"neuroncore{dev.index * block + local}", dev.index * block + local, dev)
                units[unit.id] = unit
                devices.append(self._device(unit, host, lnc, block))
        self._units, self._snapshot, self._lnc, self._block = units, host, lnc, block
        self._layout = {}  # a new discovery lists the cores and categories again
        return devices

    def _device(self, unit: Unit, host: NeuronHost, lnc: int, block: int) -> Device:
        dev = unit.device
        first = dev.index * block
        extra: dict[str, str | int | bool] = {
            "deviceId": dev.index,
            "coreCount": block,
            "logicalCoreConfig": lnc,
        }
        facts = {
            "deviceName": dev.device_name,
            "archType": dev.arch_type,
            "instanceFamily": dev.instance_type,  # sysfs instance_type: Trn1, not the EC2 type
            "neuronDriverVersion": host.driver_version,
            "connectedDevices": ",".join(map(str, dev.connected)) or None,
        }
        extra.update({k: v for k, v in facts.items() if v is not None})
        is_core = self.config.unit == "core"
        if is_core:
            extra.update(coreId=unit.position, localCoreId=unit.position - first)
        else:
            extra["coreIds"] = compact(range(first, first + block))
        memory = MEMORY_GIB.get(dev.device_name or "")
        return Device(
            id=unit.id,
            health=Health.UNHEALTHY if dev.problems else Health.HEALTHY,
            health_reason=dev.problems[0] if dev.problems else None,
            numa_nodes=(dev.numa_node,) if dev.numa_node is not None else (),
            model=dev.device_name,
            uuid=dev.serial,
            index=unit.position,
            memory_mib=None if memory is None or is_core else memory * 1024,
            cores=1 if is_core else block,
            pci_bus_id=dev.pci_bus_id,
            pcie_root=self._placement.pcie_root(dev.pci_bus_id),
            link_domain=self._domains.get(dev.index),
            extra=extra,
        )

    async def watch(self) -> AsyncGenerator[list[Device]]:
        """New and removed devices wake it at once (inotify on the class directory and /dev); health
        counters and states are values, which sysfs never announces, so they are polled."""
        async for devices in host_changes(
            self.discover, lambda: [CLASS_DIR, "/dev"], self.host, self.config.poll_seconds
        ):
            yield devices

    # ------------------------------------------------------------------ allocation
    def _chosen(self, devices: Sequence[Device]) -> list[Unit]:
        try:
            return sorted((self._units[d.id] for d in devices), key=lambda u: u.position)
        except KeyError as exc:
            raise BackendError(f"not a Neuron {self.config.unit} of this resource: {exc.args[0]}") from None

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        units = self._chosen(devices)
        positions = [u.position for u in units]
        what = "devices" if self.config.unit == "device" else "NeuronCores"
        if self.config.require_contiguous and not is_contiguous(positions):
            raise BackendError(
                f"Neuron {what} {compact(positions)} are not contiguous and the Neuron runtime refuses such "
                "a set; request a count that fits a free contiguous run (requireContiguous: false allows it)"
            )
        indexes = sorted({u.device.index for u in units})
        edits = ContainerEdits(
            device_nodes=[
                DeviceNode(f"/dev/neuron{i}", str(self.host.path(f"/dev/neuron{i}")), "rw") for i in indexes
            ]
        )
        if self.config.unit == "core":
            edits.env[VISIBLE_CORES_ENV] = compact(positions)
            if any(u.device.device_name in LNC_DEVICES for u in units):
                edits.env[LNC_ENV] = str(self._lnc)  # the numbering above is at this config
        return edits

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        """A contiguous run (see placement); if none exists, NUMA-packed devices (Allocate will then refuse)."""
        by_position = {
            self._units[d.id].position: d.id for d in [*available, *must_include] if d.id in self._units
        }
        required = [self._units[d.id].position for d in must_include if d.id in self._units]
        run = contiguous_run(
            sorted(by_position), required, size, self._block if self.config.unit == "core" else 1
        )
        if run is not None:
            return [by_position[p] for p in run]
        return numa_packed(available, must_include, size)

    # ------------------------------------------------------------------ labels
    def node_labels(self) -> dict[str, str]:
        """kxpu's own labels (AWS's plugin labels nothing): what a nodeSelector needs to pick Neuron nodes."""
        self.discover()
        host = self._snapshot
        if host is None or not host.devices:
            return {}
        first = host.devices[0]
        labels = {
            "kxpu.io/neuron.count": str(len(host.devices)),
            "kxpu.io/neuron.cores-per-device": str(self._block),
            "kxpu.io/neuron.logical-core-config": str(self._lnc),
        }
        for key, value in (
            ("device-name", first.device_name),
            ("family", first.instance_type),
            ("driver-version", host.driver_version),
        ):
            if value:
                labels[f"kxpu.io/neuron.{key}"] = value
        return labels

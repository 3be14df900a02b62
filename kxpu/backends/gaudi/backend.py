"""Intel Gaudi accelerators through HLML (Habana's ``pyhlml``), served as Habana's device plugin serves them.

Devices are named by serial number (Habana's device IDs), discovered once at start (a device
lost later stays listed, unhealthy, as with Habana's plugin); health changes come from the HLML
event thread (``health.py``) and are pushed through ``watch()`` at once. A container gets
``/dev/accel/accel<minor>`` and ``/dev/accel/accel_controlD<minor>`` per device and Habana's env:
``HABANA_VISIBLE_DEVICES`` (minors), ``HL_VISIBLE_DEVICES`` (device paths),
``HL_VISIBLE_DEVICES_UUID`` (serials) and, when it gets fewer than all devices,
``HABANA_VISIBLE_MODULES`` (module IDs).

When HLML cannot start (no ``libhlml.so``, driver not loaded), the devices are those the
habanalabs driver lists in sysfs (``/sys/class/accel/accel<N>/device`` of PCI vendor 0x1da3, named
by their ``serial_number``), each reported Unhealthy with the reason; a restart retries HLML.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from kxpu.backends.gaudi.config import GaudiConfig
from kxpu.backends.gaudi.health import HealthMonitor, Watched
from kxpu.backends.gaudi.hlml import HlmlSource, default_source, describe, is_code, text
from kxpu.backends.gaudi.telemetry import sample_aips
from kxpu.backends.host import Host, HostFileError
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import register_backend
from kxpu.backends.wakeups import Wakeups
from kxpu.logs import get_logger
from kxpu.model import (
    Backend,
    BackendError,
    ContainerEdits,
    Device,
    DeviceNode,
    Health,
    TelemetrySample,
    numa_packed,
)

log = get_logger("kxpu.backends.gaudi")

HABANA_VENDOR = "0x1da3"
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Aip:
    """One Gaudi device as HLML (or, without HLML, sysfs) describes it."""

    serial: str
    index: int
    minor: int | None = None
    module_id: int | None = None
    uuid: str | None = None
    name: str | None = None
    memory_mib: int | None = None
    bus_id: str | None = None
    numa: int | None = None
    error: str | None = None  # a fault known at discovery
    handle: Any = None


class GaudiBackend(Backend):
    def __init__(self, config: GaudiConfig, source: HlmlSource | None = None) -> None:
        self.config = config
        self.source = source or default_source(config.host_root)
        self.hlml = self.source.module
        self.host = Host(self.source.host_root)
        self._placement = PlacementReader(self.host)
        self._initialized = False
        self._wakeups = Wakeups()
        self.driver_version: str | None = None
        self._sample_errors: set[str] = set()
        self.aips = self._start()
        self._by_serial = {a.serial: a for a in self.aips}
        watched = [Watched(a.serial, a.handle) for a in self.aips if a.handle is not None and not a.error]
        self.monitor = (
            HealthMonitor(self.source, watched, config.health, self._wakeups.notify) if watched else None
        )
        log.info(
            "Gaudi devices discovered",
            devices=len(self.aips),
            hlml=self._initialized,
            driver=self.driver_version,
            fake_hlml=self.source.fake,
        )

    # ------------------------------------------------------------------ discovery
    def _start(self) -> list[Aip]:
        try:
            self.hlml.hlmlInit()
        except self.hlml.HLMLError as exc:
            reason = f"HLML unavailable ({describe(exc)}): is the habanalabs driver loaded?"
            log.error(reason + " Every Gaudi device in sysfs is reported unhealthy.")
            return self._from_sysfs("hlml-unavailable")
        self._initialized = True
        with contextlib.suppress(self.hlml.HLMLError):
            self.driver_version = text(self.hlml.hlmlGetDriverVersion())
        try:
            count = int(self.hlml.hlmlDeviceGetCount())
        except self.hlml.HLMLError as exc:
            log.error("HLML cannot count the devices; reporting sysfs devices unhealthy", error=describe(exc))
            return self._from_sysfs("hlml-count-failed")
        return [aip for aip in (self._aip(i) for i in range(count)) if aip is not None]

    def _aip(self, index: int) -> Aip | None:
        hlml = self.hlml
        try:
            handle = hlml.hlmlDeviceGetHandleByIndex(index)
            serial = text(hlml.hlmlDeviceGetSerial(handle))
        except hlml.HLMLError as exc:
            log.error("Gaudi device cannot be identified; skipping it", index=index, error=describe(exc))
            return None
        try:
            pci = hlml.hlmlDeviceGetPCIInfo(handle)
            bus_id = text(pci.bus_id)
            return Aip(
                serial=serial,
                index=index,
                handle=handle,
                minor=int(hlml.hlmlDeviceGetMinorNumber(handle)),
                module_id=int(hlml.hlmlDeviceGetModuleID(handle)),
                uuid=text(hlml.hlmlDeviceGetUUID(handle)),
                name=text(hlml.hlmlDeviceGetName(handle)),
                memory_mib=int(hlml.hlmlDeviceGetMemoryInfo(handle).total) // MIB,
                bus_id=bus_id,
                numa=self._numa(bus_id),
            )
        except hlml.HLMLError as exc:
            log.error("Gaudi query failed; reporting it unhealthy", serial=serial, error=describe(exc))
            reason = (
                "aip-lost" if is_code(self.source, exc, "HLML_ERROR_AIP_IS_LOST") else "hlml-query-failed"
            )
            return Aip(serial=serial, index=index, handle=handle, error=reason)

    def _numa(self, bus_id: str) -> int | None:
        """As gohlml's NumaNode: sysfs ``numa_node`` of the PCI function; none when negative or absent."""
        try:
            node = self.host.read_int(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node")
        except HostFileError as exc:
            log.warning("unreadable NUMA node", error=str(exc))
            return None
        return node if node is not None and node >= 0 else None

    def _from_sysfs(self, reason: str) -> list[Aip]:
        aips: list[Aip] = []
        for name in self.host.listdir("/sys/class/accel"):
            base = f"/sys/class/accel/{name}/device"
            try:
                if (self.host.read(f"{base}/vendor") or "").lower() != HABANA_VENDOR:
                    continue
                serial = self.host.read(f"{base}/serial_number")
                module = self.host.read_int(f"{base}/module_id", 10)
            except HostFileError as exc:
                log.warning("unreadable Gaudi sysfs entry", error=str(exc))
                continue
            minor = int(name.removeprefix("accel")) if name.removeprefix("accel").isdigit() else None
            if serial:
                aips.append(Aip(serial=serial, index=len(aips), minor=minor, module_id=module, error=reason))
        return aips

    # ------------------------------------------------------------------ devices and health
    def _device(self, aip: Aip, reason: str | None) -> Device:
        extra: dict[str, str | int | bool] = {"serial": aip.serial}
        for key, value in (
            ("minor", aip.minor),
            ("moduleID", aip.module_id),
            ("driverVersion", self.driver_version),
        ):
            if value is not None:
                extra[key] = value
        return Device(
            id=aip.serial,
            health=Health.UNHEALTHY if reason else Health.HEALTHY,
            health_reason=reason,
            numa_nodes=(aip.numa,) if aip.numa is not None else (),
            model=aip.name,
            uuid=aip.uuid,
            index=aip.index,
            memory_mib=aip.memory_mib,
            pci_bus_id=aip.bus_id,
            pcie_root=self._placement.pcie_root(aip.bus_id),
            extra=extra,
        )

    def discover(self) -> list[Device]:
        faults = self.monitor.snapshot() if self.monitor else {}
        return [self._device(a, a.error or faults.get(a.serial)) for a in self.aips]

    async def watch(self) -> AsyncGenerator[list[Device]]:
        """The full list once events are being received, then a list on every health change."""
        with self._wakeups.subscribe() as changed:
            if self.monitor is not None and not self.monitor.running:
                await asyncio.to_thread(self.monitor.start)
            yield self.discover()
            while True:
                await changed.wait()
                changed.clear()
                yield self.discover()

    # ------------------------------------------------------------------ allocation
    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        aips = []
        for device in devices:
            aip = self._by_serial.get(device.id)
            if aip is None:
                raise BackendError(f"not a Gaudi device of this resource: {device.id}")
            if aip.minor is None or aip.module_id is None:
                raise BackendError(f"{device.id}: its minor number and module ID are unknown (HLML failed)")
            aips.append(aip)
        nodes, paths = [], []
        for aip in aips:
            path = f"/dev/accel/accel{aip.minor}"
            paths.append(path)
            for node in (path, f"/dev/accel/accel_controlD{aip.minor}"):
                nodes.append(DeviceNode(node, str(self.host.path(node)), "rw"))
        env = {
            "HABANA_VISIBLE_DEVICES": ",".join(str(a.minor) for a in aips),
            "HL_VISIBLE_DEVICES": ",".join(paths),
            "HL_VISIBLE_DEVICES_UUID": ",".join(a.serial for a in aips),
        }
        if len(aips) < len(self.aips):
            env["HABANA_VISIBLE_MODULES"] = ",".join(str(a.module_id) for a in aips)
        return ContainerEdits(env=env, device_nodes=nodes)

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)

    # ------------------------------------------------------------------ labels, shutdown
    def node_labels(self) -> dict[str, str]:
        devices = [d for d in self.discover() if d.model]
        if not devices:
            return {}
        labels = {
            "habana.ai/gaudi.product": devices[0].model or "",
            "habana.ai/gaudi.count": str(len(devices)),
        }
        memories = [d.memory_mib for d in devices if d.memory_mib]
        if memories:
            labels["habana.ai/gaudi.memory"] = str(min(memories))
        if self.driver_version:
            labels["habana.ai/gaudi.driver-version"] = self.driver_version
        return labels

    def _shutdown(self) -> None:
        if self._initialized:
            self._initialized = False
            with contextlib.suppress(Exception):
                self.hlml.hlmlShutdown()

    def sample(self) -> TelemetrySample:
        """HLML's figures for the devices this resource serves (``telemetry.py``); a failing call is logged once
        and costs only its figure."""
        if not self._initialized:
            raise BackendError("HLML is not initialized (no driver, or the backend is closed)")
        aips = [
            (a.uuid or a.serial, a.index, a.name, a.handle)
            for a in self.aips
            if a.handle is not None and not a.error
        ]
        errors: list[str] = []
        sample = sample_aips(self.source, aips, errors)
        for error in errors:
            if error not in self._sample_errors:
                self._sample_errors.add(error)
                log.warning("telemetry: an HLML call failed; that figure is left out", error=error)
        return sample

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.stop(on_exit=self._shutdown)
        else:
            self._shutdown()


register_backend("gaudi", GaudiConfig)(GaudiBackend)

"""Huawei Ascend NPUs (910B/910C/310P) through DCMI, served as Huawei's and HAMi's plugins serve them.

Devices come only from DCMI; every poll re-reads the chip list and each chip's health, so a
chip unhealthy at start comes back when DCMI says it recovered, and ``/dev/davinci*`` appearing
or vanishing is seen at once (inotify). When DCMI cannot be loaded, initialised or asked for
its chips, "every device" is every ``/dev/davinci<N>`` node present, each reported Unhealthy
with the reason; a later poll retries DCMI, so installing the driver heals the node.

A container gets, for the physical IDs it was allocated (sorted):

- ``ASCEND_VISIBLE_DEVICES=<physical IDs>``: Huawei's plugin's variable; Ascend Docker Runtime
  reads it on the host to add ``/dev/davinci<phy>``, the management nodes and driver files;
  in-container tools use it as the pod's physical list.
- ``ASCEND_RT_VISIBLE_DEVICES=0,…,n-1``: the CANN runtime reads it *inside* the container, in
  the container's own numbering, where the n visible chips are 0..n-1 in physical order. It must
  not hold physical IDs (HAMi#1894: a pod given chips 3,4 failed opening "device 1").
- with ``useAscendDocker: true`` (default): ``ASCEND_RUNTIME_OPTIONS`` too, as Huawei's plugin sets it;
  with ``false``: device nodes ``/dev/davinci<phy>``, ``/dev/davinci_manager``, ``/dev/devmm_svm``,
  ``/dev/hisi_hdc`` and the driver mounts HAMi's plugin adds (each only if present on the host).
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Sequence

from kxpu.backends.ascend import dcmi
from kxpu.backends.ascend.config import HAMI_TEMPLATES, AscendConfig, VnpuTemplate
from kxpu.backends.ascend.dcmi import Dcmi, DcmiError, DcmiSource, default_source
from kxpu.backends.ascend.discovery import Npu, cards, error_codes, hccs_domains, read_npu
from kxpu.backends.ascend.telemetry import sample_npus
from kxpu.backends.host import Host, HostFileError, host_changes
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import register_backend
from kxpu.logs import get_logger
from kxpu.model import (
    Backend,
    BackendError,
    ContainerEdits,
    Device,
    DeviceNode,
    DeviceShare,
    Health,
    Mount,
    TelemetrySample,
    numa_packed,
)

log = get_logger("kxpu.backends.ascend")

VISIBLE_ENV = "ASCEND_VISIBLE_DEVICES"
RT_VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
RUNTIME_OPTIONS_ENV = "ASCEND_RUNTIME_OPTIONS"
VNPU_SPECS_ENV = "ASCEND_VNPU_SPECS"
MANAGER_NODE = "/dev/davinci_manager"
OPTIONAL_NODES = ("/dev/devmm_svm", "/dev/hisi_hdc")
VERSION_INFO = "/usr/local/Ascend/driver/version.info"
_DAVINCI = re.compile(r"^davinci(\d+)$")


class AscendBackend(Backend):
    def __init__(self, config: AscendConfig, source: DcmiSource | None = None) -> None:
        self.config = config
        self.source = source or default_source(config.host_root)
        self.host = Host(self.source.host_root)
        self._lib: Dcmi | None = None
        self._dcmi_error: str | None = None
        self._physical: dict[str, int] = {}  # device ID → physical ID, from the last discovery
        self._reasons: dict[str, str | None] = {}  # device ID → last health reason, to log changes once
        self._names: dict[int, str] = {}  # physical ID → chip name, remembered for chips that stop answering
        self._chip = ""
        self._sampled: list[tuple[str, Npu]] = []  # (UUID, chip) of the last discovery, for sample()
        self._sample_errors: set[str] = set()
        self._placement = PlacementReader(self.host)
        # (the placeable chips it was measured for, physical ID → HCCS domain)
        self._hccs: tuple[tuple[tuple[int, int, int, str | None], ...], dict[int, str]] = ((), {})
        self._start_dcmi()
        devices = self.discover()
        log.info(
            "Ascend NPUs discovered",
            devices=len(devices),
            healthy=sum(d.healthy for d in devices),
            chip=self._chip or None,
            dcmi_error=self._dcmi_error,
            fake_dcmi=self.source.fake is not None,
        )

    # ------------------------------------------------------------------ DCMI lifecycle
    def _start_dcmi(self) -> bool:
        """Load and initialise DCMI if not done yet; on failure remember why (the devices' reason)."""
        if self._lib is not None:
            return True
        try:
            lib = self.source.open(self.config.dcmi_library)
            dcmi.check("dcmi_init", lib.dcmi_init())
        except (OSError, DcmiError) as exc:
            if self._dcmi_error != str(exc):
                log.error("DCMI unavailable; every /dev/davinci node is reported unhealthy", error=str(exc))
            self._dcmi_error = str(exc)
            return False
        if self._dcmi_error is not None:
            log.info("DCMI available again", previously=self._dcmi_error)
        self._lib, self._dcmi_error = lib, None
        return True

    # ------------------------------------------------------------------ devices
    def _id(self, phy: int) -> str:
        return f"{self.config.id_prefix}-{phy}"

    def _node_numbers(self) -> list[int]:
        found = (_DAVINCI.match(name) for name in self.host.listdir("/dev"))
        return sorted(int(m.group(1)) for m in found if m)

    def _fallback(self, reason: str) -> list[Device]:
        return [
            Device(
                id=self._id(n),
                health=Health.UNHEALTHY,
                health_reason=reason,
                index=n,
                extra={"physicalID": n},
            )
            for n in self._node_numbers()
        ]

    def _npus(self) -> list[Npu] | str:
        """Every chip DCMI lists, or the reason it could not list them."""
        if not self._start_dcmi():
            return "dcmi-unavailable"
        lib = self._lib
        try:
            chips = cards(lib)
        except DcmiError as exc:
            log.error(
                "DCMI cannot list the NPUs; every /dev/davinci node is reported unhealthy", error=str(exc)
            )
            return f"dcmi-list-failed{exc.code}"
        npus = [npu for card, dev in chips if (npu := read_npu(lib, self.host, card, dev)) is not None]
        # HCCS links change only with the hardware: asked again only when the set of placeable chips changes.
        placeable = tuple((n.phy_id, n.card_id, n.device_id, n.bus_id) for n in npus if n.fault is None)
        if placeable != self._hccs[0]:
            self._hccs = (placeable, hccs_domains(lib, npus))
        for npu in npus:
            if npu.chip_name:
                self._names[npu.phy_id] = npu.chip_name
        wanted = set(self.config.chip_names)
        # A chip whose queries fail has no name now: judged by the name it had (kept if never known).
        return [n for n in npus if not wanted or self._names.get(n.phy_id, next(iter(wanted))) in wanted]

    def _reason(self, npu: Npu, nodes: set[int]) -> str | None:
        if npu.fault:
            return npu.fault
        if npu.phy_id not in nodes:
            return "device-node-missing"
        if npu.health not in self.config.health.healthy_states:
            return f"dcmi-health-{npu.health}"
        return None

    def _device(self, npu: Npu, reason: str | None, driver: str | None) -> Device:
        extra: dict[str, str | int | bool] = {
            "physicalID": npu.phy_id,
            "logicID": npu.logic_id,
            "cardID": npu.card_id,
            "deviceID": npu.device_id,
        }
        for key, value in (
            ("chipName", npu.chip_name),
            ("chipType", npu.chip_type),
            ("chipVersion", npu.chip_ver),
            ("aiCoreCount", npu.aicore),
            ("driverVersion", driver),
        ):
            if value:
                extra[key] = value
        return Device(
            id=self._id(npu.phy_id),
            health=Health.UNHEALTHY if reason else Health.HEALTHY,
            health_reason=reason,
            numa_nodes=(npu.numa,) if npu.numa is not None else (),
            model=f"{npu.chip_type or 'Ascend'}{npu.chip_name}" if npu.chip_name else None,
            uuid=npu.uuid,
            index=npu.phy_id,
            memory_mib=npu.memory_mib,
            cores=npu.aicore,
            pci_bus_id=npu.bus_id,
            pcie_root=self._placement.pcie_root(npu.bus_id),
            link_domain=self._hccs[1].get(npu.phy_id),
            extra=extra,
        )

    def driver_version(self) -> str | None:
        """``Version=`` of the driver's version.info (what ``npu-smi`` reports as the driver version)."""
        try:
            text = self.host.read(VERSION_INFO)
        except HostFileError:
            return None
        for line in (text or "").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "Version" and value.strip():
                return value.strip()
        return None

    def sample(self) -> TelemetrySample:
        """DCMI's figures for the chips of the last discovery (``telemetry.py``); none while DCMI is down. A
        call that fails is logged once (by call and code), the rest still sampled."""
        lib, npus = self._lib, list(self._sampled)
        if lib is None:
            raise BackendError(f"DCMI is not available: {self._dcmi_error or 'not started'}")
        errors: list[str] = []
        sample = sample_npus(lib, npus, errors)
        for error in errors:
            if error not in self._sample_errors:
                self._sample_errors.add(error)
                log.warning("telemetry: a DCMI call failed; that figure is left out", error=error)
        return sample

    def discover(self) -> list[Device]:
        npus = self._npus()
        self._sampled = (
            [] if isinstance(npus, str) else [(npu.uuid or self._id(npu.phy_id), npu) for npu in npus]
        )
        devices = self._fallback(npus) if isinstance(npus, str) else self._from_dcmi(npus)
        self._physical = {d.id: int(d.extra["physicalID"]) for d in devices}
        self._log_changes(devices)
        return devices

    def _log_changes(self, devices: list[Device]) -> None:
        reasons = {d.id: d.health_reason for d in devices}
        for device_id, reason in reasons.items():
            before = self._reasons.get(device_id, "new")
            if reason == before:
                continue
            if reason:
                log.warning("NPU unhealthy", device=device_id, reason=reason)
            elif before != "new":
                log.info("NPU healthy again", device=device_id, previously=before)
        for device_id in self._reasons.keys() - reasons.keys():
            log.warning("NPU gone", device=device_id)
        self._reasons = reasons

    def _from_dcmi(self, npus: list[Npu]) -> list[Device]:
        nodes = set(self._node_numbers())
        driver = self.driver_version()
        devices = []
        for npu in sorted(npus, key=lambda n: n.phy_id):
            reason = self._reason(npu, nodes)
            if reason and reason != self._reasons.get(self._id(npu.phy_id)) and self._lib is not None:
                codes = error_codes(self._lib, npu.card_id, npu.device_id)
                log.info("NPU fault details", physical_id=npu.phy_id, detail=npu.detail, error_codes=codes)
            devices.append(self._device(npu, reason, driver))
            self._chip = self._chip or npu.chip_name
        return devices

    async def watch(self) -> AsyncGenerator[list[Device]]:
        """DCMI re-read every ``pollSeconds`` (it has no event to wait on); /dev changes wake it at once."""
        async for devices in host_changes(
            self.discover, lambda: ["/dev"], self.host, self.config.poll_seconds
        ):
            yield devices

    # ------------------------------------------------------------------ allocation
    def _phys(self, devices: Sequence[Device]) -> list[int]:
        phys = []
        for device in devices:
            phy = self._physical.get(device.id)
            if phy is None:
                raise BackendError(f"not an Ascend NPU of this resource: {device.id}")
            phys.append(phy)
        return sorted(set(phys))

    def _host_path(self, path: str) -> str:
        """Where the runtime finds ``path``: itself on a real host (hostRoot /), the fake's file on a fake one."""
        return str(self.host.path(path))

    def _existing(self, paths: Sequence[str]) -> list[str]:
        return [p for p in paths if self.host.exists(p)]

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        return self._allocate(devices, None)

    def allocate_shares(self, shares: Sequence[DeviceShare]) -> ContainerEdits:
        """A shared chip (kxpu's fractional sharing, HAMi's names) gets HAMi's vNPU template for its grant."""
        return self._allocate([s.device for s in shares], self._template(shares))

    def _allocate(self, devices: Sequence[Device], template: VnpuTemplate | None) -> ContainerEdits:
        phys = self._phys(devices)
        edits = ContainerEdits(
            env={
                VISIBLE_ENV: ",".join(map(str, phys)),
                RT_VISIBLE_ENV: ",".join(str(n) for n in range(len(phys))),
            }
        )
        if template is not None:
            edits.env[VNPU_SPECS_ENV] = template.name
        if self.config.use_ascend_docker:
            edits.env[RUNTIME_OPTIONS_ENV] = self.config.runtime_options
            return edits
        if not self.host.exists(MANAGER_NODE):
            raise BackendError(f"{MANAGER_NODE} is missing on the host: is the Ascend driver loaded?")
        nodes = [f"/dev/davinci{p}" for p in phys] + [MANAGER_NODE] + self._existing(OPTIONAL_NODES)
        edits.device_nodes = [DeviceNode(path, self._host_path(path), "rw") for path in nodes]
        mounts = self._existing(self.config.driver_mounts)
        edits.mounts = [Mount(p, self._host_path(p), read_only=True) for p in mounts]
        return edits

    def templates(self) -> tuple[VnpuTemplate, ...]:
        if self.config.vnpu_templates is not None:
            return tuple(self.config.vnpu_templates)
        return HAMI_TEMPLATES.get(self._chip, ())

    def _template(self, shares: Sequence[DeviceShare]) -> VnpuTemplate | None:
        """HAMi's choice for a shared chip: the smallest template holding the granted memory (none: whole chip)."""
        if not shares:
            return None
        memory = max(s.memory_mib for s in shares)
        fitting = [t for t in self.templates() if t.memory >= memory]
        return min(fitting, key=lambda t: t.memory) if fitting else None

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)

    # ------------------------------------------------------------------ labels
    def node_labels(self) -> dict[str, str]:
        devices = [d for d in self.discover() if d.model]
        if not devices:
            return {}
        first = devices[0]
        labels = {
            "huawei.com/npu.product": first.model or "",
            "huawei.com/npu.chip": str(first.extra.get("chipName", "")),
            "huawei.com/npu.count": str(len(devices)),
        }
        if first.memory_mib:
            labels["huawei.com/npu.memory"] = str(min(d.memory_mib or 0 for d in devices))
        if first.cores:
            labels["huawei.com/npu.aicore"] = str(first.cores)
        driver = first.extra.get("driverVersion")
        if driver:
            labels["huawei.com/npu.driver-version"] = str(driver)
        return labels

    def close(self) -> None:
        self._lib = None  # DCMI has no shutdown call; the library stays mapped until the process exits


register_backend("ascend", AscendConfig)(AscendBackend)

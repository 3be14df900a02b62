"""AMD Instinct GPUs and Hygon DCUs from the amdgpu driver's sysfs, served as their plugins serve them.

``amd:`` follows ROCm/k8s-device-plugin: device IDs are the PCI address of a whole GPU or
``amdgpu_xcp_<n>`` for an MI300-class partition; a container gets ``/dev/kfd`` plus each device's
``/dev/dri/card<N>`` and ``/dev/dri/renderD<N>``, ``rw``, and no environment. Without
``partitionType`` a section serves every device (the plugin's ``single`` strategy); with
``partitionType: cpx_nps4`` only the devices of GPUs in that mode (the ``mixed`` strategy, resource
``amd.com/cpx_nps4``). Unlike the plugin, health is per GPU with a reason, a repartition or a
reloaded driver is picked up without a restart, and an unhealthy GPU can recover.

``hygon:`` follows HAMi's dcu-vgpu-device-plugin (a fork of AMD's): vendor 0x1d94, IDs
``DCU-<serial>``, ``/dev/kfd`` and ``/dev/mkfd`` (``rwm``) plus the DCU's drm nodes, ``/opt/hyhal``
mounted read-only, no environment.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Literal

from pydantic import Field

from kxpu.backends.amd.placement import best_effort
from kxpu.backends.amd.sysfs import (
    AMD_VENDOR,
    DRIVER_DIR,
    HYGON_VENDOR,
    KFD_NODES,
    PLATFORM_DIR,
    SEAM,
    AmdReader,
    Gpu,
    Snapshot,
    Unit,
    amdsmi_uuid,
)
from kxpu.backends.amd.telemetry import AmdSampler, SampledUnit
from kxpu.backends.host import Host, HostBackendConfig, HostFileError, chosen_host, host_changes
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
    Mount,
    TelemetrySample,
)

log = get_logger("kxpu.backends.amd")

AMDSMI_NOT_SUPPORTED = 2
# Marketing names by PCI device ID, where sysfs has no product_name (the plugin asks libdrm).
MODELS = {
    0x740F: "AMD Instinct MI210",
    0x740C: "AMD Instinct MI250X/MI250",
    0x74A1: "AMD Instinct MI300X",
    0x74A5: "AMD Instinct MI325X",
    0x74A0: "AMD Instinct MI300A",
    0x75A0: "AMD Instinct MI350X",
    0x6320: "Hygon DCU Z100",
    0x6321: "Hygon DCU K100",
}
PARTITION_TYPE = r"^(spx|dpx|tpx|qpx|cpx)_(nps1|nps2|nps4|nps8)$"


class AmdCommonConfig(HostBackendConfig):
    ras_recovery_seconds: float | None = Field(
        default=None,
        ge=0,
        le=86400,
        description="a GPU whose uncorrectable RAS count stops rising is healthy again after this "
        "long (None: it stays unhealthy until the counters reset)",
    )


class AmdConfig(AmdCommonConfig):
    partition_type: str | None = Field(
        default=None,
        pattern=PARTITION_TYPE,
        description="serve only devices of GPUs in this <compute>_<memory> mode (AMD's mixed strategy)",
    )
    amdsmi: Literal["off", "optional", "required"] = Field(
        default="off",
        description="ECC health through amdsmi; required: every GPU is Unhealthy while it cannot start",
    )


class HygonConfig(AmdCommonConfig):
    hyhal_path: str = Field(default="/opt/hyhal", pattern=r"^/", description="mounted read-only")


class _HealthMemory:
    """Uncorrectable counts per (GPU, source) and when each last rose, for recovery after quiet."""

    def __init__(self, recovery: float | None) -> None:
        self.recovery = recovery
        self.seen: dict[tuple[str, str], tuple[int, float]] = {}

    def failing(self, bdf: str, source: str, count: int) -> bool:
        now = time.monotonic()
        before = self.seen.get((bdf, source))
        if before is None or count > before[0]:
            self.seen[(bdf, source)] = (count, now)
        elif count < before[0]:  # counters reset (driver reload): no new error
            self.seen[(bdf, source)] = (count, before[1])
        since = self.seen[(bdf, source)][1]
        return count > 0 and (self.recovery is None or now - since < self.recovery)


@register_backend("amd", AmdConfig)
class AmdBackend(Backend):
    vendor = AMD_VENDOR
    vendor_label = "amd"
    what = "AMD GPU"
    control_nodes: tuple[tuple[str, str], ...] = (("/dev/kfd", "rw"),)

    def __init__(self, config: AmdCommonConfig, amdsmi: Any = None, host: Host | None = None) -> None:
        self.config = config
        self.host = chosen_host(config, host, SEAM)
        self.reader = AmdReader(self.host, self.vendor)
        self._placement = PlacementReader(self.host)
        self._lock = threading.Lock()
        self._memory = _HealthMemory(config.ras_recovery_seconds)
        self._smi_module = amdsmi
        self._smi_started = False
        self._smi_error: str | None = None
        self._units: dict[str, Unit] = {}
        self._sampled: list[SampledUnit] = []  # the served units, for sample()
        self._sampler = AmdSampler(self.host, self.vendor_label)
        self._sample_errors: set[str] = set()
        self._snapshot = Snapshot(False)
        self._links: tuple[tuple[int, ...], dict[tuple[int, int], int]] | None = None
        self._reported: dict[str, str | None] | None = None
        self._driver_reported: bool | None = None

    # ------------------------------------------------------------------ amdsmi (optional)
    @property
    def _smi_mode(self) -> str:
        return getattr(self.config, "amdsmi", "off")

    def _smi(self) -> Any:
        if self._smi_mode == "off":
            return None
        try:
            module = self._smi_module or importlib.import_module("amdsmi")
            if not self._smi_started:
                module.amdsmi_init()
                self._smi_started = True
                log.info("amdsmi started")
        except Exception as exc:  # amdsmi raises KeyError/OSError at import without ROCm
            self._smi_fail(f"amdsmi cannot start: {_smi_text(exc)}")
            return None
        self._smi_module, self._smi_error = module, None
        return module

    def _smi_fail(self, message: str) -> None:
        if message != self._smi_error:
            consequence = (
                "every GPU is reported Unhealthy until it starts"
                if self._smi_mode == "required"
                else "ECC health is read from sysfs only"
            )
            log.error(f"{message}; {consequence}")
        self._smi_error = message
        self._smi_started = False

    def _smi_ecc(self) -> tuple[dict[str, int], str | None]:
        """BDF → uncorrectable ECC count from amdsmi; and the reason every GPU fails, if it must."""
        smi = self._smi()
        if smi is None:
            failed = self._smi_mode == "required" and self._smi_error is not None
            return {}, "amdsmi-unavailable" if failed else None
        out: dict[str, int] = {}
        try:
            for handle in smi.amdsmi_get_processor_handles():
                bdf = str(smi.amdsmi_get_gpu_device_bdf(handle)).lower()
                try:
                    ecc = smi.amdsmi_get_gpu_total_ecc_count(handle)
                except Exception as exc:
                    if getattr(exc, "err_code", None) == AMDSMI_NOT_SUPPORTED:
                        continue
                    raise
                out[bdf] = max(out.get(bdf, 0), int(ecc.get("uncorrectable_count", 0)))
        except Exception as exc:
            self._smi_fail(f"amdsmi call failed: {_smi_text(exc)}")
            return {}, "amdsmi-unavailable" if self._smi_mode == "required" else None
        return out, None

    def close(self) -> None:
        if self._smi_started and self._smi_module is not None:
            try:
                self._smi_module.amdsmi_shut_down()
            except Exception as exc:
                log.warning("amdsmi shut down failed", error=_smi_text(exc))
            self._smi_started = False

    # ------------------------------------------------------------------ telemetry
    def sample(self) -> TelemetrySample:
        """sysfs and KFD's figures for the units of the last discovery (``telemetry.py``); a GPU whose files
        cannot be read is reported without figures, logged once."""
        with self._lock:
            units = list(self._sampled)
        sample, errors = self._sampler.sample(units)
        for error in errors:
            if error not in self._sample_errors:
                self._sample_errors.add(error)
                log.warning("telemetry: a GPU's figures cannot be read", error=error)
        return sample

    # ------------------------------------------------------------------ discovery
    def _served(self, unit: Unit) -> bool:
        wanted = getattr(self.config, "partition_type", None)
        return wanted is None or unit.gpu.mode == wanted

    def device_id(self, unit: Unit) -> str:
        return unit.id

    def discover(self) -> list[Device]:
        with self._lock:
            snap = self.reader.read()
            ecc, smi_reason = self._smi_ecc() if snap.driver_loaded else ({}, None)
            gpu_reasons = {g.bdf: self._gpu_reason(g, ecc, smi_reason) for g in snap.gpus}
            siblings = Counter(u.gpu.bdf for u in snap.units)
            devices: list[Device] = []
            units: dict[str, Unit] = {}
            sampled: list[SampledUnit] = []
            for unit in snap.units:
                if not self._served(unit):
                    continue
                device_id = self.device_id(unit)
                units[device_id] = unit
                reason = gpu_reasons[unit.gpu.bdf] or self._unit_reason(unit)
                device = self._device(device_id, unit, reason, siblings[unit.gpu.bdf])
                devices.append(device)
                whole = siblings[unit.gpu.bdf] <= 1
                sampled.append(SampledUnit(device.uuid or device.id, unit, unit.partition == 0, whole))
            self._units, self._snapshot, self._sampled = units, snap, sampled
            self._log_changes(snap, devices)
            return devices

    def _gpu_reason(self, gpu: Gpu, ecc: dict[str, int], smi_reason: str | None) -> str | None:
        if gpu.error is not None:
            return "bad-sysfs"
        for block, count in gpu.ras_uncorrectable:
            if self._memory.failing(gpu.bdf, block, count):
                return f"ras-uncorrectable-{block}"
        if self._memory.failing(gpu.bdf, "ecc", ecc.get(gpu.bdf, 0)):
            return "ecc-uncorrectable"
        return smi_reason

    def _unit_reason(self, unit: Unit) -> str | None:
        for node, _ in self.control_nodes:
            if not self.host.exists(node):
                return f"no-{node.rsplit('/', 1)[1]}"
        if unit.card is None or unit.render is None:
            return "no-drm-device"
        if not (
            self.host.exists(f"/dev/dri/card{unit.card}")
            and self.host.exists(f"/dev/dri/renderD{unit.render}")
        ):
            return "no-device-node"
        if unit.kfd is None:
            return "no-kfd-node"
        return None

    def _device(self, device_id: str, unit: Unit, reason: str | None, siblings: int) -> Device:
        gpu, kfd = unit.gpu, unit.kfd
        device_num = gpu.device_id or (kfd.device_id if kfd else 0)
        uuid = None
        if kfd is not None and kfd.unique_id:
            uuid = amdsmi_uuid(kfd.unique_id, device_num, 0xFF if siblings <= 1 else unit.partition)
        memory = (kfd.memory_bytes if kfd else None) or (gpu.vram_bytes if siblings <= 1 else None)
        extra: dict[str, str | int | bool] = {"pciBusId": gpu.bdf, "partition": unit.partition}
        for key, value in (
            ("card", unit.card),
            ("renderD", unit.render),
            ("xcp", unit.xcp),
            ("kfdNode", kfd.index if kfd else None),
            ("computePartition", gpu.compute_partition or None),
            ("memoryPartition", gpu.memory_partition or None),
            ("gfxTargetVersion", kfd.gfx_target_version if kfd else None),
            ("serial", gpu.serial),
        ):
            if value is not None:
                extra[key] = value
        return Device(
            id=device_id,
            health=Health.UNHEALTHY if reason else Health.HEALTHY,
            health_reason=reason,
            numa_nodes=(gpu.numa_node,) if gpu.numa_node is not None and gpu.numa_node >= 0 else (),
            model=gpu.product_name or MODELS.get(device_num),
            uuid=uuid,
            index=unit.render - 128 if unit.render is not None else None,
            memory_mib=memory // (1024 * 1024) if memory else None,
            cores=kfd.simd_count // kfd.simd_per_cu if kfd and kfd.simd_per_cu else None,
            pci_bus_id=gpu.bdf,
            pcie_root=self._placement.pcie_root(gpu.bdf),
            link_domain=self._hive(gpu),
            extra=extra,
        )

    def _hive(self, gpu: Gpu) -> str | None:
        """The GPU's xGMI hive (``xgmi_hive_info/xgmi_hive_id``, the driver's ``%llu``) as a link domain:
        GPUs of one hive reach each other over xGMI. 0 or no file: not in a hive."""
        path = f"{DRIVER_DIR}/{gpu.bdf}/xgmi_hive_info/xgmi_hive_id"
        try:
            hive = self.host.read_int(path, 10)
        except HostFileError as exc:
            self._placement.omitted(gpu.bdf, "linkDomain", str(exc))
            return None
        if hive is not None and not 0 <= hive < 2**64:
            self._placement.omitted(gpu.bdf, "linkDomain", f"{path}: {hive} is not a 64-bit hive ID")
            return None
        return f"xgmi-{hive}" if hive else None

    def _log_changes(self, snap: Snapshot, devices: list[Device]) -> None:
        if snap.driver_loaded != self._driver_reported:
            if not snap.driver_loaded:
                log.warning(
                    f"amdgpu driver not loaded (no /sys/module/amdgpu/drivers); serving no {self.what}s "
                    "until it loads"
                )
            elif self._driver_reported is not None:
                log.info("amdgpu driver loaded")
            self._driver_reported = snap.driver_loaded
        for error in snap.kfd_errors:
            log.warning("ignoring a KFD topology node", error=error)
        now = {d.id: d.health_reason for d in devices}
        before = self._reported or {}
        errors = {g.bdf: g.error for g in snap.gpus if g.error}
        for device in devices:
            reason = now[device.id]
            if device.id in before and before[device.id] == reason:
                continue
            if reason:
                log.warning(
                    f"{self.what} unhealthy",
                    device=device.id,
                    reason=reason,
                    error=errors.get(device.pci_bus_id or ""),
                )
            elif device.id in before:
                log.info(f"{self.what} healthy again", device=device.id)
        self._reported = now

    async def watch(self) -> AsyncGenerator[list[Device]]:
        """Device nodes, GPUs and KFD nodes appearing or going wake it (inotify); partition modes,
        RAS counters and the rest are attribute values, which sysfs never announces, so they are polled."""
        dirs = ["/dev", "/dev/dri", "/sys/module", DRIVER_DIR, KFD_NODES, PLATFORM_DIR]
        async for devices in host_changes(self.discover, lambda: dirs, self.host, self.config.poll_seconds):
            yield devices

    # ------------------------------------------------------------------ allocation
    def _chosen(self, devices: Sequence[Device]) -> list[Unit]:
        try:
            return [self._units[d.id] for d in devices]
        except KeyError as exc:
            raise BackendError(f"not a device of this {self.what} resource: {exc.args[0]}") from None

    def _node(self, path: str, permissions: str) -> DeviceNode:
        return DeviceNode(path, str(self.host.path(path)), permissions)

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        units = self._chosen(devices)
        edits = ContainerEdits()
        edits.device_nodes = [self._node(p, perm) for p, perm in self.control_nodes]
        for unit in units:
            if unit.card is None or unit.render is None:
                raise BackendError(f"{self.device_id(unit)} has no drm device nodes")
            edits.device_nodes += [
                self._node(f"/dev/dri/card{unit.card}", "rw"),
                self._node(f"/dev/dri/renderD{unit.render}", "rw"),
            ]
        return edits

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        """AMD's best-effort policy: partitions of one GPU, then XGMI over PCIe, then one NUMA node;
        partially used GPUs first."""
        units = {d.id: self._units[d.id] for d in [*available, *must_include] if d.id in self._units}
        kfd_nodes = tuple(
            sorted(u.kfd.index for u in self._units.values() if u.kfd)
        )  # all: one read per topology
        if self._links is None or self._links[0] != kfd_nodes:
            self._links = (kfd_nodes, self.reader.links(list(kfd_nodes)))
        total = {u.gpu.bdf: 0 for u in self._units.values()}
        for u in self._units.values():
            total[u.gpu.bdf] += 1
        back = {u.id: device_id for device_id, u in units.items()}
        chosen = best_effort(
            [units[d.id] for d in available if d.id in units],
            [units[d.id] for d in must_include if d.id in units],
            size,
            self._links[1],
            total,
        )
        return [back[i] for i in chosen]

    # ------------------------------------------------------------------ labels
    label_prefix = "amd.com/gpu."
    beta_prefix = "beta.amd.com/gpu."

    def node_labels(self) -> dict[str, str]:
        """AMD's node labeller: ``amd.com/gpu.<name>`` (one value, the first GPU's) and
        ``beta.amd.com/gpu.<name>.<value>`` = how many GPUs have it; partition modes where homogeneous."""
        self.discover()
        snap = self._snapshot
        gpus = [g for g in snap.gpus if g.error is None]
        if not gpus:
            return {}
        facts: dict[str, list[str]] = {}
        for gpu in gpus:
            kfd = snap.kfd.get(gpu.render or -1)
            for name, value in self._facts(gpu, kfd).items():
                if value:
                    facts.setdefault(name, []).append(value)
        labels: dict[str, str] = {}
        for name, values in facts.items():
            if self.label_prefix:
                labels[self.label_prefix + name] = values[0]
            for value in sorted(set(values)):
                labels[f"{self.beta_prefix}{name}.{value}"] = str(values.count(value))
        labels.update(self._partition_labels(gpus))
        return labels

    def _facts(self, gpu: Gpu, kfd: Any) -> dict[str, str | None]:
        vram = gpu.vram_bytes
        gfx = kfd.gfx_target_version if kfd else 0
        return {
            "family": _family(gfx),
            "device-id": f"{gpu.device_id:04x}" if gpu.device_id is not None else None,
            "product-name": _label_value(gpu.product_name or MODELS.get(gpu.device_id or 0) or ""),
            "vram": f"{round(vram / 2**30)}G" if vram else None,
            "simd-count": str(kfd.simd_count) if kfd else None,
            "cu-count": str(kfd.simd_count // kfd.simd_per_cu) if kfd and kfd.simd_per_cu else None,
            "driver-version": _label_value(self.host.read("/sys/module/amdgpu/version") or ""),
            "driver-src-version": _label_value(self.host.read("/sys/module/amdgpu/srcversion") or ""),
        }

    def _partition_labels(self, gpus: list[Gpu]) -> dict[str, str]:
        modes = {g.mode for g in gpus}
        labels = {
            "amd.com/gpu.compute-partitioning-supported": str(gpus[0].compute_supported).lower(),
            "amd.com/gpu.memory-partitioning-supported": str(gpus[0].memory_supported).lower(),
        }
        if len(modes) == 1 and (mode := modes.pop()):
            compute, memory = mode.split("_")
            labels["amd.com/gpu.compute-memory-partition"] = mode
            labels["amd.com/gpu.compute-partitioning-mode"] = compute
            labels["amd.com/gpu.memory-partitioning-mode"] = memory
        return labels


@register_backend("hygon", HygonConfig)
class HygonBackend(AmdBackend):
    vendor = HYGON_VENDOR
    vendor_label = "hygon"
    what = "Hygon DCU"
    control_nodes = (("/dev/kfd", "rwm"), ("/dev/mkfd", "rwm"))
    label_prefix = ""  # the fork's labeller writes only the experimental form
    beta_prefix = "beta.dcu/gpu."

    def device_id(self, unit: Unit) -> str:
        serial = unit.gpu.serial or (
            f"{unit.kfd.unique_id:016X}" if unit.kfd and unit.kfd.unique_id else None
        )
        return f"DCU-{serial}" if serial else unit.id

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        edits = super().allocate(devices)
        path = getattr(self.config, "hyhal_path", "/opt/hyhal")
        edits.mounts.append(Mount(path, str(self.host.path(path)), True))
        return edits

    def _partition_labels(self, gpus: list[Gpu]) -> dict[str, str]:
        return {}


def _family(gfx: int) -> str | None:
    """libdrm's family name from the gfx target version (gfx9: AI, gfx10: NV, gfx11/12: GC_*)."""
    major = gfx // 10000
    return {9: "AI", 10: "NV", 11: "GC_11_0_0", 12: "GC_12_0_0"}.get(major)


def _label_value(text: str) -> str | None:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in text.strip())[:63].strip("-_.")
    return cleaned or None


def _smi_text(exc: BaseException) -> str:
    code = getattr(exc, "err_code", None)
    text = str(exc) or type(exc).__name__
    return f"{text} (err_code {code})" if code is not None and str(code) not in text else text

"""What NVML says about the GPUs and MIG devices of this node, read once into plain records.

A GPU whose queries fail part-way (fallen off the bus, driver trouble) is kept with an
``error`` so it is reported unhealthy rather than silently dropped; only a GPU without
even a UUID is skipped, because nothing stable could name it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kxpu.backends.nvidia.nvml import Nvml, describe, is_code, text
from kxpu.logs import get_logger

log = get_logger("kxpu.backends.nvidia")

MIB = 1024 * 1024
GIB = 1024 * MIB
_CAP_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class MigInfo:
    parent_uuid: str
    parent_index: int
    slot: int  # the MIG device's index on its parent (nvmlDeviceGetMigDeviceHandleByIndex)
    uuid: str
    gi: int
    ci: int
    gi_slices: int
    ci_slices: int
    memory_mib: int
    profile: str
    cap_paths: tuple[str, ...]  # /dev/nvidia-caps/nvidia-capN for the GI and the CI (container paths)

    @property
    def index_id(self) -> str:
        return f"{self.parent_index}:{self.slot}"


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str = "unknown"
    memory_mib: int | None = None
    pci_bus_id: str | None = None  # NVML form: 00000000:07:00.0
    numa_node: int | None = None
    minor: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    migs: tuple[MigInfo, ...] = ()
    error: str | None = None  # set when a query failed: the GPU is reported unhealthy
    handle: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Inventory:
    gpus: tuple[GpuInfo, ...]
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None


def linux_pci_address(nvml_bus_id: str) -> str:
    """NVML's ``00000000:07:00.0`` → Linux's ``0000:07:00.0`` (4-digit domain, lower case)."""
    domain, _, rest = nvml_bus_id.partition(":")
    return f"{domain[-4:].rjust(4, '0')}:{rest}".lower()


def mig_profile_name(gi_slices: int, ci_slices: int, memory_mib: int, parent_total_bytes: int) -> str:
    """NVIDIA's profile naming: memory as eighths of the GPU, rounded up, times its size in whole GB.

    Instances that do not use all compute slices of their GPU instance get the ``<c>c.`` prefix.
    """
    fraction = memory_mib * MIB / parent_total_bytes if parent_total_bytes else 0.0
    eighths = math.ceil(fraction * 8 - 1e-9) / 8
    total_gb = math.ceil(parent_total_bytes / GIB)
    memory_gb = math.floor(eighths * total_gb + 0.5)
    base = f"{gi_slices}g.{memory_gb}gb"
    return base if ci_slices == gi_slices else f"{ci_slices}c.{base}"


def _cap_device(access_file: Path) -> str | None:
    try:
        match = _CAP_MINOR.search(access_file.read_text())
    except OSError:
        return None
    return f"/dev/nvidia-caps/nvidia-cap{match.group(1)}" if match else None


def _numa_from_sysfs(host_root: Path, bus_id: str) -> int | None:
    path = host_root / "sys/bus/pci/devices" / linux_pci_address(bus_id) / "numa_node"
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _numa(nvml: Nvml, handle: Any, host_root: Path, bus_id: str | None) -> int | None:
    getter = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
    if getter is not None:
        try:
            node = int(getter(handle))
            return node if node >= 0 else None
        except nvml.NVMLError as exc:
            if not is_code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                raise
    return _numa_from_sysfs(host_root, bus_id) if bus_id else None


def read_mig(nvml: Nvml, mig: Any, slot: int, gpu: GpuInfo, host_root: Path) -> MigInfo:
    """One MIG device of ``gpu`` (its handle from ``nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot)``)."""
    return _mig_info(nvml, mig, slot, gpu.index, gpu.uuid, gpu.minor, (gpu.memory_mib or 0) * MIB, host_root)


def _mig_info(
    nvml: Nvml,
    mig: Any,
    slot: int,
    index: int,
    uuid: str,
    minor: int | None,
    total_bytes: int,
    host_root: Path,
) -> MigInfo:
    attrs = nvml.nvmlDeviceGetAttributes(mig)
    gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
    ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
    memory_mib = int(attrs.memorySizeMB)
    caps: list[str] = []
    if minor is not None:
        base = host_root / f"proc/driver/nvidia/capabilities/gpu{minor}/mig/gi{gi}"
        for access in (base / "access", base / f"ci{ci}" / "access"):
            cap = _cap_device(access)
            if cap is None:
                log.warning("MIG capability file missing or unreadable", path=str(access))
            else:
                caps.append(cap)
    return MigInfo(
        parent_uuid=uuid,
        parent_index=index,
        slot=slot,
        uuid=text(nvml.nvmlDeviceGetUUID(mig)),
        gi=gi,
        ci=ci,
        gi_slices=int(attrs.gpuInstanceSliceCount),
        ci_slices=int(attrs.computeInstanceSliceCount),
        memory_mib=memory_mib,
        profile=mig_profile_name(
            int(attrs.gpuInstanceSliceCount),
            int(attrs.computeInstanceSliceCount),
            memory_mib,
            total_bytes,
        ),
        cap_paths=tuple(caps),
    )


def _migs(
    nvml: Nvml, gpu_handle: Any, index: int, uuid: str, minor: int | None, total_bytes: int, host_root: Path
) -> tuple[MigInfo, ...]:
    migs: list[MigInfo] = []
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu_handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu_handle, slot)
        except nvml.NVMLError as exc:
            if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                continue  # an empty slot
            raise
        migs.append(_mig_info(nvml, mig, slot, index, uuid, minor, total_bytes, host_root))
    return tuple(migs)


def _gpu(nvml: Nvml, index: int, host_root: Path) -> GpuInfo | None:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
    except nvml.NVMLError as exc:
        log.error("GPU cannot be identified; skipping it", index=index, error=describe(exc))
        return None
    facts: dict[str, Any] = {"index": index, "uuid": uuid, "handle": handle}
    try:
        facts["name"] = text(nvml.nvmlDeviceGetName(handle))
        facts["minor"] = int(nvml.nvmlDeviceGetMinorNumber(handle))
        total_bytes = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        facts["memory_mib"] = total_bytes // MIB
        bus_id = text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        facts["pci_bus_id"] = bus_id
        facts["numa_node"] = _numa(nvml, handle, host_root, bus_id)
        major, minor_cc = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        facts["compute_capability"] = (int(major), int(minor_cc))
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            facts["mig_capable"] = True
            facts["mig_enabled"] = int(current) == int(nvml.NVML_DEVICE_MIG_ENABLE)
        except nvml.NVMLError as exc:
            if not is_code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                raise
        if facts.get("mig_enabled"):
            facts["migs"] = _migs(nvml, handle, index, uuid, facts["minor"], total_bytes, host_root)
    except nvml.NVMLError as exc:
        facts["error"] = describe(exc)
        log.error("GPU query failed; reporting it unhealthy", index=index, uuid=uuid, error=facts["error"])
    return GpuInfo(**facts)


def cuda_version(raw: int) -> tuple[int, int]:
    """NVML's integer CUDA version (12040) → (12, 4)."""
    return raw // 1000, (raw % 1000) // 10


def discover(nvml: Nvml, host_root: Path) -> Inventory:
    """Enumerate every GPU (NVML must be initialised). Raises NVMLError only if nothing can be counted."""
    count = int(nvml.nvmlDeviceGetCount())
    gpus = tuple(g for g in (_gpu(nvml, i, host_root) for i in range(count)) if g is not None)
    driver: str | None = None
    cuda: tuple[int, int] | None = None
    try:
        driver = text(nvml.nvmlSystemGetDriverVersion())
        cuda = cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
    except nvml.NVMLError as exc:
        log.warning("driver version unavailable", error=describe(exc))
    return Inventory(gpus=gpus, driver_version=driver, cuda_driver_version=cuda)

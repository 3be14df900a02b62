"""A stand-in for the ``pynvml`` module (nvidia-ml-py), driven by machine profiles, for tests without a GPU.

It answers the functions the NVIDIA backend calls with the same names, arguments and
return shapes as nvidia-ml-py: strings come back as ``str``, memory and PCI info as the
binding's own ctypes structures (``c_nvmlMemory_t``, ``nvmlPciInfo_t``), MIG attributes as
``c_nvmlDeviceAttributes``, and failures as the binding's own ``NVMLError`` subclasses with
the real codes (the constants and error classes are taken from pynvml itself, so they
cannot drift). ``nvmlEventSetWait`` really blocks until an event or the timeout, then
raises ``NVML_ERROR_TIMEOUT``, so the backend's health thread runs as it would on a GPU.

Faults are injected in-process (``inject_xid``, ``lose_gpu``, ``fail_event_wait``…) or,
for a daemon in another process started with ``KXPU_FAKE_NVML=<profile>``, through the
unix datagram socket named by ``KXPU_FAKE_NVML_CONTROL`` (see ``send_control``).

What telemetry reads is there too, with the binding's shapes: running processes as the
binding's ``nvmlFriendlyObject`` of ``c_nvmlProcessInfo_v3_t`` fields (``usedGpuMemory`` None
when the driver says "not available"; ``gpuInstanceId`` 0xFFFFFFFF outside MIG), MPS clients
listed apart from other processes (``nvmlDeviceGetMPSComputeRunningProcesses``), utilization as
``c_nvmlUtilization_t`` (NOT_SUPPORTED while MIG is on), per-process SM samples newer than a
timestamp (NOT_FOUND when there are none), power in milliwatts, temperature, clocks in MHz,
ECC totals, and the compute mode (setting it needs root: NO_PERMISSION otherwise). Tests set
them with ``set_processes`` / ``set_telemetry`` or the ``processes`` / ``telemetry`` control ops.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid as uuidlib
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

FAKE_NVML_ENV = "KXPU_FAKE_NVML"
FAKE_NVML_CONTROL_ENV = "KXPU_FAKE_NVML_CONTROL"

_UUID_NS = uuidlib.UUID("0b7c8f5e-3f0d-4d7e-8a1c-5d0c6b9e2a41")
MIB = 1024 * 1024
RESERVED_MIB = 512  # what the fake driver keeps for itself on every GPU (an H200 keeps about 600 MiB)


def _uuid(prefix: str, *parts: object) -> str:
    return f"{prefix}-{uuidlib.uuid5(_UUID_NS, '/'.join(map(str, parts)))}"


@dataclass
class FakeMig:
    gi: int
    ci: int
    gi_slices: int
    ci_slices: int
    memory_mib: int
    uuid: str
    gi_cap_minor: int
    ci_cap_minor: int


@dataclass
class FakeProcess:
    """A process with a context on a GPU (``mps``: a client of an MPS server), as NVML lists it."""

    pid: int
    memory_mib: int | None = None  # None: NVML_VALUE_NOT_AVAILABLE, as on some platforms
    mps: bool = False
    sm_util: int | None = None  # percent of the GPU over the last sample period; None: no sample
    gi: int | None = None  # MIG GPU/compute instance the process runs in
    ci: int | None = None


@dataclass
class FakeGpu:
    name: str
    uuid: str
    memory_mib: int
    bus_id: str  # NVML's 8-digit-domain form, e.g. 00000000:07:00.0
    minor: int
    numa_node: int | None
    cuda_cc: tuple[int, int]
    pcie_switch: str
    host_bridge: str
    numa_via_nvml: bool = True  # False: nvmlDeviceGetNumaNodeId is NOT_SUPPORTED, sysfs has it
    mig_capable: bool = False
    mig_enabled: bool = False
    migs: list[FakeMig] = field(default_factory=list)
    max_mig_devices: int = 7
    nvlinks: list[str | None] = field(default_factory=list)  # remote PCI bus id per link; None = down
    lost: bool = False
    # What telemetry reads (settable with set_telemetry / set_processes).
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    processes: list[FakeProcess] = field(default_factory=list)
    utilization: tuple[int, int] = (0, 0)  # (gpu, memory) percent
    power_mw: int = 62000
    temperature_c: int = 34
    clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {
            pynvml.NVML_CLOCK_GRAPHICS: 210,
            pynvml.NVML_CLOCK_SM: 210,
            pynvml.NVML_CLOCK_MEM: 1593,
            pynvml.NVML_CLOCK_VIDEO: 795,
        }
    )
    ecc_supported: bool = True
    ecc_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) → count


@dataclass
class MachineProfile:
    name: str
    gpus: list[FakeGpu]
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040
    init_error: int | None = None  # an NVML_ERROR_* code nvmlInit raises (no driver, no library, …)
    privileged: bool = True  # as root: settings (compute mode) may be changed


# --------------------------------------------------------------------------- profiles


def _bus(n: int) -> str:
    return f"00000000:{n:02X}:00.0"


def profile_a100_8x() -> MachineProfile:
    """8x A100-SXM4-80GB on NVSwitch (12 links each), two NUMA nodes, GPU pairs behind PCIe switches."""
    bus_numbers = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD]
    switches = [_bus(0xC0 + n) for n in range(6)]
    gpus = []
    for i, b in enumerate(bus_numbers):
        numa = 0 if i < 4 else 1
        gpus.append(
            FakeGpu(
                name="NVIDIA A100-SXM4-80GB",
                uuid=_uuid("GPU", "a100", i),
                memory_mib=81920,
                bus_id=_bus(b),
                minor=i,
                numa_node=numa,
                cuda_cc=(8, 0),
                pcie_switch=f"sw{i // 2}",
                host_bridge=f"hb{numa}",
                mig_capable=True,
                nvlinks=[switches[link // 2] for link in range(12)],
            )
        )
    return MachineProfile("a100-8x", gpus)


def profile_v100_4x_nvlink() -> MachineProfile:
    """4x V100 with direct, uneven NVLinks: 0-1 and 2-3 have 2 links, 0-2 and 1-3 one, 0-3 and 1-2 none."""
    buses = [_bus(0x1A + i) for i in range(4)]
    pairs = {(0, 1): 2, (2, 3): 2, (0, 2): 1, (1, 3): 1}
    links: dict[int, list[str | None]] = {i: [] for i in range(4)}
    for (a, b), count in pairs.items():
        links[a] += [buses[b]] * count
        links[b] += [buses[a]] * count
    gpus = [
        FakeGpu(
            name="Tesla V100-SXM2-16GB",
            uuid=_uuid("GPU", "v100", i),
            memory_mib=16384,
            bus_id=buses[i],
            minor=i,
            numa_node=0,
            cuda_cc=(7, 0),
            pcie_switch=f"sw{i}",
            host_bridge="hb0",
            nvlinks=[*links[i], None, None],
        )
        for i in range(4)
    ]
    return MachineProfile("v100-4x-nvlink", gpus, driver_version="535.161.08", cuda_driver_version=12020)


def _h100(i: int, migs: list[tuple[int, int, int]] | None, tag: str) -> FakeGpu:
    """An H100 80GB; ``migs`` = (gi slices, ci slices, memory MiB) per MIG device, or None for MIG off."""
    gpu = FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        uuid=_uuid("GPU", tag, i),
        memory_mib=81559,
        bus_id=_bus(0x18 + 0x10 * i),
        minor=i,
        numa_node=i % 2,
        numa_via_nvml=False,  # exercise the sysfs fallback
        cuda_cc=(9, 0),
        pcie_switch=f"sw{i}",
        host_bridge=f"hb{i % 2}",
        mig_capable=True,
        mig_enabled=migs is not None,
    )
    for j, (g, c, mem) in enumerate(migs or []):
        gi = j + 1
        gpu.migs.append(
            FakeMig(
                gi=gi,
                ci=0,
                gi_slices=g,
                ci_slices=c,
                memory_mib=mem,
                uuid=_uuid("MIG", tag, i, j),
                gi_cap_minor=100 * (i + 1) + 10 * gi,
                ci_cap_minor=100 * (i + 1) + 10 * gi + 1,
            )
        )
    return gpu


_MIG_1G = (1, 1, 9856)
_MIG_2G = (2, 2, 19968)
_MIG_3G = (3, 3, 40192)


def profile_h100_mig_mixed() -> MachineProfile:
    """GPU 0: MIG on with 3g.40gb + 2g.20gb + 2x 1g.10gb; GPU 1: MIG off."""
    return MachineProfile(
        "h100-mig-mixed", [_h100(0, [_MIG_3G, _MIG_2G, _MIG_1G, _MIG_1G], "mixed"), _h100(1, None, "mixed")]
    )


def profile_h100_mig_single() -> MachineProfile:
    """Two GPUs, each split into 7x 1g.10gb."""
    return MachineProfile("h100-mig-single", [_h100(i, [_MIG_1G] * 7, "single") for i in range(2)])


def profile_h100_mig_empty() -> MachineProfile:
    """MIG enabled but no MIG devices created: an invalid configuration for every MIG strategy."""
    return MachineProfile("h100-mig-empty", [_h100(0, [], "empty")])


def profile_a100_lost() -> MachineProfile:
    """Two PCIe A100s; GPU 1 has fallen off the bus (only its handle and UUID still answer)."""
    gpus = [
        FakeGpu(
            name="NVIDIA A100-PCIE-40GB",
            uuid=_uuid("GPU", "lost", i),
            memory_mib=40960,
            bus_id=_bus(0x3B + 0x40 * i),
            minor=i,
            numa_node=i,
            cuda_cc=(8, 0),
            pcie_switch=f"sw{i}",
            host_bridge=f"hb{i}",
            mig_capable=True,
        )
        for i in range(2)
    ]
    gpus[1].lost = True
    return MachineProfile("a100-lost", gpus)


def profile_no_driver() -> MachineProfile:
    return MachineProfile("no-driver", [], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)


PROFILES: dict[str, Callable[[], MachineProfile]] = {
    "a100-8x": profile_a100_8x,
    "v100-4x-nvlink": profile_v100_4x_nvlink,
    "h100-mig-mixed": profile_h100_mig_mixed,
    "h100-mig-single": profile_h100_mig_single,
    "h100-mig-empty": profile_h100_mig_empty,
    "a100-lost": profile_a100_lost,
    "no-driver": profile_no_driver,
}


def load_profile(name: str) -> MachineProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(
            f"unknown fake NVML profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


# --------------------------------------------------------------------------- handles and events


@dataclass(frozen=True)
class FakeHandle:
    gpu: int
    mig: int | None = None  # slot index for MIG device handles


@dataclass
class FakeEventData:
    """The fields of nvml's ``c_nvmlEventData_t`` (the device is a fake handle)."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


NO_INSTANCE = 0xFFFFFFFF


class FakeEventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu index → event mask
        self.queue: deque[FakeEventData] = deque()
        self.failure: int | None = None
        self.freed = False
        self.cond = threading.Condition()


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """One fake machine; attributes mirror the ``pynvml`` module's functions and constants."""

    # Constants and error classes, straight from the binding.
    NVMLError = pynvml.NVMLError

    def __init__(self, profile: MachineProfile | str) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.gpus = self.profile.gpus
        self._lock = threading.Lock()
        self._initialized = 0
        self._event_sets: list[FakeEventSet] = []
        self.calls: dict[str, int] = {}
        self._host_root: Path | None = None
        self._control: socket.socket | None = None

    def __getattr__(self, name: str) -> Any:
        # NVML_* constants, nvmlEventType*, NVMLError_* classes and ctypes structures come from pynvml.
        if name.startswith(("NVML_", "nvmlEventType", "NVMLError_", "c_nvml", "nvmlPciInfo", "nvmlMemory_v")):
            return getattr(pynvml, name)
        raise AttributeError(f"fake NVML has no {name!r}")

    # ------------------------------------------------------------------ lifecycle
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.profile.init_error is not None:
            raise _err(self.profile.init_error)
        with self._lock:
            self._initialized += 1

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        with self._lock:
            if self._initialized == 0:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            self._initialized -= 1

    @property
    def initialized(self) -> bool:
        return self._initialized > 0

    def _check_init(self) -> None:
        if self._initialized == 0:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: FakeHandle, allow_lost: bool = False) -> FakeGpu:
        self._check_init()
        if not isinstance(handle, FakeHandle) or not 0 <= handle.gpu < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[handle.gpu]
        if gpu.lost and not allow_lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _mig(self, handle: FakeHandle) -> FakeMig:
        gpu = self._gpu(handle)
        if handle.mig is None or not gpu.mig_enabled or handle.mig >= len(gpu.migs):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.migs[handle.mig]

    # ------------------------------------------------------------------ system
    def nvmlSystemGetDriverVersion(self) -> str:
        self._check_init()
        return self.profile.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check_init()
        return self.profile.cuda_driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.nvmlSystemGetCudaDriverVersion()

    # ------------------------------------------------------------------ devices
    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeHandle:
        self._check_init()
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return FakeHandle(i)
            for j, mig in enumerate(gpu.migs):
                if mig.uuid == uuid:
                    return FakeHandle(i, j)
        raise _err(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._gpu(handle, allow_lost=True)
        return handle.gpu

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        gpu = self._gpu(handle, allow_lost=True)  # the driver caches it: a lost GPU still answers
        if handle.mig is not None:
            return self._mig(handle).uuid
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        gpu = self._gpu(handle)
        if handle.mig is not None:
            mig = self._mig(handle)
            mem_gb = round(mig.memory_mib / 1024)
            return f"{gpu.name} MIG {mig.gi_slices}g.{mem_gb}gb"
        return gpu.name

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        gpu = self._gpu(handle)
        total = (self._mig(handle).memory_mib if handle.mig is not None else gpu.memory_mib) * MIB
        # The driver reserves memory on every GPU; v1's ``used`` counts it, v2 reports it apart (as the driver does).
        reserved = min(total, RESERVED_MIB * MIB)
        used = min(total - reserved, sum((p.memory_mib or 0) * MIB for p in self._processes_of(handle, gpu)))
        if version == pynvml.nvmlMemory_v2:
            free = total - reserved - used
            return pynvml.c_nvmlMemory_v2_t(
                version=version, total=total, reserved=reserved, free=free, used=used
            )
        if version:  # driver 580 answers an unknown structure version so, not ARGUMENT_VERSION_MISMATCH
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return pynvml.c_nvmlMemory_t(total=total, free=total - reserved - used, used=reserved + used)

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        gpu = self._gpu(handle)
        domain, bus, rest = gpu.bus_id.split(":")
        dev = rest.split(".")[0]
        legacy = f"{int(domain, 16):04X}:{bus}:{dev}.0"
        return pynvml.nvmlPciInfo_t(
            busIdLegacy=legacy.encode(),
            domain=int(domain, 16),
            bus=int(bus, 16),
            device=int(dev, 16),
            pciDeviceId=0x20B210DE,
            pciSubSystemId=0x147F10DE,
            busId=gpu.bus_id.encode(),
        )

    def nvmlDeviceGetMinorNumber(self, handle: FakeHandle) -> int:
        return self._gpu(handle).minor

    def nvmlDeviceGetNumaNodeId(self, handle: FakeHandle) -> int:
        gpu = self._gpu(handle)
        if not gpu.numa_via_nvml:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return -1 if gpu.numa_node is None else gpu.numa_node

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        return self._gpu(handle).cuda_cc

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        gpu = self._gpu(handle)
        if not gpu.mig_capable:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.max_mig_devices

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        gpu = self._gpu(handle)
        if not gpu.mig_enabled or not 0 <= index < len(gpu.migs):  # as driver 580 answers with MIG off
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeHandle(handle.gpu, index)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: FakeHandle) -> FakeHandle:
        self._mig(handle)
        return FakeHandle(handle.gpu)

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeHandle) -> ctypes.c_uint:
        return ctypes.c_uint(handle.mig is not None)  # the binding hands back its ctypes value, not an int

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        return self._mig(handle).gi

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeHandle) -> int:
        return self._mig(handle).ci

    def nvmlDeviceGetAttributes(self, handle: FakeHandle) -> Any:
        if handle.mig is None:
            self._gpu(handle)
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a whole GPU has no MIG attributes
        mig = self._mig(handle)
        return pynvml.c_nvmlDeviceAttributes(
            multiprocessorCount=16 * mig.ci_slices,
            sharedCopyEngineCount=mig.gi_slices,
            sharedDecoderCount=mig.gi_slices,
            sharedEncoderCount=0,
            sharedJpegCount=mig.gi_slices,
            sharedOfaCount=0,
            gpuInstanceSliceCount=mig.gi_slices,
            computeInstanceSliceCount=mig.ci_slices,
            memorySizeMB=mig.memory_mib,
        )

    # ------------------------------------------------------------------ telemetry and compute mode
    def _whole(self, handle: FakeHandle) -> FakeGpu:
        """A query that whole GPUs answer and MIG device handles do not."""
        gpu = self._gpu(handle)
        if handle.mig is not None:
            self._mig(handle)
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _processes_of(self, handle: FakeHandle, gpu: FakeGpu) -> list[FakeProcess]:
        if handle.mig is None:
            return list(gpu.processes)
        mig = self._mig(handle)
        return [p for p in gpu.processes if (p.gi, p.ci) == (mig.gi, mig.ci)]

    def _process_list(self, handle: FakeHandle, mps: bool) -> list[Any]:
        gpu = self._gpu(handle)
        out = []
        for p in self._processes_of(handle, gpu):
            if p.mps != mps:
                continue
            info = pynvml.c_nvmlProcessInfo_v3_t(
                pid=p.pid,
                usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if p.memory_mib is None
                else p.memory_mib * MIB,
                gpuInstanceId=NO_INSTANCE if p.gi is None else p.gi,
                computeInstanceId=NO_INSTANCE if p.ci is None else p.ci,
            )
            obj = pynvml.nvmlStructToFriendlyObject(info)  # what the binding hands back
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._process_list(handle, mps=False)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeHandle) -> list[Any]:
        return self._process_list(handle, mps=True)

    def nvmlDeviceGetProcessUtilization(self, handle: FakeHandle, timeStamp: int) -> list[Any]:
        gpu = self._gpu(handle)
        if gpu.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now_us = int(time.time() * 1_000_000)
        samples = [
            pynvml.c_nvmlProcessUtilizationSample_t(
                pid=p.pid, timeStamp=now_us, smUtil=p.sm_util, memUtil=0, encUtil=0, decUtil=0
            )
            for p in gpu.processes
            if p.sm_util is not None and now_us > timeStamp
        ]
        if not samples:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)  # no sample newer than timeStamp
        return samples

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        gpu = self._whole(handle)
        if gpu.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization[0], memory=gpu.utilization[1])

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._whole(handle).power_mw

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        gpu = self._whole(handle)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.temperature_c

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, type: int) -> int:
        gpu = self._whole(handle)
        if type not in gpu.clocks_mhz:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # what driver 580 answers for an unknown clock type
        return gpu.clocks_mhz[type]

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle)
        if errorType not in (0, 1) or counterType not in (0, 1):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not gpu.ecc_supported:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.ecc_errors.get((errorType, counterType), 0)

    def nvmlDeviceGetComputeMode(self, handle: FakeHandle) -> int:
        return self._whole(handle).compute_mode

    def nvmlDeviceSetComputeMode(self, handle: FakeHandle, mode: int) -> None:
        gpu = self._whole(handle)
        if not self.profile.privileged:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # support removed from the driver
        if mode not in (
            pynvml.NVML_COMPUTEMODE_DEFAULT,
            pynvml.NVML_COMPUTEMODE_PROHIBITED,
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        ):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._count("nvmlDeviceSetComputeMode")
        gpu.compute_mode = mode

    # ------------------------------------------------------------------ topology
    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeHandle, b: FakeHandle) -> int:
        ga, gb = self._gpu(a), self._gpu(b)
        if a.gpu == b.gpu:
            return int(pynvml.NVML_TOPOLOGY_INTERNAL)
        if ga.pcie_switch == gb.pcie_switch:
            return int(pynvml.NVML_TOPOLOGY_SINGLE)
        if ga.host_bridge == gb.host_bridge:
            return int(pynvml.NVML_TOPOLOGY_HOSTBRIDGE)
        if ga.numa_node == gb.numa_node:
            return int(pynvml.NVML_TOPOLOGY_NODE)
        return int(pynvml.NVML_TOPOLOGY_SYSTEM)

    def _link(self, handle: FakeHandle, link: int) -> str | None:
        gpu = self._gpu(handle)
        if not gpu.nvlinks:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        remote = self._link(handle, link)
        return int(pynvml.NVML_FEATURE_ENABLED if remote is not None else pynvml.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeHandle, link: int) -> Any:
        remote = self._link(handle, link)
        if remote is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.nvmlPciInfo_t(busId=remote.encode())

    # ------------------------------------------------------------------ events
    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._check_init()
        es = FakeEventSet()
        with self._lock:
            self._event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        self._gpu(handle)
        return int(
            pynvml.nvmlEventTypeXidCriticalError
            | pynvml.nvmlEventTypeDoubleBitEccError
            | pynvml.nvmlEventTypeSingleBitEccError
            | pynvml.nvmlEventTypePState
        )

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, es: FakeEventSet) -> None:
        self._gpu(handle)
        if handle.mig is not None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with es.cond:
            es.registered[handle.gpu] = es.registered.get(handle.gpu, 0) | event_types

    def nvmlEventSetWait(self, es: FakeEventSet, timeoutms: int) -> FakeEventData:
        self._check_init()
        self._count("nvmlEventSetWait")
        with es.cond:
            es.cond.wait_for(lambda: es.queue or es.failure is not None or es.freed, timeoutms / 1000)
            if es.failure is not None:
                raise _err(es.failure)
            if es.freed:
                raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
            if not es.queue:
                raise _err(pynvml.NVML_ERROR_TIMEOUT)
            return es.queue.popleft()

    def nvmlEventSetWait_v2(self, es: FakeEventSet, timeoutms: int) -> FakeEventData:
        return self.nvmlEventSetWait(es, timeoutms)

    def nvmlEventSetFree(self, es: FakeEventSet) -> None:
        with es.cond:
            es.freed = True
            es.cond.notify_all()
        with self._lock:
            if es in self._event_sets:
                self._event_sets.remove(es)

    # ------------------------------------------------------------------ fault injection
    def _deliver(self, gpu: int, event_type: int, data: int, gi: int, ci: int) -> int:
        delivered = 0
        with self._lock:
            sets = list(self._event_sets)
        for es in sets:
            with es.cond:
                if es.registered.get(gpu, 0) & event_type:
                    es.queue.append(FakeEventData(FakeHandle(gpu), event_type, data, gi, ci))
                    es.cond.notify_all()
                    delivered += 1
        return delivered

    def inject_xid(self, gpu: int, xid: int, gi: int | None = None, ci: int | None = None) -> int:
        """Raise an Xid critical error on GPU ``gpu`` (optionally on a MIG GI/CI); returns sets reached."""
        return self._deliver(
            gpu,
            int(pynvml.nvmlEventTypeXidCriticalError),
            xid,
            NO_INSTANCE if gi is None else gi,
            NO_INSTANCE if ci is None else ci,
        )

    def inject_double_bit_ecc(self, gpu: int) -> int:
        return self._deliver(gpu, int(pynvml.nvmlEventTypeDoubleBitEccError), 0, NO_INSTANCE, NO_INSTANCE)

    def lose_gpu(self, gpu: int, xid: int | None = 79) -> None:
        """The GPU falls off the bus: its queries fail with GPU_IS_LOST; Xid 79 is reported (as drivers do)."""
        self.gpus[gpu].lost = True
        if xid is not None:
            self.inject_xid(gpu, xid)

    def restore_gpu(self, gpu: int) -> None:
        self.gpus[gpu].lost = False

    def set_processes(self, gpu: int, processes: list[FakeProcess]) -> None:
        """Replace what runs on GPU ``gpu`` (compute and MPS clients)."""
        self.gpus[gpu].processes = list(processes)

    def set_telemetry(
        self,
        gpu: int,
        utilization: tuple[int, int] | None = None,
        power_mw: int | None = None,
        temperature_c: int | None = None,
        clocks_mhz: dict[int, int] | None = None,
        ecc: dict[tuple[int, int], int] | None = None,
    ) -> None:
        target = self.gpus[gpu]
        if utilization is not None:
            target.utilization = utilization
        if power_mw is not None:
            target.power_mw = power_mw
        if temperature_c is not None:
            target.temperature_c = temperature_c
        if clocks_mhz is not None:
            target.clocks_mhz.update(clocks_mhz)
        if ecc is not None:
            target.ecc_errors.update(ecc)

    def fail_event_wait(self, code: int | None = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """Make every nvmlEventSetWait fail with ``code`` (None: work again)."""
        with self._lock:
            sets = list(self._event_sets)
        for es in sets:
            with es.cond:
                es.failure = code
                es.cond.notify_all()

    # ------------------------------------------------------------------ host files
    @property
    def host_root(self) -> Path:
        """A directory laid out like / for what NVML does not answer: sysfs NUMA nodes, MIG capability files."""
        if self._host_root is None:
            root = Path(tempfile.mkdtemp(prefix=f"kxpu-fake-nvml-{self.profile.name}-"))
            for gpu in self.gpus:
                domain, rest = gpu.bus_id.split(":", 1)
                linux_bus = f"{domain[-4:]}:{rest}".lower()
                pci = root / "sys/bus/pci/devices" / linux_bus
                pci.mkdir(parents=True, exist_ok=True)
                (pci / "numa_node").write_text(f"{-1 if gpu.numa_node is None else gpu.numa_node}\n")
                for mig in gpu.migs:
                    gi_dir = root / f"proc/driver/nvidia/capabilities/gpu{gpu.minor}/mig/gi{mig.gi}"
                    ci_dir = gi_dir / f"ci{mig.ci}"
                    ci_dir.mkdir(parents=True, exist_ok=True)
                    (gi_dir / "access").write_text(
                        f"DeviceFileMinor: {mig.gi_cap_minor}\nDeviceFileMode: 292\n"
                    )
                    (ci_dir / "access").write_text(
                        f"DeviceFileMinor: {mig.ci_cap_minor}\nDeviceFileMode: 292\n"
                    )
            self._host_root = root
            # Removed when this fake goes away or the process exits, whichever comes first.
            weakref.finalize(self, shutil.rmtree, root, True)
        return self._host_root

    # ------------------------------------------------------------------ cross-process control
    def serve_control(self, path: str) -> None:
        """Accept JSON fault commands on a unix datagram socket (blocking reads in a daemon thread)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        self._control = sock
        threading.Thread(
            target=self._control_loop, args=(sock,), name="fake-nvml-control", daemon=True
        ).start()

    def _control_loop(self, sock: socket.socket) -> None:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            try:
                self.apply(json.loads(data))
            except Exception as exc:  # a bad command must not kill the fake
                print(f"fake NVML: bad control message {data!r}: {exc}", flush=True)

    def apply(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "xid":
            self.inject_xid(int(message["gpu"]), int(message["xid"]), message.get("gi"), message.get("ci"))
        elif op == "ecc":
            self.inject_double_bit_ecc(int(message["gpu"]))
        elif op == "lose":
            self.lose_gpu(int(message["gpu"]))
        elif op == "restore":
            self.restore_gpu(int(message["gpu"]))
        elif op == "fail-wait":
            self.fail_event_wait(message.get("code", pynvml.NVML_ERROR_UNKNOWN))
        elif op == "processes":
            self.set_processes(
                int(message["gpu"]),
                [
                    FakeProcess(
                        int(p["pid"]),
                        p.get("memoryMiB"),
                        bool(p.get("mps", False)),
                        p.get("smUtil"),
                        p.get("gi"),
                        p.get("ci"),
                    )
                    for p in message.get("processes", [])
                ],
            )
        elif op == "telemetry":
            utilization = message.get("utilization")
            self.set_telemetry(
                int(message["gpu"]),
                utilization=(int(utilization[0]), int(utilization[1])) if utilization is not None else None,
                power_mw=message.get("powerMw"),
                temperature_c=message.get("temperatureC"),
            )
        elif op == "compute-mode":
            self.gpus[int(message["gpu"])].compute_mode = int(message["mode"])
        else:
            raise ValueError(f"unknown op {op!r}")


def send_control(path: str | os.PathLike[str], **message: Any) -> None:
    """Send one fault command to a fake NVML in another process, e.g. ``send_control(p, op="xid", gpu=0, xid=79)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(json.dumps(message).encode(), os.fspath(path))


_shared: dict[str, FakeNvml] = {}
_shared_lock = threading.Lock()


def from_env() -> FakeNvml | None:
    """The process-wide fake named by ``KXPU_FAKE_NVML`` (one per process, so every backend sees one machine)."""
    name = os.environ.get(FAKE_NVML_ENV)
    if not name:
        return None
    with _shared_lock:
        fake = _shared.get(name)
        if fake is None:
            fake = FakeNvml(name)
            control = os.environ.get(FAKE_NVML_CONTROL_ENV)
            if control:
                fake.serve_control(control)
            _shared[name] = fake
        return fake

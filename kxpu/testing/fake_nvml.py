"""A stand-in for the ``pynvml`` module (nvidia-ml-py), driven by machine profiles, for tests without a GPU.

It answers the functions the NVIDIA backend calls with the same names, arguments and
return shapes as nvidia-ml-py: strings come back as ``str``, memory and PCI info as the
binding's own ctypes structures (``c_nvmlMemory_t``, ``nvmlPciInfo_t``), MIG attributes as
``c_nvmlDeviceAttributes``, and failures as the binding's own ``NVMLError`` subclasses with
the real codes (the constants and error classes are taken from pynvml itself, so they
cannot drift). ``nvmlEventSetWait`` really blocks until an event or the timeout, then
raises ``NVML_ERROR_TIMEOUT``, so the backend's health thread runs as it would on a GPU.

Faults are injected in-process (``inject_xid``, ``lose_gpu``, ``fail_event_wait``…) or,
for a daemon in another process started with ``--import kxpu.testing.fake_nvml`` and
``KXPU_FAKE_NVML=<profile>``, through the unix datagram socket named by ``KXPU_FAKE_NVML_CONTROL``
(see ``send_control``). Importing this module plugs the fake into the backend's seam
(``kxpu.backends.nvidia.nvml.SEAM``); it plays a machine only while ``KXPU_FAKE_NVML`` names one.

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

from kxpu.backends.nvidia.nvml import SEAM, NvmlSource

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


@dataclass(frozen=True)
class MigGiProfile:
    """One GPU instance profile as ``nvmlDeviceGetGpuInstanceProfileInfo`` describes it, with its placements
    (``nvmlDeviceGetGpuInstancePossiblePlacements``: start memory slice, ``size`` memory slices each)."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_* (what GetGpuInstanceProfileInfo is asked for)
    id: int  # the profile ID (nvidia-smi mig -lgip's "ID", what instances are created with)
    name: str  # as the v2 structure names it, e.g. "MIG 1g.10gb"
    slices: int  # compute slices
    instances: int  # instanceCount
    sm: int
    ce: int
    dec: int
    enc: int
    jpeg: int
    ofa: int
    memory_mib: int
    starts: tuple[int, ...]
    size: int


def _gip(index: str, *fields: Any) -> MigGiProfile:
    return MigGiProfile(getattr(pynvml, f"NVML_GPU_INSTANCE_PROFILE_{index}"), *fields)


# What the driver reports: nvidia-smi mig -lgip / -lgipp on an H100 80GB HBM3 (read on one for this fake), and
# NVIDIA's MIG user guide for the A100s. Columns: index, ID, name, slices, instances, SM, CE, DEC, ENC, JPEG,
# OFA, memory MiB (the GiB nvidia-smi prints times 1024), placement starts, memory slices per placement.
MIG_PROFILES_H100_80GB: tuple[MigGiProfile, ...] = (
    _gip("1_SLICE", 19, "MIG 1g.10gb", 1, 7, 16, 1, 1, 0, 1, 0, 9984, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV1", 20, "MIG 1g.10gb+me", 1, 1, 16, 1, 1, 0, 1, 1, 9984, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV2", 15, "MIG 1g.20gb", 1, 4, 26, 1, 1, 0, 1, 0, 20096, (0, 2, 4, 6), 2),
    _gip("2_SLICE", 14, "MIG 2g.20gb", 2, 3, 32, 2, 2, 0, 2, 0, 20096, (0, 2, 4), 2),
    _gip("3_SLICE", 9, "MIG 3g.40gb", 3, 2, 60, 3, 3, 0, 3, 0, 40448, (0, 4), 4),
    _gip("4_SLICE", 5, "MIG 4g.40gb", 4, 1, 64, 4, 4, 0, 4, 0, 40448, (0,), 4),
    _gip("7_SLICE", 0, "MIG 7g.80gb", 7, 1, 132, 8, 7, 0, 7, 1, 81152, (0,), 8),
)
MIG_PROFILES_A100_40GB: tuple[MigGiProfile, ...] = (
    _gip("1_SLICE", 19, "MIG 1g.5gb", 1, 7, 14, 1, 0, 0, 0, 0, 4864, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV1", 20, "MIG 1g.5gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 4864, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV2", 15, "MIG 1g.10gb", 1, 4, 14, 1, 1, 0, 0, 0, 9856, (0, 2, 4, 6), 2),
    _gip("2_SLICE", 14, "MIG 2g.10gb", 2, 3, 28, 2, 1, 0, 0, 0, 9856, (0, 2, 4), 2),
    _gip("3_SLICE", 9, "MIG 3g.20gb", 3, 2, 42, 3, 2, 0, 0, 0, 19968, (0, 4), 4),
    _gip("4_SLICE", 5, "MIG 4g.20gb", 4, 1, 56, 4, 2, 0, 0, 0, 19968, (0,), 4),
    _gip("7_SLICE", 0, "MIG 7g.40gb", 7, 1, 98, 7, 5, 0, 1, 1, 40192, (0,), 8),
)
MIG_PROFILES_A100_80GB: tuple[MigGiProfile, ...] = (
    _gip("1_SLICE", 19, "MIG 1g.10gb", 1, 7, 14, 1, 0, 0, 0, 0, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV1", 20, "MIG 1g.10gb+me", 1, 1, 14, 1, 1, 0, 1, 1, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    _gip("1_SLICE_REV2", 15, "MIG 1g.20gb", 1, 4, 14, 1, 1, 0, 0, 0, 19968, (0, 2, 4, 6), 2),
    _gip("2_SLICE", 14, "MIG 2g.20gb", 2, 3, 28, 2, 1, 0, 0, 0, 19968, (0, 2, 4), 2),
    _gip("3_SLICE", 9, "MIG 3g.40gb", 3, 2, 42, 3, 2, 0, 0, 0, 40192, (0, 4), 4),
    _gip("4_SLICE", 5, "MIG 4g.40gb", 4, 1, 56, 4, 2, 0, 0, 0, 40192, (0,), 4),
    _gip("7_SLICE", 0, "MIG 7g.80gb", 7, 1, 98, 7, 5, 0, 1, 1, 80896, (0,), 8),
)
# Driver 580 knows GPU instance profile indexes up to 2_SLICE_ALL_ME (0x10): it answers INVALID_ARGUMENT for
# 3_SLICE_GFX (0x11), which the binding names, and NOT_SUPPORTED for the ones the GPU lacks (seen on an H100).
DRIVER_GI_PROFILE_COUNT = 0x11
# Compute instance profile index (NVML_COMPUTE_INSTANCE_PROFILE_*) → compute slices; the ID equals the index.
CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


def gi_swizzle_id(start: int, size: int) -> int:
    """The GPU instance ID the driver gives a placement (a binary tree over the 8 memory slices, as nvidia-smi
    mig -lgi shows: the whole GPU 0, halves 1-2, quarters 3-6, eighths 7-14)."""
    level = {8: 0, 4: 1, 2: 3, 1: 7}[size]
    return level + start // size


@dataclass
class FakeComputeInstance:
    """A compute instance handle (``nvmlGpuInstanceCreateComputeInstance``)."""

    gi: FakeGpuInstance
    id: int
    profile_id: int
    slices: int
    start: int
    mig: FakeMig
    destroyed: bool = False


@dataclass
class FakeGpuInstance:
    """A GPU instance handle (``nvmlDeviceCreateGpuInstanceWithPlacement``)."""

    gpu: int  # GPU index
    id: int
    profile: MigGiProfile
    start: int
    cis: dict[int, FakeComputeInstance] = field(default_factory=dict)
    destroyed: bool = False

    @property
    def memory_slices(self) -> range:
        return range(self.start, self.start + self.profile.size)


@dataclass
class FakeInstanceInfo:
    """``c_nvmlGpuInstanceInfo_t`` / ``c_nvmlComputeInstanceInfo_t`` with the same field names; ``device`` (and a
    compute instance's ``gpuInstance``) are fake handles, which no ctypes structure can hold."""

    device: Any
    id: int
    profileId: int
    placement: Any
    gpuInstance: Any = None


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
    # Dynamic MIG: the GPU instance profiles the GPU supports, and the instances made through NVML.
    mig_profiles: tuple[MigGiProfile, ...] = ()
    gpu_instances: dict[int, FakeGpuInstance] = field(default_factory=dict)
    nvlinks: list[str | None] = field(default_factory=list)  # remote PCI bus id per link; None = down
    # NVLink fabric (nvmlDeviceGetGpuFabricInfo): (cluster UUID, clique ID) once registered; None: not supported
    fabric: tuple[str, int] | None = None
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
    energy_mj: int = 1_234_567_000  # nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded
    pcie_kbps: tuple[int, int] = (0, 0)  # nvmlDeviceGetPcieThroughput: (TX, RX) KB/s over the last 20 ms
    # NVML_FI_DEV_PCIE_COUNT_TX_BYTES / _RX_BYTES (Hopper and newer here): bytes since the driver loaded, advanced
    # at ``pcie_kbps`` between reads, and the driver time (µs) they were last advanced to; read modulo 2**32
    pcie_count_bytes: list[float] = field(default_factory=lambda: [7.0e12, 3.0e12])
    pcie_count_at_us: int = 0
    # nvmlDeviceGetRemappedRows: (correctable rows, uncorrectable rows, pending, failure); Ampere and newer
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    clocks_event_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    # NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX per link (scope ID): KiB since the driver loaded
    nvlink_kib: dict[int, tuple[int, int]] = field(default_factory=dict)
    # GPM (Hopper and newer): metric ID → the value nvmlGpmMetricsGet computes between two samples (percent)
    gpm: dict[int, float] = field(default_factory=dict)  # a metric not set here reads 0
    gpm_unsupported: set[int] = field(default_factory=set)  # metric IDs answered NOT_SUPPORTED


@dataclass
class MachineProfile:
    name: str
    gpus: list[FakeGpu]
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040
    init_error: int | None = None  # an NVML_ERROR_* code nvmlInit raises (no driver, no library, …)
    privileged: bool = True  # as root: settings (compute mode) may be changed


# The GPM metric IDs NVML defines (NVML_GPM_METRIC_*, but not the _MAX bound)
_GPM_METRIC_IDS = frozenset(
    getattr(pynvml, name)
    for name in dir(pynvml)
    if name.startswith("NVML_GPM_METRIC_") and not name.endswith("_MAX")
)


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
                mig_profiles=MIG_PROFILES_A100_80GB,
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
        mig_profiles=MIG_PROFILES_H100_80GB,
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


def profile_h100_mig_dynamic() -> MachineProfile:
    """Three H100s: GPUs 0 and 1 in MIG mode with no instance yet (for dynamic MIG), GPU 2 with MIG off."""
    gpus = [_h100(0, [], "dynamic"), _h100(1, [], "dynamic"), _h100(2, None, "dynamic")]
    for gpu in gpus:
        gpu.mig_profiles = MIG_PROFILES_H100_80GB
    return MachineProfile("h100-mig-dynamic", gpus, driver_version="580.95.05", cuda_driver_version=13000)


def profile_a100_mig_dynamic() -> MachineProfile:
    """An A100-SXM4-40GB and an A100-SXM4-80GB, both in MIG mode with no instance yet (for dynamic MIG)."""
    gpus = []
    for i, (name, memory, profiles) in enumerate(
        [
            ("NVIDIA A100-SXM4-40GB", 40960, MIG_PROFILES_A100_40GB),
            ("NVIDIA A100-SXM4-80GB", 81920, MIG_PROFILES_A100_80GB),
        ]
    ):
        gpus.append(
            FakeGpu(
                name=name,
                uuid=_uuid("GPU", "a100-dynamic", i),
                memory_mib=memory,
                bus_id=_bus(0x07 + 0x40 * i),
                minor=i,
                numa_node=0,
                cuda_cc=(8, 0),
                pcie_switch=f"sw{i}",
                host_bridge="hb0",
                mig_capable=True,
                mig_enabled=True,
                mig_profiles=profiles,
            )
        )
    return MachineProfile("a100-mig-dynamic", gpus)


def profile_a100_pcie_4x_bridged() -> MachineProfile:
    """4x A100 PCIe 80GB with NVLink bridges joining 0-1 and 2-3, each pair behind its own CPU (two PCIe root
    complexes, two NUMA nodes): two NVLink islands, so a claim for two GPUs on one island has two answers."""
    buses = [_bus(n) for n in (0x17, 0x31, 0x98, 0xB1)]
    gpus = [
        FakeGpu(
            name="NVIDIA A100 80GB PCIe",
            uuid=_uuid("GPU", "a100-pcie", i),
            memory_mib=81920,
            bus_id=buses[i],
            minor=i,
            numa_node=i // 2,
            cuda_cc=(8, 0),
            pcie_switch=f"sw{i}",
            host_bridge=f"hb{i // 2}",
            mig_capable=True,
            mig_profiles=MIG_PROFILES_A100_80GB,
            nvlinks=[buses[i ^ 1]] * 12,  # a bridge set: 12 links to the partner
        )
        for i in range(4)
    ]
    return MachineProfile("a100-pcie-4x-bridged", gpus)


def profile_gb200_4x() -> MachineProfile:
    """One GB200 NVL72 compute tray: 4 GPUs on the rack's NVLink switches (18 links each), registered with the
    fabric as one clique of a cluster (nvmlDeviceGetGpuFabricInfo)."""
    switches = [_bus(0xE0 + n) for n in range(18)]
    gpus = [
        FakeGpu(
            name="NVIDIA GB200",
            uuid=_uuid("GPU", "gb200", i),
            memory_mib=189471,
            bus_id=_bus(0x01 + 0x40 * i),
            minor=i,
            numa_node=i // 2,
            cuda_cc=(10, 0),
            pcie_switch=f"sw{i}",
            host_bridge=f"hb{i // 2}",
            nvlinks=list(switches),
            fabric=("5e7c1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b", 32766),
        )
        for i in range(4)
    ]
    return MachineProfile("gb200-4x", gpus, driver_version="580.95.05", cuda_driver_version=13000)


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
            mig_profiles=MIG_PROFILES_A100_40GB,
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
    "h100-mig-dynamic": profile_h100_mig_dynamic,
    "a100-mig-dynamic": profile_a100_mig_dynamic,
    "a100-lost": profile_a100_lost,
    "a100-pcie-4x-bridged": profile_a100_pcie_4x_bridged,
    "gb200-4x": profile_gb200_4x,
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


def pcie_root_of(gpu: FakeGpu) -> str:
    """The PCIe root complex a fake GPU sits under: one per host bridge (``hb1`` → ``pci0000:80``), in the
    GPU's PCI domain."""
    digits = "".join(c for c in gpu.host_bridge if c.isdigit()) or "0"
    return f"pci{gpu.bus_id.split(':', 1)[0][-4:].lower()}:{int(digits) * 0x80 % 0x100:02x}"


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _deref(ref: Any) -> Any:
    """The ctypes object behind ``ctypes.byref(x)`` or ``ctypes.pointer(x)``, as the C library writes through it."""
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    obj = getattr(ref, "_obj", None)
    if obj is None:
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return obj


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
        self._gpm_samples: dict[int, tuple[Any, int | None]] = {}  # sample address → (sample, GPU it holds)
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

    # ------------------------------------------------------------------ dynamic MIG (GPU and compute instances)
    def _mig_gpu(self, handle: FakeHandle) -> FakeGpu:
        """A whole GPU that supports MIG (a MIG device handle or a GPU without MIG: NOT_SUPPORTED)."""
        gpu = self._gpu(handle)
        if handle.mig is not None or not gpu.mig_capable or not gpu.mig_profiles:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _gi_profile(self, gpu: FakeGpu, profile_id: int) -> MigGiProfile:
        for profile in gpu.mig_profiles:
            if profile.id == profile_id:
                return profile
        raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, device: FakeHandle, profile: int, version: int = 2) -> Any:
        gpu = self._mig_gpu(device)
        if version not in (1, 2):
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # what the binding raises itself
        if not 0 <= profile < DRIVER_GI_PROFILE_COUNT:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a profile index newer than the driver
        found = next((p for p in gpu.mig_profiles if p.index == profile), None)
        if found is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a profile this GPU does not have
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
        info.id = found.id
        info.isP2pSupported = 0
        info.sliceCount = found.slices
        info.instanceCount = found.instances
        info.multiprocessorCount = found.sm
        info.copyEngineCount = found.ce
        info.decoderCount = found.dec
        info.encoderCount = found.enc
        info.jpegCount = found.jpeg
        info.ofaCount = found.ofa
        info.memorySizeMB = found.memory_mib
        if version == 2:
            info.name = found.name.encode()
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: FakeHandle, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        """As the C function: ``placementsRef`` None asks for the count; else an array of
        ``c_nvmlGpuInstancePlacement_t`` long enough (the driver writes past a short one; the fake refuses it
        with INSUFFICIENT_SIZE). ``countRef``: ``byref``/``pointer`` to a ``c_uint``."""
        gpu = self._mig_gpu(device)
        profile = self._gi_profile(gpu, profileId)
        count = _deref(countRef)
        if placementsRef is not None:
            if len(placementsRef) < len(profile.starts):
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for n, start in enumerate(profile.starts):
                placementsRef[n].start = start
                placementsRef[n].size = profile.size
        count.value = len(profile.starts)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: FakeHandle, profileId: int) -> int:
        gpu = self._mig_gpu(device)  # answers with MIG off too (the driver does: every placement is free)
        profile = self._gi_profile(gpu, profileId)
        made = sum(1 for gi in gpu.gpu_instances.values() if gi.profile.id == profile.id)
        free = sum(1 for start in profile.starts if self._gi_refusal(gpu, profile, start) is None)
        return min(profile.instances - made, free)

    def _gi_refusal(self, gpu: FakeGpu, profile: MigGiProfile, start: int) -> int | None:
        """Why the driver would refuse a GPU instance of ``profile`` at ``start`` now (an NVML error code)."""
        if start not in profile.starts:
            return int(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        wanted = set(range(start, start + profile.size))
        live = list(gpu.gpu_instances.values())
        if any(wanted & set(gi.memory_slices) for gi in live):
            return int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if sum(1 for gi in live if gi.profile.id == profile.id) >= profile.instances:
            return int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        # Media engines (the +me profiles' OFA/JPEG) and compute slices are shared out of the whole GPU's.
        whole = max(gpu.mig_profiles, key=lambda p: p.slices)
        for attr in ("slices", "ofa", "jpeg", "dec", "ce", "sm"):
            if sum(getattr(gi.profile, attr) for gi in live) + getattr(profile, attr) > getattr(whole, attr):
                return int(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return None

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: FakeHandle, profileId: int, placement: Any
    ) -> FakeGpuInstance:
        gpu = self._mig_gpu(device)
        if not gpu.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self.profile.privileged:
            raise _err(pynvml.NVML_ERROR_NO_PERMISSION)
        profile = self._gi_profile(gpu, profileId)
        # The C function takes ``const nvmlGpuInstancePlacement_t *``, and the binding passes the argument through:
        # callers pass ``byref(placement)``; a structure by value would be read as a pointer by the driver.
        if isinstance(placement, ctypes.Structure):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        where = _deref(placement)
        start, size = int(where.start), int(where.size)
        if size != profile.size:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._count("nvmlDeviceCreateGpuInstanceWithPlacement")
        with self._lock:
            refusal = self._gi_refusal(gpu, profile, start)
            if refusal is not None:
                raise _err(refusal)
            gi = FakeGpuInstance(device.gpu, gi_swizzle_id(start, size), profile, start)
            gpu.gpu_instances[gi.id] = gi
        self._write_caps(gpu)
        return gi

    def nvmlDeviceCreateGpuInstance(self, device: FakeHandle, profileId: int) -> FakeGpuInstance:
        """The driver picks the first placement that fits."""
        gpu = self._mig_gpu(device)
        profile = self._gi_profile(gpu, profileId)
        for start in profile.starts:
            if self._gi_refusal(gpu, profile, start) is None:
                return self.nvmlDeviceCreateGpuInstanceWithPlacement(
                    device, profileId, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, profile.size))
                )
        if not gpu.mig_enabled:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)

    def _live_gi(self, gi: FakeGpuInstance) -> FakeGpuInstance:
        self._check_init()
        if not isinstance(gi, FakeGpuInstance) or gi.destroyed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi

    def nvmlDeviceGetGpuInstanceById(self, device: FakeHandle, gpuInstanceId: int) -> FakeGpuInstance:
        gpu = self._mig_gpu(device)
        gi = gpu.gpu_instances.get(int(gpuInstanceId))
        if gi is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)  # with MIG off too, as driver 580 answers
        return gi

    def nvmlGpuInstanceGetInfo(self, gpuInstance: FakeGpuInstance) -> FakeInstanceInfo:
        gi = self._live_gi(gpuInstance)
        return FakeInstanceInfo(
            FakeHandle(gi.gpu),
            gi.id,
            gi.profile.id,
            pynvml.c_nvmlGpuInstancePlacement_t(gi.start, gi.profile.size),
        )

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gpuInstance: FakeGpuInstance, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        gi = self._live_gi(gpuInstance)
        if version not in (1, 2):
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if (
            engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            or profile not in CI_PROFILE_SLICES
        ):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = CI_PROFILE_SLICES[profile]
        if slices > gi.profile.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = gi.profile.slices // slices
        info.multiprocessorCount = gi.profile.sm * slices // gi.profile.slices
        info.sharedCopyEngineCount = gi.profile.ce
        info.sharedDecoderCount = gi.profile.dec
        info.sharedEncoderCount = gi.profile.enc
        info.sharedJpegCount = gi.profile.jpeg
        info.sharedOfaCount = gi.profile.ofa
        if version == 2:
            base = gi.profile.name.removeprefix("MIG ")
            info.name = ("MIG " + (base if slices == gi.profile.slices else f"{slices}c.{base}")).encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: FakeGpuInstance, profileId: int
    ) -> FakeComputeInstance:
        gi = self._live_gi(gpuInstance)
        if profileId not in CI_PROFILE_SLICES:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slices = CI_PROFILE_SLICES[profileId]
        if slices > gi.profile.slices:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu = self.gpus[gi.gpu]
        self._count("nvmlGpuInstanceCreateComputeInstance")
        with self._lock:
            used = sorted(s for ci in gi.cis.values() for s in range(ci.start, ci.start + ci.slices))
            start = next(
                (
                    s
                    for s in range(0, gi.profile.slices - slices + 1, slices)
                    if not set(range(s, s + slices)) & set(used)
                ),
                None,
            )
            if start is None:
                raise _err(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci_id = next(n for n in range(len(gi.cis) + 1) if n not in gi.cis)
            memory = gi.profile.memory_mib
            minor = gpu.minor
            mig = FakeMig(
                gi=gi.id,
                ci=ci_id,
                gi_slices=gi.profile.slices,
                ci_slices=slices,
                memory_mib=memory,
                uuid=f"MIG-{uuidlib.uuid4()}",  # a new UUID each time an instance is made, as the driver's
                gi_cap_minor=1000 * (minor + 1) + 10 * gi.id,
                ci_cap_minor=1000 * (minor + 1) + 10 * gi.id + 1 + ci_id,
            )
            ci = FakeComputeInstance(gi, ci_id, profileId, slices, start, mig)
            gi.cis[ci_id] = ci
            gpu.migs.append(mig)
        self._write_caps(gpu)
        return ci

    def _live_ci(self, ci: FakeComputeInstance) -> FakeComputeInstance:
        self._check_init()
        if not isinstance(ci, FakeComputeInstance) or ci.destroyed or ci.gi.destroyed:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ci

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: FakeGpuInstance, computeInstanceId: int
    ) -> FakeComputeInstance:
        gi = self._live_gi(gpuInstance)
        ci = gi.cis.get(int(computeInstanceId))
        if ci is None:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return ci

    def nvmlComputeInstanceGetInfo(self, computeInstance: FakeComputeInstance) -> FakeInstanceInfo:
        ci = self._live_ci(computeInstance)
        return FakeInstanceInfo(
            FakeHandle(ci.gi.gpu),
            ci.id,
            ci.profile_id,
            pynvml.c_nvmlComputeInstancePlacement_t(ci.start, ci.slices),
            gpuInstance=ci.gi,
        )

    def nvmlComputeInstanceGetInfo_v2(self, computeInstance: FakeComputeInstance) -> FakeInstanceInfo:
        return self.nvmlComputeInstanceGetInfo(computeInstance)

    def nvmlComputeInstanceDestroy(self, computeInstance: FakeComputeInstance) -> int:
        ci = self._live_ci(computeInstance)
        gpu = self.gpus[ci.gi.gpu]
        if any((p.gi, p.ci) == (ci.gi.id, ci.id) for p in gpu.processes):
            raise _err(pynvml.NVML_ERROR_IN_USE)
        self._count("nvmlComputeInstanceDestroy")
        with self._lock:
            ci.destroyed = True
            del ci.gi.cis[ci.id]
            gpu.migs.remove(ci.mig)
        self._write_caps(gpu)
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceDestroy(self, gpuInstance: FakeGpuInstance) -> int:
        gi = self._live_gi(gpuInstance)
        gpu = self.gpus[gi.gpu]
        if gi.cis or any(p.gi == gi.id for p in gpu.processes):
            raise _err(pynvml.NVML_ERROR_IN_USE)  # compute instances (or processes) still in it
        self._count("nvmlGpuInstanceDestroy")
        with self._lock:
            gi.destroyed = True
            del gpu.gpu_instances[gi.id]
        self._write_caps(gpu)
        return int(pynvml.NVML_SUCCESS)

    def mig_state(self) -> list[dict[str, Any]]:
        """The GPU and compute instances that exist now, for tests (``mig-state`` over the control socket)."""
        with self._lock:
            return [
                {
                    "gpu": index,
                    "gi": gi.id,
                    "profile": gi.profile.name.removeprefix("MIG "),
                    "profileId": gi.profile.id,
                    "start": gi.start,
                    "size": gi.profile.size,
                    "cis": [{"ci": ci.id, "uuid": ci.mig.uuid} for ci in gi.cis.values()],
                }
                for index, gpu in enumerate(self.gpus)
                for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id)
            ]

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

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        gpu = self._whole(handle)
        if gpu.cuda_cc < (7, 0):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # Volta and newer
        return gpu.energy_mj

    def nvmlDeviceGetPcieThroughput(self, device: FakeHandle, counter: int) -> int:
        gpu = self._whole(device)
        if counter not in (pynvml.NVML_PCIE_UTIL_TX_BYTES, pynvml.NVML_PCIE_UTIL_RX_BYTES):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.pcie_kbps[counter]

    def nvmlDeviceGetRemappedRows(self, device: FakeHandle) -> tuple[int, int, int, int]:
        gpu = self._whole(device)
        if gpu.cuda_cc < (8, 0):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)  # row remapping: Ampere and newer
        return gpu.remapped_rows

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._whole(handle).clocks_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._whole(handle).clocks_event_reasons

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, fieldIds: list[Any]) -> Any:
        """As pynvml: an array of c_nvmlFieldValue_t, each with its own nvmlReturn; ``fieldIds`` items are IDs or
        (ID, scope ID) pairs. Known here: the NVLink data throughput fields and the PCIe byte counters; another
        field ID of NVML's answers NOT_SUPPORTED, one beyond NVML_FI_MAX INVALID_ARGUMENT (as driver 580 does)."""
        gpu = self._whole(handle)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        now_us = int(time.time() * 1e6)
        for i, requested in enumerate(fieldIds):
            field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
            value = values[i]
            value.fieldId, value.scopeId, value.timestamp = field_id, scope, now_us
            if not 0 < field_id < pynvml.NVML_FI_MAX:
                value.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
                continue
            pcie = {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: 0, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: 1}.get(
                field_id
            )
            if pcie is not None:
                if gpu.cuda_cc < (9, 0):
                    value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                    continue
                self._advance_pcie_counts(gpu, now_us)
                value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.value.ullVal = int(gpu.pcie_count_bytes[pcie]) % 2**32  # wraps as an H200's did
                continue
            direction = {
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 0,
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 1,
            }.get(field_id)
            if direction is None or scope not in gpu.nvlink_kib:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            value.nvmlReturn = pynvml.NVML_SUCCESS
            value.value.ullVal = gpu.nvlink_kib[scope][direction]
        return values

    @staticmethod
    def _advance_pcie_counts(gpu: FakeGpu, now_us: int) -> None:
        if gpu.pcie_count_at_us and now_us > gpu.pcie_count_at_us:
            seconds = (now_us - gpu.pcie_count_at_us) / 1e6
            for direction in (0, 1):
                gpu.pcie_count_bytes[direction] += gpu.pcie_kbps[direction] * 1024 * seconds
        gpu.pcie_count_at_us = max(gpu.pcie_count_at_us, now_us)

    # GPM: opaque samples (pynvml's c_nvmlGpmSample_t pointers), filled by nvmlGpmSampleGet, compared by
    # nvmlGpmMetricsGet; a GPU before Hopper is not a supported device.
    def nvmlGpmQueryDeviceSupport(self, device: FakeHandle) -> Any:
        gpu = self._whole(device)
        return pynvml.c_nvmlGpmSupport_t(
            version=pynvml.NVML_GPM_SUPPORT_VERSION, isSupportedDevice=int(gpu.cuda_cc >= (9, 0))
        )

    def nvmlGpmSampleAlloc(self) -> Any:
        sample = ctypes.pointer(pynvml.struct_c_nvmlGpmSample_t())
        self._gpm_samples[ctypes.cast(sample, ctypes.c_void_p).value or 0] = (sample, None)
        return sample

    def _gpm_sample(self, sample: Any) -> int:
        key = ctypes.cast(sample, ctypes.c_void_p).value if sample else None
        if key is None or key not in self._gpm_samples:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return key

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        del self._gpm_samples[self._gpm_sample(gpmSample)]

    def nvmlGpmSampleGet(self, device: FakeHandle, gpmSample: Any) -> Any:
        gpu = self._whole(device)
        if gpu.cuda_cc < (9, 0):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = self._gpm_sample(gpmSample)
        self._gpm_samples[key] = (self._gpm_samples[key][0], self.gpus.index(gpu))
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        if metricsGet.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        first = self._gpm_samples[self._gpm_sample(metricsGet.sample1)][1]
        second = self._gpm_samples[self._gpm_sample(metricsGet.sample2)][1]
        if first is None or first != second or not 0 < metricsGet.numMetrics <= pynvml.NVML_GPM_METRIC_MAX:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[first]
        for i in range(metricsGet.numMetrics):
            metric = metricsGet.metrics[i]
            if metric.metricId not in _GPM_METRIC_IDS:  # as driver 580 answers for an ID NVML does not define
                metric.value, metric.nvmlReturn = 0.0, pynvml.NVML_ERROR_INVALID_ARGUMENT
            elif metric.metricId in gpu.gpm_unsupported:
                metric.value, metric.nvmlReturn = 0.0, pynvml.NVML_ERROR_NOT_SUPPORTED
            else:  # every metric NVML defines is answered on a supported GPU (an H200 under driver 580 did)
                metric.value, metric.nvmlReturn = gpu.gpm.get(metric.metricId, 0.0), pynvml.NVML_SUCCESS
        return metricsGet

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

    def nvmlDeviceGetGpuFabricInfo(self, handle: FakeHandle, info_ref: Any) -> int:
        gpu = self._gpu(handle)
        if gpu.fabric is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = _deref(info_ref)
        cluster, clique = gpu.fabric
        info.clusterUuid[:] = list(uuidlib.UUID(cluster).bytes)
        info.status = pynvml.NVML_SUCCESS
        info.cliqueId = clique
        info.state = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
        return int(pynvml.NVML_SUCCESS)

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
                # As the kernel lays PCI out: the function under its root complex and root port in
                # /sys/devices, linked from /sys/bus/pci/devices (where pcieRoot and numa_node are read).
                pcie_root = pcie_root_of(gpu)
                port = f"{pcie_root[3:]}:01.0"
                pci = root / "sys/devices" / pcie_root / port / linux_bus
                pci.mkdir(parents=True, exist_ok=True)
                (pci / "numa_node").write_text(f"{-1 if gpu.numa_node is None else gpu.numa_node}\n")
                link = root / "sys/bus/pci/devices" / linux_bus
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f"../../../devices/{pcie_root}/{port}/{linux_bus}")
            self._host_root = root
            for gpu in self.gpus:
                self._write_caps(gpu)
            # Removed when this fake goes away or the process exits, whichever comes first.
            weakref.finalize(self, shutil.rmtree, root, True)
        return self._host_root

    def _write_caps(self, gpu: FakeGpu) -> None:
        """The MIG capability files (/proc/driver/nvidia/capabilities/gpuN/mig/giX[/ciY]/access) of the GPU's
        instances as they are now: the driver adds and removes them as instances come and go."""
        if self._host_root is None:
            return
        mig_dir = self._host_root / f"proc/driver/nvidia/capabilities/gpu{gpu.minor}/mig"
        with self._lock:
            shutil.rmtree(mig_dir, ignore_errors=True)
            for mig in gpu.migs:
                gi_dir = mig_dir / f"gi{mig.gi}"
                ci_dir = gi_dir / f"ci{mig.ci}"
                ci_dir.mkdir(parents=True, exist_ok=True)
                (gi_dir / "access").write_text(f"DeviceFileMinor: {mig.gi_cap_minor}\nDeviceFileMode: 292\n")
                (ci_dir / "access").write_text(f"DeviceFileMinor: {mig.ci_cap_minor}\nDeviceFileMode: 292\n")
            for gi in gpu.gpu_instances.values():  # a GPU instance without a compute instance yet
                gi_dir = mig_dir / f"gi{gi.id}"
                if not gi_dir.exists():
                    gi_dir.mkdir(parents=True)
                    minor = 1000 * (gpu.minor + 1) + 10 * gi.id
                    (gi_dir / "access").write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")

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
        elif op == "mig-state":
            reply = message.get("reply")
            if reply:
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                    sock.sendto(json.dumps(self.mig_state()).encode(), reply)
        elif op == "compute-mode":
            self.gpus[int(message["gpu"])].compute_mode = int(message["mode"])
        else:
            raise ValueError(f"unknown op {op!r}")


def send_control(path: str | os.PathLike[str], **message: Any) -> None:
    """Send one fault command to a fake NVML in another process, e.g. ``send_control(p, op="xid", gpu=0, xid=79)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(json.dumps(message).encode(), os.fspath(path))


def query_control(path: str | os.PathLike[str], timeout: float = 10.0, **message: Any) -> Any:
    """Send a command that answers (``op="mig-state"``) and return the fake's JSON reply."""
    with tempfile.TemporaryDirectory(prefix="kxpu-fake-nvml-reply-") as tmp:
        reply = os.path.join(tmp, "reply.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(reply)
            sock.settimeout(timeout)
            sock.sendto(json.dumps({**message, "reply": reply}).encode(), os.fspath(path))
            return json.loads(sock.recv(1 << 20))


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


def _stand_in() -> NvmlSource | None:
    """What the NVIDIA backend reads in place of pynvml once this module is imported."""
    fake = from_env()
    return None if fake is None else NvmlSource(fake, fake.host_root, fake=True)


SEAM.plug(
    _stand_in
)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_nvml``) plugs it in

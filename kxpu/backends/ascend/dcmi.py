"""Huawei's DCMI library (``libdcmi.so``) through ctypes: the structures, return codes and calls kxpu uses.

Names, signatures, structure layouts and return codes follow ``dcmi_interface_api.h`` as
Ascend's own Go wrapper (``ascend-common/devmanager/dcmi``, what Huawei's and HAMi's device
plugins call) declares and uses it. The raw API is keyed by ``(card_id, device_id)``;
``dcmi_get_device_logic_id`` and ``dcmi_get_device_phyid_from_logicid`` map that to the
logical and physical IDs (``/dev/davinci<phy>``). Every call returns ``DCMI_OK`` (0) or a
negative code; outputs come back through ``ctypes.byref`` out-parameters.

The backend is handed a *module-like* object whose attributes are these functions (the real
``ctypes.CDLL`` with argument types set, or a stand-in plugged into ``SEAM``), never an import, so tests
and a daemon that imports a fake (``KXPU_FAKE_DCMI=<profile>``) run the real backend over a fake machine.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kxpu.backends.fakes import Seam

# The library object: a ctypes.CDLL, or the fake. Untyped on purpose, as with pynvml.
Dcmi = Any

# Where the driver package installs libdcmi.so (Ascend's GetDriverLibPath looks there too).
DEFAULT_LIBRARY_PATHS = (
    "/usr/local/Ascend/driver/lib64/driver/libdcmi.so",
    "/usr/local/Ascend/driver/lib64/common/libdcmi.so",
    "/usr/local/Ascend/driver/lib64/libdcmi.so",
    "/usr/local/dcmi/libdcmi.so",
)

MAX_CARD_NUM = 64  # HiAIMaxCardNum
MAX_CHIP_NAME_LEN = 32
DIE_ID_COUNT = 5
MAX_ERROR_CODE_COUNT = 128
VDIE = 1  # enum dcmi_die_type: NDIE = 0, VDIE = 1 (HAMi takes the VDIE as the chip's UUID)

DCMI_OK = 0
# enum of dcmi_get_topo_info_by_device_id's topo_type: SELF 0, SYS 1, PHB 2, HCCS 3, PXB 4, PIX 5, BUTT 6.
TOPO_HCCS = 3
# DCMI_ERROR_CODE_BASE (-8000) minus n, as the header defines them.
ERROR_NAMES = {
    -8001: "invalid parameter",
    -8002: "operation not permitted",
    -8003: "memory operation failed",
    -8004: "security function failed",
    -8005: "inner error",
    -8006: "timed out",
    -8007: "invalid device ID",
    -8008: "device does not exist",
    -8009: "ioctl failed",
    -8010: "sending the message failed",
    -8011: "receiving the message failed",
    -8012: "not ready",  # what a card that dropped off the bus answers
    -8013: "not supported in a container",
    -8014: "file operation failed",
    -8015: "reset failed",
    -8016: "operation aborted",
    -8017: "upgrading",
    -8020: "resource occupied",
    -8022: "partitions inconsistent",
    -8255: "not supported",
}
ERR_INVALID_PARAMETER = -8001
ERR_DEVICE_NOT_EXIST = -8008
ERR_NOT_READY = -8012
ERR_NOT_SUPPORT = -8255


class DcmiChipInfo(ctypes.Structure):
    _fields_ = [
        ("chip_type", ctypes.c_ubyte * MAX_CHIP_NAME_LEN),
        ("chip_name", ctypes.c_ubyte * MAX_CHIP_NAME_LEN),
        ("chip_ver", ctypes.c_ubyte * MAX_CHIP_NAME_LEN),
        ("aicore_cnt", ctypes.c_uint),
    ]


class DcmiDieId(ctypes.Structure):
    _fields_ = [("soc_die", ctypes.c_uint * DIE_ID_COUNT)]


class DcmiPcieInfoAll(ctypes.Structure):
    _fields_ = [
        ("venderid", ctypes.c_uint),
        ("subvenderid", ctypes.c_uint),
        ("deviceid", ctypes.c_uint),
        ("subdeviceid", ctypes.c_uint),
        ("domain", ctypes.c_int),
        ("bdf_busid", ctypes.c_uint),
        ("bdf_deviceid", ctypes.c_uint),
        ("bdf_funcid", ctypes.c_uint),
        ("reserve", ctypes.c_ubyte * 32),
    ]


class DcmiHbmInfo(ctypes.Structure):
    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("freq", ctypes.c_uint),
        ("memory_usage", ctypes.c_ulonglong),
        ("temp", ctypes.c_int),
        ("bandwith_util_rate", ctypes.c_uint),
    ]


class DcmiMemoryInfo(ctypes.Structure):
    """``struct dcmi_get_memory_info_stru`` (``dcmi_get_device_memory_info_v3``)."""

    _fields_ = [
        ("memory_size", ctypes.c_ulonglong),  # MB
        ("memory_available", ctypes.c_ulonglong),
        ("freq", ctypes.c_uint),
        ("hugepagesize", ctypes.c_ulong),
        ("hugepages_total", ctypes.c_ulong),
        ("hugepages_free", ctypes.c_ulong),
        ("utiliza", ctypes.c_uint),
        ("reserve", ctypes.c_ubyte * 60),
    ]


class DcmiProcMemInfo(ctypes.Structure):
    """``struct dcmi_proc_mem_info`` (``dcmi_get_device_resource_info``): a process on the chip, memory in bytes."""

    _fields_ = [("proc_id", ctypes.c_int), ("proc_mem_usage", ctypes.c_ulong)]


MAX_PROC_NUM = 32  # MAX_PROC_NUM_IN_DEVICE: the most processes dcmi_get_device_resource_info lists

# dcmi_get_device_utilization_rate's input_type (DCMI API reference)
UTILIZATION_MEMORY = 1
UTILIZATION_AICORE = 2
UTILIZATION_AICPU = 3
UTILIZATION_CTRLCPU = 4
UTILIZATION_MEMORY_BANDWIDTH = 5
UTILIZATION_HBM = 6
UTILIZATION_DDR = 8
UTILIZATION_HBM_BANDWIDTH = 10
UTILIZATION_VECTORCORE = 12
UTILIZATION_NPU = 13
# enum dcmi_freq_type (dcmi_get_device_frequency, MHz)
FREQ_DDR = 1
FREQ_CTRLCPU = 2
FREQ_HBM = 6
FREQ_AICORE_CURRENT = 7
FREQ_VECTORCORE_CURRENT = 12

_INT_P = ctypes.POINTER(ctypes.c_int)
_UINT_P = ctypes.POINTER(ctypes.c_uint)
_C = ctypes.c_int

# name → argument types; every function returns int.
SIGNATURES: dict[str, list[Any]] = {
    "dcmi_init": [],
    "dcmi_get_card_list": [_INT_P, _INT_P, _C],
    "dcmi_get_device_num_in_card": [_C, _INT_P],
    "dcmi_get_device_logic_id": [_INT_P, _C, _C],
    "dcmi_get_device_phyid_from_logicid": [ctypes.c_uint, _UINT_P],
    "dcmi_get_device_chip_info": [_C, _C, ctypes.POINTER(DcmiChipInfo)],
    "dcmi_get_device_die_v2": [_C, _C, _C, ctypes.POINTER(DcmiDieId)],
    "dcmi_get_device_health": [_C, _C, _UINT_P],
    "dcmi_get_device_errorcode_v2": [_C, _C, _INT_P, _UINT_P, ctypes.c_uint],
    "dcmi_get_device_pcie_info_v2": [_C, _C, ctypes.POINTER(DcmiPcieInfoAll)],
    "dcmi_get_device_hbm_info": [_C, _C, ctypes.POINTER(DcmiHbmInfo)],
    "dcmi_get_device_memory_info_v3": [_C, _C, ctypes.POINTER(DcmiMemoryInfo)],
    "dcmi_get_device_utilization_rate": [_C, _C, _C, _UINT_P],
    "dcmi_get_device_power_info": [_C, _C, _INT_P],  # 0.1 W
    "dcmi_get_device_temperature": [_C, _C, _INT_P],  # °C
    "dcmi_get_device_frequency": [_C, _C, _C, _UINT_P],
    "dcmi_get_device_resource_info": [_C, _C, ctypes.POINTER(DcmiProcMemInfo), _INT_P],
    "dcmi_get_topo_info_by_device_id": [_C, _C, _C, _C, _INT_P],
}


class DcmiError(Exception):
    """A DCMI call answered a non-zero code."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        super().__init__(f"{call} returned {code} ({ERROR_NAMES.get(code, 'unknown error')})")


def check(call: str, code: int) -> None:
    if code != DCMI_OK:
        raise DcmiError(call, int(code))


def text(raw: Sequence[int]) -> str:
    """A NUL-terminated ``unsigned char[]`` field as text."""
    data = bytes(raw)
    return data.split(b"\0", 1)[0].decode(errors="replace")


def die_id(die: DcmiDieId) -> str:
    """The chip UUID as Ascend's devmanager writes it: five 8-digit upper-case hex words joined by '-'."""
    return "-".join(f"{int(word):08X}" for word in die.soc_die)


def bus_id(pcie: DcmiPcieInfoAll) -> str:
    """``0000:C1:00.0``, as ``npu-smi info`` prints the Bus-Id."""
    return f"{pcie.domain:04X}:{pcie.bdf_busid:02X}:{pcie.bdf_deviceid:02X}.{pcie.bdf_funcid:X}"


@dataclass(frozen=True, slots=True)
class DcmiSource:
    """Opens the DCMI library: the real one from the host, or a fake machine."""

    host_root: Path
    fake: Any = None  # a stand-in for the library (``open(paths)`` gives it), or None for the real one

    def open(self, paths: Sequence[str]) -> Dcmi:
        """The library, with argument types set; OSError naming what was tried when none loads."""
        if self.fake is not None:
            return self.fake.open(paths)
        tried = []
        for path in paths:
            full = self.host_root / path.lstrip("/")
            if not full.exists():
                tried.append(f"{path}: not found")
                continue
            try:
                lib = ctypes.CDLL(os.fspath(full))
            except OSError as exc:
                tried.append(f"{path}: {exc}")
                continue
            for name, argtypes in SIGNATURES.items():
                func = getattr(lib, name, None)
                if func is not None:
                    func.argtypes, func.restype = argtypes, ctypes.c_int
            return lib
        raise OSError("libdcmi.so not loadable (" + "; ".join(tried) + ")")


# A stand-in for libdcmi plugs in here; it is given ``hostRoot`` (where it may write its machine).
SEAM: Seam[[Path], DcmiSource] = Seam("DCMI")


def default_source(host_root: Path) -> DcmiSource:
    """The stand-in plugged into ``SEAM`` if it names a machine, else the host's library."""
    return SEAM.stand_in(host_root) or DcmiSource(host_root)

"""libcndev through ctypes: the structures and calls the Cambricon backend makes, as cndev.h declares them.

Shapes, names and return codes are from Cambricon's cndev.h (shipped in
cambricon-k8s-device-plugin up to v2.0.21, ``device-plugin/pkg/cndev/include/cndev.h``) and the
calls its plugin makes (``pkg/cndev/bindings.go``): every versioned structure carries ``version``
set to ``CNDEV_VERSION_6`` on input, a device is addressed by the handle
``cndevGetDeviceHandleByIndex`` returns, and each call answers a ``cndevRet_t``.

The backend never loads the library at import: ``load_library`` does, and a fake with the same
function names and argument conventions (``kxpu.testing.fake_cambricon.FakeLibcndev``) can stand in.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CNDEV_VERSION_6 = 6
CNDEV_SUCCESS = 0
ERROR_NAMES = {
    1: "CNDEV_ERROR_NO_DRIVER",
    2: "CNDEV_ERROR_LOW_DRIVER_VERSION",
    3: "CNDEV_ERROR_UNSUPPORTED_API_VERSION",
    4: "CNDEV_ERROR_UNINITIALIZED",
    5: "CNDEV_ERROR_INVALID_ARGUMENT",
    6: "CNDEV_ERROR_INVALID_DEVICE_ID",
    7: "CNDEV_ERROR_UNKNOWN",
    8: "CNDEV_ERROR_MALLOC",
    9: "CNDEV_ERROR_INSUFFICIENT_SPACE",
    10: "CNDEV_ERROR_NOT_SUPPORTED",
    11: "CNDEV_ERROR_INVALID_LINK",
    12: "CNDEV_ERROR_NO_DEVICES",
    13: "CNDEV_ERROR_NO_PERMISSION",
    14: "CNDEV_ERROR_NOT_FOUND",
    15: "CNDEV_ERROR_IN_USE",
    16: "CNDEV_ERROR_DUPLICATE",
    17: "CNDEV_ERROR_TIMEOUT",
    18: "CNDEV_ERROR_IN_PROBLEM",
}
CNDEV_ERROR_UNSUPPORTED_API_VERSION = 3
CNDEV_ERROR_UNINITIALIZED = 4
CNDEV_ERROR_INVALID_DEVICE_ID = 6
CNDEV_ERROR_UNKNOWN = 7
CNDEV_ERROR_NOT_SUPPORTED = 10
CNDEV_ERROR_NO_DEVICES = 12
CNDEV_ERROR_IN_PROBLEM = 18
CNDEV_HEALTH_STATE_DEVICE_GOOD = 1  # cndevHealthStateEnum_t; 0 is IN_PROBLEM
DRIVER_STATES = (  # cndevDriverHealthStateEnum_t
    "early-inited",
    "bring-up",
    "booting",
    "lateinit",
    "running",
    "boot-error",
    "reset",
    "reset-error",
    "unknown",
)
CNDEV_HEALTH_STATE_DRIVER_RUNNING = 4
CNDEV_COMPUTEMODE_PROHIBITED = 2  # cndevComputeModeEnum_t: DEFAULT 0, EXCLUSIVE 1, PROHIBITED 2
CNDEV_UUID_SIZE = 37


class cndevCardInfo_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("number", ctypes.c_uint)]


class cndevUUID_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("uuid", ctypes.c_uint8 * CNDEV_UUID_SIZE),
        ("ncsUUID64", ctypes.c_ulong),
    ]


class cndevMemoryInfoV2_t(ctypes.Structure):
    _fields_ = [
        ("physicalMemoryTotal", ctypes.c_long),
        ("physicalMemoryUsed", ctypes.c_long),
        ("reservedMemory", ctypes.c_long),
        ("virtualMemoryTotal", ctypes.c_long),
        ("virtualMemoryUsed", ctypes.c_long),
        ("globalMemory", ctypes.c_ulong),
        ("reserved", ctypes.c_ulong * 16),
    ]


class cndevVersionInfo_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("mcuMajorVersion", ctypes.c_uint),
        ("mcuMinorVersion", ctypes.c_uint),
        ("mcuBuildVersion", ctypes.c_uint),
        ("driverMajorVersion", ctypes.c_uint),
        ("driverMinorVersion", ctypes.c_uint),
        ("driverBuildVersion", ctypes.c_uint),
    ]


class cndevCardSN_t(ctypes.Structure):
    _fields_ = [("version", ctypes.c_int), ("sn", ctypes.c_ulong), ("motherBoardSn", ctypes.c_ulong)]


class cndevPCIeInfoV2_t(ctypes.Structure):
    _fields_ = [
        ("subsystemId", ctypes.c_uint),
        ("deviceId", ctypes.c_uint),
        ("vendor", ctypes.c_ushort),
        ("subsystemVendor", ctypes.c_ushort),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("function", ctypes.c_uint),
        ("moduleId", ctypes.c_ushort),
        ("slotId", ctypes.c_ushort),
        ("reserved", ctypes.c_uint * 8),
    ]


class cndevCardHealthState_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int),
        ("health", ctypes.c_int),
        ("deviceState", ctypes.c_int),
        ("driverState", ctypes.c_int),
    ]


class cndevVersionedInt_t(ctypes.Structure):
    """The shape shared by cndevNUMANodeId_t (nodeId), cndevComputeMode_t (mode) and cndevCardCoreCount_t (count)."""

    _fields_ = [("version", ctypes.c_int), ("value", ctypes.c_int)]


cndevNUMANodeId_t = cndevComputeMode_t = cndevCardCoreCount_t = cndevVersionedInt_t

_P = ctypes.POINTER
_INT = ctypes.c_int
SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "cndevInit": (_INT, [_INT]),
    "cndevRelease": (_INT, []),
    "cndevGetErrorString": (ctypes.c_char_p, [_INT]),
    "cndevGetDeviceCount": (_INT, [_P(cndevCardInfo_t)]),
    "cndevGetDeviceHandleByIndex": (_INT, [_INT, _P(_INT)]),
    "cndevGetUUID": (_INT, [_P(cndevUUID_t), _INT]),
    "cndevGetCardNameStringByDevId": (ctypes.c_char_p, [_INT]),
    "cndevGetCardSN": (_INT, [_P(cndevCardSN_t), _INT]),
    "cndevGetMemoryUsageV2": (_INT, [_P(cndevMemoryInfoV2_t), _INT]),
    "cndevGetNUMANodeIdByDevId": (_INT, [_P(cndevVersionedInt_t), _INT]),
    "cndevGetPCIeInfoV2": (_INT, [_P(cndevPCIeInfoV2_t), _INT]),
    "cndevGetCoreCount": (_INT, [_P(cndevVersionedInt_t), _INT]),
    "cndevGetVersionInfo": (_INT, [_P(cndevVersionInfo_t), _INT]),
    "cndevGetCardHealthState": (_INT, [_P(cndevCardHealthState_t), _INT]),
    "cndevGetComputeMode": (_INT, [_P(cndevVersionedInt_t), _INT]),
}


def load_library(path: str) -> Any:
    """libcndev with the signatures above set; a symbol an older library lacks is simply absent
    (its call then fails with CNDEV_ERROR_NOT_SUPPORTED, as the plugin's ``checkExist`` does)."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in SIGNATURES.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            continue
        function.restype, function.argtypes = restype, argtypes
    return lib


class CndevError(Exception):
    def __init__(self, code: int, call: str, message: str) -> None:
        self.code, self.call = code, call
        name = ERROR_NAMES.get(code, f"code {code}")
        super().__init__(f"{call}: {name}" + ("" if message in (name, "") else f" ({message})"))

    @property
    def reason(self) -> str:
        """A short health reason: ``cndev-in-problem``, ``cndev-uninitialized``, ``cndev-18`` …"""
        name = ERROR_NAMES.get(self.code)
        return "cndev-" + (
            name.removeprefix("CNDEV_ERROR_").lower().replace("_", "-") if name else str(self.code)
        )


@dataclass(frozen=True, slots=True)
class Card:
    """What cndev says about one MLU, once: identity and fixed facts."""

    index: int
    uuid: str  # MLU-<uuid>, the plugin's device ID
    model: str
    serial: str
    motherboard: str
    memory_mib: int
    numa_node: int | None
    pci_bus_id: str | None
    cores: int | None


@dataclass(frozen=True, slots=True)
class Health:
    healthy: bool
    reason: str | None = None


def _text(raw: bytes | str | None) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


class Cndev:
    """The calls the backend makes; a failed call raises CndevError with cndev's own message."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def _function(self, name: str) -> Callable[..., Any]:
        function = getattr(self.lib, name, None)
        if function is None:
            raise CndevError(CNDEV_ERROR_NOT_SUPPORTED, name, "not in this libcndev")
        return function  # type: ignore[no-any-return]

    def _call(self, name: str, *args: Any) -> None:
        code = int(self._function(name)(*args))
        if code != CNDEV_SUCCESS:
            raise CndevError(code, name, self.error_string(code))

    def error_string(self, code: int) -> str:
        try:
            return _text(self._function("cndevGetErrorString")(code)) or "no message"
        except CndevError:
            return "no message"

    def init(self) -> None:
        self._call("cndevInit", 0)

    def release(self) -> None:
        self._call("cndevRelease")

    def device_count(self) -> int:
        info = cndevCardInfo_t(version=CNDEV_VERSION_6)
        self._call("cndevGetDeviceCount", ctypes.byref(info))
        return int(info.number)

    def handle(self, index: int) -> int:
        handle = ctypes.c_int()
        self._call("cndevGetDeviceHandleByIndex", index, ctypes.byref(handle))
        return handle.value

    def _versioned_int(self, call: str, handle: int) -> int:
        out = cndevVersionedInt_t(version=CNDEV_VERSION_6)
        self._call(call, ctypes.byref(out), handle)
        return int(out.value)

    def card(self, index: int, handle: int) -> Card:
        uuid = cndevUUID_t(version=CNDEV_VERSION_6)
        self._call("cndevGetUUID", ctypes.byref(uuid), handle)
        sn = cndevCardSN_t(version=CNDEV_VERSION_6)
        self._call("cndevGetCardSN", ctypes.byref(sn), handle)
        memory = cndevMemoryInfoV2_t()
        self._call("cndevGetMemoryUsageV2", ctypes.byref(memory), handle)
        numa = self._versioned_int("cndevGetNUMANodeIdByDevId", handle)
        try:
            pcie = cndevPCIeInfoV2_t()
            self._call("cndevGetPCIeInfoV2", ctypes.byref(pcie), handle)
            pci: str | None = f"{pcie.domain:04x}:{pcie.bus:02x}:{pcie.device:02x}.{pcie.function:x}"
        except CndevError as exc:
            if exc.code != CNDEV_ERROR_NOT_SUPPORTED:
                raise
            pci = None
        try:
            cores: int | None = self._versioned_int("cndevGetCoreCount", handle)
        except CndevError as exc:
            if exc.code != CNDEV_ERROR_NOT_SUPPORTED:
                raise
            cores = None
        return Card(
            index=index,
            uuid="MLU-" + bytes(uuid.uuid).split(b"\0", 1)[0].decode(errors="replace"),
            model=_text(self._function("cndevGetCardNameStringByDevId")(handle)),
            serial=f"{sn.sn:x}",
            motherboard=f"{sn.motherBoardSn:x}",
            memory_mib=int(memory.physicalMemoryTotal),
            numa_node=numa if numa >= 0 else None,
            pci_bus_id=pci,
            cores=cores,
        )

    def versions(self, handle: int) -> tuple[str, str]:
        """(MCU, driver) as the plugin's labels print them: ``v1.1.4``, ``v5.10.22``."""
        info = cndevVersionInfo_t(version=CNDEV_VERSION_6)
        self._call("cndevGetVersionInfo", ctypes.byref(info), handle)
        mcu = f"v{info.mcuMajorVersion}.{info.mcuMinorVersion}.{info.mcuBuildVersion}"
        return mcu, f"v{info.driverMajorVersion}.{info.driverMinorVersion}.{info.driverBuildVersion}"

    def health(self, handle: int, check_compute_mode: bool = True) -> Health:
        """The plugin's rule: health flag 0 is unhealthy, and so is compute mode PROHIBITED."""
        state = cndevCardHealthState_t(version=CNDEV_VERSION_6)
        self._call("cndevGetCardHealthState", ctypes.byref(state), handle)
        if state.health == 0:  # the plugin: 0 is unhealthy, anything else is not
            if state.driverState != CNDEV_HEALTH_STATE_DRIVER_RUNNING and 0 <= state.driverState < len(
                DRIVER_STATES
            ):
                return Health(False, "driver-" + DRIVER_STATES[state.driverState])
            if state.deviceState != CNDEV_HEALTH_STATE_DEVICE_GOOD:
                return Health(False, "device-in-problem")
            return Health(False, "cndev-health")
        if (
            check_compute_mode
            and self._versioned_int("cndevGetComputeMode", handle) == CNDEV_COMPUTEMODE_PROHIBITED
        ):
            return Health(False, "compute-mode-prohibited")
        return Health(True)

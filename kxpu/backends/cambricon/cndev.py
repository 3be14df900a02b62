"""libcndev through ctypes: the structures and calls the Cambricon backend makes, as cndev.h declares them.

Shapes, names and return codes are from Cambricon's cndev.h (shipped in
cambricon-k8s-device-plugin up to v2.0.21, ``device-plugin/pkg/cndev/include/cndev.h``) and the
calls its plugin makes (``pkg/cndev/bindings.go``): every versioned structure carries ``version``
set to ``CNDEV_VERSION_6`` on input, a device is addressed by the handle
``cndevGetDeviceHandleByIndex`` returns, and each call answers a ``cndevRet_t``.

The backend never loads the library at import: ``load_library`` does, and a fake with the same
function names and argument conventions can stand in (plugged into the backend's ``SEAM``).
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


class cndevUtilizationInfo_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int32),
        ("averageCoreUtilization", ctypes.c_int32),  # percent
        ("coreUtilization", ctypes.c_int32 * 80),
    ]


class cndevDevicePowerInfo_t(ctypes.Structure):
    """No ``version`` field in this one (cndev.h)."""

    _fields_ = [
        ("usage", ctypes.c_int32),  # W
        ("cap", ctypes.c_int32),
        ("machine", ctypes.c_int32),
        ("tdp", ctypes.c_int32),
        ("maxPower", ctypes.c_int32),
        ("reserved", ctypes.c_int32 * 16),
    ]


class cndevTemperatureInfo_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int32),
        ("board", ctypes.c_int32),  # °C
        ("cluster", ctypes.c_int32 * 20),
        ("memoryDie", ctypes.c_int32 * 8),
        ("chip", ctypes.c_int32),
        ("airInlet", ctypes.c_int32),
        ("airOutlet", ctypes.c_int32),
        ("memory", ctypes.c_int32),
        ("videoInput", ctypes.c_int32),
        ("cpu", ctypes.c_int32),
        ("isp", ctypes.c_int32),
    ]


class cndevProcessInfo_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_int32),
        ("pid", ctypes.c_uint32),
        ("physicalMemoryUsed", ctypes.c_uint64),  # KiB
        ("virtualMemoryUsed", ctypes.c_uint64),  # KiB
    ]


CNDEV_ERROR_INSUFFICIENT_SPACE = 9

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
    "cndevGetDeviceUtilizationInfo": (_INT, [_P(cndevUtilizationInfo_t), _INT]),
    "cndevGetDevicePowerInfo": (_INT, [_P(cndevDevicePowerInfo_t), _INT]),
    "cndevGetTemperatureInfo": (_INT, [_P(cndevTemperatureInfo_t), _INT]),
    "cndevGetProcessInfo": (_INT, [_P(ctypes.c_uint32), _P(cndevProcessInfo_t), _INT]),
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


@dataclass(frozen=True, slots=True)
class Usage:
    """What one MLU is doing now; None where cndev does not support the call."""

    utilization: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    power_watts: float | None
    temperatures: dict[str, float]
    processes: list[tuple[int, int]]  # (host PID, bytes of MLU memory)


def _supported(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except CndevError as exc:
        if exc.code == CNDEV_ERROR_NOT_SUPPORTED:
            return None
        raise


class Telemetry(Cndev):
    """The sampling calls (``cndevGetDeviceUtilizationInfo``, ``cndevGetMemoryUsageV2``, ``cndevGetDevicePowerInfo``,
    ``cndevGetTemperatureInfo``, ``cndevGetProcessInfo``); a call the library answers NOT_SUPPORTED is a figure
    left out, any other error raises CndevError (the caller logs it once and goes on with the next MLU)."""

    def usage(self, handle: int) -> Usage:
        def utilization() -> float:
            info = cndevUtilizationInfo_t(version=CNDEV_VERSION_6)
            self._call("cndevGetDeviceUtilizationInfo", ctypes.byref(info), handle)
            return int(info.averageCoreUtilization) / 100

        def memory() -> cndevMemoryInfoV2_t:
            info = cndevMemoryInfoV2_t()
            self._call("cndevGetMemoryUsageV2", ctypes.byref(info), handle)
            return info

        def power() -> float:
            info = cndevDevicePowerInfo_t()
            self._call("cndevGetDevicePowerInfo", ctypes.byref(info), handle)
            return float(info.usage)

        def temperatures() -> dict[str, float]:
            info = cndevTemperatureInfo_t(version=CNDEV_VERSION_6)
            self._call("cndevGetTemperatureInfo", ctypes.byref(info), handle)
            return {"chip": float(info.chip), "board": float(info.board), "memory": float(info.memory)}

        mem = _supported(memory)
        return Usage(
            utilization=_supported(utilization),
            memory_used_mib=None if mem is None else int(mem.physicalMemoryUsed),
            memory_total_mib=None if mem is None else int(mem.physicalMemoryTotal),
            power_watts=_supported(power),
            temperatures=_supported(temperatures) or {},
            processes=_supported(lambda: self.processes(handle)) or [],
        )

    def processes(self, handle: int) -> list[tuple[int, int]]:
        """``cndevGetProcessInfo``: ``infoCount`` in is the room given, out the processes listed; asked again with
        more room when it answers INSUFFICIENT_SPACE (as cnmon does)."""
        room = 16
        while True:
            count = ctypes.c_uint32(room)
            infos = (cndevProcessInfo_t * room)()
            for info in infos:
                info.version = CNDEV_VERSION_6
            code = int(self._function("cndevGetProcessInfo")(ctypes.byref(count), infos, handle))
            if code == CNDEV_ERROR_INSUFFICIENT_SPACE and room < 4096:
                room = max(room * 2, int(count.value))
                continue
            if code != CNDEV_SUCCESS:
                raise CndevError(code, "cndevGetProcessInfo", self.error_string(code))
            return [(int(i.pid), int(i.physicalMemoryUsed) * 1024) for i in infos[: min(count.value, room)]]

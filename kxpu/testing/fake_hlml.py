"""A stand-in for Habana's ``pyhlml`` module, driven by machine profiles, for tests without a Gaudi.

It answers the calls the ``gaudi`` backend makes with pyhlml's names, arguments and return
shapes: strings as ``bytes``, handles and event sets as ``ctypes.c_void_p`` (``HLML_DEVICE.TYPE``,
``HLML_EVENT_SET.TYPE``), PCI, memory and event data as pyhlml's own structures
(``c_hlml_pci_info``, ``c_hlml_memory``, ``c_hlml_event_data``), failures as pyhlml's own
``HLMLError`` subclasses with ``HLML_RETURN`` codes; constants come from
``pyhlml.pyhlml_types_generated`` itself. ``hlmlEventSetWait`` really blocks until an event or
the timeout, then raises ``HLML_ERROR_TIMEOUT`` (inferred from NVML, which HLML mirrors).

It also writes the machine's files under a root through ``FakeHost``: ``/dev/accel/accel<minor>``
and ``accel_controlD<minor>`` (character devices as root), the driver's sysfs
(``/sys/class/accel/accel<minor>/device`` → the PCI function with ``vendor``, ``device``,
``numa_node``, ``serial_number``, ``module_id``, ``device_type``, ``status``, ``pci_addr``).

Faults are injected in-process (``inject_critical``, ``lose``, …) or, for a daemon in another
process started with ``--import kxpu.testing.fake_hlml`` and ``KXPU_FAKE_HLML=<profile>``, through the
unix datagram socket named by ``KXPU_FAKE_HLML_CONTROL`` (``send_control``), as ``fake_nvml`` does.
Importing this module plugs the fake into ``kxpu.backends.gaudi.hlml.SEAM``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kxpu.backends.gaudi.hlml import SEAM, HlmlSource
from kxpu.testing.fake_host import FakeHost

with warnings.catch_warnings():  # importing pyhlml imports its own deprecated hlml_types module
    warnings.simplefilter("ignore", DeprecationWarning)
    import pyhlml.hlml_error as hlml_error
    import pyhlml.hlml_types as hlml_t  # the structures as pyhlml.main returns them
    import pyhlml.pyhlml_types_generated as types

hlml_error.ErrorsAsClass()  # pyhlml does this in hlmlInit: HLMLError_Timeout, HLMLError_AipIsLost, …

FAKE_HLML_ENV = "KXPU_FAKE_HLML"
FAKE_HLML_CONTROL_ENV = "KXPU_FAKE_HLML_CONTROL"
MARKER = "/run/kxpu-fake-hlml/profile"
ACCEL_MAJOR = 510  # any char major: the fake nodes are only stat'ed and mounted, never opened
GIB = 1024**3
R = types.HLML_RETURN
D = types.HLML_DEFINES


@dataclass
class FakeAip:
    name: str  # hlmlDeviceGetName, e.g. HL-225
    serial: str
    uuid: str
    bus: int
    minor: int
    module_id: int
    numa: int | None
    memory_bytes: int = 96 * GIB
    pci_device: int = 0x1020  # Gaudi2
    device_type: str = "GAUDI2"
    lost: bool = False
    # what the device is doing (hlmlDeviceGet* answers); a name in ``unsupported`` answers NOT_SUPPORTED
    aip_util: int = 0
    memory_used: int = 512 * 1024 * 1024
    power_mw: int = 182_000
    temperatures: dict[int, int] = field(default_factory=lambda: {0: 38, 1: 31, 3: 36})  # by sensor
    soc_mhz: int = 1600
    ecc: dict[int, int] = field(default_factory=dict)  # by error type (volatile)
    energy_mj: int = 5_400_000
    unsupported: set[str] = field(default_factory=set)

    @property
    def bus_id(self) -> str:
        return f"0000:{self.bus:02x}:00.0"


@dataclass
class HlmlProfile:
    name: str
    aips: list[FakeAip]
    driver_version: str = "1.16.0-94aac46"
    init_error: int | None = None


_GAUDI2_BUSES = [0x19, 0x1A, 0x33, 0x34, 0x4D, 0x4E, 0x9A, 0x9B]
_GAUDI2_MODULES = [2, 3, 0, 1, 6, 7, 4, 5]  # OAM slots do not follow PCI order on HLS-Gaudi2


def profile_gaudi2_8x() -> HlmlProfile:
    """An HLS-Gaudi2 server: eight HL-225 (96 GiB HBM), two NUMA nodes, module IDs out of PCI order."""
    aips = [
        FakeAip(
            name="HL-225",
            serial=f"AM4000{9170 + i}",
            uuid=f"01P0-HL2080A0-15-TNP2A6-0{i}-07-09",
            bus=_GAUDI2_BUSES[i],
            minor=i,
            module_id=_GAUDI2_MODULES[i],
            numa=i // 4,
        )
        for i in range(8)
    ]
    return HlmlProfile("gaudi2-8x", aips)


def profile_gaudi2_8x_lost() -> HlmlProfile:
    profile = profile_gaudi2_8x()
    profile.name = "gaudi2-8x-lost"
    profile.aips[5].lost = True
    return profile


def profile_no_driver() -> HlmlProfile:
    """No libhlml.so: pyhlml's hlmlInit raises HLMLError(UNINITIALIZED) when it cannot load it."""
    return HlmlProfile("no-driver", [], init_error=R.HLML_ERROR_UNINITIALIZED)


PROFILES: dict[str, Callable[[], HlmlProfile]] = {
    "gaudi2-8x": profile_gaudi2_8x,
    "gaudi2-8x-lost": profile_gaudi2_8x_lost,
    "no-driver": profile_no_driver,
}


def load_profile(name: str) -> HlmlProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(
            f"unknown fake HLML profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def _err(code: int) -> hlml_error.HLMLError:
    return hlml_error.HLMLError(int(code))


class FakeEventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # device index → event mask
        self.queue: deque[tuple[int, int]] = deque()  # (device index, event type)
        self.failure: int | None = None
        self.freed = False
        self.cond = threading.Condition()


class FakeHlml:
    """One fake machine; attributes mirror the ``pyhlml`` module's functions."""

    HLMLError = hlml_error.HLMLError
    types = types
    _HANDLE_BASE = 0x5A000

    def __init__(self, profile: HlmlProfile | str, root: Path | None = None) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.aips = self.profile.aips
        self.host = FakeHost(root)
        self.root = self.host.root
        self._lock = threading.Lock()
        self._initialized = 0
        self._sets: dict[int, FakeEventSet] = {}
        self.calls: dict[str, int] = {}
        if not self.host.path(MARKER).exists():  # another process may have written this machine already
            self._write_tree()

    def _write_tree(self) -> None:
        host = self.host
        host.mkdir("/dev/accel")
        for aip in self.aips:
            host.device_node(f"/dev/accel/accel{aip.minor}", ACCEL_MAJOR, aip.minor)
            host.device_node(f"/dev/accel/accel_controlD{aip.minor}", ACCEL_MAJOR, 64 + aip.minor)
            root = f"pci0000:{max(aip.numa or 0, 0) * 0x80 % 0x100:02x}"  # one root complex per CPU
            pci = f"/sys/devices/{root}/{aip.bus_id}"
            for attr, value in (
                ("vendor", "0x1da3"),
                ("device", f"0x{aip.pci_device:04x}"),
                ("numa_node", -1 if aip.numa is None else aip.numa),
                ("serial_number", aip.serial),
                ("module_id", aip.module_id),
                ("device_type", aip.device_type),
                ("status", "operational"),
                ("pci_addr", aip.bus_id),
            ):
                host.write_attribute(f"{pci}/{attr}", value)
            host.symlink(f"/sys/bus/pci/devices/{aip.bus_id}", f"../../..{pci.removeprefix('/sys')}")
            host.symlink(f"/sys/class/accel/accel{aip.minor}/device", f"../../..{pci.removeprefix('/sys')}")
        host.write_file(MARKER, self.profile.name)

    def cleanup(self) -> None:
        self.host.cleanup()

    # ------------------------------------------------------------------ lifecycle
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def hlmlInit(self) -> None:
        self._count("hlmlInit")
        if self.profile.init_error is not None:
            raise _err(self.profile.init_error)
        with self._lock:
            self._initialized += 1

    def hlmlShutdown(self) -> None:
        self._count("hlmlShutdown")
        with self._lock:
            if not self._initialized:
                raise _err(R.HLML_ERROR_UNINITIALIZED)
            self._initialized = 0  # pyhlml drops every reference at shutdown

    @property
    def initialized(self) -> bool:
        return self._initialized > 0

    def _check_init(self) -> None:
        if not self._initialized:
            raise _err(R.HLML_ERROR_UNINITIALIZED)

    def _aip(self, handle: Any, allow_lost: bool = False) -> FakeAip:
        self._check_init()
        value = handle.value if isinstance(handle, ctypes.c_void_p) else None
        index = (value or 0) - self._HANDLE_BASE
        if value is None or not 0 <= index < len(self.aips):
            raise _err(R.HLML_ERROR_INVALID_ARGUMENT)
        aip = self.aips[index]
        if aip.lost and not allow_lost:
            raise _err(R.HLML_ERROR_AIP_IS_LOST)
        return aip

    # ------------------------------------------------------------------ system and devices
    def hlmlGetDriverVersion(self) -> bytes:
        self._check_init()
        return self.profile.driver_version.encode()

    def hlmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.aips)

    def hlmlDeviceGetHandleByIndex(self, index: int) -> ctypes.c_void_p:
        self._check_init()
        if not 0 <= index < len(self.aips):
            raise _err(R.HLML_ERROR_INVALID_ARGUMENT)
        return ctypes.c_void_p(self._HANDLE_BASE + index)

    def hlmlDeviceGetHandleByUUID(self, uuid: str) -> ctypes.c_void_p:
        self._check_init()
        for i, aip in enumerate(self.aips):
            if aip.uuid == uuid:
                return ctypes.c_void_p(self._HANDLE_BASE + i)
        raise _err(R.HLML_ERROR_NOT_FOUND)

    def hlmlDeviceGetSerial(self, handle: Any) -> bytes:
        return self._aip(
            handle, allow_lost=True
        ).serial.encode()  # kept by the driver: a lost AIP still answers

    def hlmlDeviceGetUUID(self, handle: Any) -> bytes:
        return self._aip(handle).uuid.encode()

    def hlmlDeviceGetName(self, handle: Any) -> bytes:
        return self._aip(handle).name.encode()

    def hlmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._aip(handle).minor

    def hlmlDeviceGetModuleID(self, handle: Any) -> int:
        return self._aip(handle).module_id

    def hlmlDeviceGetPCIInfo(self, handle: Any) -> Any:
        aip = self._aip(handle)
        return hlml_t.c_hlml_pci_info(
            bus=aip.bus, bus_id=aip.bus_id.encode(), device=0, domain=0, pci_device_id=aip.pci_device
        )

    def hlmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        aip = self._aip(handle)
        used = aip.memory_used
        return hlml_t.c_hlml_memory(free=aip.memory_bytes - used, total=aip.memory_bytes, used=used)

    # ------------------------------------------------------------------ telemetry
    def _measured(self, handle: Any, call: str) -> FakeAip:
        aip = self._aip(handle)
        if call in aip.unsupported:
            raise _err(R.HLML_ERROR_NOT_SUPPORTED)
        return aip

    def hlmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        aip = self._measured(handle, "hlmlDeviceGetUtilizationRates")
        return hlml_t.c_hlml_utilization(aip=aip.aip_util, memory=0)

    def hlmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._measured(handle, "hlmlDeviceGetPowerUsage").power_mw

    def hlmlDeviceGetTemperature(self, handle: Any, sensor_type: int) -> int:
        aip = self._measured(handle, "hlmlDeviceGetTemperature")
        if int(sensor_type) not in aip.temperatures:
            raise _err(R.HLML_ERROR_NOT_SUPPORTED)
        return aip.temperatures[int(sensor_type)]

    def hlmlDeviceGetClockInfo(self, handle: Any, clock_type: int = 0) -> int:
        aip = self._measured(handle, "hlmlDeviceGetClockInfo")
        if int(clock_type) != types.HLML_CLOCK_TYPE.HLML_CLOCK_SOC:
            raise _err(R.HLML_ERROR_NOT_SUPPORTED)
        return aip.soc_mhz

    def hlmlDeviceGetTotalECCErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        aip = self._measured(handle, "hlmlDeviceGetTotalECCErrors")
        if int(counter_type) not in (0, 1) or int(error_type) not in (0, 1):
            raise _err(R.HLML_ERROR_INVALID_ARGUMENT)
        return aip.ecc.get(int(error_type), 0)

    def hlmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._measured(handle, "hlmlDeviceGetTotalEnergyConsumption").energy_mj

    # ------------------------------------------------------------------ events
    def _set(self, st: Any) -> FakeEventSet:
        self._check_init()
        es = self._sets.get(st.value) if isinstance(st, ctypes.c_void_p) and st.value else None
        if es is None:
            raise _err(R.HLML_ERROR_INVALID_ARGUMENT)
        return es

    def hlmlEventSetCreate(self) -> ctypes.c_void_p:
        self._check_init()
        with self._lock:
            key = 0xE0000 + len(self._sets) + 1
            self._sets[key] = FakeEventSet()
        return ctypes.c_void_p(key)

    def hlmlDeviceRegisterEvents(self, device: Any, event_types: int, st: Any) -> None:
        aip = self._aip(device)
        es = self._set(st)
        with es.cond:
            index = self.aips.index(aip)
            es.registered[index] = es.registered.get(index, 0) | int(event_types)

    def hlmlEventSetWait(self, st: Any, timeout: int) -> Any:
        es = self._set(st)
        self._count("hlmlEventSetWait")
        with es.cond:
            es.cond.wait_for(lambda: es.queue or es.failure is not None or es.freed, timeout / 1000)
            if es.failure is not None:
                raise _err(es.failure)
            if es.freed:
                raise _err(R.HLML_ERROR_UNINITIALIZED)
            if not es.queue:
                raise _err(R.HLML_ERROR_TIMEOUT)
            index, event_type = es.queue.popleft()
        return hlml_t.c_hlml_event_data(device=self._HANDLE_BASE + index, event_type=event_type)

    def hlmlEventSetFree(self, st: Any) -> None:
        es = self._set(st)
        with es.cond:
            es.freed = True
            es.cond.notify_all()

    # ------------------------------------------------------------------ fault injection
    def _deliver(self, index: int, event_type: int) -> int:
        delivered = 0
        for es in list(self._sets.values()):
            with es.cond:
                if es.registered.get(index, 0) & event_type:
                    es.queue.append((index, event_type))
                    es.cond.notify_all()
                    delivered += 1
        return delivered

    def inject_critical(self, index: int) -> int:
        """A critical error on device ``index`` (what Habana's plugin watches); returns the sets reached."""
        return self._deliver(index, D.HLML_EVENT_CRITICAL_ERR)

    def inject_double_bit_ecc(self, index: int) -> int:
        return self._deliver(index, D.HLML_EVENT_ECC_DERR)

    def lose(self, index: int) -> None:
        """The device stops answering (AIP_IS_LOST) and raises a critical event, as a failing AIP does."""
        self.aips[index].lost = True
        self.inject_critical(index)

    def restore(self, index: int) -> None:
        self.aips[index].lost = False

    def fail_event_wait(self, code: int | None = R.HLML_ERROR_UNKNOWN) -> None:
        for es in list(self._sets.values()):
            with es.cond:
                es.failure = code
                es.cond.notify_all()

    # ------------------------------------------------------------------ cross-process control
    def serve_control(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        threading.Thread(
            target=self._control_loop, args=(sock,), name="fake-hlml-control", daemon=True
        ).start()

    def _control_loop(self, sock: socket.socket) -> None:
        ops: dict[str, Callable[[dict[str, Any]], object]] = {
            "critical": lambda m: self.inject_critical(int(m["index"])),
            "ecc": lambda m: self.inject_double_bit_ecc(int(m["index"])),
            "lose": lambda m: self.lose(int(m["index"])),
            "restore": lambda m: self.restore(int(m["index"])),
            "fail-wait": lambda m: self.fail_event_wait(m.get("code")),
        }
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            try:
                message = json.loads(data)
                ops[message["op"]](message)
            except Exception as exc:  # a bad command must not kill the fake
                print(f"fake HLML: bad control message {data!r}: {exc}", flush=True)


def send_control(path: str | os.PathLike[str], **message: Any) -> None:
    """One fault command to a fake HLML in another process, e.g. ``send_control(p, op="critical", index=3)``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(json.dumps(message).encode(), os.fspath(path))


_shared: dict[tuple[str, str], FakeHlml] = {}
_shared_lock = threading.Lock()


def from_env(host_root: Path) -> FakeHlml | None:
    """The fake named by ``KXPU_FAKE_HLML``, its machine under ``host_root`` (a new temporary root when that is /)."""
    name = os.environ.get(FAKE_HLML_ENV)
    if not name:
        return None
    with _shared_lock:
        key = (name, str(host_root))
        fake = _shared.get(key)
        if fake is None:
            fake = FakeHlml(name, None if host_root == Path("/") else host_root)
            weakref.finalize(fake, fake.cleanup)  # a temporary root goes at exit; a given one stays
            control = os.environ.get(FAKE_HLML_CONTROL_ENV)
            if control:
                fake.serve_control(control)
            _shared[key] = fake
        return fake


def _stand_in(host_root: Path) -> HlmlSource | None:
    """What the gaudi backend reads in place of pyhlml once this module is imported."""
    fake = from_env(host_root)
    return None if fake is None else HlmlSource(fake, fake.types, fake.root, fake=True)


SEAM.plug(
    _stand_in
)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_hlml``) plugs it in

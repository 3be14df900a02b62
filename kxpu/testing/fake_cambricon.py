"""A fake Cambricon machine: a stand-in for libcndev plus the ``/dev/cambricon_*`` nodes, from named profiles.

``FakeLibcndev`` answers the C functions the backend calls through ctypes with the same names,
the same argument conventions (output structures passed by reference, handles as ints,
``cndevGetErrorString`` and ``cndevGetCardNameStringByDevId`` returning ``bytes`` as a
``c_char_p`` restype does) and cndev.h's return codes: ``CNDEV_ERROR_UNINITIALIZED`` before
``cndevInit``, ``CNDEV_ERROR_UNSUPPORTED_API_VERSION`` for a structure whose ``version`` is not set,
``CNDEV_ERROR_INVALID_DEVICE_ID`` for a bad handle, ``CNDEV_ERROR_NO_DRIVER`` from ``cndevInit``
without a driver, ``CNDEV_ERROR_IN_PROBLEM`` for a card that fell off the bus.

Like Cambricon's own C mock (``pkg/cndev/mock/cndev.c``, which re-reads ``$MOCK_JSON`` on every
call) the machine's state is a JSON file, here ``<root>/.kxpu-fake-cndev.json``, so a daemon in
another process running the real backend over ``FakeLibcndev(root)`` (``KXPU_FAKE_CAMBRICON=<root>`` with
``--import kxpu.testing.fake_cambricon``, which plugs this fake into the backend's seam)
sees every change a test makes with ``FakeCambricon``. The profile values (models, memory, cores,
which companion nodes exist) are illustrative; the calls and shapes are cndev's.

Profiles: ``mlu370-x8-4x``, ``mlu590-8x``, ``no-driver`` (no nodes; ``cndevInit`` fails).
``python -m kxpu.testing.fake_cambricon <profile> <dir>`` writes one for ``kxpu devices``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import tempfile
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kxpu.backends.cambricon import cndev as c
from kxpu.backends.cambricon.backend import SEAM
from kxpu.backends.host import Host
from kxpu.testing.fake_host import FakeHost

STATE_FILE = ".kxpu-fake-cndev.json"
FAKE_MAJOR = 241  # the driver's majors are dynamic; 240-254 are for local use, so nothing answers here
_NS = uuidlib.UUID("6a1f0a7e-5d2c-4f0b-9a55-0c3b1f3c2d10")


@dataclass(frozen=True)
class CambriconProfile:
    name: str
    model: str  # cndevGetCardNameStringByDevId
    count: int
    memory_mib: int
    cores: int
    numa: tuple[int, ...]
    companions: tuple[
        str, ...
    ]  # per-MLU node kinds besides cambricon_dev<N>: ipcm, commu, msgq, rpc, cmsg, console
    global_nodes: tuple[str, ...] = ("cambricon_ctl",)
    driver: bool = True
    versions: tuple[tuple[int, int, int], tuple[int, int, int]] = ((1, 1, 4), (5, 10, 22))  # MCU, driver
    pci_bus: int = 0x3B
    extra_state: dict[str, Any] = field(default_factory=dict)


PROFILES = {
    p.name: p
    for p in (
        CambriconProfile("mlu370-x8-4x", "MLU370-X8", 4, 49152, 32, (0, 0, 1, 1), ("ipcm",)),
        CambriconProfile(
            "mlu590-8x",
            "MLU590",
            8,
            81920,
            48,
            (0, 0, 0, 0, 1, 1, 1, 1),
            ("ipcm",),
            ("cambricon_ctl", "cambricon_gdr"),
        ),
    )
}
PROFILES["no-driver"] = replace(PROFILES["mlu370-x8-4x"], name="no-driver", driver=False)
NODE_NAMES = {
    "ipcm": "cambricon_ipcm{n}",
    "commu": "commu{n}",
    "msgq": "cambr-msgq:{n}",
    "rpc": "cambr-rpc:{n}",
    "cmsg": "cmsg_ctrl{n}",
    "console": "ttyMS{n}",
}


def load_profile(name: str) -> CambriconProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown fake Cambricon profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def _out(arg: Any) -> Any:
    """The structure behind an output argument: ``byref(x)`` (what the backend passes) or ``pointer(x)``."""
    return arg._obj if hasattr(arg, "_obj") else arg.contents


class FakeLibcndev:
    """libcndev's functions over the machine state in ``<root>/.kxpu-fake-cndev.json``."""

    def __init__(self, root: Path) -> None:
        self.state_path = Path(root) / STATE_FILE
        self._initialized = False
        self._cache: tuple[tuple[int, int], dict[str, Any]] | None = None
        self.calls: dict[str, int] = {}

    def _state(self) -> dict[str, Any]:
        st = os.stat(self.state_path)
        key = (st.st_ino, st.st_mtime_ns)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, json.loads(self.state_path.read_text()))
        return self._cache[1]

    def _card(self, name: str, handle: int, out: Any = None) -> tuple[int, dict[str, Any]]:
        """(code, card): the checks every per-device call makes, in cndev's order."""
        self.calls[name] = self.calls.get(name, 0) + 1
        if not self._initialized:
            return c.CNDEV_ERROR_UNINITIALIZED, {}
        if self._state().get("init_error"):  # the driver went away under an initialized library
            return int(self._state()["init_error"]), {}
        if out is not None and hasattr(out, "version") and not 1 <= out.version <= c.CNDEV_VERSION_6:
            return c.CNDEV_ERROR_UNSUPPORTED_API_VERSION, {}
        cards = self._state()["cards"]
        if not isinstance(handle, int) or not 0 <= handle < len(cards):
            return c.CNDEV_ERROR_INVALID_DEVICE_ID, {}
        card = cards[handle]
        if card["lost"]:
            return c.CNDEV_ERROR_IN_PROBLEM, card
        return int(card.get("fail", {}).get(name, c.CNDEV_SUCCESS)), card

    # -- lifecycle -------------------------------------------------------------------------------------
    def cndevInit(self, reserved: int) -> int:
        error = self._state().get("init_error")
        if error:
            return int(error)
        self._initialized = True
        return c.CNDEV_SUCCESS

    def cndevRelease(self) -> int:
        self._initialized = False
        return c.CNDEV_SUCCESS

    def cndevGetErrorString(self, code: int) -> bytes:
        return c.ERROR_NAMES.get(code, "Cndev_ERROR not found!").encode()

    # -- device management -----------------------------------------------------------------------------
    def cndevGetDeviceCount(self, info: Any) -> int:
        out = _out(info)
        if not self._initialized:
            return c.CNDEV_ERROR_UNINITIALIZED
        if self._state().get("init_error"):
            return int(self._state()["init_error"])
        if not 1 <= out.version <= c.CNDEV_VERSION_6:
            return c.CNDEV_ERROR_UNSUPPORTED_API_VERSION
        out.number = len(self._state()["cards"])
        return c.CNDEV_SUCCESS

    def cndevGetDeviceHandleByIndex(self, index: int, handle: Any) -> int:
        if not self._initialized:
            return c.CNDEV_ERROR_UNINITIALIZED
        if not 0 <= index < len(self._state()["cards"]):
            return 14  # CNDEV_ERROR_NOT_FOUND
        _out(handle).value = index  # the C mock's handle is the index too
        return c.CNDEV_SUCCESS

    def cndevGetUUID(self, uuid_info: Any, handle: int) -> int:
        out = _out(uuid_info)
        code, card = self._card("cndevGetUUID", handle, out)
        if code == c.CNDEV_SUCCESS:
            raw = card["uuid"].encode()[: c.CNDEV_UUID_SIZE - 1]
            ctypes.memmove(out.uuid, raw + b"\0", len(raw) + 1)
        return code

    def cndevGetCardNameStringByDevId(self, handle: int) -> bytes:
        code, card = self._card("cndevGetCardNameStringByDevId", handle)
        return card["model"].encode() if code == c.CNDEV_SUCCESS else b"Unknown"

    def cndevGetCardSN(self, sn: Any, handle: int) -> int:
        out = _out(sn)
        code, card = self._card("cndevGetCardSN", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.sn, out.motherBoardSn = card["sn"], card["motherboard_sn"]
        return code

    def cndevGetMemoryUsageV2(self, memory: Any, handle: int) -> int:
        out = _out(memory)
        code, card = self._card("cndevGetMemoryUsageV2", handle)
        if code == c.CNDEV_SUCCESS:
            out.physicalMemoryTotal = card["memory_mib"]
            out.physicalMemoryUsed = card.get("memory_used_mib", 0)
        return code

    def cndevGetNUMANodeIdByDevId(self, numa: Any, handle: int) -> int:
        out = _out(numa)
        code, card = self._card("cndevGetNUMANodeIdByDevId", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.value = card["numa"]
        return code

    def cndevGetPCIeInfoV2(self, pcie: Any, handle: int) -> int:
        out = _out(pcie)
        code, card = self._card("cndevGetPCIeInfoV2", handle)
        if code == c.CNDEV_SUCCESS:
            out.domain, out.bus, out.device, out.function = card["pci"]
            out.vendor = 0xCABC  # Cambricon's PCI vendor ID (the plugin's FetchMLUCounts)
        return code

    def cndevGetCoreCount(self, count: Any, handle: int) -> int:
        out = _out(count)
        code, card = self._card("cndevGetCoreCount", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.value = card["cores"]
        return code

    def cndevGetVersionInfo(self, info: Any, handle: int) -> int:
        out = _out(info)
        code, card = self._card("cndevGetVersionInfo", handle, out)
        if code == c.CNDEV_SUCCESS:
            (out.mcuMajorVersion, out.mcuMinorVersion, out.mcuBuildVersion) = card["mcu"]
            (out.driverMajorVersion, out.driverMinorVersion, out.driverBuildVersion) = card["driver"]
        return code

    def cndevGetCardHealthState(self, state: Any, handle: int) -> int:
        out = _out(state)
        code, card = self._card("cndevGetCardHealthState", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.health, out.deviceState, out.driverState = (
                card["health"],
                card["device_state"],
                card["driver_state"],
            )
        return code

    # -- telemetry ---------------------------------------------------------------------------------------
    def cndevGetDeviceUtilizationInfo(self, util: Any, handle: int) -> int:
        out = _out(util)
        code, card = self._card("cndevGetDeviceUtilizationInfo", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.averageCoreUtilization = card.get("utilization", 0)
        return code

    def cndevGetDevicePowerInfo(self, power: Any, handle: int) -> int:
        out = _out(power)
        code, card = self._card("cndevGetDevicePowerInfo", handle)  # no version field in this structure
        if code == c.CNDEV_SUCCESS:
            out.usage, out.cap, out.tdp = card.get("power_w", 75), 150, 150
        return code

    def cndevGetTemperatureInfo(self, temp: Any, handle: int) -> int:
        out = _out(temp)
        code, card = self._card("cndevGetTemperatureInfo", handle, out)
        if code == c.CNDEV_SUCCESS:
            out.board, out.chip, out.memory = card.get("temperatures", [35, 46, 40])
        return code

    def cndevGetProcessInfo(self, info_count: Any, proc_info: Any, handle: int) -> int:
        count = _out(info_count)
        code, card = self._card("cndevGetProcessInfo", handle)
        if code != c.CNDEV_SUCCESS:
            return code
        listed = card.get("processes", [])  # [[pid, KiB], …]
        room = int(count.value)
        count.value = len(listed)
        if len(listed) > room:
            return c.CNDEV_ERROR_INSUFFICIENT_SPACE
        for i, (pid, kib) in enumerate(listed):
            entry = proc_info[i]
            if not 1 <= entry.version <= c.CNDEV_VERSION_6:
                return c.CNDEV_ERROR_UNSUPPORTED_API_VERSION
            entry.pid, entry.physicalMemoryUsed, entry.virtualMemoryUsed = pid, kib, kib
        return code

    def cndevGetComputeMode(self, mode: Any, handle: int) -> int:
        out = _out(mode)
        code, card = self._card("cndevGetComputeMode", handle, out)
        if code == c.CNDEV_SUCCESS:
            if card.get("compute_mode") is None:
                return c.CNDEV_ERROR_NOT_SUPPORTED
            out.value = card["compute_mode"]
        return code


class FakeCambricon:
    """One fake machine under ``root`` (a new temporary directory by default): nodes and cndev's state."""

    def __init__(self, profile: CambriconProfile | str, root: Path | None = None) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.fake = FakeHost(root)
        self.root = self.fake.root
        p = self.profile
        self.state: dict[str, Any] = {"profile": p.name, "init_error": None, "cards": []}
        for n in range(p.count):
            self.state["cards"].append(
                {
                    "uuid": str(uuidlib.uuid5(_NS, f"{p.name}/{n}")),
                    "model": p.model,
                    "sn": 0x3700000000 + n,
                    "motherboard_sn": 0x1100 + n // 2,
                    "memory_mib": p.memory_mib,
                    "numa": p.numa[n],
                    "pci": [0, p.pci_bus + n, 0, 0],
                    "cores": p.cores,
                    "mcu": list(p.versions[0]),
                    "driver": list(p.versions[1]),
                    "health": 1,
                    "device_state": c.CNDEV_HEALTH_STATE_DEVICE_GOOD,
                    "driver_state": c.CNDEV_HEALTH_STATE_DRIVER_RUNNING,
                    "compute_mode": 0,
                    "lost": False,
                    **p.extra_state,
                }
            )
        if p.driver:
            self.load_driver()
        else:
            self.state["init_error"] = 1  # CNDEV_ERROR_NO_DRIVER
            self._save()

    @property
    def library(self) -> FakeLibcndev:
        """A fresh library object over this machine (as each process would dlopen its own)."""
        return FakeLibcndev(self.root)

    def uuid(self, index: int) -> str:
        return "MLU-" + str(self.state["cards"][index]["uuid"])

    def _save(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".cndev-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.state, f)
        os.replace(tmp, self.root / STATE_FILE)  # atomic: a reader sees the old state or the new one

    def _nodes(self, index: int) -> list[str]:
        return [f"/dev/cambricon_dev{index}"] + [
            "/dev/" + NODE_NAMES[kind].format(n=index) for kind in self.profile.companions
        ]

    # -- changes, as the driver makes them -------------------------------------------------------------
    def load_driver(self) -> None:
        self.state["init_error"] = None
        for name in self.profile.global_nodes:
            self.fake.device_node(f"/dev/{name}", FAKE_MAJOR, 250 if name == "cambricon_ctl" else 251)
        for n in range(self.profile.count):
            self.restore(n)
        self._save()

    def unload_driver(self) -> None:
        """The driver goes away: every node disappears and cndevInit fails with CNDEV_ERROR_NO_DRIVER."""
        self.state["init_error"] = 1
        for name in self.profile.global_nodes:
            self.fake.remove(f"/dev/{name}")
        for n in range(self.profile.count):
            for path in self._nodes(n):
                self.fake.remove(path)
        self._save()

    def set_health(
        self, index: int, healthy: bool, driver_state: int = c.CNDEV_HEALTH_STATE_DRIVER_RUNNING
    ) -> None:
        card = self.state["cards"][index]
        card["health"] = int(healthy)
        card["device_state"] = c.CNDEV_HEALTH_STATE_DEVICE_GOOD if healthy else 0
        card["driver_state"] = driver_state
        self._save()

    def set_compute_mode(self, index: int, mode: int | None) -> None:
        """0 default, 1 exclusive, 2 prohibited; None: the call is not supported."""
        self.state["cards"][index]["compute_mode"] = mode
        self._save()

    def fail_call(self, index: int, call: str, code: int | None) -> None:
        """Make one cndev function answer ``code`` for this MLU (None: answer normally again)."""
        fail = self.state["cards"][index].setdefault("fail", {})
        if code is None:
            fail.pop(call, None)
        else:
            fail[call] = code
        self._save()

    def set_usage(self, index: int, **values: Any) -> None:
        """What the MLU is doing: ``utilization`` (percent), ``memory_used_mib``, ``power_w``,
        ``temperatures`` ([board, chip, memory] °C), ``processes`` ([(pid, KiB), …])."""
        card = self.state["cards"][index]
        card.update({k: [list(p) for p in v] if k == "processes" else v for k, v in values.items()})
        self._save()

    def lose(self, index: int) -> None:
        """The MLU falls off the bus: its nodes go and cndev answers CNDEV_ERROR_IN_PROBLEM for it."""
        self.state["cards"][index]["lost"] = True
        for path in self._nodes(index):
            self.fake.remove(path)
        self._save()

    def pci_address(self, index: int) -> str:
        domain, bus, device, function = self.state["cards"][index]["pci"]
        return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"

    def restore(self, index: int) -> None:
        self.state["cards"][index]["lost"] = False
        # The function under its CPU's root complex in /sys/devices, linked from /sys/bus/pci/devices (what the
        # plugin's FetchMLUCounts reads, and where pcieRoot comes from).
        address, numa = self.pci_address(index), self.state["cards"][index]["numa"]
        root = f"pci0000:{max(numa or 0, 0) * 0x80 % 0x100:02x}"
        pci = f"/sys/devices/{root}/{root[3:]}:01.0/{address}"
        self.fake.symlink(f"/sys/bus/pci/devices/{address}", f"../../..{pci.removeprefix('/sys')}")
        self.fake.write_attribute(f"{pci}/vendor", "0xcabc")
        self.fake.write_attribute(f"{pci}/class", "0x120000")
        for k, path in enumerate(self._nodes(index)):
            self.fake.device_node(path, FAKE_MAJOR, index * 16 + k)
        self._save()

    def cleanup(self) -> None:
        self.fake.cleanup()


FAKE_CAMBRICON_ENV = "KXPU_FAKE_CAMBRICON"
_shared: dict[str, FakeCambricon] = {}


def from_env(value: str) -> Path:
    """The root named by KXPU_FAKE_CAMBRICON: an existing fake's path, or a profile (one per process)."""
    if value.startswith("/"):
        if not Path(value, STATE_FILE).is_file():
            raise ValueError(f"KXPU_FAKE_CAMBRICON={value}: no fake machine there (no {STATE_FILE})")
        return Path(value)
    if value not in _shared:
        _shared[value] = FakeCambricon(value)
        atexit.register(_shared[value].cleanup)
    return _shared[value].root


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -m kxpu.testing.fake_cambricon PROFILE DIR  (profiles: {', '.join(PROFILES)})")
        return 2
    fake = FakeCambricon(argv[0], Path(argv[1]))
    print(
        f"wrote a fake {fake.profile.name} under {fake.root}; run kxpu with KXPU_FAKE_CAMBRICON={fake.root} "
        "and --import kxpu.testing.fake_cambricon"
    )
    return 0


def _stand_in() -> tuple[Any, Host] | None:
    """The libcndev and machine the cambricon backend uses in place of the host's once this module is
    imported."""
    value = os.environ.get(FAKE_CAMBRICON_ENV)
    if not value:
        return None
    root = from_env(value)
    return FakeLibcndev(root), Host(root)


SEAM.plug(
    _stand_in
)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_cambricon``) plugs it in


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

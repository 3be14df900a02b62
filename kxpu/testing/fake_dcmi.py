"""A stand-in for Huawei's ``libdcmi.so``, driven by machine profiles, for tests without an NPU.

``FakeDcmi`` answers the DCMI calls the ``ascend`` backend makes with the C names, argument
shapes and return codes of ``dcmi_interface_api.h``: every function returns an ``int`` (0 or a
negative ``DCMI_ERR_CODE_*``) and writes its outputs into the ``ctypes.byref`` out-parameters and
arrays it is handed, rejecting arguments of the wrong ctypes type as the real library's argtypes
would. A card that dropped off the bus answers ``dcmi_get_device_health`` with -8012, as field
monitoring code records; which codes other failures return is inferred (docs/vendor-ascend.md).

It also writes the machine's files under a root through ``FakeHost``: ``/dev/davinci<phy>`` and
the management nodes (real character devices when run as root), the driver's ``version.info``,
``npu-smi``, ``lib64/driver`` (with a placeholder ``libdcmi.so``: "loading" fails when it is
removed, like a missing driver) and sysfs ``numa_node`` per PCI function.

Live changes (health flips, a dropped or lost chip, a missing driver) go into a JSON state file
in that root, which every call re-reads when it changed: a daemon in another process started with
``--import kxpu.testing.fake_dcmi`` (which plugs this fake into the backend's seam),
``KXPU_FAKE_DCMI=<profile>`` and ``hostRoot`` pointing at the same root sees them at its next poll,
as it would see the driver's answers change.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kxpu.atomicfile import write_atomically
from kxpu.backends.ascend import dcmi
from kxpu.backends.ascend.dcmi import SEAM, DcmiSource
from kxpu.testing.fake_host import FakeHost

FAKE_DCMI_ENV = "KXPU_FAKE_DCMI"
STATE_FILE = "/run/kxpu-fake-dcmi/state.json"
LIBRARY = "/usr/local/Ascend/driver/lib64/driver/libdcmi.so"
CARD_DROP_FAULT = 0x40F84E00  # the fault code Ascend's devmanager adds for a dropped card
DAVINCI_MAJOR = 236  # any char major: the fake nodes are only stat'ed and mounted, never opened
MANAGEMENT_NODES = {"/dev/davinci_manager": (237, 0), "/dev/devmm_svm": (238, 0), "/dev/hisi_hdc": (239, 0)}


# what changes while the machine runs, shared with other processes through the state file
LIVE = (
    *("health", "health_rc", "errors", "present"),
    *("utilization", "power_tenths", "temperature", "memory_used_mib", "processes"),
)
# input_type → what a chip without HBM (310P) does not answer
HBM_ONLY = {dcmi.UTILIZATION_HBM, dcmi.UTILIZATION_HBM_BANDWIDTH}


@dataclass
class FakeChip:
    card: int
    device: int
    logic: int
    phy: int
    chip_name: str
    aicore: int
    die: tuple[int, int, int, int, int]
    bus: int  # PCI bus number (domain 0, device 0, function 0)
    memory_mib: int
    hbm: bool = True  # False: dcmi_get_device_hbm_info is not supported (310P)
    numa: int | None = 0
    chip_type: str = "Ascend"
    chip_ver: str = "V1"
    device_id: int = 0xD802
    hccs: int | None = None  # chips with one value are joined by HCCS (a ring or a mesh); None: PCIe only
    pcie_root: int = 0  # the root complex's bus number (pci0000:<root>) the chip sits under
    # live state
    health: int = 0
    health_rc: int = 0  # -8012: the card dropped off the bus
    errors: list[int] = field(default_factory=list)
    present: bool = True  # False: gone from the card list and /dev (hot-unplugged)
    # what the chip is doing: utilization by input_type (as text keys: JSON), 0.1 W, °C, MiB, [[pid, bytes]]
    utilization: dict[str, int] = field(default_factory=dict)
    power_tenths: int = 851
    temperature: int = 43
    memory_used_mib: int = 3072
    processes: list[list[int]] = field(default_factory=list)

    @property
    def bus_id(self) -> str:
        return f"0000:{self.bus:02x}:00.0"


@dataclass
class DcmiProfile:
    name: str
    chips: list[FakeChip]
    driver_version: str = "24.1.rc2"
    init_rc: int = 0
    library: bool = True


def _die(tag: int, n: int) -> tuple[int, int, int, int, int]:
    return (0x2B3C0000 + tag, 0x10000000 + n, 0x0A5A5A5A, 0x00C0FFEE + n, 0x01)


_910B_BUSES = [0xC1, 0x01, 0x41, 0x81, 0xC2, 0x02, 0x42, 0x82]


def profile_910b_8x() -> DcmiProfile:
    """An Atlas 800T A2: eight 910B3 (20 AI cores, 64 GiB HBM), one chip per card, NUMA 0 and 1."""
    chips = [
        FakeChip(
            card=i,
            device=0,
            logic=i,
            phy=i,
            chip_name="910B3",
            aicore=20,
            die=_die(0x910, i),
            bus=_910B_BUSES[i],
            memory_mib=65536,
            numa=i // 4,
            hccs=0,  # an Atlas 800T A2's eight chips are one HCCS mesh
            pcie_root=_910B_BUSES[i] & 0xC0,
        )
        for i in range(8)
    ]
    return DcmiProfile("910b-8x", chips)


def profile_910_8x_rings() -> DcmiProfile:
    """An Atlas 800 training server (model 9000): eight Ascend 910 in two HCCS rings of four (0-3 and
    4-7), a ring per CPU; chips of different rings talk over PCIe and the CPUs' link only."""
    chips = [
        FakeChip(
            card=i,
            device=0,
            logic=i,
            phy=i,
            chip_name="910",
            aicore=32,
            die=_die(0x911, i),
            bus=_910B_BUSES[i],
            memory_mib=32768,
            numa=i // 4,
            device_id=0xD801,
            hccs=i // 4,
            pcie_root=_910B_BUSES[i] & 0xC0,
        )
        for i in range(8)
    ]
    return DcmiProfile("910-8x-rings", chips, driver_version="23.0.3")


def profile_910b_8x_one_dropped() -> DcmiProfile:
    profile = profile_910b_8x()
    profile.name = "910b-8x-one-dropped"
    profile.chips[3].health_rc = dcmi.ERR_NOT_READY
    profile.chips[3].errors = [CARD_DROP_FAULT]
    return profile


def profile_310p_4x() -> DcmiProfile:
    """Two Atlas 300I Duo cards in PCIe slots 1 and 2, two 310P3 chips each (8 AI cores, 21527 MiB DDR)."""
    chips = [
        FakeChip(
            card=1 + i // 2,
            device=i % 2,
            logic=i,
            phy=i,
            chip_name="310P3",
            aicore=8,
            die=_die(0x310, i),
            bus=0x3B + i,
            pcie_root=0x3A,
            memory_mib=21527,
            hbm=False,
            device_id=0xD500,
        )
        for i in range(4)
    ]
    return DcmiProfile("310p-4x", chips, driver_version="23.0.3")


def profile_no_driver() -> DcmiProfile:
    return DcmiProfile("no-driver", [], library=False)


PROFILES: dict[str, Callable[[], DcmiProfile]] = {
    "910b-8x": profile_910b_8x,
    "910b-8x-one-dropped": profile_910b_8x_one_dropped,
    "910-8x-rings": profile_910_8x_rings,
    "310p-4x": profile_310p_4x,
    "no-driver": profile_no_driver,
}


def load_profile(name: str) -> DcmiProfile:
    try:
        return PROFILES[name]()
    except KeyError:
        raise ValueError(
            f"unknown fake DCMI profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def _out(arg: Any, kind: type) -> Any:
    """The object behind an out-parameter (``byref(x)``, an array or a pointer), checked like argtypes."""
    obj = getattr(arg, "_obj", arg)
    if not isinstance(obj, kind):
        raise ctypes.ArgumentError(f"expected a {kind.__name__} out-parameter, got {type(arg).__name__}")
    return obj


def _int(arg: Any) -> int:
    if isinstance(arg, bool) or not isinstance(arg, int):
        raise ctypes.ArgumentError(f"expected an int argument, got {type(arg).__name__}")
    return arg


def _put_text(target: Any, value: str) -> None:
    data = value.encode()[: len(target) - 1]
    for i in range(len(target)):
        target[i] = data[i] if i < len(data) else 0


class FakeDcmi:
    """One fake machine: its files under ``root`` and the DCMI functions answering about it."""

    def __init__(self, profile: DcmiProfile | str, root: Path | None = None) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.host = FakeHost(root)
        self.root = self.host.root
        self._lock = threading.Lock()
        self._state_mtime = -1
        self.calls: dict[str, int] = {}
        if self.host.path(STATE_FILE).exists():
            self._reload()  # another process wrote this machine: share its state
        else:
            self._write_tree()
            self._save()

    # ------------------------------------------------------------------ the machine's files
    def _write_tree(self) -> None:
        host = self.host
        host.mkdir("/dev")
        for path, (major, minor) in MANAGEMENT_NODES.items():
            if self.profile.library:
                host.device_node(path, major, minor)
        for chip in self.profile.chips:
            self._node(chip)
            # The function under its root complex in /sys/devices, linked from /sys/bus/pci/devices.
            pci = f"/sys/devices/pci0000:{chip.pcie_root:02x}/0000:{chip.pcie_root:02x}:00.0/{chip.bus_id}"
            host.symlink(f"/sys/bus/pci/devices/{chip.bus_id}", f"../../..{pci.removeprefix('/sys')}")
            host.write_attribute(f"{pci}/vendor", "0x19e5")
            host.write_attribute(f"{pci}/device", f"0x{chip.device_id:04x}")
            host.write_attribute(f"{pci}/numa_node", -1 if chip.numa is None else chip.numa)
        if self.profile.library:
            host.write_file(LIBRARY, b"\x7fELF fake libdcmi for kxpu tests\n")
            host.write_file(
                "/usr/local/Ascend/driver/version.info", f"Version={self.profile.driver_version}\n"
            )
            host.write_file("/usr/local/bin/npu-smi", "#!/bin/sh\necho fake npu-smi\n")
            host.path("/usr/local/bin/npu-smi").chmod(0o755)
            host.write_file("/etc/ascend_install.info", "Driver_Install_Path_Param=/usr/local/Ascend\n")

    def _node(self, chip: FakeChip) -> None:
        if chip.present:
            self.host.device_node(f"/dev/davinci{chip.phy}", DAVINCI_MAJOR, chip.phy)
        else:
            self.host.remove(f"/dev/davinci{chip.phy}")

    def cleanup(self) -> None:
        self.host.cleanup()

    # ------------------------------------------------------------------ shared live state
    def _save(self) -> None:
        state = {
            "initRc": self.profile.init_rc,
            "chips": {str(c.phy): {k: asdict(c)[k] for k in LIVE} for c in self.profile.chips},
        }
        write_atomically(self.host.path(STATE_FILE), json.dumps(state))
        self._state_mtime = os.stat(self.host.path(STATE_FILE)).st_mtime_ns

    def _reload(self) -> None:
        path = self.host.path(STATE_FILE)
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._state_mtime:
            return
        state = json.loads(path.read_text())
        self._state_mtime = mtime
        self.profile.init_rc = int(state["initRc"])
        for chip in self.profile.chips:
            for key, value in state["chips"].get(str(chip.phy), {}).items():
                setattr(chip, key, value)

    def _change(self, phy: int, **values: Any) -> None:
        with self._lock:
            self._reload()
            chip = self._chip_by_phy(phy)
            for key, value in values.items():
                setattr(chip, key, value)
            self._save()
            self._node(chip)

    def _chip_by_phy(self, phy: int) -> FakeChip:
        for chip in self.profile.chips:
            if chip.phy == phy:
                return chip
        raise ValueError(f"no chip with physical ID {phy} in profile {self.profile.name}")

    def set_health(self, phy: int, health: int, errors: Sequence[int] = ()) -> None:
        """What dcmi_get_device_health answers for the chip (0 = OK; 1 minor, 2 major, 3 critical alarm)."""
        self._change(phy, health=health, health_rc=0, errors=list(errors))

    def drop(self, phy: int) -> None:
        """The card drops off the bus: health answers -8012, the fault list holds the card-drop code."""
        self._change(phy, health_rc=dcmi.ERR_NOT_READY, errors=[CARD_DROP_FAULT])

    def recover(self, phy: int) -> None:
        self._change(phy, health=0, health_rc=0, errors=[])

    def set_usage(self, phy: int, **values: Any) -> None:
        """What the chip is doing: ``utilization={input_type: percent}``, ``power_tenths``, ``temperature``,
        ``memory_used_mib``, ``processes=[(pid, bytes), …]``."""
        if "utilization" in values:
            values["utilization"] = {str(k): v for k, v in values["utilization"].items()}
        if "processes" in values:
            values["processes"] = [list(p) for p in values["processes"]]
        self._change(phy, **values)

    def lose(self, phy: int) -> None:
        """Hot-unplug: gone from the card list and from /dev."""
        self._change(phy, present=False)

    def restore(self, phy: int) -> None:
        self._change(phy, present=True)

    def remove_driver(self) -> None:
        self.host.remove(LIBRARY)

    def install_driver(self) -> None:
        self.host.write_file(LIBRARY, b"\x7fELF fake libdcmi for kxpu tests\n")

    def fail_init(self, code: int | None) -> None:
        """dcmi_init answers ``code`` (None: succeeds again)."""
        with self._lock:
            self._reload()
            self.profile.init_rc = code or 0
            self._save()

    # ------------------------------------------------------------------ loading (DcmiSource.open)
    def open(self, paths: Sequence[str]) -> FakeDcmi:
        for path in paths:
            if self.host.path(path).exists():
                return self
        raise OSError("libdcmi.so not loadable (" + "; ".join(f"{p}: not found" for p in paths) + ")")

    # ------------------------------------------------------------------ the DCMI functions
    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _present(self) -> list[FakeChip]:
        with self._lock:
            self._reload()
        return [c for c in self.profile.chips if c.present]

    def _find(self, card: Any, device: Any) -> FakeChip | int:
        card, device = _int(card), _int(device)
        if card < 0 or device < 0:
            return dcmi.ERR_INVALID_PARAMETER
        for chip in self._present():
            if chip.card == card and chip.device == device:
                return chip
        return dcmi.ERR_DEVICE_NOT_EXIST

    def dcmi_init(self) -> int:
        self._count("dcmi_init")
        with self._lock:
            self._reload()
        return self.profile.init_rc

    def dcmi_get_card_list(self, card_num: Any, card_list: Any, list_len: Any) -> int:
        self._count("dcmi_get_card_list")
        num, ids = _out(card_num, ctypes.c_int), _out(card_list, ctypes.Array)
        cards = sorted({c.card for c in self._present()})
        if _int(list_len) < len(cards) or len(ids) < _int(list_len):
            return dcmi.ERR_INVALID_PARAMETER
        num.value = len(cards)
        for i, card in enumerate(cards):
            ids[i] = card
        return dcmi.DCMI_OK

    def dcmi_get_device_num_in_card(self, card_id: Any, device_num: Any) -> int:
        out = _out(device_num, ctypes.c_int)
        chips = [c for c in self._present() if c.card == _int(card_id)]
        if not chips:
            return dcmi.ERR_DEVICE_NOT_EXIST
        out.value = len(chips)
        return dcmi.DCMI_OK

    def dcmi_get_device_logic_id(self, device_logic_id: Any, card_id: Any, device_id: Any) -> int:
        out = _out(device_logic_id, ctypes.c_int)
        chip = self._find(card_id, device_id)
        if isinstance(chip, int):
            return chip
        out.value = chip.logic
        return dcmi.DCMI_OK

    def dcmi_get_device_phyid_from_logicid(self, logicid: Any, phyid: Any) -> int:
        out = _out(phyid, ctypes.c_uint)
        for chip in self._present():
            if chip.logic == _int(logicid):
                out.value = chip.phy
                return dcmi.DCMI_OK
        return dcmi.ERR_DEVICE_NOT_EXIST

    def _query(self, card_id: Any, device_id: Any) -> FakeChip | int:
        """A chip that answers queries; a dropped card answers everything with -8012."""
        chip = self._find(card_id, device_id)
        if isinstance(chip, FakeChip) and chip.health_rc:
            return chip.health_rc
        return chip

    def dcmi_get_device_health(self, card_id: Any, device_id: Any, health: Any) -> int:
        self._count("dcmi_get_device_health")
        out = _out(health, ctypes.c_uint)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        out.value = chip.health
        return dcmi.DCMI_OK

    def dcmi_get_device_errorcode_v2(
        self, card_id: Any, device_id: Any, error_count: Any, error_code_list: Any, list_len: Any
    ) -> int:
        count, codes = _out(error_count, ctypes.c_int), _out(error_code_list, ctypes.Array)
        chip = self._find(card_id, device_id)
        if isinstance(chip, int):
            return chip
        if chip.health_rc:
            return chip.health_rc  # the devmanager then adds the card-drop code itself
        errors = chip.errors[: min(_int(list_len), len(codes))]
        count.value = len(errors)
        for i, code in enumerate(errors):
            codes[i] = code
        return dcmi.DCMI_OK

    def dcmi_get_device_chip_info(self, card_id: Any, device_id: Any, chip_info: Any) -> int:
        out = _out(chip_info, dcmi.DcmiChipInfo)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        _put_text(out.chip_type, chip.chip_type)
        _put_text(out.chip_name, chip.chip_name)
        _put_text(out.chip_ver, chip.chip_ver)
        out.aicore_cnt = chip.aicore
        return dcmi.DCMI_OK

    def dcmi_get_device_die_v2(self, card_id: Any, device_id: Any, input_type: Any, die_id: Any) -> int:
        out = _out(die_id, dcmi.DcmiDieId)
        if _int(input_type) not in (0, dcmi.VDIE):
            return dcmi.ERR_INVALID_PARAMETER
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        die = chip.die if input_type == dcmi.VDIE else tuple(w ^ 0xFFFF for w in chip.die)
        for i, word in enumerate(die):
            out.soc_die[i] = word
        return dcmi.DCMI_OK

    def dcmi_get_device_pcie_info_v2(self, card_id: Any, device_id: Any, pcie_info: Any) -> int:
        out = _out(pcie_info, dcmi.DcmiPcieInfoAll)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        out.venderid, out.deviceid, out.domain = 0x19E5, chip.device_id, 0
        out.bdf_busid, out.bdf_deviceid, out.bdf_funcid = chip.bus, 0, 0
        return dcmi.DCMI_OK

    def dcmi_get_topo_info_by_device_id(
        self, card_id1: Any, device_id1: Any, card_id2: Any, device_id2: Any, topo_type: Any
    ) -> int:
        self._count("dcmi_get_topo_info_by_device_id")
        out = _out(topo_type, ctypes.c_int)
        a, b = self._query(card_id1, device_id1), self._query(card_id2, device_id2)
        if isinstance(a, int):
            return a
        if isinstance(b, int):
            return b
        if a is b:
            out.value = 0  # SELF
        elif a.hccs is not None and a.hccs == b.hccs:
            out.value = dcmi.TOPO_HCCS
        elif a.card == b.card:
            out.value = 5  # PIX: the two chips of one card, behind its PCIe switch
        elif a.pcie_root == b.pcie_root:
            out.value = 2  # PHB
        else:
            out.value = 1  # SYS
        return dcmi.DCMI_OK

    def dcmi_get_device_hbm_info(self, card_id: Any, device_id: Any, hbm_info: Any) -> int:
        out = _out(hbm_info, dcmi.DcmiHbmInfo)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        if not chip.hbm:
            return dcmi.ERR_NOT_SUPPORT
        out.memory_size, out.memory_usage, out.temp = chip.memory_mib, chip.memory_used_mib, 40
        out.freq = 1600
        out.bandwith_util_rate = chip.utilization.get(str(dcmi.UTILIZATION_HBM_BANDWIDTH), 0)
        return dcmi.DCMI_OK

    def dcmi_get_device_memory_info_v3(self, card_id: Any, device_id: Any, memory_info: Any) -> int:
        out = _out(memory_info, dcmi.DcmiMemoryInfo)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        size = chip.memory_mib if not chip.hbm else 15360  # 910 chips report their small DDR here
        used = chip.memory_used_mib if not chip.hbm else 1024
        out.memory_size, out.memory_available = size, size - used
        out.utiliza = used * 100 // size
        return dcmi.DCMI_OK

    def dcmi_get_device_utilization_rate(
        self, card_id: Any, device_id: Any, input_type: Any, utilization_rate: Any
    ) -> int:
        self._count("dcmi_get_device_utilization_rate")
        out, kind = _out(utilization_rate, ctypes.c_uint), _int(input_type)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        if kind not in (2, 3, 4, 6, 10, 12, 13) or (kind in HBM_ONLY and not chip.hbm):
            return dcmi.ERR_NOT_SUPPORT  # the reference lists 2, 3, 4, 6, 10, 12 and 13 as supported
        out.value = chip.utilization.get(str(kind), 0)
        return dcmi.DCMI_OK

    def dcmi_get_device_power_info(self, card_id: Any, device_id: Any, power: Any) -> int:
        out = _out(power, ctypes.c_int)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        out.value = chip.power_tenths
        return dcmi.DCMI_OK

    def dcmi_get_device_temperature(self, card_id: Any, device_id: Any, temperature: Any) -> int:
        out = _out(temperature, ctypes.c_int)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        out.value = chip.temperature
        return dcmi.DCMI_OK

    def dcmi_get_device_frequency(self, card_id: Any, device_id: Any, input_type: Any, frequency: Any) -> int:
        out, kind = _out(frequency, ctypes.c_uint), _int(input_type)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        mhz = {dcmi.FREQ_AICORE_CURRENT: 1650, dcmi.FREQ_HBM: 1600 if chip.hbm else 0, dcmi.FREQ_DDR: 3200}
        if not mhz.get(kind):
            return dcmi.ERR_NOT_SUPPORT
        out.value = mhz[kind]
        return dcmi.DCMI_OK

    def dcmi_get_device_resource_info(
        self, card_id: Any, device_id: Any, proc_info: Any, proc_num: Any
    ) -> int:
        self._count("dcmi_get_device_resource_info")
        entries, count = _out(proc_info, ctypes.Array), _out(proc_num, ctypes.c_int)
        chip = self._query(card_id, device_id)
        if isinstance(chip, int):
            return chip
        listed = chip.processes[: min(len(entries), dcmi.MAX_PROC_NUM)]
        for i, (pid, used) in enumerate(listed):
            entries[i].proc_id, entries[i].proc_mem_usage = pid, used
        count.value = len(listed)
        return dcmi.DCMI_OK


_shared: dict[tuple[str, str], FakeDcmi] = {}
_shared_lock = threading.Lock()


def from_env(host_root: Path) -> FakeDcmi | None:
    """The fake named by ``KXPU_FAKE_DCMI``, its machine under ``host_root`` (a new temporary root when that is /)."""
    name = os.environ.get(FAKE_DCMI_ENV)
    if not name:
        return None
    with _shared_lock:
        key = (name, str(host_root))
        fake = _shared.get(key)
        if fake is None:
            fake = FakeDcmi(name, None if host_root == Path("/") else host_root)
            weakref.finalize(fake, fake.cleanup)  # a temporary root goes at exit; a given one stays
            _shared[key] = fake
        return fake


def _stand_in(host_root: Path) -> DcmiSource | None:
    """What the ascend backend loads in place of libdcmi once this module is imported."""
    fake = from_env(host_root)
    return None if fake is None else DcmiSource(fake.root, fake)


SEAM.plug(
    _stand_in
)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_dcmi``) plugs it in

"""What DCMI says about this node's NPUs, read into plain records in the order Huawei's devmanager reads it.

Cards from ``dcmi_get_card_list``, chips per card from ``dcmi_get_device_num_in_card``, then per
chip its logical ID, physical ID (the ``/dev/davinci<phy>`` number), chip info, VDIE die ID (the
UUID HAMi uses), PCIe address, memory and health. A chip whose later queries fail is kept with a
``fault`` so it is reported unhealthy rather than dropped; only failing to list cards or to
identify a chip (no physical ID) drops it, since nothing stable could name it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, replace

from kxpu.backends.ascend import dcmi
from kxpu.backends.ascend.dcmi import Dcmi, DcmiError, check
from kxpu.backends.host import Host, HostFileError
from kxpu.backends.links import link_groups
from kxpu.logs import get_logger

log = get_logger("kxpu.backends.ascend")


@dataclass(frozen=True, slots=True)
class Npu:
    phy_id: int
    logic_id: int
    card_id: int
    device_id: int
    chip_type: str = ""
    chip_name: str = ""
    chip_ver: str = ""
    aicore: int | None = None
    uuid: str | None = None
    memory_mib: int | None = None
    bus_id: str | None = None
    numa: int | None = None
    health: int | None = None
    fault: str | None = None  # short reason when DCMI cannot vouch for the chip
    detail: str | None = None  # the DCMI error behind ``fault``


def cards(lib: Dcmi) -> list[tuple[int, int]]:
    """``(card_id, device_id)`` of every chip; DcmiError if DCMI cannot list them."""
    num = ctypes.c_int()
    ids = (ctypes.c_int * dcmi.MAX_CARD_NUM)()
    check("dcmi_get_card_list", lib.dcmi_get_card_list(ctypes.byref(num), ids, dcmi.MAX_CARD_NUM))
    if not 0 <= num.value <= dcmi.MAX_CARD_NUM:
        raise DcmiError("dcmi_get_card_list", dcmi.ERR_INVALID_PARAMETER)
    chips = []
    for card in ids[: num.value]:
        count = ctypes.c_int()
        check("dcmi_get_device_num_in_card", lib.dcmi_get_device_num_in_card(card, ctypes.byref(count)))
        chips += [(card, dev) for dev in range(count.value)]
    return chips


def _ids(lib: Dcmi, card: int, dev: int) -> tuple[int, int]:
    logic = ctypes.c_int()
    check("dcmi_get_device_logic_id", lib.dcmi_get_device_logic_id(ctypes.byref(logic), card, dev))
    phy = ctypes.c_uint()
    check(
        "dcmi_get_device_phyid_from_logicid",
        lib.dcmi_get_device_phyid_from_logicid(logic.value, ctypes.byref(phy)),
    )
    return logic.value, phy.value


def _memory_mib(lib: Dcmi, card: int, dev: int) -> int:
    """HBM where the chip has it (910 series), else the DDR figure of ``memory_info_v3`` (310P)."""
    hbm = dcmi.DcmiHbmInfo()
    code = lib.dcmi_get_device_hbm_info(card, dev, ctypes.byref(hbm))
    if code == dcmi.DCMI_OK and hbm.memory_size:
        return int(hbm.memory_size)
    memory = dcmi.DcmiMemoryInfo()
    check(
        "dcmi_get_device_memory_info_v3", lib.dcmi_get_device_memory_info_v3(card, dev, ctypes.byref(memory))
    )
    return int(memory.memory_size)


def health(lib: Dcmi, card: int, dev: int) -> int:
    value = ctypes.c_uint()
    check("dcmi_get_device_health", lib.dcmi_get_device_health(card, dev, ctypes.byref(value)))
    return value.value


def error_codes(lib: Dcmi, card: int, dev: int) -> list[int]:
    """The chip's current fault codes (``dcmi_get_device_errorcode_v2``), for logs and reasons."""
    count = ctypes.c_int()
    codes = (ctypes.c_uint * dcmi.MAX_ERROR_CODE_COUNT)()
    code = lib.dcmi_get_device_errorcode_v2(card, dev, ctypes.byref(count), codes, dcmi.MAX_ERROR_CODE_COUNT)
    if code != dcmi.DCMI_OK:
        return []
    return [int(c) for c in codes[: max(0, min(count.value, dcmi.MAX_ERROR_CODE_COUNT))] if c]


def _numa(host: Host, bus_id: str) -> int | None:
    try:
        node = host.read_int(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node")
    except HostFileError as exc:  # a garbage sysfs file costs the hint, not the device
        log.warning("unreadable NUMA node", error=str(exc))
        return None
    return node if node is not None and node >= 0 else None


def hccs_domains(lib: Dcmi, npus: list[Npu]) -> dict[int, str]:
    """Physical ID → the chip's HCCS domain (``hccs-<lowest PCI address in it>``): chips DCMI's topology
    (``dcmi_get_topo_info_by_device_id``) says are joined by HCCS, transitively (an Atlas 800's ring of
    four, a 910B server's mesh of eight). A chip DCMI cannot place is in none; so is one with no HCCS peer."""
    topo = getattr(lib, "dcmi_get_topo_info_by_device_id", None)
    usable = sorted((n for n in npus if n.fault is None and n.bus_id), key=lambda n: n.bus_id or "")
    if topo is None or len(usable) < 2:
        return {}

    def hccs_pairs() -> Iterator[tuple[int, int]]:
        for i, a in enumerate(usable):
            for b in usable[i + 1 :]:
                kind = ctypes.c_int(-1)
                code = topo(a.card_id, a.device_id, b.card_id, b.device_id, ctypes.byref(kind))
                if code != dcmi.DCMI_OK:
                    log.debug("no DCMI topology for a chip pair", a=a.phy_id, b=b.phy_id, code=code)
                    continue
                if kind.value == dcmi.TOPO_HCCS:
                    yield a.phy_id, b.phy_id

    bus = {n.phy_id: n.bus_id for n in usable}  # by PCI address: the first of each domain names it
    groups = link_groups([n.phy_id for n in usable], hccs_pairs())
    return {phy: f"hccs-{bus[first]}" for phy, first in groups.items()}


def read_npu(lib: Dcmi, host: Host, card: int, dev: int) -> Npu | None:
    try:
        logic, phy = _ids(lib, card, dev)
    except DcmiError as exc:
        log.error("NPU cannot be identified; skipping it", card=card, device=dev, error=str(exc))
        return None
    npu = Npu(phy_id=phy, logic_id=logic, card_id=card, device_id=dev)
    try:
        npu = replace(npu, health=health(lib, card, dev))
        chip = dcmi.DcmiChipInfo()
        check("dcmi_get_device_chip_info", lib.dcmi_get_device_chip_info(card, dev, ctypes.byref(chip)))
        npu = replace(
            npu,
            chip_type=dcmi.text(chip.chip_type),
            chip_name=dcmi.text(chip.chip_name),
            chip_ver=dcmi.text(chip.chip_ver),
            aicore=int(chip.aicore_cnt) or None,
        )
        die = dcmi.DcmiDieId()
        check("dcmi_get_device_die_v2", lib.dcmi_get_device_die_v2(card, dev, dcmi.VDIE, ctypes.byref(die)))
        pcie = dcmi.DcmiPcieInfoAll()
        check("dcmi_get_device_pcie_info_v2", lib.dcmi_get_device_pcie_info_v2(card, dev, ctypes.byref(pcie)))
        npu = replace(
            npu,
            uuid=dcmi.die_id(die),
            bus_id=dcmi.bus_id(pcie),
            numa=_numa(host, dcmi.bus_id(pcie)),
            memory_mib=_memory_mib(lib, card, dev),
        )
    except DcmiError as exc:
        npu = replace(npu, fault=f"dcmi{exc.code}", detail=str(exc))
    return npu

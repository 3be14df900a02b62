"""The amdgpu driver's sysfs and KFD topology, read as ROCm/k8s-device-plugin reads them.

- GPUs: ``/sys/module/amdgpu/drivers/pci:amdgpu/<dddd:bb:dd.f>`` (the driver's bound PCI
  functions); per GPU ``current_compute_partition``, ``current_memory_partition`` (lower-cased),
  ``numa_node``, ``drm/card<N>`` and ``drm/renderD<N>`` (each with a ``dev`` of ``226:<minor>``).
  ``available_{compute,memory}_partition`` exist only where the GPU can be partitioned.
- MI300-class partitions: ``/sys/devices/platform/amdgpu_xcp_<n>/drm/{card,renderD}<N>``. The
  driver keeps these devices in every mode; only those whose render minor KFD lists are real
  partitions now (the plugin's rule), so a repartition shows as KFD nodes coming and going.
- KFD: ``/sys/class/kfd/kfd/topology/nodes/<k>/properties`` (``key value`` lines), ``mem_banks/0``,
  ``io_links/<j>`` and ``p2p_links/<j>`` (``node_from``, ``node_to``, ``type``: 2 PCIe, 11 XGMI).
- RAS: ``ras/<block>_err_count`` under the GPU's PCI directory, ``ue: <n>`` / ``ce: <n>`` lines.

Everything a GPU needs is read inside one ``try``: a garbage or unreadable file marks that GPU
(or that KFD node) bad with the file named, never the whole read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kxpu.backends.fakes import Seam
from kxpu.backends.host import Host, HostFileError
from kxpu.logs import get_logger

log = get_logger("kxpu.backends.amd")

# A fake amdgpu machine plugs in here: the root of its tree (sys/, dev/), read in place of hostRoot.
SEAM: Seam[[], Path] = Seam("amdgpu")

MODULE_DIR = "/sys/module/amdgpu"
DRIVER_DIR = "/sys/module/amdgpu/drivers/pci:amdgpu"
PLATFORM_DIR = "/sys/devices/platform"
KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
AMD_VENDOR = 0x1002
HYGON_VENDOR = 0x1D94
LINK_PCIE = 2
LINK_XGMI = 11
_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_XCP = re.compile(r"^amdgpu_xcp_(\d+)$")


@dataclass(frozen=True, slots=True)
class KfdNode:
    """A GPU (or partition) node of KFD's topology."""

    index: int
    render_minor: int
    bdf: str | None
    device_id: int
    vendor_id: int
    unique_id: int
    simd_count: int
    simd_per_cu: int
    gfx_target_version: int
    num_xcc: int
    memory_bytes: int | None
    gpu_id: int | None = None  # KFD's ID of the node: names its per-process files (proc/<pid>/vram_<gpu_id>)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One PCI function bound to amdgpu."""

    bdf: str
    vendor: int | None = None
    device_id: int | None = None
    numa_node: int | None = None
    compute_partition: str = ""
    memory_partition: str = ""
    compute_supported: bool = False
    memory_supported: bool = False
    card: int | None = None
    render: int | None = None
    product_name: str | None = None
    serial: str | None = None
    vram_bytes: int | None = None
    ras_uncorrectable: tuple[tuple[str, int], ...] = ()
    error: str | None = None  # a file that could not be read: the GPU is listed, unhealthy

    @property
    def mode(self) -> str:
        """``cpx_nps4``: the mixed strategy's resource suffix; empty where the GPU is not partitionable."""
        if self.compute_partition and self.memory_partition:
            return f"{self.compute_partition}_{self.memory_partition}"
        return ""


@dataclass(frozen=True, slots=True)
class Unit:
    """One allocatable device: a whole GPU (its own drm nodes) or one ``amdgpu_xcp_<n>`` partition."""

    id: str
    gpu: Gpu
    card: int | None
    render: int | None
    kfd: KfdNode | None
    partition: int  # 0: the PCI function's own nodes; 1…: the xcp partitions, by render minor
    xcp: int | None = None


@dataclass(slots=True)
class Snapshot:
    driver_loaded: bool
    gpus: list[Gpu] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    kfd: dict[int, KfdNode] = field(default_factory=dict)  # by render minor
    kfd_errors: list[str] = field(default_factory=list)


def bdf_from_location(domain: int, location_id: int) -> str:
    """KFD's ``domain``/``location_id`` as a PCI address (bus bits 8-15, device 3-7, function 0-2)."""
    return f"{domain:04x}:{(location_id >> 8) & 0xFF:02x}:{(location_id >> 3) & 0x1F:02x}.{location_id & 7}"


def amdsmi_uuid(serial: int, device_id: int, index: int = 0xFF) -> str:
    """The UUID amd-smi prints (``amdsmi_uuid_gen``): device ID, index (0xff a whole GPU, else the
    partition), the 64-bit ASIC serial spread over the rest, version 1, variant 2."""
    time_low = ((serial >> 56) & 0xFF) << 24 | (index & 0xFF) << 16 | (device_id & 0xFFFF)
    asic_6 = (serial >> 48) & 0xFF
    asic_4 = (serial >> 32) & 0xFFFF
    return f"{time_low:08x}-0000-1000-{0x80:02x}{asic_6:02x}-{asic_4:04x}{serial & 0xFFFFFFFF:08x}"


def _int(props: dict[str, str], key: str, where: str, default: int | None = None) -> int:
    value = props.get(key)
    if value is None:
        if default is None:
            raise HostFileError(f"{where}: no {key}")
        return default
    try:
        return int(value, 0)
    except ValueError:
        raise HostFileError(f"{where}: {key} is not an integer: {value[:40]!r}") from None


class AmdReader:
    def __init__(self, host: Host, vendor: int) -> None:
        self.host = host
        self.vendor = vendor

    def driver_loaded(self) -> bool:
        return self.host.is_dir("/sys/module/amdgpu/drivers")

    def read(self) -> Snapshot:
        if not self.driver_loaded():
            return Snapshot(False)
        snap = Snapshot(True)
        snap.kfd = self._kfd(snap.kfd_errors)
        for name in self.host.listdir(DRIVER_DIR):
            if _BDF.match(name):
                gpu = self._gpu(name)
                if gpu.vendor in (None, self.vendor):
                    snap.gpus.append(gpu)
        self._units(snap)
        return snap

    # ------------------------------------------------------------------ KFD
    def _kfd(self, errors: list[str]) -> dict[int, KfdNode]:
        out: dict[int, KfdNode] = {}
        for name in self.host.listdir(KFD_NODES):
            if not name.isdigit():
                continue
            where = f"{KFD_NODES}/{name}/properties"
            try:
                node = self._kfd_node(int(name), where)
            except HostFileError as exc:
                errors.append(str(exc))
                continue
            if node is not None:
                out[node.render_minor] = node
        return out

    def _kfd_node(self, index: int, where: str) -> KfdNode | None:
        props = self.host.read_properties(where)
        if props is None:
            return None
        render = _int(props, "drm_render_minor", where, 0)
        gfx = _int(props, "gfx_target_version", where, 0)
        if render <= 0 or gfx <= 0 or _int(props, "cpu_cores_count", where, 0) != 0:
            return None  # a CPU node
        bank = self.host.read_properties(f"{KFD_NODES}/{index}/mem_banks/0/properties") or {}
        location = props.get("location_id")
        return KfdNode(
            index=index,
            render_minor=render,
            bdf=None
            if location is None
            else bdf_from_location(_int(props, "domain", where, 0), _int(props, "location_id", where)),
            device_id=_int(props, "device_id", where, 0),
            vendor_id=_int(props, "vendor_id", where, 0),
            unique_id=_int(props, "unique_id", where, 0),
            simd_count=_int(props, "simd_count", where, 0),
            simd_per_cu=_int(props, "simd_per_cu", where, 0),
            gfx_target_version=gfx,
            num_xcc=_int(props, "num_xcc", where, 1),
            memory_bytes=_int(bank, "size_in_bytes", where, 0) or None,
            gpu_id=self.host.read_int(f"{KFD_NODES}/{index}/gpu_id", 10),
        )

    def links(self, nodes: list[int]) -> dict[tuple[int, int], int]:
        """(from, to) with from < to → link type, for KFD nodes among ``nodes`` (io_links and p2p_links)."""
        wanted = set(nodes)
        out: dict[tuple[int, int], int] = {}
        for node in nodes:
            for kind in ("io_links", "p2p_links"):
                base = f"{KFD_NODES}/{node}/{kind}"
                for link in self.host.listdir(base):
                    where = f"{base}/{link}/properties"
                    try:
                        props = self.host.read_properties(where) or {}
                        a = _int(props, "node_from", where)
                        b = _int(props, "node_to", where)
                        kind_id = _int(props, "type", where)
                    except HostFileError as exc:
                        log.warning("ignoring a KFD link", error=str(exc))
                        continue
                    if a in wanted and b in wanted and a != b:
                        out[(min(a, b), max(a, b))] = kind_id
        return out

    # ------------------------------------------------------------------ GPUs
    def _gpu(self, bdf: str) -> Gpu:
        base = f"{DRIVER_DIR}/{bdf}"
        try:
            return self._read_gpu(bdf, base)
        except HostFileError as exc:
            return Gpu(bdf=bdf, error=str(exc))

    def _read_gpu(self, bdf: str, base: str) -> Gpu:
        h = self.host
        card, render = self._drm(f"{base}/drm")
        ras = []
        for name in h.listdir(f"{base}/ras"):
            if name.endswith("_err_count"):
                ue = self._ras_count(f"{base}/ras/{name}")
                ras.append((name.removesuffix("_err_count"), ue))
        return Gpu(
            bdf=bdf,
            vendor=h.read_int(f"{base}/vendor", 16),
            device_id=h.read_int(f"{base}/device", 16),
            numa_node=h.read_int(f"{base}/numa_node", 10),
            compute_partition=(h.read(f"{base}/current_compute_partition") or "").lower(),
            memory_partition=(h.read(f"{base}/current_memory_partition") or "").lower(),
            compute_supported=h.exists(f"{base}/available_compute_partition"),
            memory_supported=h.exists(f"{base}/available_memory_partition"),
            card=card,
            render=render,
            product_name=h.read(f"{base}/product_name") or None,
            serial=h.read(f"{base}/serial_number") or None,
            vram_bytes=h.read_int(f"{base}/mem_info_vram_total", 10),
            ras_uncorrectable=tuple(ras),
        )

    def _ras_count(self, path: str) -> int:
        text = self.host.read(path) or ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "ue":
                try:
                    return int(value.strip())
                except ValueError:
                    break
        raise HostFileError(f"{path}: expected 'ue: <count>', found {text[:40]!r}")

    def _drm(self, drm_dir: str) -> tuple[int | None, int | None]:
        card = render = None
        for name in self.host.listdir(drm_dir):
            if name.startswith("renderD") and name[7:].isdigit():
                render = int(name[7:])
            elif name.startswith("card") and name[4:].isdigit():
                card = int(name[4:])
        return card, render

    # ------------------------------------------------------------------ units
    def _units(self, snap: Snapshot) -> None:
        by_bdf = {g.bdf: g for g in snap.gpus}
        by_card = {g.card: g for g in snap.gpus if g.card is not None}
        per_gpu: dict[str, list[Unit]] = {g.bdf: [] for g in snap.gpus}
        for gpu in snap.gpus:
            kfd = snap.kfd.get(gpu.render) if gpu.render is not None else None
            per_gpu[gpu.bdf].append(Unit(gpu.bdf, gpu, gpu.card, gpu.render, kfd, 0))
        xcps = sorted(
            (int(m.group(1)), name) for name in self.host.listdir(PLATFORM_DIR) if (m := _XCP.match(name))
        )
        for n, name in xcps:
            card, render = self._drm(f"{PLATFORM_DIR}/{name}/drm")
            kfd = snap.kfd.get(render) if render is not None else None
            if kfd is None:
                continue  # not a partition in the current mode (the plugin's rule)
            parent = by_bdf.get(kfd.bdf or "")
            if parent is None and card is not None:  # the plugin's fallback: 8 card minors per GPU
                parent = by_card.get(((card - 1) // 8) * 8 + 1)
            if parent is None:
                log.debug("partition with no GPU", xcp=name)
                continue
            per_gpu[parent.bdf].append(Unit(name, parent, card, render, kfd, 0, n))
        for gpu in snap.gpus:
            units = sorted(per_gpu[gpu.bdf], key=lambda u: (u.xcp is not None, u.render or 0))
            for i, unit in enumerate(units):
                snap.units.append(Unit(unit.id, unit.gpu, unit.card, unit.render, unit.kfd, i, unit.xcp))

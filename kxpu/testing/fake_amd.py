"""A fake amdgpu machine: the sysfs, KFD topology and /dev nodes ROCm/k8s-device-plugin reads.

Generated, not copied, with the shape of the trees AMD's plugin ships as test data
(``testdata/topo-mi210-xgmi-pcie``, ``topo-mi300-cpx``, ``topology-parsing-mi308``): KFD nodes
with ``key value`` properties (CPU nodes first, then one node per GPU or partition),
``mem_banks/0``, ``io_links/<j>`` (type 2 PCIe to the CPU, 11 XGMI between GPUs and between the
partitions of one GPU); PCI functions bound to amdgpu with partition files, ``numa_node``,
``drm/card<N>`` and ``drm/renderD<N>`` (8 card minors per MI300-class GPU, its partitions
after it), ``ras/<block>_err_count``; ``/sys/devices/platform/amdgpu_xcp_<n>`` for every
possible partition (7 per GPU, present in every mode, as the driver makes them; only KFD says
which are live); ``/dev/kfd`` and ``/dev/dri/*`` (real character devices as root).

Telemetry files as amdgpu writes them (``Documentation/gpu/amdgpu/thermal.rst`` and ``driver-misc.rst``):
``gpu_busy_percent``, ``mem_busy_percent``, ``mem_info_vram_used`` in bytes, ``pp_dpm_sclk`` / ``pp_dpm_mclk``
(``<level>: <n>Mhz``, the current level marked ``*``), ``hwmon/hwmon<N>/`` with ``name`` amdgpu,
``temp1_input``..``temp3_input`` in millidegrees labelled edge / junction / mem, power in microwatts as
``power1_average`` (``power1_input`` instead on MI300-class GPUs, where the driver hides the average), and
KFD's per-process directories ``/sys/class/kfd/kfd/proc/<pid>/vram_<gpu_id>`` (bytes of VRAM the process
holds on the KFD node whose ``gpu_id`` that is; the PID is the host's).

Profile values (bus numbers, serials, unique IDs, link layouts) are illustrative.

Live changes go through ``FakeHost``: values (RAS counters, partition modes) change in place with
no inotify event, as on sysfs; directories and nodes appear and disappear. The state is kept in
``<root>/.fake-amd.json`` so that a shell (or another process) can change a tree a daemon reads::

    python -m kxpu.testing.fake_amd write mi300x-8x-cpx /dev/shm/amd
    python -m kxpu.testing.fake_amd change /dev/shm/amd repartition spx_nps1
    python -m kxpu.testing.fake_amd change /dev/shm/amd ras 3 umc 1
    python -m kxpu.testing.fake_amd change /dev/shm/amd lose 5 | restore 5 | unload | load
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kxpu.backends.amd.sysfs import SEAM
from kxpu.testing.fake_host import FakeHost

DRI_MAJOR = 226
KFD_MAJOR = 240  # dynamic on a real host; 240-254 are for local use, so nothing answers here
MKFD_MINOR = 1
STATE_FILE = ".fake-amd.json"
PARTITIONS = {"spx": 1, "dpx": 2, "tpx": 3, "qpx": 4, "cpx": 8}
NPS = {"nps1": 1, "nps2": 2, "nps4": 4, "nps8": 8}
BUSES = (0x0C, 0x22, 0x38, 0x5C, 0x9F, 0xAF, 0xBF, 0xDF)
RAS_BLOCKS = ("umc", "gfx", "sdma", "mmhub", "xgmi_wafl")
GIB = 1 << 30
HIVE_BASE = 0x7C2A_51F0_E3B4_9D11  # illustrative; the driver derives it from the hive's first device


@dataclass(frozen=True, slots=True)
class GpuModel:
    vendor: int
    device: int
    product: str
    gfx: int
    cus: int
    vram_gib: int
    xccs: int
    partitionable: bool


MI300X = GpuModel(0x1002, 0x74A1, "AMD Instinct MI300X OAM", 90402, 304, 192, 8, True)
MI210 = GpuModel(0x1002, 0x740F, "AMD Instinct MI210", 90010, 104, 64, 1, False)
DCU_Z100 = GpuModel(0x1D94, 0x6320, "", 90006, 64, 32, 1, False)


@dataclass(frozen=True, slots=True)
class AmdProfile:
    name: str
    model: GpuModel | None
    modes: tuple[str, ...]  # per GPU: "cpx_nps4", or "" where not partitionable
    numa: tuple[int, ...]
    xgmi: bool  # every GPU pair over XGMI; else the links below
    pcie_pairs: tuple[tuple[int, int], ...] = ()
    xgmi_pairs: tuple[tuple[int, int], ...] = ()

    @property
    def count(self) -> int:
        return len(self.modes)


PROFILES = {
    p.name: p
    for p in (
        AmdProfile("mi300x-8x-spx", MI300X, ("spx_nps1",) * 8, (0,) * 4 + (1,) * 4, True),
        AmdProfile("mi300x-8x-cpx", MI300X, ("cpx_nps4",) * 8, (0,) * 4 + (1,) * 4, True),
        AmdProfile(
            "mi210-4x-xgmi",
            MI210,
            ("",) * 4,
            (0, 0, 1, 1),
            False,
            pcie_pairs=((0, 2), (1, 3)),
            xgmi_pairs=((0, 1), (2, 3)),
        ),
        AmdProfile("mixed-partitions", MI300X, ("cpx_nps4",) * 2 + ("spx_nps1",) * 2, (0, 0, 1, 1), True),
        AmdProfile(
            "hygon-dcu-8x",
            DCU_Z100,
            ("",) * 8,
            (0,) * 4 + (1,) * 4,
            False,
            pcie_pairs=tuple((a, b) for a in range(8) for b in range(a + 1, 8)),
        ),
        AmdProfile("no-driver", None, (), (0,), False),
    )
}


def load_profile(name: str) -> AmdProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown fake AMD profile {name!r}; known: {', '.join(PROFILES)}") from None


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="kxpu-fake-amd-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="kxpu-fake-amd-"))


class FakeAmd:
    """A fake machine of ``profile`` under ``root`` (a new directory, on /dev/shm where it can)."""

    def __init__(self, profile: AmdProfile | str, root: Path | None = None, *, write: bool = True) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.owned = root is None
        self.root = _shm_dir() if root is None else root
        self.fake = FakeHost(self.root)
        self.modes = list(self.profile.modes)
        self.present = set(range(self.profile.count))
        self.driver = self.profile.model is not None
        self.ras: dict[str, int] = {}
        self.usage: dict[int, dict[str, int]] = {}
        self.gpu_ids: dict[tuple[int, int], int] = {}  # (GPU, partition) → KFD gpu_id
        if write:
            self._write_all()

    # ------------------------------------------------------------------ facts
    @property
    def model(self) -> GpuModel:
        assert self.profile.model is not None
        return self.profile.model

    def bdf(self, g: int) -> str:
        return f"0000:{BUSES[g]:02x}:00.0"

    def card(self, g: int, k: int = 0) -> int:
        return 1 + 8 * g + k

    def render(self, g: int, k: int = 0) -> int:
        return 128 + 8 * g + k

    def xcp(self, g: int, k: int) -> int:
        """The platform device index of GPU ``g``'s partition ``k`` (1…7)."""
        return 7 * g + k - 1

    def partitions(self, g: int) -> int:
        mode = self.modes[g]
        return PARTITIONS[mode.split("_")[0]] if mode else 1

    def unique_id(self, g: int) -> int:
        return 0x4F2A_1C00_0000_0000 | (g + 1) * 0x1_0001_0203

    def hive(self, g: int) -> int:
        """GPU ``g``'s xGMI hive ID (0: in none): one hive for a fully connected profile, else one per group of
        GPUs joined by ``xgmi_pairs`` (an MI210 bridge joins two or four cards)."""
        if self.profile.xgmi:
            return HIVE_BASE
        group = {g}
        for _ in range(self.profile.count):
            group |= {b for a, b in self.profile.xgmi_pairs if a in group} | {
                a for a, b in self.profile.xgmi_pairs if b in group
            }
        return HIVE_BASE + min(group) + 1 if len(group) > 1 else 0

    def serial(self, g: int) -> str:
        return (
            f"T8R13800{0x130616 + g:06X}" if self.model.vendor == 0x1D94 else f"PCB0{BUSES[g]:02X}9A{g:02d}"
        )

    def device_ids(self) -> list[str]:
        """The IDs AMD's plugin would list now, in its order (GPU, then its live partitions)."""
        out: list[str] = []
        for g in sorted(self.present):
            out.append(self.bdf(g))
            out += [f"amdgpu_xcp_{self.xcp(g, k)}" for k in range(1, self.partitions(g))]
        return out

    # ------------------------------------------------------------------ writing
    def _gpu_dir(self, g: int) -> str:
        return f"/sys/devices/pci0000:00/{self.bdf(g)}"

    def _write_all(self) -> None:
        f = self.fake
        f.mkdir("/dev")
        f.mkdir("/sys/devices/platform")
        if not self.driver:
            self._save()
            return
        f.write_attribute("/sys/module/amdgpu/version", "6.10.5")
        f.write_attribute("/sys/module/amdgpu/srcversion", "8F6E0C5B7A1D2E3F4A5B6C7")
        f.mkdir("/sys/bus/pci/drivers/amdgpu")
        f.symlink("/sys/module/amdgpu/drivers/pci:amdgpu", "../../../bus/pci/drivers/amdgpu")
        f.device_node("/dev/kfd", KFD_MAJOR, 0)
        if self.model.vendor == 0x1D94:
            f.device_node("/dev/mkfd", KFD_MAJOR, MKFD_MINOR)
            f.write_file("/opt/hyhal/lib/libhydmi.so", b"\x7fELF fake")
        for g in sorted(self.present):
            self._write_gpu(g)
        self._write_kfd()
        self._save()

    def _write_gpu(self, g: int) -> None:
        f, m, base = self.fake, self.model, self._gpu_dir(g)
        f.write_attribute(f"{base}/vendor", f"0x{m.vendor:04x}")
        f.write_attribute(f"{base}/device", f"0x{m.device:04x}")
        f.write_attribute(f"{base}/class", "0x120000")
        f.write_attribute(f"{base}/numa_node", self.profile.numa[g])
        f.write_attribute(f"{base}/mem_info_vram_total", m.vram_gib * GIB)
        self._write_usage(g)
        f.write_attribute(f"{base}/serial_number", self.serial(g))
        if m.product:
            f.write_attribute(f"{base}/product_name", m.product)
        if m.partitionable:
            compute, memory = self.modes[g].split("_")
            f.write_attribute(f"{base}/current_compute_partition", compute.upper())
            f.write_attribute(f"{base}/current_memory_partition", memory.upper())
            f.write_attribute(f"{base}/available_compute_partition", "SPX, DPX, QPX, CPX")
            f.write_attribute(f"{base}/available_memory_partition", "NPS1, NPS4")
        for block in RAS_BLOCKS if m.vendor == 0x1002 else ("umc",):
            ue = self.ras.get(f"{g}/{block}", 0)
            f.write_attribute(f"{base}/ras/{block}_err_count", f"ue: {ue}\nce: 0")
        f.symlink(
            f"/sys/bus/pci/drivers/amdgpu/{self.bdf(g)}", f"../../../../devices/pci0000:00/{self.bdf(g)}"
        )
        f.symlink(f"{base}/driver", "../../../bus/pci/drivers/amdgpu")
        self._drm(f"{base}/drm", g, 0, device_link="../..")
        f.symlink(f"/sys/bus/pci/devices/{self.bdf(g)}", f"../../../devices/pci0000:00/{self.bdf(g)}")
        hive = self.hive(g)
        if hive:  # the hive's directory lives under its first GPU; the others link to it, as amdgpu does
            first = min(o for o in range(self.profile.count) if self.hive(o) == hive)
            if first == g:
                f.write_attribute(f"{base}/xgmi_hive_info/xgmi_hive_id", hive)
            else:
                f.symlink(f"{base}/xgmi_hive_info", f"../{self.bdf(first)}/xgmi_hive_info")
        if m.partitionable:
            for k in range(1, 8):  # every possible partition, in every mode
                self._drm(f"/sys/devices/platform/amdgpu_xcp_{self.xcp(g, k)}/drm", g, k)

    def _write_usage(self, g: int) -> None:
        f, base = self.fake, self._gpu_dir(g)
        use = self.usage.get(g, {})
        f.write_attribute(f"{base}/gpu_busy_percent", use.get("busy", 0))
        f.write_attribute(f"{base}/mem_busy_percent", use.get("memBusy", 0))
        f.write_attribute(f"{base}/mem_info_vram_used", use.get("vramUsed", 0))
        f.write_attribute(f"{base}/pp_dpm_sclk", "0: 500Mhz\n1: 1700Mhz *\n2: 2100Mhz")
        f.write_attribute(f"{base}/pp_dpm_mclk", "0: 900Mhz\n1: 1300Mhz *")
        hwmon = f"{base}/hwmon/hwmon{g + 2}"
        f.write_attribute(f"{hwmon}/name", "amdgpu")
        for n, (label, milli) in enumerate((("edge", 41000), ("junction", 47000), ("mem", 44000)), start=1):
            f.write_attribute(f"{hwmon}/temp{n}_input", milli)
            f.write_attribute(f"{hwmon}/temp{n}_label", label)
        power = "power1_input" if self.model.partitionable else "power1_average"  # MI300 hides the average
        f.write_attribute(f"{hwmon}/{power}", use.get("powerMicroW", 90_000_000))

    def _drm(self, drm: str, g: int, k: int, device_link: str | None = None) -> None:
        f = self.fake
        card, render = self.card(g, k), self.render(g, k)
        f.write_attribute(f"{drm}/card{card}/dev", f"{DRI_MAJOR}:{card}")
        f.write_attribute(f"{drm}/renderD{render}/dev", f"{DRI_MAJOR}:{render}")
        if device_link:
            f.symlink(f"{drm}/card{card}/device", device_link)
            f.symlink(f"/sys/class/drm/card{card}", f"../../devices/pci0000:00/{self.bdf(g)}/drm/card{card}")
        f.device_node(f"/dev/dri/card{card}", DRI_MAJOR, card)
        f.device_node(f"/dev/dri/renderD{render}", DRI_MAJOR, render)

    def _write_kfd(self) -> None:
        f, m = self.fake, self.model
        f.remove("/sys/class/kfd/kfd/topology/nodes")
        self.gpu_ids.clear()
        numa_nodes = sorted(set(self.profile.numa))
        nodes: list[tuple[int, int, int]] = []  # (kfd node, gpu, partition)
        index = len(numa_nodes)
        for g in sorted(self.present):
            for k in range(self.partitions(g)):
                nodes.append((index, g, k))
                index += 1
        top = "/sys/class/kfd/kfd/topology/nodes"
        for n in numa_nodes:
            f.write_attribute(
                f"{top}/{n}/properties",
                f"cpu_cores_count 48\nsimd_count 0\nmem_banks_count 1\nio_links_count {len(nodes)}\n"
                "gfx_target_version 0\ndrm_render_minor 0\nvendor_id 0\ndevice_id 0\nlocation_id 0\n",
            )
            f.write_attribute(f"{top}/{n}/gpu_id", 0)
        for node, g, k in nodes:
            parts = self.partitions(g)
            nps = NPS[self.modes[g].split("_")[1]] if self.modes[g] else 1
            where = f"{top}/{node}"
            f.write_attribute(
                f"{where}/properties",
                "\n".join(
                    [
                        "cpu_cores_count 0",
                        f"simd_count {m.cus * 4 // parts}",
                        "mem_banks_count 1",
                        "simd_per_cu 4",
                        f"gfx_target_version {m.gfx}",
                        f"vendor_id {m.vendor}",
                        f"device_id {m.device}",
                        f"location_id {BUSES[g] << 8}",
                        "domain 0",
                        f"drm_render_minor {self.render(g, k)}",
                        f"hive_id {self.hive(g)}",
                        f"num_xcc {max(1, m.xccs // parts)}",
                        f"unique_id {self.unique_id(g)}",
                    ]
                ),
            )
            f.write_attribute(f"{where}/gpu_id", 1000 + node)
            self.gpu_ids[(g, k)] = 1000 + node
            f.write_attribute(f"{where}/name", f"gfx{m.gfx // 10000}{m.gfx // 100 % 100:x}{m.gfx % 100:x}")
            f.write_attribute(
                f"{where}/mem_banks/0/properties",
                f"heap_type 1\nsize_in_bytes {m.vram_gib * GIB // nps}\nflags 0\nwidth 64\nmem_clk_max 1300",
            )
            links = [(self.profile.numa[g], 2, 20)]
            for other, og, _ in nodes:
                if other == node:
                    continue
                kind = self._link(g, og)
                if kind is not None:
                    links.append((other, kind, 13 if og == g else 15 if kind == 11 else 40))
            for j, (to, kind, weight) in enumerate(links):
                f.write_attribute(
                    f"{where}/io_links/{j}/properties",
                    f"type {kind}\nversion_major 0\nnode_from {node}\nnode_to {to}\nweight {weight}\n"
                    f"min_bandwidth {50000 if kind == 11 else 312}\nmax_bandwidth {50000 if kind == 11 else 64000}",
                )

    def _link(self, a: int, b: int) -> int | None:
        if a == b or self.profile.xgmi:
            return 11
        pair = (min(a, b), max(a, b))
        if pair in self.profile.xgmi_pairs:
            return 11
        if pair in self.profile.pcie_pairs:
            return 2
        return None

    def _save(self) -> None:
        state = {
            "profile": self.profile.name,
            "modes": self.modes,
            "present": sorted(self.present),
            "driver": self.driver,
            "ras": self.ras,
        }
        (self.root / STATE_FILE).write_text(json.dumps(state))

    @classmethod
    def open(cls, root: Path) -> FakeAmd:
        """A tree written earlier (by this process or ``python -m kxpu.testing.fake_amd write``)."""
        try:
            state = json.loads((root / STATE_FILE).read_text())
        except (OSError, ValueError):
            raise ValueError(f"{root}: not a fake AMD machine (no readable {STATE_FILE})") from None
        fake = cls(state["profile"], root, write=False)
        fake.modes, fake.present = list(state["modes"]), set(state["present"])
        fake.driver, fake.ras = bool(state["driver"]), dict(state["ras"])
        return fake

    # ------------------------------------------------------------------ live changes
    def set_ras(self, g: int, block: str, ue: int, ce: int = 0) -> None:
        """An error count changes: a value, no inotify event (as on sysfs)."""
        self.ras[f"{g}/{block}"] = ue
        self.fake.set_attribute(f"{self._gpu_dir(g)}/ras/{block}_err_count", f"ue: {ue}\nce: {ce}")
        self._save()

    def set_usage(self, g: int, **values: int) -> None:
        """What GPU ``g`` is doing: ``busy``, ``memBusy`` (percent), ``vramUsed`` (bytes), ``powerMicroW``."""
        self.usage.setdefault(g, {}).update(values)
        self._write_usage(g)

    def run_process(self, pid: int, vram: dict[tuple[int, int], int]) -> None:
        """A process with KFD memory on (GPU, partition) pairs: ``proc/<pid>/vram_<gpu_id>`` per KFD node."""
        for (g, k), used in vram.items():
            self.fake.write_attribute(f"/sys/class/kfd/kfd/proc/{pid}/vram_{self.gpu_ids[(g, k)]}", used)
        self.fake.write_attribute(f"/sys/class/kfd/kfd/proc/{pid}/pasid", 0x8000 + pid % 0x1000)

    def end_process(self, pid: int) -> None:
        self.fake.remove(f"/sys/class/kfd/kfd/proc/{pid}")

    def repartition(self, mode: str, gpus: list[int] | None = None) -> None:
        """``amd-smi set --compute-partition``: the mode files change in place, KFD's nodes are rebuilt."""
        compute, memory = mode.lower().split("_")
        for g in gpus if gpus is not None else sorted(self.present):
            self.modes[g] = mode.lower()
            base = self._gpu_dir(g)
            self.fake.set_attribute(f"{base}/current_compute_partition", compute.upper())
            self.fake.set_attribute(f"{base}/current_memory_partition", memory.upper())
        self._write_kfd()
        self._save()

    def lose(self, g: int) -> None:
        """GPU ``g`` falls off the bus: its PCI function, drm nodes, partitions and KFD nodes go."""
        f = self.fake
        self.present.discard(g)
        f.remove(f"/sys/bus/pci/drivers/amdgpu/{self.bdf(g)}")
        f.remove(f"/sys/bus/pci/devices/{self.bdf(g)}")
        f.remove(self._gpu_dir(g))
        for k in range(8):
            f.remove(f"/dev/dri/card{self.card(g, k)}")
            f.remove(f"/dev/dri/renderD{self.render(g, k)}")
            f.remove(f"/sys/class/drm/card{self.card(g, k)}")
            if k:
                f.remove(f"/sys/devices/platform/amdgpu_xcp_{self.xcp(g, k)}")
        self._write_kfd()
        self._save()

    def restore(self, g: int) -> None:
        self.present.add(g)
        self._write_gpu(g)
        self._write_kfd()
        self._save()

    def unload_driver(self) -> None:
        """``modprobe -r amdgpu``: the module, its sysfs, KFD and every node go away."""
        f = self.fake
        for path in (
            "/sys/module/amdgpu",
            "/sys/bus/pci/drivers/amdgpu",
            "/sys/class/kfd",
            "/dev/kfd",
            "/dev/mkfd",
        ):
            f.remove(path)
        for name in os.listdir(f.path("/dev/dri")) if f.path("/dev/dri").is_dir() else []:
            f.remove(f"/dev/dri/{name}")
        for name in os.listdir(f.path("/sys/devices/platform")):
            if name.startswith("amdgpu_xcp_"):
                f.remove(f"/sys/devices/platform/{name}")
        self.driver = False
        self._save()

    def load_driver(self) -> None:
        if self.profile.model is None:
            raise ValueError(f"profile {self.profile.name} has no GPUs to load a driver for")
        self.driver = True
        self._write_all()

    def cleanup(self) -> None:
        self.fake.cleanup()
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)


FAKE_AMD_ENV = "KXPU_FAKE_AMD"
_shared: dict[str, FakeAmd] = {}


def from_env(value: str) -> Path:
    """The root named by KXPU_FAKE_AMD: an existing tree's path, or a profile (one tree per process)."""
    if value.startswith("/"):
        if not Path(value, "sys").is_dir():
            raise ValueError(f"KXPU_FAKE_AMD={value}: no fake machine there (no sys/ directory)")
        return Path(value)
    if value not in _shared:
        _shared[value] = FakeAmd(value)
        atexit.register(_shared[value].cleanup)
    return _shared[value].root


USAGE = """usage: python -m kxpu.testing.fake_amd write PROFILE DIR
       python -m kxpu.testing.fake_amd change DIR repartition MODE [GPU...] | ras GPU BLOCK COUNT
                                              | lose GPU | restore GPU | unload | load
profiles: """ + ", ".join(PROFILES)


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 3 and argv[0] == "write":
            fake = FakeAmd(argv[1], Path(argv[2]))
            print(
                f"wrote a fake {fake.profile.name} under {fake.root}; run kxpu with KXPU_FAKE_AMD={fake.root} "
                "and --import kxpu.testing.fake_amd"
            )
            return 0
        if len(argv) >= 3 and argv[0] == "change":
            fake = FakeAmd.open(Path(argv[1]))
            op, args = argv[2], argv[3:]
            if op == "repartition" and args:
                fake.repartition(args[0], [int(a) for a in args[1:]] or None)
            elif op == "ras" and len(args) == 3:
                fake.set_ras(int(args[0]), args[1], int(args[2]))
            elif op in ("lose", "restore") and len(args) == 1:
                getattr(fake, op)(int(args[0]))
            elif op in ("unload", "load") and not args:
                fake.unload_driver() if op == "unload" else fake.load_driver()
            else:
                print(USAGE)
                return 2
            print(f"{op} done; devices now: {len(fake.device_ids()) if fake.driver else 0}")
            return 0
    except (ValueError, KeyError, IndexError) as exc:
        print(f"fake_amd: {exc}", file=sys.stderr)
        return 1
    print(USAGE)
    return 2


def _stand_in() -> Path | None:
    """The tree the amd and hygon backends read in place of hostRoot once this module is imported."""
    value = os.environ.get(FAKE_AMD_ENV)
    return from_env(value) if value else None


SEAM.plug(_stand_in)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_amd``) plugs it in


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

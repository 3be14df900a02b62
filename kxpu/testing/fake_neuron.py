"""A fake AWS Neuron machine: the driver's sysfs tree and ``/dev/neuron<N>``, from named profiles.

The tree is the one the Neuron driver builds (see ``kxpu.backends.neuron.sysfs`` for the
sources): ``/sys/devices/virtual/neuron_device/neuron<N>`` with ``core_count``,
``connected_devices``, ``reset``, ``dev``, ``uevent``, a ``subsystem`` link, ``info/`` and
``stats/hardware/``, one ``neuron_core<K>/`` per NeuronCore, the class links
``/sys/class/neuron_device/neuron<N>``, ``/sys/module/neuron/version`` and the char devices.

Profiles: ``inf1-6xl`` (4 Inferentia, 4 cores each), ``inf2-48xl`` (12 Inferentia2 in a ring),
``trn1-32xl`` (16 Trainium1 in a 4x4 torus, 2 cores each), ``trn2-48xl`` (16 Trainium2, 8
physical cores, LNC 2 by default) and ``trn2-48xl-lnc1`` (the EKS node file sets LNC 1),
``no-driver``; ``*-new-layout`` variants stand in for driver 2.31's reorganized tree. AWS
documents that 2.31 moved nodes but the new paths were not available when this was written:
those variants move ``core_count`` and ``connected_devices`` into ``info/`` as a *stand-in*, which
proves the backend finds attributes by name, not that it matches 2.31's real tree.

Changes happen as on hardware: ``set_ecc``/``set_state`` rewrite values in place (no inotify
event, as sysfs raises none), ``lose``/``restore`` and ``unload_driver``/``load_driver`` remove
and add directories and device nodes (which do raise events). The tree lives on disk, so a daemon
in another process pointed at the root (``hostRoot``, or ``KXPU_FAKE_NEURON=<root>`` with
``--import kxpu.testing.fake_neuron``, which plugs this fake into the backend's seam) sees every
change. ``python -m kxpu.testing.fake_neuron <profile> <dir>`` writes one for ``kxpu devices``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kxpu.backends.neuron.sysfs import LEGACY_PATHS, LNC_DEVICES, LNC_FILE, SEAM
from kxpu.testing.fake_host import FakeHost

DEVICE_DIR = "/sys/devices/virtual/neuron_device"
MONITOR_PATH = "/opt/aws/neuron/bin/neuron-monitor"  # where aws-neuronx-tools installs it
FAKE_MAJOR = 240  # the driver's major is dynamic; 240-254 are for local use, so nothing answers here
NEW_LAYOUT = {"core_count": "info/core_count", "connected_devices": "info/connected_devices"}  # stand-in


@dataclass(frozen=True)
class NeuronProfile:
    name: str
    device_name: str  # info/architecture/device_name
    arch: tuple[str, str]  # arch_type of the device and of its cores
    family: str  # info/architecture/instance_type
    count: int
    physical_cores: int
    topology: Literal["torus", "ring", "none"]
    layout: Literal["legacy", "new"] = "legacy"
    driver_version: str = "2.24.7.0"
    lnc_file: int | None = None
    driver: bool = True
    pci_parents: bool = False  # each device's ``device`` link to its PCI function (half under each CPU)
    tools: bool = False  # aws-neuronx-tools installed: a fake neuron-monitor at /opt/aws/neuron/bin

    @property
    def logical_core_config(self) -> int:
        """As the backend derives it: the EKS node file, else 2 on Trainium2/3 and 1 elsewhere."""
        return self.lnc_file or (2 if self.device_name in LNC_DEVICES else 1)

    @property
    def cores_per_device(self) -> int:
        """Logical NeuronCores per device: what neuron-monitor numbers cores by."""
        return self.physical_cores // self.logical_core_config


def _base_profiles() -> list[NeuronProfile]:
    # arch suffixes from the driver's dhal tables: v1 Inferentia, v2 Trainium1, v3/v2 Inferentia2, v3 Trainium2.
    return [
        NeuronProfile("inf1-6xl", "Inferentia", ("NDv1", "NCv1"), "Inf1", 4, 4, "none"),
        NeuronProfile("inf2-48xl", "Inferentia2", ("NDv3", "NCv2"), "Inf2", 12, 2, "ring"),
        NeuronProfile("trn1-32xl", "Trainium1", ("NDv2", "NCv2"), "Trn1", 16, 2, "torus"),
        NeuronProfile("trn2-48xl", "Trainium2", ("NDv3", "NCv3"), "Trn2", 16, 8, "torus"),
    ]


def _profiles() -> dict[str, NeuronProfile]:
    out = {p.name: p for p in _base_profiles()}
    out["trn2-48xl-lnc1"] = replace(out["trn2-48xl"], name="trn2-48xl-lnc1", lnc_file=1)
    for base in ("trn1-32xl", "inf2-48xl"):
        out[f"{base}-new-layout"] = replace(
            out[base], name=f"{base}-new-layout", layout="new", driver_version="2.31.0.0"
        )
    out["trn1-32xl-pci"] = replace(
        out["trn1-32xl"], name="trn1-32xl-pci", layout="new", driver_version="2.31.0.0", pci_parents=True
    )
    for base in ("trn1-32xl", "trn2-48xl"):
        out[f"{base}-tools"] = replace(out[base], name=f"{base}-tools", tools=True)
    out["no-driver"] = replace(out["trn1-32xl"], name="no-driver", driver=False)
    return out


PROFILES = _profiles()


def load_profile(name: str) -> NeuronProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown fake Neuron profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def neighbours(profile: NeuronProfile, index: int) -> list[int]:
    """connected_devices: a 4-wide torus lists up, left, down, right (neuron-ls on trn2.48xlarge)."""
    n = profile.count
    if profile.topology == "ring":
        return [(index - 1) % n, (index + 1) % n]
    if profile.topology == "torus":
        row, col = divmod(index, 4)
        rows = n // 4
        return [
            ((row - 1) % rows) * 4 + col,
            row * 4 + (col - 1) % 4,
            ((row + 1) % rows) * 4 + col,
            row * 4 + (col + 1) % 4,
        ]
    return []


def attribute_path(profile: NeuronProfile, index: int, name: str) -> str:
    """The host path of one of device ``index``'s attributes in ``profile``'s layout."""
    return _attribute_template(profile, name).format(index=index)


def _attribute_template(profile: NeuronProfile, name: str) -> str:
    rel = NEW_LAYOUT.get(name) if profile.layout == "new" else None
    return f"{DEVICE_DIR}/neuron{{index}}/{rel or LEGACY_PATHS[name]}"  # type: ignore[index]


# device_mem's categories (neuron_sysfs_metrics.c, device_mem_category_counter_nodes_info_tbl)
MEMORY_CATEGORIES = (
    *("model_code", "tensors", "constants", "model_shared_scratchpad", "runtime_memory", "driver_memory"),
    *("collectives", "nonshared_scratchpad", "notifications", "dma_rings", "uncategorized"),
)


class FakeNeuron:
    """One fake Neuron machine under ``root`` (a new temporary directory by default)."""

    def __init__(self, profile: NeuronProfile | str, root: Path | None = None) -> None:
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.fake = FakeHost(root)
        self.root = self.fake.root
        if self.profile.driver:
            self.load_driver()
        if self.profile.tools:
            self.install_monitor()

    # ------------------------------------------------------------------ layout
    def attribute(self, index: int, name: str) -> str:
        """The host path of one of device ``index``'s attributes in this profile's layout."""
        return attribute_path(self.profile, index, name)

    def pci_address(self, index: int) -> str:
        """Device ``index``'s PCI function (``pci_parents`` profiles): half under each CPU's root complex."""
        half = self.profile.count // 2
        bus = 0x10 + index * 0x08 if index < half else 0x90 + (index - half) * 0x08
        return f"0000:{bus:02x}:00.0"

    def serial(self, index: int) -> str:
        return hashlib.sha256(f"{self.profile.name}/{index}".encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ building
    def load_driver(self) -> None:
        p = self.profile
        self.fake.write_attribute("/sys/module/neuron/version", p.driver_version)
        self.fake.mkdir("/sys/class/neuron_device")
        if p.lnc_file is not None:
            self.fake.write_file(LNC_FILE, f"NEURON_LOGICAL_NC_CONFIG={p.lnc_file}")
        for index in range(p.count):
            self.restore(index)

    def unload_driver(self) -> None:
        for index in range(self.profile.count):
            self.fake.remove(f"/dev/neuron{index}")
        for path in ("/sys/class/neuron_device", DEVICE_DIR, "/sys/module/neuron"):
            self.fake.remove(path)

    def restore(self, index: int) -> None:
        """Write device ``index`` (sysfs directory, class link, device node) as the driver does on probe."""
        p, base = self.profile, f"{DEVICE_DIR}/neuron{index}"
        values: dict[str, str | int] = {
            "core_count": p.physical_cores,
            "connected_devices": ", ".join(map(str, neighbours(p, index))),
            "reset": 1,
            "serial_number": self.serial(index),
            "arch_type": p.arch[0],
            "device_name": p.device_name,
            "instance_type": p.family,
            "mem_ecc_uncorrected": 0,
            "sram_ecc_uncorrected": 0,
        }
        for name, value in values.items():
            self.fake.write_attribute(self.attribute(index, name), value)
        self.fake.write_attribute(f"{base}/dev", f"{FAKE_MAJOR}:{index}")
        self.fake.write_attribute(
            f"{base}/uevent", f"MAJOR={FAKE_MAJOR}\nMINOR={index}\nDEVNAME=neuron{index}"
        )
        self.fake.write_attribute(f"{base}/info/notify_delay", -1)
        self.fake.write_attribute(f"{base}/power/control", "auto")
        self.fake.write_attribute(f"{base}/stats/hardware/mem_ecc_repairable_uncorrected", 0)
        # the driver's power stats read "no data" until its first minute of samples (neuron_power.c)
        self.fake.write_attribute(f"{base}/stats/power/utilization", "POWER_STATUS_NO_DATA,0,0.00,0.00,0.00")
        self.fake.symlink(f"{base}/subsystem", "../../../../class/neuron_device")
        if p.pci_parents:
            bdf, root = self.pci_address(index), f"pci0000:{index * 2 // p.count * 0x80:02x}"
            pci = f"{root}/{root[3:]}:01.0/{bdf}"
            self.fake.write_attribute(f"/sys/devices/{pci}/numa_node", index * 2 // p.count)
            self.fake.symlink(f"{base}/device", f"../../../{pci}")
            self.fake.symlink(f"/sys/bus/pci/devices/{bdf}", f"../../../devices/{pci}")
        for core in range(p.physical_cores):
            self.fake.write_attribute(f"{base}/neuron_core{core}/info/architecture/arch_type", p.arch[1])
            self.fake.write_attribute(f"{base}/neuron_core{core}/stats/status/success/total", 0)
            self.fake.write_attribute(f"{base}/neuron_core{core}/stats/status/success/present", 0)
            self.set_memory(index, core, {})
        self.fake.symlink(
            f"/sys/class/neuron_device/neuron{index}", f"../../devices/virtual/neuron_device/neuron{index}"
        )
        self.fake.device_node(f"/dev/neuron{index}", FAKE_MAJOR, index)

    # ------------------------------------------------------------------ changes, as hardware makes them
    def set_ecc(self, index: int, kind: Literal["mem", "sram"], count: int) -> None:
        self.fake.set_attribute(self.attribute(index, f"{kind}_ecc_uncorrected"), count)

    def set_memory(self, index: int, core: int, present: dict[str, int]) -> None:
        """What a core's runtime holds by category (bytes), as ``stats/memory_usage/device_mem`` shows it: each
        category's ``present``/``total``/``peak`` and their sum at the top."""
        base = f"{DEVICE_DIR}/neuron{index}/neuron_core{core}/stats/memory_usage/device_mem"
        for category in MEMORY_CATEGORIES:
            value = present.get(category, 0)
            for name in ("present", "total", "peak"):
                self.fake.write_attribute(f"{base}/{category}/{name}", value)
        for name in ("present", "total", "peak"):
            self.fake.write_attribute(f"{base}/{name}", sum(present.values()))

    def set_power(
        self,
        index: int,
        average: float,
        low: float | None = None,
        high: float | None = None,
        status: str = "VALID",
    ) -> None:
        """The last minute's power as a percentage of the device's maximum, as ``stats/power/utilization`` shows
        it: ``POWER_STATUS_<status>,<unix time>,<min>,<max>,<avg>`` with two decimals."""
        low, high = average if low is None else low, average if high is None else high
        self.fake.set_attribute(
            f"{DEVICE_DIR}/neuron{index}/stats/power/utilization",
            f"POWER_STATUS_{status},{int(time.time())},{low:.2f},{high:.2f},{average:.2f}",
        )

    def set_state(self, index: int, state: int) -> None:
        """The device state ``reset`` reads back: 0 resetting, 1 ready, 2 invalid."""
        self.fake.set_attribute(self.attribute(index, "reset"), state)

    def lose(self, index: int) -> None:
        """The device falls off the bus: its class link, sysfs directory and device node go away."""
        self.fake.remove(f"/sys/class/neuron_device/neuron{index}")
        self.fake.remove(f"{DEVICE_DIR}/neuron{index}")
        self.fake.remove(f"/dev/neuron{index}")

    # ------------------------------------------------------------------ neuron-monitor (fake_neuron_monitor)
    def install_monitor(self) -> None:
        """Install aws-neuronx-tools' neuron-monitor: a script at its real path that runs the fake monitor over
        this tree (``kxpu.testing.fake_neuron_monitor``), whose applications ``run_app`` sets."""
        from kxpu.testing import fake_neuron_monitor as monitor

        monitor.write_state(self.root, self._monitor_state())
        self.fake.write_file(
            MONITOR_PATH,
            f"#!{sys.executable}\nimport sys\nfrom kxpu.testing.fake_neuron_monitor import main\n"
            f"sys.exit(main(sys.argv[1:], {str(self.root)!r}))\n",
        )
        self.fake.path(MONITOR_PATH).chmod(0o755)

    def run_app(
        self, pid: int, cores: dict[int, tuple[float, dict[str, int]]], tag: str | None = None
    ) -> None:
        """A Neuron application (process ``pid``) on ``cores``: logical NeuronCore index (numbered across devices,
        as neuron-monitor does) → (utilization in percent, device memory by category). Its memory also shows in the
        driver's per-core counters, as the runtime's allocations do."""
        from kxpu.testing import fake_neuron_monitor as monitor

        state = monitor.read_state(self.root) or self._monitor_state()
        apps = [a for a in state["apps"] if a["pid"] != pid]
        entry = {"utilization": 0.0, "memory": {}}
        apps.append(
            {
                "pid": pid,
                "tag": tag or str(pid),
                "cores": {str(c): {**entry, "utilization": u, "memory": m} for c, (u, m) in cores.items()},
            }
        )
        monitor.write_state(self.root, {**state, "apps": apps})
        for core, (_, memory) in cores.items():
            self.set_memory(*self._physical(core), memory)

    def end_app(self, pid: int) -> None:
        from kxpu.testing import fake_neuron_monitor as monitor

        state = monitor.read_state(self.root) or self._monitor_state()
        for app in state["apps"]:
            if app["pid"] == pid:
                for core in app["cores"]:
                    self.set_memory(*self._physical(int(core)), {})
        apps = [a for a in state["apps"] if a["pid"] != pid]
        monitor.write_state(self.root, {**state, "apps": apps})

    def set_ecc_corrected(self, index: int, kind: Literal["mem", "sram"], count: int) -> None:
        """Corrected ECC events, which only neuron-monitor reports (the driver's sysfs counts uncorrected ones)."""
        from kxpu.testing import fake_neuron_monitor as monitor

        state = monitor.read_state(self.root) or self._monitor_state()
        corrected = state["corrected"].setdefault(str(index), {})
        corrected[kind] = count
        monitor.write_state(self.root, state)

    def monitor_fault(self, fault: Literal["exit", "garbage"] | None) -> None:
        """Make the fake neuron-monitor misbehave from its next report on: exit with an error, or print lines that
        are not JSON; None: report again."""
        from kxpu.testing import fake_neuron_monitor as monitor

        state = monitor.read_state(self.root) or self._monitor_state()
        monitor.write_state(self.root, {**state, "fault": fault})

    def _monitor_state(self) -> dict[str, Any]:
        """The fake monitor's first state: what it reports of this machine (it reads nothing of the profile)."""
        from kxpu.backends.neuron.sysfs import MEMORY_GIB

        profile = self.profile
        return {
            "profile": profile.name,
            "family": profile.family,
            "neuroncore_version": profile.arch[1].lower().replace("nc", ""),
            "device_name": profile.device_name,
            "cores_per_device": profile.cores_per_device,
            "logical_core_config": profile.logical_core_config,
            "memory_bytes": MEMORY_GIB.get(profile.device_name, 0) * 1024**3,
            "ecc_uncorrected": {
                kind: _attribute_template(profile, f"{kind}_ecc_uncorrected") for kind in ("mem", "sram")
            },
            "apps": [],
            "corrected": {},
            "fault": None,
        }

    def _physical(self, core: int) -> tuple[int, int]:
        """Logical NeuronCore ``core`` → (device index, first physical core's directory index)."""
        per_device = self.profile.cores_per_device
        return core // per_device, (core % per_device) * self.profile.logical_core_config

    def cleanup(self) -> None:
        self.fake.cleanup()


FAKE_NEURON_ENV = "KXPU_FAKE_NEURON"
_shared: dict[str, FakeNeuron] = {}


def from_env(value: str) -> Path:
    """The root named by KXPU_FAKE_NEURON: an existing tree's path, or a profile (one tree per process)."""
    if value.startswith("/"):
        if not Path(value, "sys").is_dir():
            raise ValueError(f"KXPU_FAKE_NEURON={value}: no fake machine there (no sys/ directory)")
        return Path(value)
    if value not in _shared:
        _shared[value] = FakeNeuron(value)
        atexit.register(_shared[value].cleanup)
    return _shared[value].root


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -m kxpu.testing.fake_neuron PROFILE DIR  (profiles: {', '.join(PROFILES)})")
        return 2
    fake = FakeNeuron(argv[0], Path(argv[1]))
    print(
        f"wrote a fake {fake.profile.name} under {fake.root}; run kxpu with KXPU_FAKE_NEURON={fake.root} "
        "and --import kxpu.testing.fake_neuron"
    )
    return 0


def _stand_in() -> Path | None:
    """The tree the neuron backend reads in place of hostRoot once this module is imported."""
    value = os.environ.get(FAKE_NEURON_ENV)
    return from_env(value) if value else None


SEAM.plug(
    _stand_in
)  # importing this module (a test, or ``kxpu --import kxpu.testing.fake_neuron``) plugs it in


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

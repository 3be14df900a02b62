"""What an AWS Neuron host says about its devices: the driver's sysfs tree and /dev/neuron<N>.

Facts read from the driver's own source (aws-neuron/aws-neuron-driver, versions 2.24.7.0 to
2.30.2.0: neuron_cdev.c, neuron_sysfs_metrics.c, v*/neuron_dhal_v*.c, neuron_device.h):

- the driver makes a class ``neuron_device`` and, per device, ``neuron<N>`` with no parent
  device, so ``/sys/class/neuron_device/neuron<N>`` links to
  ``/sys/devices/virtual/neuron_device/neuron<N>``; the char device is ``/dev/neuron<N>``;
- on the device: ``core_count`` (physical NeuronCores, printed without a newline),
  ``connected_devices`` (``12, 3, 4, 1``), ``reset`` (reads the device state: 0 resetting,
  1 ready, 2 invalid); all three readable by root only;
- ``info/serial_number`` (16 hex digits, empty when the firmware cannot be read),
  ``info/architecture/{arch_type,device_name,instance_type}`` (``NDv2``, ``Trainium1``, ``Trn1``),
  ``stats/hardware/{mem_ecc_uncorrected,sram_ecc_uncorrected}`` (uncorrectable ECC counts, since
  driver 2.14), one ``neuron_core<K>/`` per NeuronCore, and ``/sys/module/neuron/version``.

Driver 2.31 reorganized this tree and moved several nodes to new paths (AWS Neuron sysfs user
guide, 2.33). The new paths were not in any source available when this was written, so each
attribute is looked up at its pre-2.31 path first and otherwise *by its file name* anywhere in
the device's directory (outside the per-core directories); ``sysfsPaths`` in the config pins a
path when that is ambiguous. ``hack/neuron-check`` on a machine with driver 2.31 settles it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kxpu.backends.fakes import Seam
from kxpu.backends.host import Host, HostFileError

# A fake Neuron machine plugs in here: the root of its tree (sys/, dev/, opt/), read in place of hostRoot.
SEAM: Seam[[], Path] = Seam("Neuron")

CLASS_DIR = "/sys/class/neuron_device"
DRIVER_VERSION = "/sys/module/neuron/version"
# Where EKS node templates set the node's logical NeuronCore config (aws-neuron-sdk deploy/eks/prerequisites.rst).
LNC_FILE = "/opt/aws/neuron/logical_nc_config"
REORGANIZED_IN = (2, 31)

Attribute = Literal[
    "core_count",
    "connected_devices",
    "reset",
    "serial_number",
    "arch_type",
    "device_name",
    "instance_type",
    "mem_ecc_uncorrected",
    "sram_ecc_uncorrected",
]
LEGACY_PATHS: dict[Attribute, str] = {
    "core_count": "core_count",
    "connected_devices": "connected_devices",
    "reset": "reset",
    "serial_number": "info/serial_number",
    "arch_type": "info/architecture/arch_type",
    "device_name": "info/architecture/device_name",
    "instance_type": "info/architecture/instance_type",
    "mem_ecc_uncorrected": "stats/hardware/mem_ecc_uncorrected",
    "sram_ecc_uncorrected": "stats/hardware/sram_ecc_uncorrected",
}

DEVICE_STATE_INVALID = 2  # enum neuron_device_state: RESET 0, READY 1, INVALID 2
# Physical NeuronCores per device by device_name (V1/V2/V3_NC_PER_DEVICE), when core_count is unreadable.
PHYSICAL_CORES = {"Inferentia": 4, "Inferentia2": 2, "Trainium1": 2, "Trainium2": 8}
# Logical NeuronCore config applies to these; 2 is the default there (logical-neuroncore-config.rst).
LNC_DEVICES = ("Trainium2", "Trainium3")
# Device memory per device, GiB, as neuron-ls reports it (8 GB inf1, 32 GB inf2/trn1, 96 GB trn2).
MEMORY_GIB = {"Inferentia": 8, "Inferentia2": 32, "Trainium1": 32, "Trainium2": 96}

_DEVICE = re.compile(r"^neuron(\d+)$")
_LNC_LINE = re.compile(r"^\s*NEURON_LOGICAL_NC_CONFIG\s*=\s*(\S+)\s*$", re.M)


@dataclass(frozen=True, slots=True)
class NeuronDevice:
    """One device as read now; ``problems`` are the reasons it is unhealthy (empty: healthy)."""

    index: int
    path: str  # host path of its sysfs directory
    physical_cores: int | None
    device_name: str | None = None
    arch_type: str | None = None
    instance_type: str | None = None
    serial: str | None = None
    connected: tuple[int, ...] = ()
    pci_bus_id: str | None = None
    numa_node: int | None = None
    problems: tuple[str, ...] = ()
    errors: tuple[str, ...] = field(default=(), compare=False)  # what was unreadable, for the log


@dataclass(frozen=True, slots=True)
class NeuronHost:
    driver_version: str | None
    devices: tuple[NeuronDevice, ...]

    @property
    def reorganized(self) -> bool:
        """Whether the driver is 2.31 or newer (the reorganized sysfs tree), when its version is known."""
        numbers = [int(n) for n in re.findall(r"\d+", self.driver_version or "")[:2]]
        return len(numbers) == 2 and tuple(numbers) >= REORGANIZED_IN


class AttributeFinder:
    """Finds a device's attribute files: pinned path, pre-2.31 path, else by file name (cached)."""

    def __init__(self, host: Host, pinned: Mapping[str, str]) -> None:
        self.host = host
        self.pinned = dict(pinned)
        self._found: dict[tuple[str, str], str] = {}

    def path(self, device_dir: str, attribute: Attribute) -> str | None:
        if attribute in self.pinned:
            return f"{device_dir}/{self.pinned[attribute]}"
        for rel in (self._found.get((device_dir, attribute)), LEGACY_PATHS[attribute]):
            if rel is not None and os.path.isfile(self.host.path(f"{device_dir}/{rel}")):
                return f"{device_dir}/{rel}"
        rel = self._search(device_dir, os.path.basename(LEGACY_PATHS[attribute]))
        if rel is not None:
            self._found[(device_dir, attribute)] = rel
            return f"{device_dir}/{rel}"
        return None

    def _search(self, device_dir: str, name: str) -> str | None:
        root = self.host.path(device_dir)
        hits: list[str] = []
        for here, dirs, files in os.walk(root):  # symlinks (subsystem, device) are not followed
            dirs[:] = [d for d in dirs if not d.startswith("neuron_core") and d != "power"]
            if name in files:
                hits.append(os.path.relpath(os.path.join(here, name), root))
        if len(hits) > 1:
            raise HostFileError(
                f"{device_dir}: {name} found at {', '.join(sorted(hits))}; pin one with sysfsPaths"
            )
        return hits[0] if hits else None


class NeuronReader:
    """Reads the whole Neuron host in one pass (a few dozen small files)."""

    def __init__(self, host: Host, pinned: Mapping[str, str] | None = None) -> None:
        self.host = host
        self.finder = AttributeFinder(host, pinned or {})

    def driver_present(self) -> bool:
        return self.host.is_dir(CLASS_DIR)

    def read(self) -> NeuronHost:
        devices: list[NeuronDevice] = []
        for name in self.host.listdir(CLASS_DIR):
            match = _DEVICE.match(name)
            if match:
                devices.append(self._device(int(match.group(1)), f"{CLASS_DIR}/{name}"))
        devices.sort(key=lambda d: d.index)
        return NeuronHost(self.host.read(DRIVER_VERSION), tuple(devices))

    def logical_core_config(self) -> int | None:
        """NEURON_LOGICAL_NC_CONFIG from the node's config file, None when it does not set it."""
        text = self.host.read(LNC_FILE)
        match = _LNC_LINE.search(text or "")
        if match is None:
            return None
        if match.group(1) not in ("1", "2"):
            raise HostFileError(
                f"{LNC_FILE}: NEURON_LOGICAL_NC_CONFIG must be 1 or 2, found {match.group(1)!r}"
            )
        return int(match.group(1))

    def _text(self, device_dir: str, attribute: Attribute, errors: list[str]) -> str | None:
        try:
            path = self.finder.path(device_dir, attribute)
            return None if path is None else self.host.read(path)
        except HostFileError as exc:
            errors.append(str(exc))
            return None

    def _int(self, device_dir: str, attribute: Attribute, errors: list[str]) -> int | None:
        text = self._text(device_dir, attribute, errors)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            path = self.finder.path(device_dir, attribute)
            errors.append(f"{path}: expected an integer, found {text[:40]!r}")
            return None

    def _device(self, index: int, device_dir: str) -> NeuronDevice:
        errors: list[str] = []
        name = self._text(device_dir, "device_name", errors)
        cores = self._int(device_dir, "core_count", errors)
        if cores is None:  # the driver makes one neuron_core<K> directory per NeuronCore
            counted = sum(1 for e in self.host.listdir(device_dir) if re.fullmatch(r"neuron_core\d+", e))
            cores = counted or PHYSICAL_CORES.get(name or "")
        connected_text = self._text(device_dir, "connected_devices", errors) or ""
        parts = [p.strip() for p in connected_text.split(",") if p.strip()]
        if not all(p.isdigit() for p in parts):
            path = self.finder.path(device_dir, "connected_devices")
            errors.append(f"{path}: expected device numbers like '1, 3', found {connected_text[:40]!r}")
            parts = []
        state = self._int(device_dir, "reset", errors)
        hbm_ecc = self._int(device_dir, "mem_ecc_uncorrected", errors)
        sram_ecc = self._int(device_dir, "sram_ecc_uncorrected", errors)
        arch, family = (self._text(device_dir, a, errors) for a in ("arch_type", "instance_type"))
        serial = self._text(device_dir, "serial_number", errors)
        pci = self.host.link_name(f"{device_dir}/device")  # no parent device before 2.31
        numa = None
        if pci is not None:
            try:
                numa = self.host.read_int(f"{device_dir}/device/numa_node")
            except HostFileError as exc:
                errors.append(str(exc))
        problems = [
            reason
            for reason, bad in (
                ("no-device-node", not self.host.exists(f"/dev/neuron{index}")),
                ("core-count-unknown", not cores),
                ("device-state-invalid", state == DEVICE_STATE_INVALID),
                ("hbm-uncorrectable-error", (hbm_ecc or 0) > 0),
                ("sram-uncorrectable-error", (sram_ecc or 0) > 0),
                ("sysfs-unreadable", bool(errors)),
            )
            if bad
        ]
        return NeuronDevice(
            index=index,
            path=device_dir,
            physical_cores=cores or None,
            device_name=name,
            arch_type=arch,
            instance_type=family,
            serial=serial or None,
            connected=tuple(int(p) for p in parts),
            pci_bus_id=pci,
            numa_node=numa if numa is not None and numa >= 0 else None,
            problems=tuple(problems),
            errors=tuple(errors),
        )

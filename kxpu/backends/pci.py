"""Where a PCI device sits: its PCIe root complex, read from sysfs under a backend's host root.

Kubernetes' standard attribute ``resource.kubernetes.io/pcieRoot`` names the root complex a device
hangs under (``pci<domain>:<bus>``), so that a claim can ask for a GPU and a NIC behind one host
bridge (``matchAttribute``). Its source, as Kubernetes' own helper reads it
(``k8s.io/dynamic-resource-allocation/deviceattribute``): ``/sys/bus/pci/devices/<address>`` is a
symlink into ``/sys/devices``, whose tree mirrors the hardware, and the first directory below
``/sys/devices`` on that path is the root (``../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0``
→ ``pci0000:00``).

Anything else there (a missing link, a link out of ``/sys/devices/pci…``, a link ending at another
device) leaves the attribute out with one warning line per device, never an error: placement
hints are worth less than the device itself.
"""

from __future__ import annotations

import os
import posixpath
import re

from kxpu.backends.host import Host
from kxpu.logs import get_logger
from kxpu.model import pci_address

log = get_logger("kxpu.backends.pci")

PCI_DEVICES = "/sys/bus/pci/devices"
_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


class PcieRootError(ValueError):
    """sysfs does not say where the device sits (the message names the path and what was found)."""


def read_pcie_root(host: Host, bus_id: str) -> str:
    """The root complex (``pci0000:00``) of the PCI function ``bus_id`` (any vendor's spelling)."""
    address = pci_address(bus_id)
    if address is None:
        raise PcieRootError(f"{bus_id!r} is not a PCI address (dddd:bb:dd.f)")
    link = f"{PCI_DEVICES}/{address}"
    try:
        target = os.readlink(host.path(link))
    except FileNotFoundError:
        raise PcieRootError(f"{link} does not exist") from None
    except OSError as exc:
        raise PcieRootError(f"{link} is not a symlink into /sys/devices ({exc.strerror or exc})") from None
    resolved = posixpath.normpath(target if target.startswith("/") else posixpath.join(PCI_DEVICES, target))
    parts = resolved.split("/")  # ['', 'sys', 'devices', 'pci0000:00', …, '0000:07:00.0']
    if len(parts) < 5 or parts[1:3] != ["sys", "devices"] or not _ROOT.match(parts[3]):
        raise PcieRootError(f"{link} points to {target!r}, not into /sys/devices/pci<domain>:<bus>/")
    if parts[-1] != address:
        raise PcieRootError(f"{link} points to {target!r}, which is not {address}")
    return parts[3]


class PlacementReader:
    """Placement facts for a backend that rediscovers often: a fact sysfs (or a vendor library) answers
    with garbage is left out with one warning line per device and fact (again only if the answer
    changes), not one at every poll."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self._warned: dict[tuple[str, str], str] = {}

    def pcie_root(self, bus_id: str | None) -> str | None:
        if not bus_id:
            return None
        try:
            root = read_pcie_root(self.host, bus_id)
        except PcieRootError as exc:
            self.omitted(bus_id, "resource.kubernetes.io/pcieRoot", str(exc))
            return None
        self._warned.pop((bus_id, "resource.kubernetes.io/pcieRoot"), None)
        return root

    def omitted(self, device: str, attribute: str, error: str) -> None:
        """Say once that ``device`` is published without ``attribute`` because of ``error``."""
        if self._warned.get((device, attribute)) != error:
            self._warned[(device, attribute)] = error
            log.warning(
                f"{attribute} unknown; left out of the device's attributes", device=device, error=error
            )

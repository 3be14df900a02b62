"""One description of a device, shared by every output (ListAndWatch, CDI, labels, sharing inventory)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

# The kubelet stores IDs in its checkpoint and CDI names embed them: keep them short and name-safe.
MAX_DEVICE_ID_LENGTH = 63
# The kubelet's topology manager keeps NUMA nodes in a 64-bit mask ("bit number must be in range 0-63").
MAX_NUMA_NODE = 63
# Between a device's ID and the number of one of its parts the device plugin hands out (a generic share, an
# NVIDIA time-slicing replica, a sharing slot): the DRA driver splits on it to find the whole device.
SUB_DEVICE_SEPARATOR = "::"
_DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
# A PCI address as vendors' tools print it: 4 (Linux) or 8 (NVML) hex digits of domain, any case.
_PCI_ADDRESS = re.compile(r"^([0-9a-fA-F]{4}|[0-9a-fA-F]{8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class Health(StrEnum):
    """The two values the kubelet understands (anything but Healthy counts as unhealthy)."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class InvalidDeviceError(ValueError):
    """A backend produced a device the kubelet could not accept."""


def check_device_id(device_id: str) -> str:
    if not device_id or len(device_id) > MAX_DEVICE_ID_LENGTH or not _DEVICE_ID.match(device_id):
        raise InvalidDeviceError(
            f"device ID {device_id!r} must be 1-{MAX_DEVICE_ID_LENGTH} characters of letters, digits, "
            "'_', '.', ':' or '-', starting with a letter or digit"
        )
    return device_id


def pci_address(text: str | None) -> str | None:
    """The extended BDF Linux and Kubernetes' ``resource.kubernetes.io/pciBusID`` use (``0000:07:00.0``,
    lower case) from any vendor's spelling (NVML's ``00000000:07:00.0``); None if ``text`` is not one."""
    match = _PCI_ADDRESS.match((text or "").strip())
    if match is None:
        return None
    domain, bus, slot, function = match.groups()
    if len(domain) == 8:
        if int(domain[:4], 16):
            return None  # a domain beyond 16 bits has no 4-digit Linux form
        domain = domain[4:]
    return f"{domain}:{bus}:{slot}.{function}".lower()


@dataclass(frozen=True, slots=True)
class Device:
    """An allocatable unit as the kubelet counts it (a whole device, or one share of it).

    The typed attributes are optional; backends fill what they know. ``extra`` carries
    vendor facts (compute capability, MIG profile, …) for labels and CDI without
    widening this class for every vendor.
    """

    id: str
    health: Health = Health.HEALTHY
    numa_nodes: tuple[int, ...] = ()
    model: str | None = None
    uuid: str | None = None
    index: int | None = None
    memory_mib: int | None = None
    cores: int | None = None
    pci_bus_id: str | None = None
    extra: Mapping[str, str | int | bool] = field(default_factory=dict)
    # Why the device is unhealthy (e.g. "xid-79", "state-file"): counted in metrics, shown in logs.
    health_reason: str | None = None
    # A partition's draw on its physical device: counter set name → counter → amount (``Partitioner``).
    consumes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    # Where the device sits, for claims that want devices that line up (``matchAttribute``):
    # the PCIe root complex it hangs under (``pci0000:00``, from sysfs; a GPU and a NIC with one root
    # share a host bridge), and its link domain: devices with equal values are joined by the vendor's
    # device-to-device link (an NVLink island or clique, an xGMI hive, an HCCS ring). Partitions
    # inherit both from their physical device.
    pcie_root: str | None = None
    link_domain: str | None = None

    def __post_init__(self) -> None:
        check_device_id(self.id)
        # Accept plain strings from backends but always store the enum.
        object.__setattr__(self, "health", Health(self.health))
        object.__setattr__(self, "numa_nodes", tuple(self.numa_nodes))

    @property
    def healthy(self) -> bool:
        return self.health is Health.HEALTHY

    def with_health(self, health: Health, reason: str | None = None) -> Device:
        return replace(self, health=health, health_reason=None if health is Health.HEALTHY else reason)

    def __hash__(self) -> int:  # extra is a dict; identity for sets and dicts is the ID
        return hash(self.id)


def index_by_id(devices: list[Device] | tuple[Device, ...]) -> dict[str, Device]:
    """Map ID → device, refusing duplicates (two devices with one ID would be one to the kubelet)."""
    by_id: dict[str, Device] = {}
    for device in devices:
        if device.id in by_id:
            raise InvalidDeviceError(f"duplicate device ID {device.id!r}")
        by_id[device.id] = device
    return by_id

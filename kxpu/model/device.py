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
_DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


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

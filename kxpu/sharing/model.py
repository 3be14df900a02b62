"""Plain data for fractional sharing: devices as the scheduler sees them, requests, assignments.

Nothing here knows Kubernetes or the device plugin API; the extender, the webhook and the
node wrapper all speak these types and convert at their edges.

Units: memory in MiB; cores in percent of one device (100 = the whole device, which also
means *exclusive*: nobody else may share a device a container holds with 100 cores).
A device's *capacity* is its physical amount times the node's scaling factor (a factor
above 1 overcommits); *split count* is how many containers may share it at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

EXCLUSIVE_CORES = 100


class Policy(StrEnum):
    BINPACK = "binpack"  # fill used nodes/devices first, keep others whole
    SPREAD = "spread"  # prefer the least used, spreading load


@dataclass(frozen=True, slots=True)
class SharedDevice:
    """One physical device of a node, as published in the node's inventory."""

    id: str  # the vendor backend's device ID (the slots the kubelet sees are ``<id>::<n>``)
    uuid: str
    model: str
    memory_mib: int  # physical memory
    memory_capacity_mib: int  # physical x memory scaling: what may be granted in total
    core_capacity: int  # 100 x core scaling
    split_count: int  # containers that may share the device at once
    numa: int | None = None
    healthy: bool = True
    index: int = 0
    cores: int | None = None  # physical core count (SMs), informational


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """The devices of one resource family on one node."""

    resource: str
    devices: tuple[SharedDevice, ...]
    published_at: float = 0.0  # seconds since the epoch, as the node wrote it


@dataclass(frozen=True, slots=True)
class DeviceFilter:
    """Which devices a pod accepts: model substrings and UUIDs to use or avoid (empty = no constraint)."""

    use_types: frozenset[str] = frozenset()
    nouse_types: frozenset[str] = frozenset()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()

    def accepts(self, device: SharedDevice) -> bool:
        model = device.model.lower()
        if self.use_types and not any(t in model for t in self.use_types):
            return False
        if any(t in model for t in self.nouse_types):
            return False
        ids = (device.uuid, device.id)
        if self.use_uuids and not any(i in self.use_uuids for i in ids):
            return False
        return not any(i in self.nouse_uuids for i in ids)

    @property
    def empty(self) -> bool:
        return not (self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids)


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """What one container asks of one resource family, defaults already applied.

    Exactly one of ``memory_mib`` and ``memory_percentage`` is set; a percentage is of the
    device's physical memory and becomes MiB once a device is chosen.
    """

    container: str
    count: int
    memory_mib: int | None
    memory_percentage: int | None
    cores: int

    def memory_for(self, device: SharedDevice) -> int:
        if self.memory_mib is not None:
            return self.memory_mib
        assert self.memory_percentage is not None
        return device.memory_mib * self.memory_percentage // 100

    @property
    def exclusive(self) -> bool:
        return self.cores >= EXCLUSIVE_CORES


@dataclass(frozen=True, slots=True)
class PodRequest:
    """Everything a pod asks of one resource family: its containers in spec order, and its constraints."""

    resource: str
    containers: tuple[ContainerRequest, ...]
    device_filter: DeviceFilter = field(default_factory=DeviceFilter)
    numa_bind: bool = False
    node_policy: Policy | None = None  # None: the scheduler's configured default
    device_policy: Policy | None = None


@dataclass(frozen=True, slots=True)
class DeviceGrant:
    """A share of one device for one container."""

    device: str  # SharedDevice.id
    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class ContainerAssignment:
    container: str
    resource: str
    devices: tuple[DeviceGrant, ...]


@dataclass(frozen=True, slots=True)
class Assignment:
    """The scheduler's decision for a pod, signed and written on the pod at bind."""

    pod_uid: str
    namespace: str
    name: str
    node: str
    containers: tuple[ContainerAssignment, ...]
    issued_at: int  # seconds since the epoch

    def for_resource(self, resource: str) -> tuple[ContainerAssignment, ...]:
        return tuple(c for c in self.containers if c.resource == resource)

    @property
    def resources(self) -> frozenset[str]:
        return frozenset(c.resource for c in self.containers)

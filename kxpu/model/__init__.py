"""The device model: devices, container edits, and the backend contract."""

from kxpu.model.allocation import numa_packed
from kxpu.model.backend import (
    AsyncAllocator,
    Backend,
    BackendError,
    Capabilities,
    Closable,
    NodeLabeller,
    PreferredAllocator,
    PreStarter,
    Watcher,
    capabilities_of,
)
from kxpu.model.device import (
    MAX_DEVICE_ID_LENGTH,
    MAX_NUMA_NODE,
    Device,
    Health,
    InvalidDeviceError,
    check_device_id,
    index_by_id,
)
from kxpu.model.edits import ContainerEdits, DeviceNode, Mount

__all__ = [
    "MAX_DEVICE_ID_LENGTH",
    "MAX_NUMA_NODE",
    "AsyncAllocator",
    "Backend",
    "BackendError",
    "Capabilities",
    "Closable",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Health",
    "InvalidDeviceError",
    "Mount",
    "NodeLabeller",
    "PreStarter",
    "PreferredAllocator",
    "Watcher",
    "capabilities_of",
    "check_device_id",
    "index_by_id",
    "numa_packed",
]

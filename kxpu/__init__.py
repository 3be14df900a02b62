"""kxpu: heterogeneous accelerators on Kubernetes.

What a backend author needs is re-exported here; everything else is internal.
"""

from kxpu.backends.host import Host, HostBackendConfig, HostFileError, host_changes
from kxpu.backends.mounts import MountConfig
from kxpu.backends.registry import BackendConfig, register_backend
from kxpu.backends.templates import render_env
from kxpu.model import (
    Backend,
    BackendError,
    Closable,
    ContainerEdits,
    Device,
    DeviceNode,
    Health,
    Mount,
    PreferredAllocator,
    PreStarter,
    Watcher,
    numa_packed,
)

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendError",
    "Closable",
    "ContainerEdits",
    "Device",
    "DeviceNode",
    "Health",
    "Host",
    "HostBackendConfig",
    "HostFileError",
    "Mount",
    "MountConfig",
    "PreStarter",
    "PreferredAllocator",
    "Watcher",
    "host_changes",
    "numa_packed",
    "register_backend",
    "render_env",
]

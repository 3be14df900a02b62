"""kxpu: heterogeneous accelerators on Kubernetes.

What a backend author needs is re-exported here; everything else is internal.
"""

# Loaded on first use (PEP 562): ``import kxpu.cli`` (every daemon start) must not pay for every backend
# helper; ``from kxpu import Device`` works as before.
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_EXPORTS = {
    "Host": "kxpu.backends.host",
    "HostBackendConfig": "kxpu.backends.host",
    "HostFileError": "kxpu.backends.host",
    "host_changes": "kxpu.backends.host",
    "MountConfig": "kxpu.backends.mounts",
    "BackendConfig": "kxpu.backends.registry",
    "register_backend": "kxpu.backends.registry",
    "render_env": "kxpu.backends.templates",
    "Backend": "kxpu.model",
    "BackendError": "kxpu.model",
    "Closable": "kxpu.model",
    "ContainerEdits": "kxpu.model",
    "Device": "kxpu.model",
    "DeviceNode": "kxpu.model",
    "Health": "kxpu.model",
    "Mount": "kxpu.model",
    "PreferredAllocator": "kxpu.model",
    "PreStarter": "kxpu.model",
    "Watcher": "kxpu.model",
    "numa_packed": "kxpu.model",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kxpu' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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

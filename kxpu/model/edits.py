"""What a container gets for a set of devices: the common shape of Allocate responses and CDI edits."""

from __future__ import annotations

from dataclasses import dataclass, field

_PERMISSION_CHARS = frozenset("rwm")


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node made visible in the container (a DeviceSpec on the wire)."""

    container_path: str
    host_path: str
    permissions: str = "rw"

    def __post_init__(self) -> None:
        if not self.permissions or not set(self.permissions) <= _PERMISSION_CHARS:
            raise ValueError(f"device permissions {self.permissions!r} must be a non-empty mix of r, w, m")


@dataclass(slots=True)
class ContainerEdits:
    """Env vars, mounts, device nodes, annotations and CDI device names for one container."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    device_nodes: list[DeviceNode] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)

    def merge(self, other: ContainerEdits) -> ContainerEdits:
        """Combine two edits; on conflicts the first value wins, as the kubelet does across resources."""
        seen_mounts = {m.container_path for m in self.mounts}
        seen_nodes = {d.container_path for d in self.device_nodes}
        return ContainerEdits(
            env={**other.env, **self.env},
            mounts=self.mounts + [m for m in other.mounts if m.container_path not in seen_mounts],
            device_nodes=self.device_nodes
            + [d for d in other.device_nodes if d.container_path not in seen_nodes],
            annotations={**other.annotations, **self.annotations},
            cdi_devices=self.cdi_devices + [c for c in other.cdi_devices if c not in self.cdi_devices],
        )

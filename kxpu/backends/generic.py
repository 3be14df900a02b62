"""Any device exposed as /dev nodes (FPGAs, NPUs, …): each glob match is a device, or ``count`` shares of one.

Only character and block devices are devices: a container runtime refuses anything else as a device
("not a device node"), so a regular file, FIFO, socket or directory that matches a glob is skipped, with
one warning per path. Nodes that appear or disappear are picked up through inotify on their directories
and reported at once. NUMA affinity comes from sysfs, and so does the PCI function a node belongs to
(``/sys/dev/<char|block>/<major>:<minor>`` links into ``/sys/devices``; the nearest PCI function above the
node, e.g. a NIC's for ``/dev/infiniband/uverbs0``): its address and PCIe root complex are published as
``resource.kubernetes.io/pciBusID`` and ``pcieRoot``, so a claim can pair the device with a GPU behind the
same host bridge.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import stat
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from pydantic import Field, field_validator

from kxpu.backends.host import Host
from kxpu.backends.mounts import MountConfig
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import BackendConfig, register_backend
from kxpu.backends.templates import EnvTemplates, check_template, render_env
from kxpu.fswatch import directory_changes
from kxpu.logs import get_logger
from kxpu.model import (
    MAX_DEVICE_ID_LENGTH,
    MAX_NUMA_NODE,
    SUB_DEVICE_SEPARATOR,
    Backend,
    ContainerEdits,
    Device,
    DeviceNode,
    numa_packed,
    pci_address,
)

log = get_logger("kxpu.backends.generic")

_GLOB_CHARS = re.compile(r"[*?\[]")
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]")
SHARE_SEPARATOR = SUB_DEVICE_SEPARATOR


class DeviceGroup(BackendConfig):
    paths: list[str] = Field(min_length=1)
    container_path: str = Field(default="{path}", description="template: {path} (host path), {name}")
    permissions: str = "rw"
    count: int = Field(default=1, ge=1, le=1024, description="shares of each matched device")
    env: EnvTemplates = Field(default_factory=dict)
    mounts: list[MountConfig] = Field(default_factory=list)

    @field_validator("paths")
    @classmethod
    def _absolute_globs(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern.startswith("/"):
                raise ValueError(f"path glob {pattern!r} must be absolute")
        return value

    @field_validator("container_path")
    @classmethod
    def _container_template(cls, value: str) -> str:
        check_template(value, ("path", "name"))
        if not value.startswith(("/", "{path}")):
            raise ValueError(f"containerPath {value!r} must be absolute")
        return value

    @field_validator("permissions")
    @classmethod
    def _permissions(cls, value: str) -> str:
        if not value or not set(value) <= set("rwm"):
            raise ValueError(f"permissions {value!r} must be a non-empty mix of r, w and m")
        return value


class GenericConfig(BackendConfig):
    groups: list[DeviceGroup] = Field(min_length=1)
    sysfs_root: Path = Field(
        default=Path("/sys"),
        description="where sysfs is read (NUMA node, PCI parent); the device globs stay host paths",
    )

    @field_validator("sysfs_root")
    @classmethod
    def _sysfs(cls, value: Path) -> Path:
        if not value.is_absolute() or value.name != "sys":
            raise ValueError(f"sysfsRoot {value} must be an absolute path ending in /sys")
        return value


def device_name(path: str) -> str:
    """A stable, ID-safe name for a device node: its path under /dev (``dri/renderD128`` → ``dri_renderD128``)."""
    rel = os.path.relpath(path, "/dev") if path.startswith("/dev/") else os.path.basename(path)
    return _UNSAFE_ID_CHARS.sub("_", rel).lstrip("_.-") or "dev"


def _device_kind(path: str) -> tuple[str, os.stat_result] | str:
    """``("char" | "block", stat)`` for a device node, else what the path is (for the warning)."""
    try:
        st = os.stat(path)  # follows symlinks: /dev/disk/by-id style links to devices are fine
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISCHR(st.st_mode):
        return ("char", st)
    if stat.S_ISBLK(st.st_mode):
        return ("block", st)
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    if stat.S_ISFIFO(st.st_mode):
        return "a FIFO"
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    return "not a device node"


def _numa_of(host: Host, kind: str, st: os.stat_result) -> tuple[int, ...]:
    sysfs = host.path(f"/sys/dev/{kind}/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/device/numa_node")
    try:
        node = int(sysfs.read_text().strip())
    except (OSError, ValueError):
        return ()
    return (node,) if 0 <= node <= MAX_NUMA_NODE else ()


def _pci_parent(host: Host, kind: str, st: os.stat_result) -> str | None:
    """The PCI function a device node belongs to: the last PCI address on its sysfs path
    (``/sys/dev/char/231:192`` → ``../../devices/pci0000:80/0000:80:01.0/0000:81:00.0/infiniband_verbs/uverbs0``
    → ``0000:81:00.0``); None for a node with no PCI parent (``/dev/null``, a virtual device)."""
    try:
        target = os.readlink(host.path(f"/sys/dev/{kind}/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"))
    except OSError:
        return None
    parts = target.split("/")
    if "devices" not in parts:
        return None
    below = parts[parts.index("devices") + 1 :]
    if not below or not below[0].startswith("pci"):
        return None
    found = [p for p in below if pci_address(p) == p]
    return found[-1] if found else None


@register_backend("generic", GenericConfig)
class GenericBackend(Backend):
    def __init__(self, config: GenericConfig) -> None:
        self.config = config
        # Device ID → (group, host path); rebuilt by every discovery.
        self._where: dict[str, tuple[DeviceGroup, str]] = {}
        self._skipped: set[str] = set()  # matches that are not device nodes, warned about once
        self._unmatched: list[str] = []  # globs that match nothing, warned about once (until they match)
        self._sysfs = Host(config.sysfs_root.parent)
        self._placement = PlacementReader(self._sysfs)

    def config_warnings(self) -> list[str]:
        return [f"device glob {pattern} matches nothing" for pattern in self._unmatched]

    def discover(self) -> list[Device]:
        devices: list[Device] = []
        where: dict[str, tuple[DeviceGroup, str]] = {}
        skipped: set[str] = set()
        unmatched: list[str] = []
        for group in self.config.groups:
            matches: set[str] = set()
            for pattern in group.paths:
                found = glob.glob(pattern)
                matches.update(found)
                if not found and pattern not in unmatched:
                    unmatched.append(pattern)
                    if pattern not in self._unmatched:
                        log.warning(
                            "device glob matches nothing: the resource serves no device from it until a path "
                            "matches (a typo, or a driver not loaded?)",
                            glob=pattern,
                        )
            for path in sorted(matches):
                kind = _device_kind(path)
                if isinstance(kind, str):
                    skipped.add(path)
                    if path not in self._skipped and kind != "a directory":
                        log.warning(
                            "matches a device glob but is not a device node; skipped", path=path, found=kind
                        )
                    continue
                name = device_name(path)
                numa = _numa_of(self._sysfs, *kind)
                bus_id = _pci_parent(self._sysfs, *kind)
                root = self._placement.pcie_root(bus_id)
                ids = (
                    [name]
                    if group.count == 1
                    else [f"{name}{SHARE_SEPARATOR}{i}" for i in range(group.count)]
                )
                for device_id in ids:
                    if device_id in where:
                        log.error(
                            "two device nodes map to one ID; skipping the second",
                            id=device_id,
                            first=where[device_id][1],
                            second=path,
                        )
                        continue
                    if len(device_id) > MAX_DEVICE_ID_LENGTH:
                        log.error("device path too long for a device ID; skipping", path=path)
                        continue
                    where[device_id] = (group, path)
                    devices.append(
                        Device(
                            id=device_id,
                            numa_nodes=numa,
                            pci_bus_id=bus_id,
                            pcie_root=root,
                            extra={"path": path},
                        )
                    )
        self._where = where
        self._skipped = skipped
        self._unmatched = unmatched
        return devices

    def _watched_dirs(self) -> list[Path]:
        dirs: set[Path] = set()
        for group in self.config.groups:
            for pattern in group.paths:
                parent = os.path.dirname(pattern)
                wildcard = _GLOB_CHARS.search(parent)
                if wildcard:
                    # Watch the fixed part (new matching dirs appear there) and every matching dir.
                    fixed = parent[: wildcard.start()]
                    dirs.add(Path(fixed if fixed.endswith("/") else os.path.dirname(fixed)))
                    dirs.update(Path(d) for d in glob.glob(parent) if os.path.isdir(d))
                else:
                    dirs.add(Path(parent))
        return sorted(dirs)

    async def watch(self) -> AsyncIterator[list[Device]]:
        patterns = [p for g in self.config.groups for p in g.paths]

        def relevant(path: Path) -> bool:
            return any(fnmatch.fnmatch(str(path), p) for p in patterns)

        async for _ in directory_changes(self._watched_dirs, relevant):
            yield self.discover()

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        edits = ContainerEdits()
        for group in self.config.groups:
            mine = [d for d in devices if self._where.get(d.id, (None, ""))[0] is group]
            if not mine:
                continue
            nodes: dict[str, DeviceNode] = {}
            for device in mine:
                host = self._where[device.id][1]
                container = group.container_path.format(path=host, name=os.path.basename(host))
                nodes.setdefault(host, DeviceNode(container, host, group.permissions))
            edits = edits.merge(
                ContainerEdits(
                    env=render_env(group.env, mine),
                    mounts=[m.to_mount() for m in group.mounts],
                    device_nodes=list(nodes.values()),
                )
            )
        return edits

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)

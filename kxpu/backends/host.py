"""The host as a backend reads it: sysfs, /dev and driver files under one root (``hostRoot``).

Every vendor backend reads the machine through a ``Host``: in production its root is ``/``;
tests and ``kxpu devices`` over a fake machine point it at a generated tree. Paths are written
as the *host* sees them (``/sys/class/kfd``, ``/dev/kfd``) and only reading goes through
``Host.path``. A container's edits name the path inside the container as the vendor's plugin
does (``/dev/kfd``) and, for its source on the host, the path as read under the root: the same
thing when the root is ``/``, and the fake's nodes when it is a fake tree (so that the real
kubelet and containerd can hand the e2e suite's mknod'ed nodes to a pod).

Garbage in a sysfs file (a driver bug, a half-written fake) raises ``HostFileError`` naming the
file and what was expected, never a bare ``ValueError`` from deep inside a backend.

``host_changes`` is how a sysfs backend follows the machine: inotify for things that appear and
disappear (device nodes under ``/dev``, device directories in sysfs), and polling for attribute
*values*, because on real sysfs a value that changes raises no inotify event (only ``poll()``
through ``sysfs_notify``, where a driver supports it) while the same change in a tmpfs fake
would. Polling is cheap here: a rediscovery is a few dozen small reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import stat
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator

from kxpu.backends.fakes import Seam
from kxpu.backends.registry import BackendConfig
from kxpu.fswatch import directory_changes
from kxpu.logs import get_logger
from kxpu.model import BackendError, Device
from kxpu.timeouts import wait_event

log = get_logger("kxpu.backends.host")

DEFAULT_POLL_SECONDS = 5.0


class HostFileError(BackendError):
    """A host file exists but does not hold what its driver documents."""


class HostBackendConfig(BackendConfig):
    """Base for a backend section that reads the host: ``hostRoot`` and the attribute poll interval."""

    host_root: Path = Field(default=Path("/"), description="where /sys, /dev and driver files are read")
    poll_seconds: float = Field(
        default=DEFAULT_POLL_SECONDS,
        gt=0,
        le=3600,
        description="how often attribute values (health, partition mode) are re-read",
    )

    @field_validator("host_root")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"hostRoot {value} must be an absolute path")
        return value

    @property
    def host(self) -> Host:
        return Host(self.host_root)


@dataclass(frozen=True, slots=True)
class Host:
    """Reads host paths under ``root``; every argument is a host path such as ``/sys/class/drm``."""

    root: Path = Path("/")

    def path(self, host_path: str) -> Path:
        """Where ``host_path`` is read from."""
        if not host_path.startswith("/"):
            raise ValueError(f"host path {host_path!r} must be absolute")
        return self.root / host_path.lstrip("/")

    def host_path(self, read_path: Path | str) -> str:
        """The host path of something found under the root (the inverse of ``path``)."""
        rel = os.path.relpath(read_path, self.root)
        return "/" + ("" if rel == "." else rel)

    def exists(self, host_path: str) -> bool:
        return os.path.lexists(self.path(host_path))

    def is_dir(self, host_path: str) -> bool:
        return self.path(host_path).is_dir()

    def is_device_node(self, host_path: str) -> bool:
        """A character or block device (what a container's device cgroup can grant)."""
        try:
            mode = os.stat(self.path(host_path)).st_mode
        except OSError:
            return False
        return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)

    def read(self, host_path: str) -> str | None:
        """The file's text without surrounding whitespace, or None if it does not exist."""
        try:
            raw = self.path(host_path).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except IsADirectoryError:
            raise HostFileError(f"{host_path}: expected a file, found a directory") from None
        except OSError as exc:  # EIO and friends: sysfs attributes of a device that is going away
            raise HostFileError(f"{host_path}: unreadable: {exc.strerror or exc}") from None
        try:
            return raw.decode().strip()
        except UnicodeDecodeError:
            raise HostFileError(f"{host_path}: not text ({len(raw)} bytes)") from None

    def read_int(self, host_path: str, base: int = 0) -> int | None:
        """An integer attribute (``0x1002``, ``-1``, ``42``); None if the file does not exist."""
        text = self.read(host_path)
        if text is None:
            return None
        try:
            return int(text, base)
        except ValueError:
            raise HostFileError(f"{host_path}: expected an integer, found {text[:40]!r}") from None

    def read_properties(self, host_path: str) -> dict[str, str] | None:
        """A ``key value`` per line file (KFD topology ``properties``); None if it does not exist."""
        text = self.read(host_path)
        if text is None:
            return None
        out: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            key, _, value = line.strip().partition(" ")
            if not value.strip():
                raise HostFileError(f"{host_path}: line {n} is not 'key value': {line[:40]!r}")
            out[key] = value.strip()
        return out

    def listdir(self, host_path: str) -> list[str]:
        """Sorted entry names; empty if the directory does not exist."""
        try:
            return sorted(os.listdir(self.path(host_path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def glob(self, pattern: str) -> list[str]:
        """Host paths matching a host-path glob, sorted."""
        return sorted(self.host_path(p) for p in glob.glob(str(self.path(pattern))))

    def link_name(self, host_path: str) -> str | None:
        """The last component of a symlink's target (``device/driver`` → ``amdgpu``); None if absent."""
        try:
            return os.path.basename(os.readlink(self.path(host_path)))
        except OSError:
            return None


def chosen_host(config: HostBackendConfig, given: Host | None, seam: Seam[[], Path]) -> Host:
    """The host a backend reads: the one a test passes; else the fake tree that the stand-in plugged into
    ``seam`` names (``kxpu devices`` and the e2e suite over a fake); else ``hostRoot``."""
    if given is not None:
        return given
    root = seam.stand_in()
    if root is None:
        return config.host
    log.warning(f"reading a fake {seam.library} machine", root=str(root))
    return Host(root)


async def host_changes(
    discover: Callable[[], list[Device]],
    watched_dirs: Callable[[], Iterable[str]],
    host: Host,
    poll_seconds: float,
) -> AsyncGenerator[list[Device]]:
    """Yield ``discover()`` now, then each time its answer changes.

    Rediscovery runs in a worker thread when any of ``watched_dirs`` (host paths, re-evaluated
    after each change) gains or loses an entry, and every ``poll_seconds`` for attribute values.
    A discovery that fails is logged on one line and retried at the next wake-up; the last good
    list stays in force meanwhile.
    """
    wake = asyncio.Event()

    async def follow_dirs() -> None:
        async for _ in directory_changes(lambda: [host.path(d) for d in watched_dirs()], lambda _path: True):
            wake.set()

    follower = asyncio.create_task(follow_dirs())
    last: list[Device] | None = None
    try:
        while True:
            try:
                devices = await asyncio.to_thread(discover)
            except BackendError as exc:
                log.error("rediscovery failed; keeping the last device list", error=str(exc))
            else:
                if devices != last:
                    last = devices
                    yield devices
            wake.clear()
            await wait_event(wake, poll_seconds)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower

"""A fake machine's files under a root directory, for the vendor fakes (``fake_amd``, ``fake_neuron``, …).

``FakeHost`` writes sysfs attributes, directories, symlinks and device nodes under its root
the way the vendor's driver lays them out, and changes them afterwards *as hardware does*:

- ``set_attribute`` rewrites a value through ``mmap``, which raises no inotify event, just as a
  real sysfs attribute changing under a driver raises none. A backend that relied on inotify
  for attribute values would pass against a naive tmpfs fake and miss changes on hardware;
  against this one it fails its tests. Attribute files therefore have a fixed size
  (``ATTRIBUTE_SIZE``): the value, a newline, then padding spaces, which readers strip.
- Directories and device nodes appearing or disappearing (hot-plug, a repartition, a lost
  device) do raise inotify events, on hardware (devtmpfs, sysfs directories) and here.
- Device nodes are real character devices (``mknod``) when running as root, else regular files:
  vendor backends find devices through sysfs or their library and only check that a node
  exists, as the vendors' plugins do; the kubelet end to end runs as root with real nodes.

It refuses a root that looks like a real host (``/``, or one whose ``sys`` is a sysfs mount).
"""

from __future__ import annotations

import mmap
import os
import shutil
import stat
import tempfile
from pathlib import Path

# sysfs serves at most one page per attribute.
ATTRIBUTE_SIZE = 4096


class FakeHostError(RuntimeError):
    """The fake would write somewhere it must not, or was asked for something impossible."""


def _is_sysfs(path: Path) -> bool:
    return path.exists() and _fs_type(path) == "sysfs"


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (the longest matching mount point)."""
    best, kind = "", ""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        inside = len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/"))
        if inside and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


class FakeHost:
    """A tree of host files under ``root`` (a new temporary directory by default)."""

    def __init__(self, root: Path | None = None) -> None:
        self.owned = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kxpu-fake-host-")) if root is None else root
        if self.root.resolve() == Path("/") or _is_sysfs(self.root / "sys"):
            raise FakeHostError(f"refusing to write a fake machine over the real host at {self.root}")
        self.root.mkdir(parents=True, exist_ok=True)
        # Attribute files mapped for in-place changes; kept open, since closing a file opened for
        # writing raises IN_CLOSE_WRITE, which sysfs never does for a value change.
        self._views: dict[Path, tuple[int, mmap.mmap]] = {}

    def path(self, host_path: str) -> Path:
        if not host_path.startswith("/"):
            raise FakeHostError(f"host path {host_path!r} must be absolute")
        return self.root / host_path.lstrip("/")

    # -- writing the tree -----------------------------------------------------------------------------------
    def mkdir(self, host_path: str) -> Path:
        path = self.path(host_path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def write_attribute(self, host_path: str, value: str | int) -> None:
        """Create (or replace) an attribute file holding ``value`` (fixed size: see the module doc)."""
        path = self.path(host_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_padded(host_path, str(value)))

    def set_attribute(self, host_path: str, value: str | int) -> None:
        """Change an existing attribute's value in place, raising no inotify event (as sysfs does)."""
        path = self.path(host_path)
        data = _padded(host_path, str(value))
        view = self._view(path, host_path)
        view[:] = data

    def _view(self, path: Path, host_path: str) -> mmap.mmap:
        known = self._views.get(path)
        if known is not None:
            fd, view = known
            if os.path.exists(path) and os.fstat(fd).st_ino == os.stat(path).st_ino:
                return view
            self._close_view(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FakeHostError(f"{host_path} does not exist; create it with write_attribute") from None
        if os.fstat(fd).st_size != ATTRIBUTE_SIZE:
            os.close(fd)
            raise FakeHostError(f"{host_path} was not written by write_attribute")
        view = mmap.mmap(fd, ATTRIBUTE_SIZE)
        self._views[path] = (fd, view)
        return view

    def _close_view(self, path: Path) -> None:
        fd, view = self._views.pop(path)
        view.close()
        os.close(fd)

    def write_file(self, host_path: str, content: str | bytes) -> None:
        """A plain file with exact content (a library, a text file a driver ships, garbage for tests)."""
        path = self.path(host_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)

    def symlink(self, host_path: str, target: str) -> None:
        """A symlink at ``host_path`` pointing to ``target`` (relative, as sysfs links are)."""
        path = self.path(host_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        path.symlink_to(target)

    def device_node(self, host_path: str, major: int, minor: int) -> None:
        """A character device (as root), else a regular file standing in for it."""
        path = self.path(host_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            path.unlink()
        if os.geteuid() == 0:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        else:
            path.touch()

    def remove(self, host_path: str) -> None:
        """Remove a file, node or whole directory (a device lost, a partition gone)."""
        path = self.path(host_path)
        for mapped in [p for p in self._views if p == path or path in p.parents]:
            self._close_view(mapped)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

    def cleanup(self) -> None:
        for mapped in list(self._views):
            self._close_view(mapped)
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)


def _padded(host_path: str, value: str) -> bytes:
    data = (value + "\n").encode()
    if len(data) > ATTRIBUTE_SIZE:
        raise FakeHostError(f"{host_path}: value longer than {ATTRIBUTE_SIZE - 1} bytes")
    return data + b" " * (ATTRIBUTE_SIZE - len(data))

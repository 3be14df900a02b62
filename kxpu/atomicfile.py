"""Replace a file so that readers (container runtimes, NFD) never see half of it."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

# Temp names: this process's ID and a counter, created with O_EXCL (a name taken, by another process with the
# same ID in another PID namespace or a crash's leftover, is skipped). tempfile.mkstemp does the same with
# random names, at twice the CPU time of the whole write: a DRA prepare writes two files.
_sequence = itertools.count()
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _create_temp(path: Path) -> tuple[int, str]:
    """An open, new, empty file (mode 0600) beside ``path``, and its name."""
    prefix = os.path.join(os.fspath(path.parent), f".{path.name}.{os.getpid()}-")
    while True:
        name = f"{prefix}{next(_sequence)}.tmp"
        try:
            return os.open(name, _FLAGS, 0o600), name
        except FileExistsError:
            continue
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)


def write_atomically(path: Path, text: str, mode: int = 0o644, durable: bool = False) -> None:
    """Write to a temp file in the same directory, then rename over ``path``.

    ``durable``: the content is on disk before the rename and the rename is on disk before returning (fsync
    of the file, then of the directory), so a power loss leaves the old file or the new one, never an empty
    one; for records that must survive (the DRA checkpoint), at the price of the disk's flush latency.

    The file gets ``mode`` exactly (whatever the umask) on its open descriptor, before any content: never a
    chmod by path, which follows whatever the name points to by then (a symlink put in its place)."""
    fd, tmp = _create_temp(path)
    try:
        try:
            os.fchmod(fd, mode)
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(os.fspath(path.parent))


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

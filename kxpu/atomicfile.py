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
# The process ID, asked once (a system call per write otherwise; a DRA claim writes three files) and again in a
# forked child, whose temp names must not be its parent's.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _create_temp(directory: str, prefix: str) -> tuple[int, str]:
    """An open, new, empty file (mode 0600) named ``prefix…`` in ``directory``, and its name."""
    while True:
        temp = f"{prefix}{next(_sequence)}.tmp"
        try:
            return os.open(temp, _FLAGS, 0o600), temp
        except FileExistsError:
            continue
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)


def write_atomically(path: Path | str, text: str, mode: int = 0o644, durable: bool = False) -> os.stat_result:
    """Write to a temp file in the same directory, then rename over ``path``; returns the file's status as
    written (its inode, size, mode and modification time: what the name now points to, unless another writer
    has replaced it since).

    ``durable``: the content is on disk before the rename and the rename is on disk before returning (fsync
    of the file, then of the directory), so a power loss leaves the old file or the new one, never an empty
    one; for records that must survive (the DRA checkpoint), at the price of the disk's flush latency.

    The file gets ``mode`` exactly (whatever the umask) on its open descriptor, before any content: never a
    chmod by path, which follows whatever the name points to by then (a symlink put in its place)."""
    path = os.fspath(path)
    head, sep, name = path.rpartition("/")  # os.path's split and join are Python: a write costs them twice
    directory = head or sep or "."
    fd, tmp = _create_temp(directory, f"{head}{sep}.{name}.{_pid}-")
    try:
        try:
            os.fchmod(fd, mode)
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data) :]
            if durable:
                os.fsync(fd)
            written = os.fstat(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(directory)
    return written


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Replace a file so that readers (container runtimes, NFD) never see half of it."""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
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


# Spare path → the inode this process last left there with its directory flushed: only such a spare is written over
# at once. Any other (left by a process that crashed, or by the other process of a rolling update) may still be
# the file's name on disk, the renames that made it the spare not flushed yet: the directory is flushed first.
_settled: dict[str, int] = {}


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_spare(spare: str, mode: int) -> tuple[int, os.stat_result, bool]:
    """The spare file open for writing, created if missing (True: made now); never one that has another name
    too (the live file, after a crash midway) or that is not a regular file."""
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    except OSError:  # ELOOP: a symlink in its place, not ours
        os.unlink(spare)
        fd = -1
    if fd >= 0:
        st = os.fstat(fd)
        if st.st_nlink == 1 and stat.S_ISREG(st.st_mode):
            return fd, st, False
        os.close(fd)
        os.unlink(spare)
    fd = os.open(spare, _FLAGS, mode)
    return fd, os.fstat(fd), True


def replace_durably(path: Path, text: str, mode: int = 0o600) -> None:
    """``write_atomically(path, text, mode, durable=True)`` without making a file: for a file replaced on every
    call (the DRA checkpoint), where creating and freeing an inode each time costs more CPU than the write itself
    (a filesystem's inode allocation, the discard of the freed blocks).

    The inode the previous replace retired is kept as ``spare`` in ``.<name>.spares/`` beside ``path`` and written
    over in place (flushed), then renamed over ``path``; the inode ``path`` had is linked aside first (``retired``)
    and becomes the next spare. In a directory of their own, those links and renames are no changes of ``path``'s
    directory to whoever watches it (the DRA driver watches its sockets' directory): one rename shows there, as for
    a new file. Readers see the old content or the new, whole, as with a rename of a new file; a power loss leaves
    one of them. Writers of one path must take turns (the checkpoint's lock): they share the spare. A reader that
    holds the file open across two replaces reads the second one's bytes over the first's: readers read at once."""
    directory = os.path.dirname(os.fspath(path))
    name = os.fspath(path)
    spares = os.path.join(directory, f".{path.name}.spares")
    spare = os.path.join(spares, "spare")
    retired = os.path.join(spares, "retired")
    data = text.encode()
    try:
        fd, st, made = _open_spare(spare, mode)
    except FileNotFoundError:
        os.makedirs(spares, mode=0o700, exist_ok=True)
        fd, st, made = _open_spare(spare, mode)
    try:
        if not made and _settled.get(spare) != st.st_ino:
            _fsync_dir(directory)
        _settled.pop(spare, None)  # written over from here: settled again only once renamed and flushed
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        if st.st_size != len(data):
            os.ftruncate(fd, len(data))
        # The content, and the size where it changed: what a reader of the renamed file needs.
        os.fdatasync(fd)
    finally:
        os.close(fd)
    try:
        try:
            os.link(name, retired, follow_symlinks=False)
        except FileExistsError:  # left by a crash midway
            os.unlink(retired)
            os.link(name, retired, follow_symlinks=False)
    except OSError:  # the first write, or no hard links: the old inode goes, the next write makes a spare
        retired = ""
    try:
        os.replace(spare, name)
    except BaseException:
        if retired:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(retired)
        raise
    if retired:
        os.replace(retired, spare)
    _fsync_dir(directory)
    if retired:
        _settled[spare] = os.stat(spare, follow_symlinks=False).st_ino


def write_over(spare: str, path: Path, text: str, mode: int = 0o644) -> bool:
    """``write_atomically(path, text, mode)`` into ``spare``, a file this process set aside (renamed out of sight,
    never linked) instead of a new one: written over in place, then renamed over ``path``. False, with nothing
    written, when ``spare`` is gone or is not such a file (the caller writes a new file then)."""
    try:
        fd = os.open(spare, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_nlink != 1 or not stat.S_ISREG(st.st_mode):
            return False
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        data = text.encode()
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        if st.st_size != len(data):
            os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    os.replace(spare, path)
    return True

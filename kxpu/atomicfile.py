"""Replace a file so that readers (container runtimes, NFD) never see half of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, text: str, mode: int = 0o644, durable: bool = False) -> None:
    """Write to a temp file in the same directory, then rename over ``path``.

    ``durable``: the content is on disk before the rename and the rename is on disk before returning (fsync
    of the file, then of the directory), so a power loss leaves the old file or the new one, never an empty
    one; for records that must survive (the DRA checkpoint), at the price of the disk's flush latency.

    The file gets ``mode`` exactly (whatever the umask) on its open descriptor, before any content: never a
    chmod by path, which follows whatever the name points to by then (a symlink put in its place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # O_EXCL, 0600
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), mode)
            out.write(text)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

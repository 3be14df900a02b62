"""Two processes of one DRA driver on one node, without a fight.

A DaemonSet rolled with ``maxSurge`` runs the new pod beside the old one until the new one is Ready; both serve
sockets of their own and the kubelet may call either (it prefers the newest registration, and falls back to the
other if that one goes). What they share lives in the driver's directory under the kubelet's plugin directory,
guarded by ``flock(2)`` locks on files there (the kernel drops a lock with the process that held it, so a killed
pod never leaves one behind):

- ``checkpoint.json.lock``: held across each NodePrepareResources / NodeUnprepareResources call (and the start's
  reconciliation); whoever takes it reloads the checkpoint if the other process changed it (its inode, time or
  size, or the count of checkpoint writes kept in the lock file), so each call starts from what is on disk and
  neither overwrites the other's claims;
- ``publish.lock``: held by the one process that writes the driver's ResourceSlices for the node, for as long as
  it runs. The other one leaves the slices alone and takes the lock, and the slices as they are (updated in
  place, never deleted and created again), when the first exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

# How often a waiting process tries a held lock again: a call holds the checkpoint's lock for milliseconds.
RETRY_FIRST_S = 0.005
RETRY_MAX_S = 0.1


class HostLock:
    """An exclusive ``flock`` on ``path`` (created, mode 0600); not reentrant."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._name = str(path)
        self._fd: int | None = None
        # The count as this holder last read or wrote it: only a holder writes it, so it stays true until release.
        self._count: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if no other holder has it; True if this object holds it now."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self._name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # its directory, only the first time (this runs on every prepare call)
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            fd = os.open(self._name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    async def acquire(self, poll_max_s: float = RETRY_MAX_S) -> None:
        """Wait for the lock without blocking the loop (a blocking flock in a thread could not be cancelled)."""
        delay = RETRY_FIRST_S
        while not self.try_acquire():
            await asyncio.sleep(delay)
            delay = min(delay * 2, poll_max_s)

    def count(self) -> int:
        """The number the holders keep in the lock file (0 before the first): ``kxpu.dra.checkpoint`` counts its
        writes there, so another process tells a change that its file's inode, time and size may not show."""
        assert self._fd is not None, "only the holder reads the count"
        if self._count is None:  # read once per hold: no other process writes it meanwhile
            data = os.pread(self._fd, 8, 0)
            self._count = int.from_bytes(data, "little") if len(data) == 8 else 0
        return self._count

    def set_count(self, value: int) -> None:
        assert self._fd is not None, "only the holder writes the count"
        self._count = None  # read again should the write fail
        os.pwrite(self._fd, value.to_bytes(8, "little"), 0)
        self._count = value

    def peek_count(self) -> int:
        """The count without taking the lock (at start, before the file it guards is read): 0 when none."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            data = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
        return int.from_bytes(data, "little") if len(data) == 8 else 0

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._count = self._fd, None, None
            os.close(fd)  # closing the only descriptor drops the flock

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await self.acquire()
        try:
            yield
        finally:
            self.release()

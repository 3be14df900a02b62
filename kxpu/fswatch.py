"""Wake-ups on filesystem changes (inotify), for state files and /dev hot-plug: push, never poll."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from asyncinotify import Inotify, Mask

from kxpu.logs import get_logger
from kxpu.timeouts import within

log = get_logger("kxpu.fswatch")

_DIR_EVENTS = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MOVED_TO
    | Mask.MOVED_FROM
    | Mask.CLOSE_WRITE
    | Mask.ATTRIB
    | Mask.ONLYDIR
)

# Editors and `echo >` write in several steps; collect a burst into one wake-up.
COALESCE_SECONDS = 0.01


def nearest_existing_dir(path: Path) -> Path:
    """The directory itself if it exists, else its closest existing ancestor (watched until it appears)."""
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path("/")


# What a directory of sockets needs: entries coming and going (a socket is bound or renamed into place, and
# unlinked or renamed away), not the writes and attribute changes of the files beside them.
ENTRY_EVENTS = Mask.CREATE | Mask.DELETE | Mask.MOVED_TO | Mask.MOVED_FROM | Mask.ONLYDIR


async def directory_changes(
    directories: Callable[[], Iterable[Path]],
    relevant: Callable[[Path], bool],
    events: Mask = _DIR_EVENTS,
) -> AsyncIterator[None]:
    """Yield once whenever something ``relevant`` changes inside the watched directories.

    ``directories`` is re-evaluated after every wake-up so that directories created later
    (a hot-plugged /dev subdirectory, a state file's parent) get watched too. Yields once
    at the start, after the watches are in place, so that nothing between a caller's first
    read and the watch is missed. ``events``: the inotify events asked for (fewer: fewer wake-ups of this
    process for changes nobody reads).
    """
    with Inotify() as inotify:
        watched: dict[Path, int] = {}  # directory → inode it had when watched

        def forget(event_watch_path: Path | None) -> None:
            if event_watch_path is not None:
                watched.pop(event_watch_path, None)

        def refresh_watches() -> None:
            # A directory removed and made again is a new inode: watch it anew even if its IGNORED
            # event was lost in a burst.
            for path, inode in list(watched.items()):
                try:
                    if os.stat(path).st_ino != inode:
                        del watched[path]
                except OSError:
                    del watched[path]
            for directory in directories():
                target = nearest_existing_dir(directory)
                if target in watched:
                    continue
                try:
                    inotify.add_watch(target, events)
                    watched[target] = os.stat(target).st_ino
                except FileNotFoundError:
                    pass  # raced with removal: the parent's watch will tell us again
                except OSError as exc:  # ENOSPC: the node's max_user_watches is exhausted
                    log.warning("cannot watch directory", path=str(target), error=str(exc))

        refresh_watches()
        yield
        changes = aiter(inotify)
        while True:
            event = await anext(changes)
            wake = _is_relevant(event.path, event.mask, relevant)
            if event.mask & Mask.IGNORED:
                forget(Path(str(event.watch.path)) if event.watch else None)
            if not wake:
                continue  # nothing to coalesce (a timer per event of a busy directory, otherwise)
            # Drain the rest of the burst before waking the caller.
            while True:
                more = await within(anext(changes), COALESCE_SECONDS)
                if more is None:
                    break
                if more.mask & Mask.IGNORED:
                    forget(Path(str(more.watch.path)) if more.watch else None)
            refresh_watches()
            yield


def _is_relevant(path: Path | None, mask: Mask, relevant: Callable[[Path], bool]) -> bool:
    if mask & (Mask.IGNORED | Mask.DELETE_SELF | Mask.MOVE_SELF):
        return True
    if path is None:
        return False
    return bool(mask & Mask.ISDIR) or relevant(path)

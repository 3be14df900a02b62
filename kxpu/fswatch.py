"""Wake-ups on filesystem changes (inotify), for state files and /dev hot-plug: push, never poll."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from asyncinotify import Inotify, Mask

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


async def directory_changes(
    directories: Callable[[], Iterable[Path]], relevant: Callable[[Path], bool]
) -> AsyncIterator[None]:
    """Yield once whenever something ``relevant`` changes inside the watched directories.

    ``directories`` is re-evaluated after every wake-up so that directories created later
    (a hot-plugged /dev subdirectory, a state file's parent) get watched too. Yields once
    at the start, after the watches are in place, so that nothing between a caller's first
    read and the watch is missed.
    """
    with Inotify() as inotify:
        watched: set[Path] = set()

        def refresh_watches() -> None:
            for directory in directories():
                target = nearest_existing_dir(directory)
                if target not in watched:
                    try:
                        inotify.add_watch(target, _DIR_EVENTS)
                        watched.add(target)
                    except OSError:
                        pass  # raced with removal: the parent's watch will tell us again

        refresh_watches()
        yield
        events = aiter(inotify)
        while True:
            event = await anext(events)
            if not _is_relevant(event.path, event.mask, relevant):
                continue
            # Drain the rest of the burst before waking the caller.
            while True:
                try:
                    await asyncio.wait_for(anext(events), COALESCE_SECONDS)
                except TimeoutError:
                    break
            if event.mask & Mask.IGNORED:
                watched.discard(Path(str(event.watch.path)) if event.watch else Path("/"))
            refresh_watches()
            yield


def _is_relevant(path: Path | None, mask: Mask, relevant: Callable[[Path], bool]) -> bool:
    if mask & (Mask.IGNORED | Mask.DELETE_SELF | Mask.MOVE_SELF):
        return True
    if path is None:
        return False
    return bool(mask & Mask.ISDIR) or relevant(path)

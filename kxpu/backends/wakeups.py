"""Wake-ups from a backend's own threads (a health-event thread, the MPS supervisor) to its ``watch()`` calls.

Those threads block in a vendor library; each running ``watch()`` waits on an asyncio event of its loop. One
fan-out for every such backend, so the thread-safe hand-over (and its "the loop is closing" case) is written once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator


class Wakeups:
    """``notify`` (from any thread) sets the event of every ``subscribe`` block running now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: set[Callable[[], None]] = set()

    def notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    @contextlib.contextmanager
    def subscribe(self) -> Iterator[asyncio.Event]:
        """An event of the running loop, set at each ``notify`` until the block ends (clear it after waking)."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(changed.set)

        with self._lock:
            self._listeners.add(wake)
        try:
            yield changed
        finally:
            with self._lock:
                self._listeners.discard(wake)

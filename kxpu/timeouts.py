"""Waiting with a timeout without losing a cancellation.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives while the awaited thing
completes (it returns the result instead; fixed in 3.12, gh-86296). In a loop that waits for a poke
or an event with a timeout, a stop that lands in that instant is lost and the loop runs forever: a
daemon that never exits on SIGTERM. ``asyncio.timeout`` counts cancellations correctly, so every
wait-with-timeout in kxpu goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T | None:
    """``await awaitable``, or None once ``seconds`` have passed (the awaitable is then cancelled)."""
    try:
        async with asyncio.timeout(seconds):
            return await awaitable
    except TimeoutError:
        return None


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` was set within ``seconds``."""
    return await within(event.wait(), seconds) is not None

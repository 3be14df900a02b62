"""Waiting on conditions with deadlines: the tests' alternative to fixed sleeps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from kxpu.testing.process import DaemonProcess


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Check ``predicate`` every 10 ms until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_ready(daemon: DaemonProcess, timeout: float = 10.0) -> dict[str, Any]:
    """Poll the daemon's /readyz until it answers 200; returns its body. Needed after ``wait_registered``:
    the kubelet has the device list a moment before the daemon counts it taken (once its ListAndWatch send
    returned), so the stand-in sees the registration before /readyz can say so."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (answer := await daemon.http_get("/readyz"))[0] != 200:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for /readyz 200; last answer: {answer}")
        await asyncio.sleep(0.01)
    body: dict[str, Any] = json.loads(answer[1])
    return body

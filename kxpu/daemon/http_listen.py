"""The node daemon's HTTP port, taken at start and answered once the HTTP server is there.

The daemon registers with the kubelet before it loads its HTTP server (h11, prometheus-client's exposition):
the port is taken first all the same, so that a taken port still fails the start in one line before anything
registers, and a probe or scrape that connects meanwhile is held until the server answers it rather than
refused. Light on purpose: asyncio only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class HttpAddressError(Exception):
    """The address cannot be listened on; the message says why and what to do."""


def parse_address(address: str) -> tuple[str, int]:
    """``:5978`` → ("0.0.0.0", 5978); ``127.0.0.1:5978`` → ("127.0.0.1", 5978)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http-address {address!r} must be [HOST]:PORT")
    return (host.strip("[]") or "0.0.0.0", int(port))


def listen_error(address: str, exc: OSError) -> str:
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on --http-address {address}: {reason} (another process listens on that port; "
            "choose another with --http-address or KXPU_HTTP_ADDRESS, or an empty one to serve no HTTP)"
        )
    return f"cannot listen on --http-address {address}: {reason}"


class Listener:
    """A listening TCP server whose connections wait for ``hand_to``'s handler."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.server: asyncio.Server | None = None
        self._handler: Handler | None = None
        self._handed = asyncio.Event()
        self._waiting: set[asyncio.Task[None]] = set()

    async def open(self) -> None:
        """Listen, or raise HttpAddressError saying why not in one line."""
        try:
            self.server = await asyncio.start_server(self._accepted, self.host, self.port)
        except OSError as exc:
            raise HttpAddressError(listen_error(self.address, exc)) from None
        self.port = self.server.sockets[0].getsockname()[1]  # when asked for port 0

    def hand_to(self, handler: Handler) -> None:
        """Serve every connection, those waiting included, with ``handler``."""
        self._handler = handler
        self._handed.set()

    async def close(self) -> None:
        """Stop listening; connections still waiting for a handler are closed."""
        if self.server is None:
            return
        self.server.close()
        for task in list(self._waiting):
            task.cancel()
        if self._waiting:
            await asyncio.wait(list(self._waiting), timeout=1.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 1.0)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._handler is None:
            task = asyncio.current_task()
            assert task is not None
            self._waiting.add(task)
            try:
                await self._handed.wait()
            except asyncio.CancelledError:  # closed before a handler came: asyncio would log a cancelled task
                writer.transport.abort()
                return
            finally:
                self._waiting.discard(task)
        assert self._handler is not None
        await self._handler(reader, writer)

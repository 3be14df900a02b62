"""What one client may cost the webhook or the extender: bytes, parse work, connections and time.

The webhook answers the API server for every pod that asks for shared devices, with
``failurePolicy: Fail``; anyone on the pod network can reach its port. One client must not be able
to exhaust its memory, stall its event loop or hold every connection, so each server holds:

- **a body limit** (``read_json``): a ``Content-Length`` over it is refused before a byte is read
  (413), a chunked body as soon as it passes it; bodies above ``INLINE_BYTES`` also reserve their
  size from a ``BodyBudget`` shared by the server (503 when the budget is spent, so many large
  bodies at once cannot add up past the memory limit);
- **bounded parse work**: a body above ``INLINE_BYTES`` is parsed *and answered* on one worker thread
  (``Parser``), never on the event loop, one at a time; JSON nested deeper than ``MAX_DEPTH`` is a
  400 naming the limit (never a ``RecursionError`` traceback and a 500);
- **a request deadline**: a connection must deliver each request's headers within
  ``request_timeout_s`` of opening (or of its previous answer), and the body within the same time
  once the handler reads it (``read_json``), or it is closed: a slow client (slowloris) holds a
  connection for seconds, not for ever;
- **a connection cap** (``GuardedSite``): past ``max_connections`` open connections, or
  ``max_per_peer`` from one client address, new ones are closed at once, so a flood of idle
  connections costs a bounded number of file descriptors and buffers (each TLS connection holds
  asyncio's 256 KiB buffer), and one pod cannot take every connection from the API server (the TLS
  handshake itself is bounded by the same deadline).

Every refusal is one line naming what was wrong and the limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner, BaseSite

from kxpu.logs import get_logger

log = get_logger("kxpu.sharing.bounds")

INLINE_BYTES = 64 * 1024  # parsed on the event loop: well under a millisecond of work
MAX_DEPTH = 100  # Kubernetes objects nest a few dozen levels at most (managedFields included)


class BodyError(Exception):
    """A request body refused; ``status`` is the HTTP status to answer with, the message one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _depth_ok(data: Any, limit: int) -> bool:
    """Whether ``data`` nests at most ``limit`` lists/objects deep (iteratively: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return True


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as JSON, or BodyError(400) naming what is wrong (not JSON, or nested too deeply)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BodyError(400, f"request body: JSON nested more than {max_depth} levels deep") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BodyError(400, f"request body is not JSON: {str(exc)[:200]}") from None
    if not _depth_ok(data, max_depth):
        raise BodyError(400, f"request body: JSON nested more than {max_depth} levels deep")
    return data


class BodyBudget:
    """Bytes of large request bodies in flight at once, all requests together (reserved before reading)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.used = 0

    def reserve(self, size: int) -> bool:
        if self.used + size > self.total:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used = max(0, self.used - size)


class Parser:
    """One worker thread for the work of large bodies (parse and answer), so the loop keeps answering.

    One thread, not a pool: the work holds the GIL in C (``json.loads``), so more threads would not go
    faster, only hold more parsed copies at once.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kxpu-parse")

    async def run(self, work: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def read_body(
    request: web.Request, limit: int, budget: BodyBudget, timeout_s: float
) -> tuple[bytes, int]:
    """The body (at most ``limit`` bytes, read within ``timeout_s``) and the budget it reserved (release it)."""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyError(413, f"request body is {length} bytes; the limit is {limit}")
    reserved = 0
    expected = limit if length is None else length
    if expected > INLINE_BYTES:
        if not budget.reserve(expected):
            raise BodyError(
                503,
                f"too many large requests at once ({budget.used} of {budget.total} bytes in flight); retry",
            )
        reserved = expected
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.content.read(limit + 1)
            while len(raw) <= limit and not request.content.at_eof():
                more = await request.content.read(limit + 1 - len(raw))
                if not more:
                    break
                raw += more
    except TimeoutError:
        budget.release(reserved)
        raise BodyError(408, f"request body not received within {timeout_s:g}s") from None
    except ConnectionError:
        budget.release(reserved)
        raise BodyError(400, "the client closed the connection before the body was complete") from None
    except BaseException:
        budget.release(reserved)
        raise
    if len(raw) > limit:
        budget.release(reserved)
        raise BodyError(413, f"request body is over the limit of {limit} bytes")
    return raw, reserved


class _Tracked:
    """One connection: the protocol aiohttp serves it with, plus the guard's deadline and accounting."""

    __slots__ = ("busy", "deadline", "done", "forwarded", "guard", "inner", "peer", "refused", "transport")

    def __init__(self, guard: ConnectionGuard, refused: bool) -> None:
        self.guard = guard
        self.inner: Any = None if refused else guard.factory()
        self.refused = refused
        self.transport: asyncio.BaseTransport | None = None
        self.peer: str | None = None
        self.forwarded = False  # aiohttp's handler saw connection_made (so it must see connection_lost)
        self.deadline = time.monotonic() + guard.request_timeout_s
        self.busy = 0
        self.done = False


class _Protocol(asyncio.Protocol):
    """Forwards to aiohttp's RequestHandler; closes the connection when over the cap or past its deadline."""

    def __init__(self, guard: ConnectionGuard) -> None:
        refused = guard.open >= guard.max_connections
        self.tracked = _Tracked(guard, refused)
        if refused:
            guard.refused += 1
        else:
            guard.connections.add(self.tracked)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tracked = self.tracked
        tracked.transport = transport
        guard = tracked.guard
        if not (tracked.refused or tracked.done):
            peername = transport.get_extra_info("peername")
            peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
            if guard.per_peer.get(peer, 0) >= guard.max_per_peer:
                guard.refused += 1
                guard.forget(tracked)
            else:
                tracked.peer = peer
                guard.per_peer[peer] = guard.per_peer.get(peer, 0) + 1
        if tracked.refused or tracked.done:
            transport.abort()  # type: ignore[attr-defined]
            return
        guard.by_transport[transport] = tracked
        tracked.forwarded = True
        tracked.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        tracked = self.tracked
        tracked.guard.forget(tracked)
        if tracked.forwarded:
            tracked.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.tracked.forwarded and not self.tracked.done:
            self.tracked.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.tracked.forwarded:
            result: bool | None = self.tracked.inner.eof_received()
            return result
        return None

    def pause_writing(self) -> None:
        if self.tracked.forwarded:
            self.tracked.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.tracked.forwarded:
            self.tracked.inner.resume_writing()


class ConnectionGuard:
    """The connection cap and request deadline of one listener (see the module docstring)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        max_connections: int,
        request_timeout_s: float,
        max_per_peer: int | None = None,
    ) -> None:
        self.factory = factory
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer or max_connections
        self.per_peer: dict[str, int] = {}
        self.request_timeout_s = request_timeout_s
        self.connections: set[_Tracked] = set()
        self.by_transport: dict[asyncio.BaseTransport, _Tracked] = {}
        self.refused = 0
        self.expired = 0
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def open(self) -> int:
        return len(self.connections)

    def __call__(self) -> asyncio.Protocol:
        return _Protocol(self)

    def forget(self, tracked: _Tracked) -> None:
        tracked.done = True
        self.connections.discard(tracked)
        if tracked.peer is not None:
            left = self.per_peer.get(tracked.peer, 1) - 1
            if left > 0:
                self.per_peer[tracked.peer] = left
            else:
                self.per_peer.pop(tracked.peer, None)
            tracked.peer = None
        if tracked.transport is not None:
            self.by_transport.pop(tracked.transport, None)

    def handling(self, transport: asyncio.BaseTransport | None, busy: bool) -> None:
        """A request's handler starts (``busy``) or has answered: the deadline stops, or starts again."""
        tracked = self.by_transport.get(transport) if transport is not None else None
        if tracked is None:
            return
        tracked.busy += 1 if busy else -1
        if not tracked.busy:
            tracked.deadline = time.monotonic() + self.request_timeout_s

    def sweep(self) -> None:
        """Close every connection that has not delivered a request's headers by its deadline."""
        now = time.monotonic()
        for tracked in [t for t in self.connections if not t.busy and t.deadline < now]:
            self.expired += 1
            self.forget(tracked)
            if tracked.transport is not None:
                tracked.transport.abort()  # type: ignore[attr-defined]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.request_timeout_s / 4))
            self.sweep()

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def guard_middleware(get_guard: Callable[[], ConnectionGuard | None]) -> Any:
    """Marks a connection busy while its request is handled (its body read has a deadline of its own)."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        guard = get_guard()
        if guard is None:
            return await handler(request)
        guard.handling(request.transport, True)
        try:
            return await handler(request)
        finally:
            guard.handling(request.transport, False)

    return middleware


class GuardedSite(BaseSite):
    """A TCP listener (TLS optional) whose connections go through a ConnectionGuard."""

    __slots__ = ("_host", "_port", "guard")

    def __init__(
        self,
        runner: BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        request_timeout_s: float,
        max_per_peer: int | None = None,
        ssl_context: Any = None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port = host, port
        assert runner.server is not None, "set the runner up first"
        self.guard = ConnectionGuard(runner.server, max_connections, request_timeout_s, max_per_peer)

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    @property
    def port(self) -> int:
        assert self._server is not None
        sockets = getattr(self._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self._port

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self.guard.request_timeout_s if self._ssl_context else None,
        )
        self.guard.start()

    async def stop(self) -> None:
        self.guard.stop()
        await super().stop()

"""/metrics, /healthz, /readyz and /status (for `kxpu status`): probes, Prometheus and people.

Served on the daemon's own event loop: asyncio streams, with h11 (the sans-IO HTTP/1.1 parser httpx already
brings) parsing requests and framing responses, and prometheus-client's exposition for /metrics. No HTTP
framework in the node daemon: aiohttp costs ~400 ms of start-up and ~9 MiB on every node (README,
Dependencies). Anyone on the pod network can reach this port, so every connection is bounded: at most
``Limits.connections`` at once and ``per_address`` from one client (past that: 503 and close), a request must arrive whole within
``request_seconds``, a keep-alive connection idle for ``idle_seconds`` is closed, a response the client does
not read within ``write_seconds`` ends the connection, and heads and bodies have size limits. /status (and
/metrics, when asked) go through an ``Authorizer`` (Kubernetes' TokenReview and SubjectAccessReview,
``kxpu.kube.review``); the probes never do: the kubelet sends no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from kxpu.daemon.http_listen import Listener, parse_address
from kxpu.logs import get_logger, log_failure

log = get_logger("kxpu.daemon.http")

Readiness = Callable[[], tuple[bool, dict[str, Any]]]
Status = Callable[[], dict[str, Any]]


# (bearer token or None, path, verb) → (200 to go on, or 401, 403, 503; the reason the client is told)
Authorizer = Callable[[str | None, str, str], Awaitable[tuple[int, str]]]


@dataclass(frozen=True)
class Limits:
    connections: int = 64  # Prometheus, two probes and `kxpu status` need a handful
    # From one client address: one pod cannot take every connection (and so the kubelet's probes) by itself
    per_address: int = 16
    request_seconds: float = 10.0  # from the first byte of a request (or the connection) to its whole body
    idle_seconds: float = 30.0  # between requests on a keep-alive connection
    write_seconds: float = 10.0  # for the client to take a response
    max_head_bytes: int = 16 * 1024  # request line and headers
    max_body_bytes: int = 4 * 1024  # GET and HEAD only: nothing legitimate sends a body


class _Reject(Exception):
    """End the connection with this status (the request broke a limit or the protocol)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


class HealthServer:
    def __init__(
        self,
        address: str,
        readiness: Readiness,
        status: Status,
        authorize: Authorizer | None = None,
        protect_metrics: bool = False,
        limits: Limits | None = None,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.readiness = readiness
        self.status = status
        self.authorize = authorize
        self.protected = frozenset({"/status", *(("/metrics",) if protect_metrics else ())})
        self.limits = limits or Limits()
        self.refused = 0  # connections turned away at the limit
        self._listener: Listener | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._per_address: dict[str, int] = {}  # client address → its connections being served
        self._lingering = 0  # connections being closed after a last answer (_linger)

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self, listener: Listener | None = None) -> None:
        """Listen, or raise HttpAddressError saying why not in one line; or serve the port ``listener`` took
        already (the daemon takes it before it registers, and starts this server after)."""
        if listener is None:
            listener = Listener(self.address)
            await listener.open()
        self._listener = listener
        listener.hand_to(self._connection)
        self.port = listener.port
        log.info(
            "serving metrics and probes",
            address=f"{self.host}:{self.port}",
            checked=sorted(self.protected) if self.authorize else [],
        )
        problem = getattr(self.authorize, "problem", "")
        if problem:  # said once the port is ours, so a taken port stays a one-line failure
            log.warning(problem)

    async def stop(self) -> None:
        if self._listener is None:
            return
        assert self._listener.server is not None
        self._listener.server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)
        await self._listener.close()

    def _refuse(self, writer: asyncio.StreamWriter, reason: str, **why: Any) -> None:
        """503 at a connection limit; logged at the first refusal and every 1000th after it."""
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning(f"HTTP {reason}; refusing connections", refused=self.refused, **why)
        _raw(writer, 503, reason)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if len(self._connections) >= self.limits.connections:
            self._refuse(writer, "too many connections", limit=self.limits.connections)
            await self._linger(reader, writer)
            return
        if self._per_address.get(address, 0) >= self.limits.per_address:
            self._refuse(writer, "too many connections from one address", address=address)
            await self._linger(reader, writer)
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._per_address[address] = self._per_address.get(address, 0) + 1
        rejected: _Reject | None = None
        try:
            await self._serve(reader, writer)
        except _Reject as exc:
            rejected = exc
        except (TimeoutError, ConnectionError, h11.ProtocolError):
            pass  # slow, gone, or broken mid-way: nothing more to say to it
        except asyncio.CancelledError:
            pass  # stop() ends its own connection tasks; asyncio would log a cancelled one as an error
        finally:
            self._connections.discard(task)
            left = self._per_address.pop(address) - 1
            if left:
                self._per_address[address] = left
        if rejected is not None:
            _raw(writer, rejected.status, rejected.reason)
            await self._linger(reader, writer)
        elif writer.transport.get_write_buffer_size():
            writer.transport.abort()  # an unread response is not kept in memory
        else:
            writer.close()

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Close after a last answer (503, 408, 413, ...). Closing with the client's bytes unread would reset
        the connection and could drop the answer: so the answer is followed by a FIN and what the client still
        sends is read (for at most a second), by at most ``connections`` closings at once; past that, the
        connection is dropped outright. Not counted against the limit."""
        if self._lingering >= self.limits.connections:
            writer.transport.abort()
            return
        self._lingering += 1
        try:
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(1.0):
                while await reader.read(4096):
                    pass
            writer.close()
        except (TimeoutError, OSError, asyncio.CancelledError):
            writer.transport.abort()
        finally:
            self._lingering -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        loop = asyncio.get_running_loop()
        first = True
        while True:
            if not first and not conn.trailing_data[0]:
                # Keep-alive: wait for the next request's first bytes, or close when idle.
                try:
                    async with asyncio.timeout(self.limits.idle_seconds):
                        data = await reader.read(4096)
                except TimeoutError:
                    return
                conn.receive_data(data)
            first = False
            deadline = loop.time() + self.limits.request_seconds
            request = await self._next(conn, reader, deadline, head=True)
            if not isinstance(request, h11.Request):
                return  # closed between requests
            await self._read_body(conn, reader, deadline, request)
            try:
                response = await self._respond(request)
            except Exception as exc:  # a bug in a handler: one line, and a 500 rather than a dead connection
                log_failure(log, "HTTP handler failed", exc, path=request.target.decode("latin-1")[:200])
                response = _Response(500, _json({"error": "internal error (see the daemon's log)"}))
            await self._send(conn, writer, request, response)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # MUST_CLOSE: the client asked for it, or spoke HTTP/1.0
            conn.start_next_cycle()

    async def _next(
        self, conn: h11.Connection, reader: asyncio.StreamReader, deadline: float, head: bool = False
    ) -> Any:
        """The next h11 event; ``head``: the request line and headers, whose size is bounded here (h11 bounds
        only what it has not parsed yet, so a head arriving whole would pass its limit)."""
        received = len(conn.trailing_data[0]) if head else 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint
                raise _Reject(status, "request head too large" if status == 431 else "bad request") from None
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout_at(deadline):
                    data = await reader.read(4096)
            except TimeoutError:
                raise _Reject(408, "request not received in time") from None
            received += len(data)
            if head and received > self.limits.max_head_bytes:
                raise _Reject(431, "request head too large")
            conn.receive_data(data)

    async def _read_body(
        self, conn: h11.Connection, reader: asyncio.StreamReader, deadline: float, request: h11.Request
    ) -> None:
        for name, value in request.headers:
            if name == b"content-length" and int(value) > self.limits.max_body_bytes:
                raise _Reject(413, "request body too large")
        size = 0
        while True:
            event = await self._next(conn, reader, deadline)
            if isinstance(event, h11.EndOfMessage):
                return
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.limits.max_body_bytes:
                    raise _Reject(413, "request body too large")
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError

    async def _respond(self, request: h11.Request) -> _Response:
        method = request.method.decode()
        path = request.target.decode("latin-1").partition("?")[0]
        if method not in ("GET", "HEAD"):
            return _Response(405, _json({"error": "only GET and HEAD"}), headers=(("Allow", "GET, HEAD"),))
        if path in self.protected and self.authorize is not None:
            code, reason = await self.authorize(_bearer(request), path, "get")
            if code != 200:
                headers = (("WWW-Authenticate", 'Bearer realm="kxpu"'),) if code == 401 else ()
                return _Response(code, _json({"error": reason}), headers=headers)
        if path == "/metrics":
            accept = ",".join(v.decode("latin-1") for k, v in request.headers if k == b"accept")
            encoder, content_type = choose_encoder(accept)
            return _Response(200, encoder(REGISTRY), content_type)
        if path == "/healthz":  # answered by the event loop itself: a wedged loop fails the probe's timeout
            return _Response(200, _json({"status": "ok"}))
        if path == "/readyz":
            ready, detail = self.readiness()
            return _Response(200 if ready else 503, _json(detail))
        if path == "/status":
            return _Response(200, _json(self.status()))
        return _Response(404, _json({"error": f"no such path {path[:200]}"}))

    async def _send(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request, response: _Response
    ) -> None:
        headers = [
            ("Content-Type", response.content_type),
            ("Content-Length", str(len(response.body))),
            *response.headers,
        ]
        phrase = HTTPStatus(response.status).phrase.encode()
        out = conn.send(h11.Response(status_code=response.status, headers=headers, reason=phrase)) or b""
        if request.method != b"HEAD":
            out += conn.send(h11.Data(data=response.body)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        writer.write(out)
        async with asyncio.timeout(self.limits.write_seconds):
            await writer.drain()


def _bearer(request: h11.Request) -> str | None:
    for name, value in request.headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _raw(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
    """A last answer on a connection h11 can no longer frame (a broken request, one over a limit)."""
    body = _json({"error": reason})
    with contextlib.suppress(Exception):
        writer.write(
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

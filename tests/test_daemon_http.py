"""The node daemon's HTTP port under abuse: idle and slow connections, floods past the limit, oversized
requests; and a port that is taken. Real sockets throughout; a real daemon process where threads and memory
are what is measured."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from kxpu.daemon.http import HealthServer, Limits
from kxpu.daemon.http_listen import Listener
from kxpu.testing.process import DaemonProcess
from tests.test_daemon import simulated
from tests.waiting import wait_until


def _status() -> dict[str, Any]:
    return {"resources": {}}


def _ready() -> tuple[bool, dict[str, Any]]:
    return True, {"ready": True}


@pytest.fixture
async def server() -> AsyncIterator[Callable[..., Any]]:
    started: list[HealthServer] = []

    async def start(**limits: Any) -> HealthServer:
        http = HealthServer("127.0.0.1:0", _ready, _status, limits=Limits(**limits))
        await http.start()
        started.append(http)
        return http

    yield start
    for http in started:
        await http.stop()


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout)


async def _get(port: int, path: str, headers: str = "") -> tuple[int, bytes]:
    reader, writer = await _open(port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode())
    data = await _answer(reader)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_idle_connections_are_closed_by_the_timeout_without_threads(
    server: Callable[..., Any],
) -> None:
    http = await server(request_seconds=0.5, connections=100, per_address=100)
    threads = threading.active_count()
    clients = [await _open(http.port) for _ in range(50)]
    await wait_until(lambda: http.connections == 50, what="the server to hold 50 connections")
    assert (
        threading.active_count() <= threads
    )  # no thread per connection (an earlier test's may end meanwhile)
    # Each idle client is told 408 and closed, within the request timeout (not by the client going away).
    answers = await asyncio.gather(*(_answer(reader) for reader, _ in clients))
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)
    await wait_until(lambda: http.connections == 0, what="every idle connection closed")
    for _, writer in clients:
        writer.close()


async def test_a_trickled_request_is_cut_at_the_request_deadline(server: Callable[..., Any]) -> None:
    """Slowloris: one byte at a time keeps no connection beyond request_seconds."""
    http = await server(request_seconds=0.5)
    reader, writer = await _open(http.port)
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)

    trickling = asyncio.create_task(trickle())
    answer = await _answer(reader)
    assert answer.startswith(b"HTTP/1.1 408 ") and loop.time() - began < 2.0
    trickling.cancel()
    writer.close()


async def test_keep_alive_serves_requests_then_closes_when_idle(server: Callable[..., Any]) -> None:
    http = await server(idle_seconds=0.3)
    reader, writer = await _open(http.port)
    for _ in range(3):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(
            next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
        )
        assert json.loads(await reader.readexactly(length)) == {"status": "ok"}
    assert await _answer(reader) == b""  # idle past idle_seconds: closed
    writer.close()


async def test_connections_past_the_limit_are_refused_and_served_again_below_it(
    server: Callable[..., Any],
) -> None:
    http = await server(connections=5, request_seconds=30)
    held = [await _open(http.port) for _ in range(5)]
    await wait_until(lambda: http.connections == 5, what="5 connections held")
    status, body = await _get(http.port, "/healthz")
    assert status == 503 and json.loads(body) == {"error": "too many connections"}
    assert http.refused == 1
    held[0][1].close()
    await wait_until(lambda: http.connections == 4, what="one connection to go")
    assert (await _get(http.port, "/healthz"))[0] == 200
    for _, writer in held[1:]:
        writer.close()


async def test_one_client_address_gets_only_its_share_of_connections(server: Callable[..., Any]) -> None:
    """One pod holding connections open cannot take the port (and the kubelet's probes) by itself."""
    http = await server(connections=10, per_address=3, request_seconds=30)
    held = [await _open(http.port) for _ in range(3)]
    await wait_until(lambda: http.connections == 3, what="3 connections held")
    status, body = await _get(http.port, "/healthz")
    assert status == 503 and json.loads(body) == {"error": "too many connections from one address"}
    reader, writer = await asyncio.open_connection("127.0.0.1", http.port, local_addr=("127.0.0.2", 0))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await _answer(reader)).startswith(b"HTTP/1.1 200 ")  # another address is still served
    writer.close()
    for _, held_writer in held:
        held_writer.close()
    await wait_until(lambda: http.connections == 0, what="the held connections to go")
    assert (await _get(http.port, "/healthz"))[0] == 200


async def test_oversized_or_unexpected_requests_are_refused(server: Callable[..., Any]) -> None:
    http = await server()
    status, _ = await _get(http.port, "/status", headers=f"X-Big: {'a' * 20000}\r\n")
    assert status == 431
    reader, writer = await _open(http.port)
    writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
    assert (await _answer(reader)).startswith(b"HTTP/1.1 413 ")
    writer.close()
    reader, writer = await _open(http.port)  # a chunked body has no length to check up front
    writer.write(b"GET /status HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(10):
        writer.write(b"400\r\n" + b"a" * 0x400 + b"\r\n")
    assert (await _answer(reader)).startswith(b"HTTP/1.1 413 ")
    writer.close()
    reader, writer = await _open(http.port)
    writer.write(b"POST /status HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    answer = await _answer(reader)
    assert answer.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD\r\n" in answer
    writer.close()
    reader, writer = await _open(http.port)
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    assert (await _answer(reader)).startswith(b"HTTP/1.1 400 ")
    writer.close()
    assert (await _get(http.port, "/healthz"))[0] == 200  # and the server still serves


def _threads_and_rss_kib(pid: int) -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


async def test_a_flood_of_idle_connections_grows_no_threads_and_little_memory(
    write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    """The daemon as deployed: 500 idle connections (the old server: a thread each, +12 MiB, kept)."""
    daemon: DaemonProcess = await daemons(write_config([simulated()]))
    await wait_until(lambda: "waiting for the kubelet" in daemon.log_text(), what="the daemon to start")
    assert (await daemon.http_get("/healthz"))[0] == 200
    threads, rss = _threads_and_rss_kib(daemon.pid)
    flood = [socket.create_connection(("127.0.0.1", daemon.http_port)) for _ in range(500)]
    try:
        # Past the limit the daemon answers 503 and closes at once (or, past as many refusals again in
        # flight, just closes); those below it wait for the request timeout.
        answers = [_first_bytes(conn) for conn in flood[100:]]
        assert all(a.startswith(b"HTTP/1.1 503 ") or a in (b"", b"reset") for a in answers)
        assert sum(a.startswith(b"HTTP/1.1 503 ") for a in answers) >= 64
        now_threads, now_rss = _threads_and_rss_kib(daemon.pid)
        assert now_threads <= threads and now_rss - rss < 4096, (threads, now_threads, rss, now_rss)
        print(f"flood: threads {threads} -> {now_threads}, RSS {rss} -> {now_rss} KiB")
    finally:
        for conn in flood:
            conn.close()
    await wait_until(
        lambda: _probe(daemon.http_port) == 200, what="the port to serve again once the flood is gone"
    )


def _first_bytes(conn: socket.socket) -> bytes:
    conn.settimeout(5)
    try:
        return conn.recv(64)
    except ConnectionResetError:
        return b"reset"


def _probe(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return int(conn.recv(64).split()[1])


def test_a_taken_port_is_one_line_naming_it(write_config: Callable[..., Path]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "kxpu",
                "plugin",
                "--config",
                str(write_config([simulated()])),
                "--http-address",
                f"127.0.0.1:{port}",
                "--http-auth",
                "none",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"kxpu: error: cannot listen on --http-address 127.0.0.1:{port}: Address already in use (another "
        "process listens on that port; choose another with --http-address or KXPU_HTTP_ADDRESS, or an empty "
        "one to serve no HTTP)"
    ], result.stderr


async def test_a_failing_handler_is_a_500_and_one_line() -> None:
    def broken() -> dict[str, Any]:
        raise KeyError("resource vanished")

    http = HealthServer("127.0.0.1:0", _ready, broken)
    await http.start()
    try:
        with structlog.testing.capture_logs() as logs:
            status, body = await _get(http.port, "/status")
        assert status == 500 and json.loads(body) == {"error": "internal error (see the daemon's log)"}
        assert (await _get(http.port, "/healthz"))[0] == 200
    finally:
        await http.stop()
    errors = [e for e in logs if e["log_level"] == "error"]
    assert errors == [
        {
            "component": "kxpu.daemon.http",
            "event": "HTTP handler failed",
            "error": "KeyError: 'resource vanished'",
            "path": "/status",
            "log_level": "error",
        }
    ]


async def test_a_connection_made_before_the_server_is_there_is_answered_once_it_is() -> None:
    """The daemon takes its port before it registers and starts the server after: a probe that connects in
    between waits for its answer instead of being refused."""
    listener = Listener("127.0.0.1:0")
    await listener.open()
    reader, writer = await _open(listener.port)
    writer.write(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    early = asyncio.ensure_future(_answer(reader))
    await wait_until(lambda: bool(listener._waiting), what="the connection accepted")
    assert not early.done()  # accepted, and held
    http = HealthServer(listener.address, _ready, _status)
    await http.start(listener)
    try:
        assert (await early).startswith(b"HTTP/1.1 200 ")
        assert (await _get(http.port, "/healthz"))[0] == 200
    finally:
        await http.stop()
    with pytest.raises(OSError):  # stopped: the port is free again
        await _open(listener.port)


async def test_a_listener_closed_before_its_server_came_closes_the_waiting_connections() -> None:
    listener = Listener("127.0.0.1:0")
    await listener.open()
    reader, writer = await _open(listener.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await wait_until(lambda: bool(listener._waiting), what="the connection accepted")
    await listener.close()
    with contextlib.suppress(ConnectionResetError):
        assert await _answer(reader) == b""  # closed, nothing said
    writer.close()

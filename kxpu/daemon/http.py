"""/metrics, /healthz, /readyz and /status (for `kxpu status`): probes, Prometheus and people.

Served by the standard library's WSGI server on one thread beside the event loop, with
prometheus-client's WSGI app for /metrics: no HTTP framework in the node daemon (memory
matters on every node). Handlers only read state; /healthz round-trips through the event
loop so that a wedged loop fails the liveness probe.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from kxpu.logs import get_logger

log = get_logger("kxpu.daemon.http")

LOOP_CHECK_SECONDS = 2.0

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
Readiness = Callable[[], tuple[bool, dict[str, Any]]]
Status = Callable[[], dict[str, Any]]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
        pass


def parse_address(address: str) -> tuple[str, int]:
    """``:9400`` → ("0.0.0.0", 9400); ``127.0.0.1:9400`` → ("127.0.0.1", 9400)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--http-address {address!r} must be [HOST]:PORT")
    return (host.strip("[]") or "0.0.0.0", int(port))


class HealthServer:
    def __init__(
        self, address: str, loop: asyncio.AbstractEventLoop, readiness: Readiness, status: Status
    ) -> None:
        self.host, self.port = parse_address(address)
        self.loop = loop
        self.readiness = readiness
        self.status = status
        self._metrics = make_wsgi_app()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._server = make_server(
            self.host, self.port, self._app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        self.port = self._server.server_port  # when asked for port 0
        self._thread = threading.Thread(target=self._server.serve_forever, name="kxpu-http", daemon=True)
        self._thread.start()
        log.info("serving metrics and probes", address=f"{self.host}:{self.port}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        if path == "/healthz":
            return self._healthz(start_response)
        if path == "/readyz":
            ready, detail = self.readiness()
            return _json(start_response, "200 OK" if ready else "503 Service Unavailable", detail)
        if path == "/status":
            return _json(start_response, "200 OK", self.status())
        return _json(start_response, "404 Not Found", {"error": f"no such path {path}"})

    def _healthz(self, start_response: StartResponse) -> Iterable[bytes]:
        async def ping() -> None:
            return None

        try:
            asyncio.run_coroutine_threadsafe(ping(), self.loop).result(LOOP_CHECK_SECONDS)
        except Exception:
            return _json(start_response, "503 Service Unavailable", {"status": "event loop not responding"})
        return _json(start_response, "200 OK", {"status": "ok"})


def _json(start_response: StartResponse, status: str, body: dict[str, Any]) -> Iterable[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]

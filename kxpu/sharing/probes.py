"""/metrics, /healthz and /readyz of the extender and the webhook, on a port of their own.

A separate plain-HTTP listener (``--metrics-address``) rather than routes on the serving port:
the extender's API (which binds pods) stays on 127.0.0.1 beside kube-scheduler, and the
webhook's port is HTTPS with a certificate Prometheus and the kubelet would have to trust.
It runs on the component's own event loop, so /healthz answering proves that loop is not
wedged, and the allocation gauges are read without racing the watch that updates them.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


def make_probe_app(ready: Callable[[], bool], not_ready: str = "not ready") -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(REGISTRY))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(request: web.Request) -> web.Response:
        return web.Response(text="ok") if ready() else web.Response(text=not_ready, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def parse_listen(address: str) -> tuple[str, int]:
    """``:9401`` → ("0.0.0.0", 9401); ``127.0.0.1:8888`` → ("127.0.0.1", 8888)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {address!r} must be [HOST]:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


async def start(app: web.Application, address: str) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``address``; the runner (to clean up) and the port bound (for port 0)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = parse_listen(address)
    await web.TCPSite(runner, host, port).start()
    return runner, int(runner.addresses[0][1])

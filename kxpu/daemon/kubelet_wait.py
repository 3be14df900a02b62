"""Say so when no kubelet appears: a wrong device-plugin directory (a kubelet with another --root-dir, a
hostPath that does not match) otherwise looks like a daemon waiting quietly forever."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from kxpu.daemon.registration import file_identity
from kxpu.daemon.wire import KUBELET_SOCKET
from kxpu.logs import get_logger

log = get_logger("kxpu.daemon")

FIRST_WARNING_SECONDS = 30.0
MAX_WARNING_INTERVAL_SECONDS = 600.0
CHECK_SECONDS = 1.0


async def warn_while_no_kubelet(
    plugin_dir: Callable[[], Path],
    waiting: Callable[[], list[str]],
    first: float | None = None,
    maximum: float | None = None,
    check: float | None = None,
) -> None:
    """Warn, naming the path, once resources have waited ``first`` seconds for a kubelet socket that does not
    exist; then again after twice as long each time, up to ``maximum``. ``waiting``: the device-plugin
    resources waiting for the kubelet now (a kubelet that exists but refuses registration is logged by the
    resource itself). Runs until cancelled."""
    first = FIRST_WARNING_SECONDS if first is None else first
    maximum = MAX_WARNING_INTERVAL_SECONDS if maximum is None else maximum
    check = CHECK_SECONDS if check is None else check
    loop = asyncio.get_running_loop()
    since: float | None = None  # since when resources wait for a kubelet socket that is not there
    next_at = interval = first
    while True:
        await asyncio.sleep(check)
        directory = plugin_dir()
        socket = directory / KUBELET_SOCKET
        names = waiting()
        if not names or file_identity(socket) is not None:
            if since is not None and next_at - since > first:  # it was warned about
                log.info("the kubelet's socket is there now", socket=str(socket))
            since = None
            continue
        now = loop.time()
        if since is None:
            since, interval = now, first
            next_at = now + first
        if now >= next_at:
            state = "exists" if directory.is_dir() else "does not exist"
            log.warning(
                f"no kubelet: {socket} has not appeared in {round(now - since)} s ({directory} {state}); is "
                "the kubelet running, and is this its device-plugins directory (<kubelet --root-dir>/"
                "device-plugins)? If not, set devicePluginDir or --device-plugin-dir",
                resources=names,
            )
            interval = min(interval * 2, maximum)
            next_at = now + interval

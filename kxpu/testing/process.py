"""Run ``kxpu plugin`` as a real separate process, as the kubelet would see it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kxpu.testing.fakes import import_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class DaemonProcess:
    def __init__(
        self,
        config: Path,
        log_path: Path,
        device_plugin_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.log_path = log_path
        self.device_plugin_dir = device_plugin_dir
        self.extra_args = list(extra_args)
        self.env = env
        self.process: asyncio.subprocess.Process | None = None
        self.http_port = free_port()  # each daemon its own, so parallel runs never collide on one port

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    async def start(self) -> None:
        args = [sys.executable, "-m", "kxpu", "plugin", "--config", str(self.config), "--log-level", "debug"]
        if self.device_plugin_dir is not None:
            args += ["--device-plugin-dir", str(self.device_plugin_dir)]
        # No API server to review tokens here: /status open to the test (extra_args may say otherwise).
        args += ["--http-address", f"127.0.0.1:{self.http_port}", "--http-auth", "none", *self.extra_args]
        env = {**os.environ, **(self.env or {})}
        args += import_args(env)  # a fake machine the environment names plays only when imported
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230  (a local file, opened once)
            self.process = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )

    def send(self, sig: signal.Signals) -> None:
        assert self.process is not None, "not started"
        self.process.send_signal(sig)

    async def wait(self, timeout: float = 10.0) -> int:
        assert self.process is not None, "not started"
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.process is None or self.process.returncode is not None:
            return self.process.returncode if self.process else None
        self.send(signal.SIGTERM)
        try:
            return await self.wait(timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
            raise

    async def http_get(self, path: str) -> tuple[int, str]:
        """GET one of the daemon's HTTP endpoints; returns (status, body)."""

        def get() -> tuple[int, str]:
            url = f"http://127.0.0.1:{self.http_port}{path}"
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode()

        return await asyncio.to_thread(get)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

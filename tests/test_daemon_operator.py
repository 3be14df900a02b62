"""Operator mistakes on the node daemon, each answered by one line that names what is wrong and what to do
(a taken HTTP port is in test_daemon_http.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from kxpu.cli import _build
from kxpu.config import parse_config
from kxpu.daemon import kubelet_wait
from kxpu.daemon.daemon import Daemon
from kxpu.testing import KubeletStandIn
from kxpu.testing.process import DaemonProcess
from tests.test_daemon import simulated
from tests.waiting import wait_ready, wait_until


async def test_an_unwritable_device_plugin_directory_is_one_line_with_its_cause(
    workdir: Path, plugin_dir: Path, write_config: Callable[..., Path]
) -> None:
    """The cause (Permission denied) in kxpu's own line, said once however often it retries; and no gRPC
    "Failed to bind" lines."""
    config = write_config([simulated()])
    as_nobody: list[str] = []
    if os.geteuid() == 0:  # root writes anywhere: run the daemon as nobody, in a directory root owns
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv (util-linux) to run the daemon as another user")
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
        workdir.chmod(0o755)
        config.chmod(0o644)
        plugin_dir.chmod(0o755)
    else:
        plugin_dir.chmod(0o555)
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *as_nobody,
            *(sys.executable, "-m", "kxpu", "plugin", "--config", str(config), "--log-level", "debug"),
            *("--http-address", ""),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            cwd=str(Path(__file__).parent.parent),
        )
    try:
        await wait_until(
            lambda: log_path.read_text().count("still cannot serve") >= 3, 20, "three retries to fail"
        )
        lines = log_path.read_text().splitlines()
        errors = [line for line in lines if "level=error" in line]
        assert len(errors) == 1, errors
        assert (
            f'error="cannot create a socket in the device-plugin directory {plugin_dir}: Permission denied '
            "(kxpu needs to create its sockets there: run it as root or as the directory's owner)\""
        ) in errors[0]
        assert not [line for line in lines if "Failed to bind" in line or "add_port" in line]

        plugin_dir.chmod(0o777)  # fixed: served at the next retry
        await wait_until(lambda: "event=serving" in log_path.read_text(), 20, "the resource to be served")
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)


async def test_no_kubelet_is_warned_about_naming_the_path_then_less_often(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wrong device-plugin directory: a warning after a while, naming the socket, then at growing
    intervals; an info line once a kubelet comes."""
    monkeypatch.setattr(kubelet_wait, "FIRST_WARNING_SECONDS", 0.3)
    monkeypatch.setattr(kubelet_wait, "MAX_WARNING_INTERVAL_SECONDS", 1.2)
    monkeypatch.setattr(kubelet_wait, "CHECK_SECONDS", 0.02)
    plugin_dir = workdir / "no-kubelet-here" / "device-plugins"
    config = parse_config(
        {"version": "v1", "devicePluginDir": str(plugin_dir), "resources": [simulated(count=1)]}
    )
    daemon = Daemon(config, lambda: config, _build)
    with structlog.testing.capture_logs() as logs:
        running = asyncio.create_task(daemon.run())
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:

            def warnings() -> list[MutableMapping[str, Any]]:
                return [
                    e for e in logs if e["log_level"] == "warning" and e["event"].startswith("no kubelet")
                ]

            await wait_until(lambda: len(warnings()) >= 3, 10, "three warnings")
            # 0.3 s, then 0.6 and 1.2 s later: not once per check
            assert loop.time() - began >= 0.3 + 0.6 + 1.2 - 0.1
            first = warnings()[0]
            assert first["event"].startswith(
                f"no kubelet: {plugin_dir / 'kubelet.sock'} has not appeared in 0 s ({plugin_dir} exists); is "
                "the kubelet running, and is this its device-plugins directory (<kubelet --root-dir>/"
                "device-plugins)? If not, set devicePluginDir or --device-plugin-dir"
            ), first
            assert first["resources"] == ["example.com/npu"]

            kubelet = KubeletStandIn(plugin_dir)
            await kubelet.start()
            try:
                await kubelet.wait_registered("example.com/npu")
                await wait_until(
                    lambda: any(e["event"] == "the kubelet's socket is there now" for e in logs),
                    5,
                    "info line",
                )
            finally:
                await kubelet.stop()
        finally:
            daemon.stop()
            await asyncio.wait_for(running, 10)


async def test_a_glob_matching_nothing_is_warned_once_and_shown_in_status(
    workdir: Path, plugin_dir: Path, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    """The resource registers (with what the other globs find), /readyz says so: the glob that matches
    nothing is named once in the log and in /status (and `kxpu status`)."""
    dev = workdir / "dev"
    dev.mkdir()
    os.mknod(dev / "fpga0", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    typo = str(dev / "fgpa*")
    config = write_config(
        [{"name": "example.com/fpga", "generic": {"groups": [{"paths": [str(dev / "fpga*"), typo]}]}}]
    )
    daemon: DaemonProcess = await daemons(config)
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    try:
        await kubelet.wait_registered("example.com/fpga")
        assert (await wait_ready(daemon))["resources"] == {"example.com/fpga": "registered"}
        doc = json.loads((await daemon.http_get("/status"))[1])
        assert doc["resources"]["example.com/fpga"]["warnings"] == [f"device glob {typo} matches nothing"]
        shown = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "kxpu",
                "status",
                "--daemon",
                f"http://127.0.0.1:{daemon.http_port}",
                "--pod-resources-socket",
                str(workdir / "none.sock"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert f"warning: example.com/fpga: device glob {typo} matches nothing" in shown.stdout.splitlines()
        os.mknod(dev / "fpga1", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a rescan: still not warned again
        await kubelet.wait_devices("example.com/fpga", lambda d: len(d) == 2)
        lines = [line for line in daemon.log_text().splitlines() if "device glob matches nothing" in line]
        assert len(lines) == 1 and "level=warning" in lines[0] and f"glob={typo}" in lines[0], lines

        os.mknod(dev / "fgpa9", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # it matches now: no warning left
        await kubelet.wait_devices("example.com/fpga", lambda d: len(d) == 3)
        doc = json.loads((await daemon.http_get("/status"))[1])
        assert "warnings" not in doc["resources"]["example.com/fpga"]
    finally:
        await kubelet.stop()

"""`kxpu status` joins the kubelet's PodResources answer with the daemon's own view."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kxpu.testing import KubeletStandIn
from kxpu.testing.process import DaemonProcess
from tests.test_daemon import NPU, simulated


async def kxpu_status(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "kxpu", "status", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


async def test_status_shows_holders_and_health(
    plugin_dir: Path, workdir: Path, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    socket = workdir / "pod-resources" / "kubelet.sock"
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    state = workdir / "state.json"
    try:
        daemon: DaemonProcess = await daemons(write_config([simulated(stateFile=str(state))]))
        await kubelet.wait_registered(NPU)
        await kubelet.allocate(NPU, ["sim-npu-0", "sim-npu-1"], ["sim-npu-3"], pod=("ml", "train"))
        # Another plugin's device: shown only with --all-resources.
        kubelet.assignments[("ml", "train", "c0")].append(("other.com/x", ["x-1"]))
        state.write_text(json.dumps({"sim-npu-2": "Unhealthy"}))
        await kubelet.wait_devices(NPU, lambda d: d["sim-npu-2"] == "Unhealthy")
        url = f"http://127.0.0.1:{daemon.http_port}"

        result = await kxpu_status("--pod-resources-socket", str(socket), "--daemon", url, "-o", "json")
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["errors"] == [] and doc["resources"] == {NPU: "registered"}
        rows = {d["id"]: d for d in doc["devices"]}
        assert set(rows) == {"sim-npu-0", "sim-npu-1", "sim-npu-2", "sim-npu-3"}
        assert rows["sim-npu-0"]["holders"] == ["ml/train/c0"]
        assert rows["sim-npu-3"]["holders"] == ["ml/train/c1"]
        assert rows["sim-npu-2"]["holders"] == [] and rows["sim-npu-2"]["health"] == "Unhealthy"
        assert rows["sim-npu-2"]["reason"] == "state-file"

        table = (
            await kxpu_status("--pod-resources-socket", str(socket), "--daemon", url, "--all-resources")
        ).stdout
        assert "ml/train/c1" in table and "Unhealthy (state-file)" in table and "x-1" in table

        # The daemon gone: the kubelet's view still shows, with the error; exit 0 (partial).
        await daemon.stop()
        result = await kxpu_status("--pod-resources-socket", str(socket), "--daemon", url, "-o", "json")
        doc = json.loads(result.stdout)
        assert result.returncode == 0
        assert any("kxpu daemon" in e for e in doc["errors"])
    finally:
        await kubelet.stop()
    # Neither side reachable: exit 1 with both errors.
    result = await kxpu_status("--pod-resources-socket", str(socket), "--daemon", "http://127.0.0.1:1")
    assert result.returncode == 1
    assert "kubelet PodResources API" in result.stdout and "kxpu daemon" in result.stdout

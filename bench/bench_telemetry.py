"""What device telemetry costs the node daemon: CPU per device per second of sampling, and memory.

The daemon runs as a separate process (``kxpu plugin``) serving the `nvidia` backend over the fake
NVML's 8x A100 profile, against the kubelet stand-in (registration, Allocate, PodResources, the device
checkpoint). Each GPU runs ``--processes`` processes, each in its own pod (fake host /proc cgroups), so
every tick samples 8 GPUs and ties every process to a pod (each holds one time-slicing replica). Measured:

- the daemon's CPU with telemetry off, then on at ``--interval`` (default 10 s, the default) and at
  0.5 s: CPU seconds per second, and per device per second of sampling (the difference from off,
  divided by devices and by ticks: what one device costs each time it is sampled);
- the sampler's own tick time (``kxpu_telemetry_sample_duration_seconds``) and one /metrics scrape;
- the daemon's RSS with telemetry on and off;
- the daemon's CPU with MPS on all 8 GPUs (telemetry off): what supervising 8 control daemons costs
  (one PID check per GPU per ``checkIntervalSeconds``, 1 s by default; the stand-in daemons' own CPU,
  which a real node spends in the driver's program instead, is not counted).

The fake NVML answers in Python, so per-call costs differ from the driver's (ioctls); ``hack/gpu-mps-check``
measures ``sample()`` over the real NVML on a GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import cpu_seconds, report, rss_mb

from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_mps import install
from kxpu.testing.fake_nvml import send_control
from kxpu.testing.process import DaemonProcess

RESOURCE = "nvidia.com/gpu"
GPUS = 8
TARGETS = {
    "cpu_ms_per_device_per_sample": 1.0,
    "cpu_percent_at_default_interval": 1.0,
    "rss_mb_telemetry_on": 80.0,
}


async def run(
    base: Path, telemetry: dict[str, Any] | None, processes: int, seconds: float, mps: bool = False
) -> dict[str, float]:
    plugin_dir = base / "dp"
    socket = base / "pr" / "kubelet.sock"
    host = base / "host"
    control = base / "nvml.sock"
    doc: dict[str, Any] = {
        "version": "v1",
        "devicePluginDir": str(plugin_dir),
        "resources": [
            {
                "name": RESOURCE,
                "nvidia": {
                    "deviceIDStrategy": "index",
                    "sharing": {"timeSlicing": {"resources": [{"replicas": max(2, processes)}]}},
                },
            }
        ],
    }
    if telemetry is not None:
        doc["telemetry"] = {
            "enabled": True,
            "hostRoot": str(host),
            "podResourcesSocket": str(socket),
            **telemetry,
        }
    if mps:
        section = doc["resources"][0]["nvidia"]
        section["sharing"] = {"mps": {"resources": [{"replicas": max(2, processes)}]}}
        section.update(
            nvidiaDriverRoot=str(base / "driver"), mpsRoot=str(base / "mps"), mps={"shmDir": "/dev/shm"}
        )
        install(base / "driver")
    config = base / "config.json"
    config.write_text(json.dumps(doc))
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    daemon = DaemonProcess(
        config,
        base / "daemon.log",
        extra_args=["--log-level", "warning"],
        env={"KXPU_FAKE_NVML": "a100-8x", "KXPU_FAKE_NVML_CONTROL": str(control)},
    )
    out: dict[str, float] = {}
    await daemon.start()
    try:
        await kubelet.wait_registered(RESOURCE, timeout=60)
        pid = 100000
        for gpu in range(GPUS):
            listed = []
            for n in range(processes):
                pod = (f"ns{gpu}", f"pod{n}")
                await kubelet.allocate(RESOURCE, [f"{gpu}::{n}"], pod=pod)
                uid = kubelet.pod_uids[pod]
                proc = host / "proc" / str(pid)
                proc.mkdir(parents=True, exist_ok=True)
                (proc / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/{'b' * 64}\n")
                listed.append({"pid": pid, "memoryMiB": 1000 + n, "smUtil": 10})
                pid += 1
            send_control(control, op="processes", gpu=gpu, processes=listed)
        await asyncio.sleep(2.0)  # past start-up work and the first ticks
        before, start = cpu_seconds(daemon.pid), time.monotonic()
        await asyncio.sleep(seconds)  # measuring: nothing else is asked of the daemon meanwhile
        elapsed = time.monotonic() - start
        out["cpu_percent"] = 100 * (cpu_seconds(daemon.pid) - before) / elapsed
        out["rss_mb"] = rss_mb(daemon.pid)
        if telemetry is not None:
            started = time.monotonic()
            status, text = await daemon.http_get("/metrics")
            out["scrape_ms"] = (time.monotonic() - started) * 1000
            assert status == 200
            total = float(_series(text, "kxpu_telemetry_sample_duration_seconds_sum"))
            count = float(_series(text, "kxpu_telemetry_sample_duration_seconds_count"))
            out["tick_ms"] = 1000 * total / count
            attributed = len(re.findall(r'^kxpu_container_memory_used_bytes\{[^}]*pod="pod', text, re.M))
            assert attributed == GPUS * processes, f"{attributed} containers attributed"
    finally:
        await daemon.stop()
        await kubelet.stop()
    return out


def _series(text: str, name: str) -> str:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, name
    return match.group(1)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=4, help="processes (pods) per GPU")
    parser.add_argument("--interval", type=float, default=10.0, help="the default sampling interval")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long CPU is measured per run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, float] = {}
    runs: dict[str, tuple[dict[str, Any] | None, bool]] = {
        "off": (None, False),
        "default": ({"intervalSeconds": args.interval}, False),
        "fast": ({"intervalSeconds": 0.5}, False),
        "mps": (None, True),
    }
    figures: dict[str, dict[str, float]] = {}
    for name, (telemetry, mps) in runs.items():
        base = Path(tempfile.mkdtemp(prefix="kx-bench-", dir="/tmp"))
        try:
            figures[name] = asyncio.run(run(base, telemetry, args.processes, args.seconds, mps))
        finally:
            for pid_file in base.glob("mps/*/pipe/nvidia-cuda-mps-control.pid"):  # the stand-ins
                with contextlib.suppress(ValueError, OSError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
            shutil.rmtree(base, ignore_errors=True)
    off, default, fast = figures["off"], figures["default"], figures["fast"]
    ticks_per_s = 1 / 0.5
    extra = max(0.0, fast["cpu_percent"] - off["cpu_percent"]) / 100  # CPU seconds per second for sampling
    results["cpu_percent_telemetry_off"] = off["cpu_percent"]
    results["cpu_percent_at_default_interval"] = default["cpu_percent"]
    results["cpu_percent_at_0.5s_interval"] = fast["cpu_percent"]
    results["cpu_ms_per_device_per_sample"] = 1000 * extra / ticks_per_s / GPUS
    results["cpu_ms_per_device_per_second_at_default_interval"] = (
        results["cpu_ms_per_device_per_sample"] / args.interval
    )
    results["tick_ms (8 GPUs, sampler's own time)"] = fast["tick_ms"]
    results["scrape_ms"] = fast["scrape_ms"]
    results["rss_mb_telemetry_off"] = off["rss_mb"]
    results["rss_mb_telemetry_on"] = fast["rss_mb"]
    results["cpu_percent_with_mps_on_8_gpus"] = figures["mps"]["cpu_percent"]
    results["rss_mb_with_mps_on_8_gpus"] = figures["mps"]["rss_mb"]
    report(
        f"kxpu telemetry, nvidia backend over the fake NVML a100-8x, {args.processes} pods per GPU",
        results,
        TARGETS,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

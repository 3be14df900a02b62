"""NVIDIA backend benchmarks over the fake NVML: 8x A100 with 10 time-slicing replicas (80 devices).

In-process:
- backend build (nvmlInit + discovery + topology) and ``discover()`` times,
- Xid event → ``watch()`` yield latency (NVML event thread → asyncio bridge).
Cross-process (a ``kxpu plugin`` process with ``KXPU_FAKE_NVML=a100-8x``, this process as the kubelet):
- process start → registered with 80 devices,
- Xid injected into the daemon's fake NVML → ListAndWatch message at the kubelet (p50/p99),
  with health recovery on so each GPU returns before the next sample,
- daemon RSS and idle CPU.
Prints a Markdown table and, with --json, the raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from measure import idle_cpu_percent, percentile, report, rss_mb

from kxpu.backends.nvidia import NvidiaBackend, NvidiaConfig
from kxpu.backends.nvidia.nvml import NvmlSource
from kxpu.logs import configure_logging
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_nvml import FakeNvml, send_control
from kxpu.testing.process import DaemonProcess

RESOURCE = "nvidia.com/gpu"
REPLICAS = 10
GPUS = 8
QUIET_SECONDS = 0.2
NVIDIA_SECTION: dict[str, Any] = {
    "sharing": {"timeSlicing": {"resources": [{"replicas": REPLICAS}]}},
    "health": {"recovery": {"enabled": True, "quietPeriodSeconds": QUIET_SECONDS}},
}
TARGETS = {
    "xid_to_watch_p99_ms": 100.0,
    "xid_to_list_and_watch_p99_ms": 100.0,
    "rss_mb": 80.0,
    "idle_cpu_percent": 1.0,
}


def build(fake: FakeNvml) -> NvidiaBackend:
    return NvidiaBackend(
        NvidiaConfig.model_validate(NVIDIA_SECTION), NvmlSource(fake, fake.host_root, True), environ={}
    )


async def in_process(builds: int, xids: int) -> dict[str, float]:
    out: dict[str, float] = {}
    fake = FakeNvml("a100-8x")
    times = []
    for _ in range(builds):
        start = time.perf_counter()
        backend = build(fake)
        times.append((time.perf_counter() - start) * 1000)
        backend.close()
    out["build_backend_ms"] = statistics.median(times)
    backend = build(fake)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        devices = backend.discover()
        times.append((time.perf_counter() - start) * 1000)
    assert len(devices) == GPUS * REPLICAS
    out["discover_80_ms"] = statistics.median(times)

    updates = backend.watch()
    await anext(updates)
    samples = []
    for n in range(xids):
        gpu = n % GPUS
        start = time.perf_counter()
        fake.inject_xid(gpu, 79)
        while True:
            devices = await asyncio.wait_for(anext(updates), 5)
            if any(not d.healthy for d in devices):
                break
        samples.append((time.perf_counter() - start) * 1000)
        while any(not d.healthy for d in await asyncio.wait_for(anext(updates), 5)):
            pass  # recovered after the quiet period
    await updates.aclose()
    backend.close()
    out["xid_to_watch_p50_ms"] = percentile(samples, 50)
    out["xid_to_watch_p99_ms"] = percentile(samples, 99)
    return out


async def cross_process(base: Path, xids: int, idle_seconds: float) -> dict[str, float]:
    plugin_dir = base / "dp"
    control = base / "nvml.sock"
    config = base / "config.json"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "devicePluginDir": str(plugin_dir),
                "resources": [{"name": RESOURCE, "nvidia": NVIDIA_SECTION}],
            }
        )
    )
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    daemon = DaemonProcess(
        config,
        base / "daemon.log",
        extra_args=["--log-level", "warning", "--http-address", ""],
        env={"KXPU_FAKE_NVML": "a100-8x", "KXPU_FAKE_NVML_CONTROL": str(control)},
    )
    out: dict[str, float] = {}
    start = time.monotonic()
    await daemon.start()
    try:
        view = await kubelet.wait_registered(RESOURCE, timeout=60)
        out["start_to_registered_ms"] = (view.history[0].at - start) * 1000
        assert len(view.devices) == GPUS * REPLICAS, len(view.devices)
        samples = []
        for n in range(xids):
            gpu = n % GPUS
            seen = len(view.history)
            start = time.monotonic()
            send_control(control, op="xid", gpu=gpu, xid=79)
            await kubelet.wait_for(lambda: len(view.history) > seen, 5, "Xid → ListAndWatch")  # noqa: B023
            samples.append((view.history[seen].at - start) * 1000)
            await kubelet.wait_for(lambda: view.allocatable == GPUS * REPLICAS, 5, "recovery")
        out["xid_to_list_and_watch_p50_ms"] = percentile(samples, 50)
        out["xid_to_list_and_watch_p99_ms"] = percentile(samples, 99)
        out["rss_mb"] = rss_mb(daemon.pid)
        out["idle_cpu_percent"] = await idle_cpu_percent(daemon.pid, idle_seconds)
    finally:
        await daemon.stop()
        await kubelet.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--builds", type=int, default=20)
    parser.add_argument("--xids", type=int, default=50)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging("error")
    base = Path(tempfile.mkdtemp(prefix="kxpu-bench-", dir="/tmp"))
    try:
        results = asyncio.run(in_process(args.builds, args.xids))
        results |= asyncio.run(cross_process(base, args.xids, args.idle_seconds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(
        f"kxpu nvidia backend, fake NVML a100-8x x {REPLICAS} replicas = {GPUS * REPLICAS} devices",
        results,
        TARGETS,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

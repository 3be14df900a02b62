"""Daemon benchmarks, cross-process over the real unix sockets (`make bench`).

The daemon runs as a separate `kxpu plugin` process serving 3 simulated resources x 64
devices; this process plays the kubelet (kxpu.testing.KubeletStandIn) and measures:
- Allocate latency for 1 and 8 devices (p50/p99),
- state-file health flip → ListAndWatch message (p50/p99),
- kubelet.sock re-creation → re-registration of all resources,
- daemon RSS, and its idle CPU while nothing happens.
Prints a Markdown table and, with --json, the raw figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml
from measure import idle_cpu_percent, percentile, report, rss_mb

from kxpu.testing import KubeletStandIn
from kxpu.testing.process import DaemonProcess

RESOURCES = [f"bench.kxpu.io/r{i}" for i in range(3)]
DEVICES = 64
TARGETS = {
    "allocate_1_p50_ms": 1.0,
    "allocate_1_p99_ms": 3.0,
    "allocate_8_p50_ms": 1.0,
    "allocate_8_p99_ms": 3.0,
    "health_flip_p99_ms": 100.0,
    "reregister_max_ms": 1000.0,
    "rss_mb": 60.0,
    "idle_cpu_percent": 1.0,
}


async def run(
    base: Path, allocations: int, flips: int, restarts: int, idle_seconds: float
) -> dict[str, float]:
    plugin_dir = base / "dp"
    states = {r: base / f"state-{i}.json" for i, r in enumerate(RESOURCES)}
    config = base / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": "v1",
                "devicePluginDir": str(plugin_dir),
                "resources": [
                    {
                        "name": r,
                        "simulated": {"count": DEVICES, "model": f"dev{i}", "stateFile": str(states[r])},
                    }
                    for i, r in enumerate(RESOURCES)
                ],
            }
        )
    )
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    daemon = DaemonProcess(config, base / "daemon.log", extra_args=["--log-level", "warning"])
    await daemon.start()
    out: dict[str, float] = {}
    try:
        for r in RESOURCES:
            await kubelet.wait_registered(r, timeout=30)
        stub = kubelet.view(RESOURCES[0]).stub
        from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb

        for size in (1, 8):
            request = pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=[f"dev0-{i}" for i in range(size)])
                ]
            )
            for _ in range(100):  # warm-up
                await stub.Allocate(request)
            samples = []
            for _ in range(allocations):
                start = time.perf_counter()
                await stub.Allocate(request)
                samples.append((time.perf_counter() - start) * 1000)
            out[f"allocate_{size}_p50_ms"] = percentile(samples, 50)
            out[f"allocate_{size}_p99_ms"] = percentile(samples, 99)

        view = kubelet.view(RESOURCES[1])
        state = states[RESOURCES[1]]
        samples = []
        for n in range(flips):
            target = "Unhealthy" if n % 2 == 0 else "Healthy"
            seen = len(view.history)
            start = time.monotonic()
            state.write_text(json.dumps({"dev1-5": target}))
            await kubelet.wait_for(lambda: len(view.history) > seen, 5, "health flip")  # noqa: B023
            assert view.devices["dev1-5"] == target
            samples.append((view.history[-1].at - start) * 1000)
        out["health_flip_p50_ms"] = percentile(samples, 50)
        out["health_flip_p99_ms"] = percentile(samples, 99)

        samples = []
        for n in range(restarts):
            await kubelet.stop()
            for entry in plugin_dir.iterdir():
                entry.unlink()
            start = time.monotonic()
            await kubelet.start()
            for r in RESOURCES:
                await kubelet.wait_registered(r, times=n + 2, timeout=10)
            samples.append((max(t for t, _ in kubelet.registrations[-3:]) - start) * 1000)
        out["reregister_p50_ms"] = percentile(samples, 50)
        out["reregister_max_ms"] = max(samples)

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
    parser.add_argument("--allocations", type=int, default=2000)
    parser.add_argument("--flips", type=int, default=200)
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kxpu-bench-", dir="/tmp"))
    try:
        results = asyncio.run(run(base, args.allocations, args.flips, args.restarts, args.idle_seconds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(f"kxpu daemon: {len(RESOURCES)} resources x {DEVICES} devices", results, TARGETS, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

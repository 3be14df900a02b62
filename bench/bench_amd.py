"""AMD backend benchmarks over a fake MI300X node in CPX mode (8 GPUs x 8 partitions = 64 devices).

In-process:
- ``discover()`` of the 64 partitions (sysfs, KFD topology, health files),
- preferred allocation over the 64 (reads KFD links once, then cached),
- a RAS counter change → ``watch()`` yield, at pollSeconds 0.1 (a value: only polling sees it).
Cross-process (a ``kxpu plugin`` process reading the tree, this process as the kubelet over real sockets):
- process start → registered with 64 devices,
- RAS change → ListAndWatch message at the kubelet (p50/p99),
- repartition CPX → SPX → the kubelet's list shows 8 devices,
- daemon RSS and idle CPU (at pollSeconds 0.1, and at the default 5 s in a second daemon).
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

from measure import idle_cpu_percent, percentile, report, rss_mb

from kxpu.backends.amd import AmdBackend, AmdConfig
from kxpu.logs import configure_logging
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_amd import FakeAmd
from kxpu.testing.process import DaemonProcess

RESOURCE = "amd.com/gpu"
POLL = 0.1
TARGETS = {
    "discover_64_ms": 50.0,
    "ras_to_list_and_watch_p99_ms": 500.0,
    "repartition_to_kubelet_ms": 2000.0,
    "rss_mb": 80.0,
    "idle_cpu_percent": 1.0,
}


async def in_process(rounds: int, changes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    fake = FakeAmd("mi300x-8x-cpx")
    try:
        backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root), "pollSeconds": POLL}))
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            devices = backend.discover()
            times.append((time.perf_counter() - start) * 1000)
        assert len(devices) == 64
        out["discover_64_ms"] = statistics.median(times)
        start = time.perf_counter()
        backend.preferred_allocation(devices, [], 12)
        out["preferred_first_ms"] = (time.perf_counter() - start) * 1000
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            backend.preferred_allocation(devices, [], 12)
            times.append((time.perf_counter() - start) * 1000)
        out["preferred_cached_ms"] = statistics.median(times)

        updates = backend.watch()
        await anext(updates)
        samples = []
        for n in range(changes):
            start = time.perf_counter()
            fake.set_ras(n % 8, "umc", n + 1)
            while True:
                listed = await asyncio.wait_for(anext(updates), 5)
                if any(not d.healthy for d in listed):
                    break
            samples.append((time.perf_counter() - start) * 1000)
            fake.set_ras(n % 8, "umc", 0)
            while any(not d.healthy for d in await asyncio.wait_for(anext(updates), 5)):
                pass
        await updates.aclose()
        out["ras_to_watch_p50_ms"] = percentile(samples, 50)
        out["ras_to_watch_p99_ms"] = percentile(samples, 99)
    finally:
        fake.cleanup()
    return out


async def cross_process(base: Path, changes: int, idle_seconds: float) -> dict[str, float]:
    fake = FakeAmd("mi300x-8x-cpx")
    plugin_dir = base / "dp"
    config = base / "config.json"
    section = {"hostRoot": str(fake.root), "pollSeconds": POLL}
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "devicePluginDir": str(plugin_dir),
                "resources": [{"name": RESOURCE, "amd": section}],
            }
        )
    )
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    daemon = DaemonProcess(
        config, base / "daemon.log", extra_args=["--log-level", "warning", "--http-address", ""]
    )
    out: dict[str, float] = {}
    start = time.monotonic()
    await daemon.start()
    try:
        view = await kubelet.wait_registered(RESOURCE, timeout=60)
        out["start_to_registered_64_ms"] = (view.history[0].at - start) * 1000
        assert len(view.devices) == 64, len(view.devices)
        samples = []
        for n in range(changes):
            seen = len(view.history)
            start = time.monotonic()
            fake.set_ras(n % 8, "umc", n + 1)
            await kubelet.wait_for(lambda: len(view.history) > seen, 5, "RAS → ListAndWatch")  # noqa: B023
            samples.append((view.history[seen].at - start) * 1000)
            fake.set_ras(n % 8, "umc", 0)
            await kubelet.wait_for(lambda: view.allocatable == 64, 5, "recovery")
        out["ras_to_list_and_watch_p50_ms"] = percentile(samples, 50)
        out["ras_to_list_and_watch_p99_ms"] = percentile(samples, 99)
        out["idle_cpu_percent_poll_0.1s"] = await idle_cpu_percent(daemon.pid, idle_seconds)
        start = time.monotonic()
        fake.repartition("spx_nps1")
        await kubelet.wait_for(lambda: len(view.devices) == 8, 10, "repartition → 8 devices")
        out["repartition_to_kubelet_ms"] = (time.monotonic() - start) * 1000
    finally:
        await daemon.stop()
        await kubelet.stop()
    try:  # the same node at the default poll interval: what a node pays while nothing changes
        section["pollSeconds"] = 5
        config.write_text(
            json.dumps(
                {
                    "version": "v1",
                    "devicePluginDir": str(plugin_dir),
                    "resources": [{"name": RESOURCE, "amd": section}],
                }
            )
        )
        fake.repartition("cpx_nps4")
        kubelet = KubeletStandIn(plugin_dir)
        await kubelet.start()
        daemon = DaemonProcess(
            config, base / "daemon2.log", extra_args=["--log-level", "warning", "--http-address", ""]
        )
        await daemon.start()
        view = await kubelet.wait_registered(RESOURCE, timeout=60)
        assert len(view.devices) == 64
        out["rss_mb"] = rss_mb(daemon.pid)
        out["idle_cpu_percent"] = await idle_cpu_percent(daemon.pid, idle_seconds)
    finally:
        await daemon.stop()
        await kubelet.stop()
        fake.cleanup()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging("error")
    base = Path(tempfile.mkdtemp(prefix="kxpu-bench-", dir="/tmp"))
    try:
        results = asyncio.run(in_process(args.rounds, args.changes))
        results |= asyncio.run(cross_process(base, args.changes, args.idle_seconds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(
        f"kxpu amd backend, fake mi300x-8x-cpx (64 partitions), pollSeconds {POLL}",
        results,
        TARGETS,
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Device-plugin Allocate: kxpu against a bare Python gRPC device plugin, same calls, same run.

Both serve 64 devices as separate processes (``python -S``, this venv's site-packages) and register with a kubelet
stand-in in this process over the real sockets; the stand-in's client then calls ``Allocate`` for one device of
one container, as the kubelet does for a pod, alternating between the two in batches (``--rounds`` x ``--calls``):

- **bare-dp**: ``bench/bare_dp_registrar.py``, grpc.aio with the generated messages: the request decoded, the answer
  an env var naming the devices (the least a Python device plugin does);
- **kxpu-dp**: ``kxpu plugin`` with the simulated backend: the IDs checked against the device snapshot, the
  backend's container edits, the Allocate histogram and the answer's size check, metrics served on a port, logging
  as the chart runs it (``--log-level info --log-format json``; each Allocate is logged at debug).

Reported per contender: the client's round trip p50 / p99 and the server's CPU per call (its threads' time on a
CPU over its batches, from ``/proc/<pid>/task/*/schedstat``, in nanoseconds), and kxpu's ratios to the floor: the median over the rounds of each round's ratio. ``--baseline TREE`` adds kxpu from another source tree (a git
worktree of an earlier commit) to every round: before and after on the same machine, same load.

``python bench/bench_allocate.py [--rounds 10] [--calls 300] [--baseline TREE] [--json]``. No cluster, no root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_startup import DEVICES, RESOURCE, _kxpu_config, _python, _site
from measure import percentile, thread_cpu_seconds

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.testing import KubeletStandIn

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Contender:
    """One plugin process, registered with its own kubelet stand-in."""

    def __init__(self, name: str, tree: Path | None, work: Path, log_level: str = "info") -> None:
        self.name, self.tree, self.work, self.log_level = name, tree, work, log_level
        self.latencies: list[float] = []
        self.cpu = 0.0
        self.calls = 0
        self.rounds: list[tuple[float, float]] = []  # per batch: (p50 s, CPU s per call)

    async def start(self) -> None:
        work = self.work
        (work / "dp").mkdir(parents=True)
        if self.tree is None:
            command = [*_python(), str(REPO / "bench" / "bare_dp_registrar.py"), RESOURCE, str(work / "dp")]
            command.append(str(DEVICES))
            path = f"{REPO}:{_site()}"  # its Allocate decodes with kxpu's generated messages
        else:
            config = _kxpu_config(work, dra=False)
            command = [*_python(), "-m", "kxpu", "plugin", "--config", str(config), "--log-format", "json"]
            command += ["--log-level", self.log_level]
            command += ["--http-address", f"127.0.0.1:{_free_port()}", "--http-auth", "none"]
            path = f"{self.tree}:{_site()}"
        self.kubelet = KubeletStandIn(work / "dp")
        await self.kubelet.start()
        env = {**os.environ, "PYTHONPATH": path, "KUBECONFIG": "/nonexistent", "NODE_NAME": "node-a"}
        with (work / "log").open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *command, stdout=log, stderr=log, env=env, cwd=work
            )
        self.view = await self.kubelet.wait_registered(RESOURCE, timeout=60)
        device = sorted(self.view.devices)[0]
        self.request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[device])]
        )
        for _ in range(50):  # warm both ends' caches and code paths
            await self.view.stub.Allocate(self.request, timeout=10)

    async def batch(self, calls: int) -> None:
        before = thread_cpu_seconds(self.proc.pid)
        batch = []
        for _ in range(calls):
            started = time.perf_counter()
            await self.view.stub.Allocate(self.request, timeout=10)
            batch.append(time.perf_counter() - started)
        cpu = thread_cpu_seconds(self.proc.pid) - before
        self.latencies += batch
        self.cpu += cpu
        self.calls += calls
        self.rounds.append((statistics.median(batch), cpu / calls))

    async def stop(self) -> None:
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 20)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        await self.kubelet.stop()

    def figures(self, floor: Contender) -> dict[str, float]:
        """Percentiles over every call; the ratios to ``floor`` are medians of the rounds' own ratios (the two
        measured back to back, so a load that comes and goes moves both)."""
        ms = [s * 1000 for s in self.latencies]
        pairs = list(zip(self.rounds, floor.rounds, strict=True))
        return {
            "p50_ratio": round(statistics.median(a[0] / b[0] for a, b in pairs), 3),
            "cpu_ratio": round(statistics.median(a[1] / b[1] for a, b in pairs if b[1] > 0), 3),
            "p50_ms": round(percentile(ms, 50), 3),
            "p99_ms": round(percentile(ms, 99), 3),
            "mean_ms": round(statistics.fmean(ms), 3),
            "server_cpu_ms_per_call": round(1000 * self.cpu / self.calls, 3),
        }


async def bench(
    rounds: int, calls: int, baseline: Path | None, log_level: str
) -> dict[str, dict[str, float]]:
    base = Path(tempfile.mkdtemp(prefix="kxpu-allocate-", dir="/tmp"))
    contenders = [
        Contender("bare-dp", None, base / "bare"),
        Contender("kxpu-dp", REPO, base / "kxpu", log_level),
    ]
    if baseline is not None:
        contenders.insert(1, Contender("kxpu-dp@baseline", baseline, base / "baseline", log_level))
    try:
        for contender in contenders:
            await contender.start()
        for n in range(rounds):
            order = contenders[n % len(contenders) :] + contenders[: n % len(contenders)]
            for contender in order:
                await contender.batch(calls)
        return {c.name: c.figures(contenders[0]) for c in contenders}
    finally:
        for contender in contenders:
            if hasattr(contender, "proc"):
                await contender.stop()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="batches of calls per contender, interleaved")
    parser.add_argument("--calls", type=int, default=300, help="Allocate calls per batch")
    parser.add_argument("--baseline", type=Path, help="another kxpu source tree, measured beside this one")
    parser.add_argument(
        "--log-level",
        default="info",
        help="kxpu's (the chart's default: info, JSON lines)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(bench(args.rounds, args.calls, args.baseline, args.log_level))
    print(
        f"Allocate, 1 device, {args.rounds} x {args.calls} calls each, kxpu logging at {args.log_level}, "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| contender | p50 (ms) | p99 (ms) | server CPU / call (ms) | p50 / floor | CPU / floor |")
    print("|---|---|---|---|---|---|")
    for name, f in results.items():
        print(
            f"| {name} | {f['p50_ms']} | {f['p99_ms']} | {f['server_cpu_ms_per_call']} | "
            f"{f['p50_ratio']:.2f}x | {f['cpu_ratio']:.2f}x |"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""exec → registered with the kubelet, and RSS once registered: kxpu against a bare Python gRPC server, both paths.

Per run, each contender is started as its own process (``python -S``, this venv's site-packages on the path, so
every contender pays the same interpreter start) against a kubelet stand-in over the real sockets, one after the
other, interleaved over ``RUNS`` runs (medians reported):

- **bare-dp**: ``bench/bare_dp_registrar.py``, a grpc.aio device plugin with 64 devices (the floor);
- **kxpu-dp**: ``kxpu plugin`` serving one resource of 64 simulated devices through the Device Plugin API;
- **bare-dra**: ``bench/bare_dra_registrar.py``, a grpc.aio server that only registers a DRA driver (the floor);
- **kxpu-dra**: ``kxpu plugin`` serving the same 64 simulated devices through DRA (no API server:
  ``KUBECONFIG`` points nowhere, so the API calls fail after registration, as in ``bench_dra_vs_go --startup``).

exec → registered is the stand-in's registration time (device plugin: once it has dialled the plugin back;
DRA: once the driver answered GetInfo) less the time of exec. RSS is read ``--settle`` seconds after
registration. ``--baseline TREE`` runs kxpu from another source tree (a git worktree of an earlier commit)
beside this one in every run: before and after on the same machine, same load.

``python bench/bench_startup.py [--runs 7] [--baseline TREE] [--json]``. No cluster, no root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from measure import rss_mb

from kxpu.testing import KubeletStandIn
from kxpu.testing.dra import DraKubeletStandIn

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "example.com/npu"
DRIVER = "npu.example.com"
DEVICES = 64


def _python() -> list[str]:
    return [str(REPO / ".venv" / "bin" / "python"), "-S"]


def _site() -> str:
    return str(next((REPO / ".venv" / "lib").glob("python3*/site-packages")))


def _kxpu_config(work: Path, dra: bool) -> Path:
    resource: dict[str, Any] = {"name": RESOURCE, "simulated": {"count": DEVICES, "model": "sim"}}
    if dra:
        resource |= {"serve": "dra", "dra": {"nodeName": "node-a", "cdiSpecDir": str(work / "cdi")}}
    config = {
        "version": "v1",
        "devicePluginDir": str(work / "dp"),
        "kubeletPluginsDir": str(work / "plugins"),
        "pluginsRegistryDir": str(work / "registry"),
        "podResourcesSocket": str(work / "pod-resources.sock"),
        "resources": [resource],
    }
    path = work / "config.json"
    path.write_text(json.dumps(config))
    return path


async def one(name: str, tree: Path | None, work: Path, settle: float) -> tuple[float, float]:
    """(exec → registered in ms, RSS in MB ``settle`` s later) of one contender."""
    dra = name.endswith("dra") or "-dra@" in name
    for d in ("dp", "plugins", "registry"):
        (work / d).mkdir(parents=True, exist_ok=True)
    if tree is None:  # a bare floor
        script = REPO / "bench" / ("bare_dra_registrar.py" if dra else "bare_dp_registrar.py")
        args = (
            [DRIVER, str(work / "registry"), str(work / "plugins")] if dra else [RESOURCE, str(work / "dp")]
        )
        command = [*_python(), str(script), *args, *([] if dra else [str(DEVICES)])]
        path = _site()
    else:
        config = _kxpu_config(work, dra)
        command = [*_python(), "-m", "kxpu", "plugin", "--config", str(config), "--log-level", "warning"]
        path = f"{tree}:{_site()}"
    env = {**os.environ, "PYTHONPATH": path, "KUBECONFIG": "/nonexistent", "NODE_NAME": "node-a"}
    kubelet: Any = DraKubeletStandIn(work / "registry") if dra else KubeletStandIn(work / "dp")
    await kubelet.start()
    loop = asyncio.get_running_loop()
    with (work / "log").open("ab") as log:
        started = loop.time()
        # In its own directory: ``python -m kxpu`` would otherwise import kxpu from the current directory.
        proc = await asyncio.create_subprocess_exec(
            *command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work
        )
    try:
        if dra:
            registered = (await kubelet.wait_registered(DRIVER, timeout=60)).registered_at
        else:
            registered = (await kubelet.wait_registered(RESOURCE, timeout=60)).registered_at
        await asyncio.sleep(settle)  # what the process holds once settled, not mid-start
        return (registered - started) * 1000, rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        await kubelet.stop()


async def bench(runs: int, baseline: Path | None, settle: float) -> dict[str, dict[str, float]]:
    trees: list[tuple[str, Path | None]] = [("", REPO)]
    if baseline is not None:
        trees.insert(0, ("@baseline", baseline))
    contenders: list[tuple[str, Path | None]] = []
    for path in ("dp", "dra"):
        contenders.append((f"bare-{path}", None))
        contenders += [(f"kxpu-{path}{suffix}", tree) for suffix, tree in trees]
    samples: dict[str, dict[str, list[float]]] = {}
    base = Path(tempfile.mkdtemp(prefix="kxpu-startup-", dir="/tmp"))
    try:
        for n in range(runs):
            for name, tree in contenders:
                work = base / f"{n}-{name}"
                ms, rss = await one(name, tree, work, settle)
                figures = samples.setdefault(name, {})
                figures.setdefault("exec_to_registered_ms", []).append(ms)
                figures.setdefault("rss_mb", []).append(rss)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        name: {k: round(statistics.median(v), 1) for k, v in figures.items()}
        for name, figures in samples.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs of each contender")
    parser.add_argument("--baseline", type=Path, help="another kxpu source tree, measured beside this one")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after registration before RSS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(bench(args.runs, args.baseline, args.settle))
    print(f"exec → registered and RSS, medians of {args.runs} interleaved runs, {os.cpu_count()} CPUs\n")
    print("| contender | exec → registered (ms) | x its bare floor | RSS (MB) |\n|---|---|---|---|")
    for name, figures in results.items():
        floor = results["bare-dra" if "dra" in name else "bare-dp"]["exec_to_registered_ms"]
        ratio = figures["exec_to_registered_ms"] / floor
        print(f"| {name} | {figures['exec_to_registered_ms']} | {ratio:.2f}x | {figures['rss_mb']} |")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

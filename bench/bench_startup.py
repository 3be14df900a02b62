"""exec → registered with the kubelet, and RSS once registered: kxpu against a bare Python gRPC server, both paths.

Per run, each contender is started as its own process (``python -S``, that interpreter's site-packages on the path,
so every contender pays the same interpreter start) against a kubelet stand-in over the real sockets, one after the
other, interleaved over ``RUNS`` runs (medians reported):

- **bare-dp**: ``bench/bare_dp_registrar.py``, a grpc.aio device plugin with 64 devices (the floor);
- **kxpu-dp**: ``kxpu plugin`` serving one resource of 64 simulated devices through the Device Plugin API;
- **bare-dra**: ``bench/bare_dra_registrar.py``, a grpc.aio server that only registers a DRA driver (the floor);
- **kxpu-dra**: ``kxpu plugin`` serving the same 64 simulated devices through DRA (no API server:
  ``KUBECONFIG`` points nowhere, so the API calls fail after registration, as in ``bench_dra_vs_go --startup``);
- with ``--libs-floor``, **bare-dp+libs** and **bare-dra+libs**: the bare floors loading and using once, before
  their first socket, the libraries kxpu loads before it registers (``bench/kept_libraries.py``: click, YAML,
  pydantic, structlog, the generated protobuf modules, asyncinotify) and none of kxpu's own code. kxpu above
  them is its own code; they above the bare floor are what the libraries the design keeps cost.

exec → registered is the stand-in's registration time (device plugin: once it has dialled the plugin back;
DRA: once the driver answered GetInfo) less the time of exec. RSS is read ``--settle`` seconds after
registration. ``--baseline TREE`` runs kxpu from another source tree (a git worktree of an earlier commit)
beside this one in every run: before and after on the same machine, same load.

``python bench/bench_startup.py [--runs 7] [--baseline TREE] [--libs-floor] [--python PATH] [--json]``: ``--python`` is the
interpreter the contenders run on (default: this repo's ``.venv``; on a lent machine, the venv that
``hack/gpu-startup-check.sh`` makes). No cluster, no root.
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

from measure import compile_tree, rss_mb

# Where kxpu is not installed in the interpreter (``--python`` on a lent machine): this tree's.
sys.path.append(str(Path(__file__).resolve().parent.parent))

from kxpu.testing import KubeletStandIn
from kxpu.testing.dra import DraKubeletStandIn

REPO = Path(__file__).resolve().parent.parent
RESOURCE = "example.com/npu"
DRIVER = "npu.example.com"
DEVICES = 64


VENV_PYTHON = REPO / ".venv" / "bin" / "python"


def _python(python: Path = VENV_PYTHON) -> list[str]:
    return [str(python), "-S"]


def _site(python: Path = VENV_PYTHON) -> str:
    """``python``'s site-packages (and what PYTHONPATH adds), put on the path of a contender started with ``-S``."""
    code = "import os, site; print(os.pathsep.join(site.getsitepackages()))"
    found = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    return os.pathsep.join(p for p in (found, os.environ.get("PYTHONPATH", "")) if p)


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


async def one(
    name: str, tree: Path | None, work: Path, settle: float, python: Path = VENV_PYTHON
) -> tuple[float, float]:
    """(exec → registered in ms, RSS in MB ``settle`` s later) of one contender."""
    dra = "-dra" in name
    for d in ("dp", "plugins", "registry"):
        (work / d).mkdir(parents=True, exist_ok=True)
    if tree is None:  # a bare floor; with the kept libraries, the generated modules from this tree
        script = REPO / "bench" / ("bare_dra_registrar.py" if dra else "bare_dp_registrar.py")
        args = (
            [DRIVER, str(work / "registry"), str(work / "plugins")] if dra else [RESOURCE, str(work / "dp")]
        )
        command = [*_python(python), str(script), *args, *([] if dra else [str(DEVICES)])]
        path = f"{REPO}:{_site(python)}" if name.endswith("+libs") else _site(python)
    else:
        config = _kxpu_config(work, dra)
        command = [
            *_python(python),
            "-m",
            "kxpu",
            "plugin",
            "--config",
            str(config),
            "--log-level",
            "warning",
        ]
        path = f"{tree}:{_site(python)}"
    env = {**os.environ, "PYTHONPATH": path, "KUBECONFIG": "/nonexistent", "NODE_NAME": "node-a"}
    env["BARE_WITH_LIBS"] = "1" if name.endswith("+libs") else "0"
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


async def bench(
    runs: int, baseline: Path | None, settle: float, python: Path = VENV_PYTHON, libs_floor: bool = False
) -> dict[str, dict[str, float]]:
    trees: list[tuple[str, Path]] = [("", REPO)]
    if baseline is not None:
        trees.insert(0, ("@baseline", baseline))
    contenders: list[tuple[str, Path | None]] = []
    for path in ("dp", "dra"):
        contenders.append((f"bare-{path}", None))
        if libs_floor:
            contenders.append((f"bare-{path}+libs", None))
        contenders += [(f"kxpu-{path}{suffix}", tree) for suffix, tree in trees]
    for _, source in trees:
        compile_tree(python, source)
    samples: dict[str, dict[str, list[float]]] = {}
    base = Path(tempfile.mkdtemp(prefix="kxpu-startup-", dir="/tmp"))
    try:
        for n in range(runs):
            for name, tree in contenders:
                work = base / f"{n}-{name}"
                ms, rss = await one(name, tree, work, settle, python)
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
    parser.add_argument(
        "--python", type=Path, default=VENV_PYTHON, help="the interpreter the contenders run on"
    )
    parser.add_argument(
        "--libs-floor", action="store_true", help="also the bare floors with the libraries kxpu keeps"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = asyncio.run(bench(args.runs, args.baseline, args.settle, args.python, args.libs_floor))
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

"""kxpu's NVIDIA backend side by side with NVIDIA's own Go device plugin, on a GPU node: start-up, Allocate, RSS.

Each contender runs as its own process against this process's kubelet stand-in (``KubeletStandIn``, the real
unix sockets), one after the other, interleaved over ``--runs`` runs (the order alternates; ``--warmup`` runs
first are not counted), medians reported:

- **kxpu**: ``kxpu plugin`` serving ``nvidia.com/gpu`` (``migStrategy: none``, ``deviceListStrategy: envvar``,
  ``deviceIDStrategy: uuid``), its HTTP port on loopback, logging at ``--kxpu-log-level`` (info, as deployed);
- **nvidia**: NVIDIA's ``nvidia-device-plugin`` (github.com/NVIDIA/k8s-device-plugin, built from its Go module by
  ``hack/nvidia-device-plugin/build.sh``) with the same strategies and its other flags at their defaults;
- **python-floor**: ``bench/bare_dp_registrar.py``, a bare grpc.aio device plugin on the same interpreter listing
  the same GPU UUIDs and answering ``NVIDIA_VISIBLE_DEVICES`` (no NVML, no device nodes): what any Python plugin
  pays on this machine (``--no-python-floor`` leaves it out).

Both pay NVML's init. Per run: exec → registered (the stand-in's time of registration, once it has dialled the
plugin back), exec → listed (the first ListAndWatch message listing every GPU Healthy), CPU used and RSS
``--settle`` seconds after that, then ``--allocations`` Allocate calls for the same GPU(s) after a few
warm-up calls (p50/p99; the first call apart), and RSS after them. The first response of each is checked to
name the GPUs in ``NVIDIA_VISIBLE_DEVICES``.

NVIDIA's plugin listens only in /var/lib/kubelet/device-plugins (``pluginapi.DevicePluginPath``; only the
kubelet socket is a flag), so the stand-in serves there for both contenders when the directory can be created
(root) and no kubelet serves it; otherwise NVIDIA is skipped with the reason in the JSON and kxpu runs alone in
a temporary directory. ``--fake PROFILE`` runs kxpu over the fake NVML (``kxpu.testing.fake_nvml``) in a
temporary directory, to test this script without a GPU.

Every wait has a deadline, ``--deadline`` bounds the whole run (no run starts unless the contender's runs so far
say it ends in time; a plugin that slows down within a run can still overrun, so the runner wraps it in
``timeout``), and
the JSON at ``--out`` is rewritten after every run, so a killed run still leaves its results.

``python bench/bench_nvidia_vs_go.py --out results.json [--nvidia-bin PATH] [--runs 9] [--fake a100-8x]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from measure import cpu_seconds, percentile, rss_mb

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # kxpu from this tree where it is not installed (the GPU machine's venv)

if TYPE_CHECKING:
    from kxpu.testing.kubelet import KubeletStandIn, PluginView

RESOURCE = "nvidia.com/gpu"
NVIDIA_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # where NVIDIA's plugin always listens
NVIDIA_BIN_ENV = "KXPU_NVIDIA_DEVICE_PLUGIN"
ALLOCATE_WARMUP = 20
DROP_AFTER = 2  # a contender whose first runs all failed is not started again
LOG_TAIL = 1500
FIGURES = (
    "exec_to_registered_ms",
    "exec_to_listed_ms",
    "cpu_to_settled_ms",
    "rss_settled_mb",
    "allocate_first_ms",
    "allocate_p50_ms",
    "allocate_p99_ms",
    "rss_after_allocate_mb",
)
CONTENDERS = ("kxpu", "nvidia", "python-floor")  # the table's order
T = TypeVar("T")


@dataclass
class Contender:
    name: str
    argv: list[str]
    env: dict[str, str]
    config: Path | None = None  # kxpu's, rewritten per run
    durations: list[float] = field(default_factory=list)  # seconds per run, to plan within the deadline


class Results:
    """The JSON document at ``--out``, rewritten whole (atomically) after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"complete": False, "runs": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=2))
        os.replace(tmp, self.path)


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return ""


def _run(argv: list[str], timeout: float = 30) -> str:
    """A short command's output, or '' when it is missing, fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def machine(fake: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "kernel": platform.release(),
        "uid": os.getuid(),
    }
    if fake:
        info["fake_nvml"] = fake
    else:
        info["gpus"] = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    return info


def expected_gpus(fake: str | None) -> list[str] | None:
    """The UUIDs every contender must list: nvidia-smi's (the fake's with ``--fake``); None when unknown."""
    if fake:
        from kxpu.testing.fake_nvml import FakeNvml

        return sorted(g.uuid for g in FakeNvml(fake).gpus)
    out = _run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
    return sorted(line.strip() for line in out.splitlines() if line.strip()) or None


def _nvml_loadable() -> str | None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        return str(exc)
    return None


def _kubelet_serving(sock: Path) -> bool:
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2)
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


def nvidia_plugin_dir(
    binary: Path | None, plugin_dir: Path | None, fake: str | None
) -> tuple[Path | None, str]:
    """(the directory the stand-in serves for NVIDIA, '') or (None, why NVIDIA is skipped)."""
    if binary is None:
        return (
            None,
            f"no binary: pass --nvidia-bin or set {NVIDIA_BIN_ENV} (hack/nvidia-device-plugin/build.sh)",
        )
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is not an executable file"
    if plugin_dir is None and fake:
        return (
            None,
            "--fake: NVIDIA's plugin would need the driver (give --plugin-dir to run a stand-in binary)",
        )
    if plugin_dir is None and (reason := _nvml_loadable()) is not None:
        return None, f"libnvidia-ml.so.1 cannot be loaded ({reason}): NVIDIA's plugin needs the driver"
    directory = plugin_dir or NVIDIA_PLUGIN_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"cannot create {directory} ({exc.strerror}), where NVIDIA's plugin listens: run as root"
    if not os.access(directory, os.W_OK):
        return None, f"{directory} is not writable, and NVIDIA's plugin listens there: run as root"
    if _kubelet_serving(directory / "kubelet.sock"):
        return None, f"a kubelet serves {directory / 'kubelet.sock'}: not touching a live node"
    return directory, ""


def kxpu_contender(python: str, fake: str | None, log_level: str, work: Path) -> Contender:
    from kxpu.testing.process import free_port

    argv = [python, "-m", "kxpu", "plugin", "--config", str(work / "kxpu.json"), "--log-level", log_level]
    argv += ["--http-address", f"127.0.0.1:{free_port()}", "--http-auth", "none"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if fake:
        argv += ["--import", "kxpu.testing.fake_nvml"]
        env["KXPU_FAKE_NVML"] = fake
    return Contender("kxpu", argv, env, config=work / "kxpu.json")


def floor_contender(python: str, gpus: list[str]) -> Contender:
    """The bare Python plugin (``bare_dp_registrar.py``) listing ``gpus``; its socket in the stand-in's directory."""
    argv = [python, str(REPO / "bench" / "bare_dp_registrar.py"), RESOURCE, "", str(len(gpus))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env |= {"BARE_DEVICE_IDS": ",".join(gpus), "BARE_VISIBLE_ENV": "NVIDIA_VISIBLE_DEVICES"}
    return Contender("python-floor", argv, env)


def write_kxpu_config(path: Path, plugin_dir: Path, work: Path, pass_specs: bool) -> None:
    nvidia = {
        "migStrategy": "none",
        "deviceListStrategy": ["envvar"],
        "deviceIDStrategy": "uuid",
        "passDeviceSpecs": pass_specs,
        "failOnInitError": True,
    }
    config = {
        "version": "v1",
        "devicePluginDir": str(plugin_dir),
        "kubeletPluginsDir": str(work / "plugins"),
        "pluginsRegistryDir": str(work / "registry"),
        "podResourcesSocket": str(work / "pod-resources.sock"),
        "resources": [{"name": RESOURCE, "nvidia": nvidia}],
    }
    path.write_text(json.dumps(config))


def nvidia_contender(binary: Path, plugin_dir: Path, pass_specs: bool, fake: str | None) -> Contender:
    argv = [
        str(binary),
        f"--kubelet-socket={plugin_dir / 'kubelet.sock'}",
        "--mig-strategy=none",
        "--fail-on-init-error=true",
        "--device-list-strategy=envvar",
        "--device-id-strategy=uuid",
        f"--pass-device-specs={'true' if pass_specs else 'false'}",
        "--driver-root=/",
        "--driver-root-ctr-path=/",  # not in a container: the driver is at /
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    if fake:  # a stand-in binary in tests plays the same machine
        env["KXPU_FAKE_NVML"] = fake
    return Contender("nvidia", argv, env)


async def _or_exit(awaitable: Awaitable[T], proc: asyncio.subprocess.Process, what: str) -> T:
    """``awaitable``'s result, unless the process exits first (then a one-line error)."""
    task = asyncio.ensure_future(awaitable)
    died = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait({task, died}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, died):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                    await pending
    if task in done:
        return task.result()
    raise RuntimeError(f"exited with status {proc.returncode} before {what}")


def _listed(devices: dict[str, str], expected: list[str] | None) -> bool:
    if expected is None:
        return bool(devices) and all(h == "Healthy" for h in devices.values())
    return sorted(devices) == expected and all(h == "Healthy" for h in devices.values())


async def _stop(proc: asyncio.subprocess.Process) -> int | None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    return proc.returncode


async def one_run(
    contender: Contender,
    plugin_dir: Path,
    work: Path,
    expected: list[str] | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One start of one contender; figures in ms and MiB, or ``error`` with the log's tail."""
    from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
    from kxpu.testing import KubeletStandIn

    work.mkdir(parents=True, exist_ok=True)
    if contender.config is not None:
        write_kxpu_config(contender.config, plugin_dir, work, args.pass_device_specs)
    kubelet: KubeletStandIn = KubeletStandIn(plugin_dir)
    await kubelet.start()
    log = work / f"{contender.name}.log"
    result: dict[str, Any] = {}
    proc: asyncio.subprocess.Process | None = None
    try:
        argv = [str(plugin_dir) if a == "" else a for a in contender.argv]  # the floor's plugin directory
        with log.open("ab") as out:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=contender.env,
                cwd=work,  # python -m kxpu must not import kxpu from the current directory by accident
            )
        view: PluginView = await _or_exit(
            kubelet.wait_registered(RESOURCE, timeout=args.step_timeout), proc, "registering"
        )
        result["exec_to_registered_ms"] = (view.registered_at - started) * 1000
        await _or_exit(
            kubelet.wait_for(
                lambda: _listed(view.devices, expected), args.step_timeout, "every GPU listed Healthy"
            ),
            proc,
            "listing every GPU Healthy",
        )
        listed = next(e for e in view.history if _listed(e.devices, expected))
        result["exec_to_listed_ms"] = (listed.at - started) * 1000
        result["gpus"] = len(listed.devices)
        await asyncio.sleep(args.settle)  # what the process uses once settled, not mid-start
        result["cpu_to_settled_ms"] = cpu_seconds(proc.pid) * 1000
        result["rss_settled_mb"] = rss_mb(proc.pid)

        ids = sorted(listed.devices)[: args.allocate_gpus]
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        start = time.perf_counter()
        response = await view.stub.Allocate(request, timeout=args.step_timeout)
        result["allocate_first_ms"] = (time.perf_counter() - start) * 1000
        visible = dict(response.container_responses[0].envs).get("NVIDIA_VISIBLE_DEVICES", "")
        if sorted(visible.split(",")) != ids:
            raise RuntimeError(f"Allocate {ids} answered NVIDIA_VISIBLE_DEVICES={visible!r}")
        result["allocate_device_nodes"] = len(response.container_responses[0].devices)
        for _ in range(ALLOCATE_WARMUP):
            await view.stub.Allocate(request, timeout=args.step_timeout)
        samples = []
        for _ in range(args.allocations):
            start = time.perf_counter()
            await view.stub.Allocate(request, timeout=args.step_timeout)
            samples.append((time.perf_counter() - start) * 1000)
        result["allocate_p50_ms"] = percentile(samples, 50)
        result["allocate_p99_ms"] = percentile(samples, 99)
        result["rss_after_allocate_mb"] = rss_mb(proc.pid)
    except Exception as exc:  # recorded, not raised: the other runs go on
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        if proc is not None:
            result["exit_status"] = await _stop(proc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(kubelet.stop(), 10)
        if "error" in result:
            result["log_tail"] = _tail(log)
    return result


def _of(doc: dict[str, Any], contender: Contender) -> list[dict[str, Any]]:
    return [r for r in doc["runs"] if r["contender"] == contender.name]


def _ratio_key(other: str) -> str:
    return f"kxpu_over_{other.replace('-', '_')}"


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    counted = [r for r in runs if not r.get("warmup") and "error" not in r]
    summary: dict[str, Any] = {}
    for name in sorted({r["contender"] for r in counted}):
        mine = [r for r in counted if r["contender"] == name]
        summary[name] = {"runs": len(mine)} | {
            k: round(statistics.median(r[k] for r in mine), 3) for k in FIGURES if all(k in r for r in mine)
        }
    for other in ("nvidia", "python-floor"):
        if "kxpu" in summary and other in summary:
            summary[_ratio_key(other)] = {
                k: round(summary["kxpu"][k] / summary[other][k], 2)
                for k in FIGURES
                if k in summary["kxpu"] and summary[other].get(k)
            }
    return summary


def table(summary: dict[str, Any]) -> str:
    names = [n for n in CONTENDERS if n in summary]
    if not names:
        return "no figures: no run of any contender succeeded"
    ratios = [o for o in CONTENDERS[1:] if _ratio_key(o) in summary]
    lines = ["| figure (median) | " + " | ".join(names) + "".join(f" | kxpu / {o}" for o in ratios) + " |"]
    lines.append("|---" * (len(names) + 1 + len(ratios)) + "|")
    for k in FIGURES:
        row = [str(summary[n].get(k, "")) for n in names]
        row += [f"{summary[_ratio_key(o)].get(k, '')}x" for o in ratios]
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    return "\n".join(lines)


async def bench(args: argparse.Namespace, results: Results) -> None:
    began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="kxpu-vs-nvidia-", dir="/tmp"))
    doc = results.doc
    try:
        doc["machine"] = machine(args.fake)
        doc["settings"] = {
            k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
            for k, v in vars(args).items()
        }
        expected = expected_gpus(args.fake)
        doc["expected_gpus"] = expected
        doc["kxpu_commit"] = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], timeout=10)
        binary = args.nvidia_bin or (
            Path(os.environ[NVIDIA_BIN_ENV]) if os.environ.get(NVIDIA_BIN_ENV) else None
        )
        plugin_dir, reason = nvidia_plugin_dir(binary, args.plugin_dir, args.fake)
        contenders = [kxpu_contender(args.python, args.fake, args.kxpu_log_level, base)]
        if plugin_dir is not None and binary is not None:
            contenders.append(nvidia_contender(binary, plugin_dir, args.pass_device_specs, args.fake))
            doc["nvidia_version"] = _run([str(binary), "--version"], timeout=10).splitlines()[:1]
        else:
            plugin_dir = base / "dp"
        if args.python_floor and expected:
            contenders.append(floor_contender(args.python, expected))
        doc["plugin_dir"] = str(plugin_dir)
        doc["contenders"] = {c.name: {"argv": c.argv} for c in contenders}
        if reason:
            doc["contenders"]["nvidia"] = {"skipped": reason}
            print(f"nvidia: skipped: {reason}", file=sys.stderr)
        results.save()
        for n in range(args.warmup + args.runs):
            order = contenders if n % 2 == 0 else contenders[::-1]
            for contender in list(order):
                elapsed = time.monotonic() - began
                need = max(contender.durations, default=args.step_timeout) * 1.5 + 5
                if elapsed + need > args.deadline:
                    doc["stopped"] = f"deadline: {elapsed:.0f} s of {args.deadline:.0f} s used before run {n}"
                    return
                start = time.monotonic()
                run = await one_run(contender, plugin_dir, base / f"{n}-{contender.name}", expected, args)
                contender.durations.append(time.monotonic() - start)
                run = {"run": n, "contender": contender.name, "warmup": n < args.warmup} | run
                doc["runs"].append(run)
                if len(contender.durations) == DROP_AFTER and all("error" in r for r in _of(doc, contender)):
                    doc["contenders"][contender.name]["dropped"] = f"its first {DROP_AFTER} runs failed"
                    contenders.remove(contender)  # the other one keeps the time left
                doc["summary"] = summarise(doc["runs"])
                doc["elapsed_s"] = round(time.monotonic() - began, 1)
                results.save()
                print(json.dumps({k: v for k, v in run.items() if k != "log_tail"}), file=sys.stderr)
        doc["complete"] = True
    finally:
        doc["summary"] = summarise(doc["runs"])
        doc["elapsed_s"] = round(time.monotonic() - began, 1)
        results.save()
        shutil.rmtree(base, ignore_errors=True)


async def _main(args: argparse.Namespace, results: Results) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop the contenders and keep the JSON, then exit
        loop.add_signal_handler(sig, task.cancel)
    try:
        await bench(args, results)
    except asyncio.CancelledError:
        results.doc["stopped"] = "interrupted (SIGTERM or SIGINT)"
        results.save()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSON results, rewritten after every run")
    parser.add_argument(
        "--nvidia-bin", type=Path, help=f"NVIDIA's nvidia-device-plugin (env {NVIDIA_BIN_ENV})"
    )
    parser.add_argument("--runs", type=int, default=9, help="counted runs of each contender, interleaved")
    parser.add_argument("--warmup", type=int, default=1, help="runs first that are not counted")
    parser.add_argument("--allocations", type=int, default=1000, help="timed Allocate calls per run")
    parser.add_argument("--allocate-gpus", type=int, default=1, help="GPUs in each Allocate request")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after listing before CPU and RSS")
    parser.add_argument("--step-timeout", type=float, default=30.0, help="seconds any one wait may take")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds for the whole benchmark")
    parser.add_argument(
        "--pass-device-specs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="both contenders also pass /dev/nvidia* in Allocate",
    )
    parser.add_argument(
        "--python-floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also a bare Python gRPC plugin listing the same GPUs (bench/bare_dp_registrar.py)",
    )
    parser.add_argument("--kxpu-log-level", default="info", help="kxpu's --log-level (info, as deployed)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs kxpu")
    parser.add_argument("--fake", metavar="PROFILE", help="kxpu over this fake NVML profile (no GPU)")
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        help="where the stand-in serves NVIDIA (tests; NVIDIA's plugin needs the default)",
    )
    args = parser.parse_args()
    results = Results(args.out)
    asyncio.run(_main(args, results))
    doc = results.doc
    print(f"\nkxpu vs NVIDIA's device plugin, {doc.get('machine', {})}\n")
    print(table(doc.get("summary", {})))
    for name, contender in doc.get("contenders", {}).items():
        for what in ("skipped", "dropped"):
            if what in contender:
                print(f"\n{name}: {what}: {contender[what]}")
    errors = [r for r in doc["runs"] if "error" in r]
    for run in errors:
        print(f"\nrun {run['run']} {run['contender']}: {run['error']}\n{run.get('log_tail', '')}")
    if doc.get("stopped"):
        print(f"\nstopped: {doc['stopped']}")
    return 0 if doc["complete"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())

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

``--backends`` measures every vendor backend instead, over its fake (the same interface calls as on the
vendor's library or sysfs, answered by Python): ``sample()``'s CPU per device per sample in this process
(``time.process_time`` over ``--samples`` samples, with ``--processes`` processes per device where the vendor
lists processes), and the daemon's RSS with telemetry on at 0.5 s, serving that backend over its fake.
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


# backend → (resource, config section, fake environment for the daemon)
DAEMONS: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "nvidia": ("nvidia.com/gpu", {"nvidia": {}}, {"KXPU_FAKE_NVML": "a100-8x"}),
    "amd": ("amd.com/gpu", {"amd": {}}, {"KXPU_FAKE_AMD": "mi300x-8x-cpx"}),
    "hygon": ("hygon.com/dcunum", {"hygon": {}}, {"KXPU_FAKE_AMD": "hygon-dcu-8x"}),
    "ascend": ("huawei.com/Ascend910", {"ascend": {}}, {"KXPU_FAKE_DCMI": "910b-8x"}),
    "gaudi": ("habana.ai/gaudi", {"gaudi": {}}, {"KXPU_FAKE_HLML": "gaudi2-8x"}),
    "neuron": ("aws.amazon.com/neuron", {"neuron": {}}, {"KXPU_FAKE_NEURON": "trn1-32xl"}),
    # with aws-neuronx-tools: neuron-monitor (the fake one, a child of the daemon) adds utilization and processes
    "neuron-monitor": (
        "aws.amazon.com/neuron",
        {"neuron": {"neuronMonitor": {"periodSeconds": 1}}},
        {"KXPU_FAKE_NEURON": "trn1-32xl-tools"},
    ),
    "cambricon": ("cambricon.com/mlu", {"cambricon": {}}, {"KXPU_FAKE_CAMBRICON": "mlu370-x8-4x"}),
}


def vendor_backends(processes: int) -> dict[str, tuple[Any, Any]]:
    """Each backend over its fake, ``processes`` processes on every device where its interface lists them;
    (backend, cleanup)."""
    from kxpu.backends.amd import AmdBackend, AmdConfig, HygonBackend, HygonConfig
    from kxpu.backends.ascend import AscendBackend, AscendConfig
    from kxpu.backends.ascend.dcmi import DcmiSource
    from kxpu.backends.cambricon import CambriconBackend, CambriconConfig
    from kxpu.backends.gaudi import GaudiBackend, GaudiConfig
    from kxpu.backends.gaudi.hlml import HlmlSource
    from kxpu.backends.host import Host
    from kxpu.backends.neuron import NeuronBackend, NeuronConfig
    from kxpu.backends.nvidia import NvidiaBackend, NvidiaConfig
    from kxpu.backends.nvidia.nvml import NvmlSource
    from kxpu.testing.fake_amd import FakeAmd
    from kxpu.testing.fake_cambricon import FakeCambricon
    from kxpu.testing.fake_dcmi import FakeDcmi
    from kxpu.testing.fake_hlml import FakeHlml
    from kxpu.testing.fake_neuron import FakeNeuron
    from kxpu.testing.fake_nvml import FakeNvml, FakeProcess

    out: dict[str, tuple[Any, Any]] = {}
    nvml = FakeNvml("a100-8x")
    for gpu in range(len(nvml.gpus)):
        nvml.set_processes(gpu, [FakeProcess(200000 + gpu * 100 + n, 1000) for n in range(processes)])
    nvidia = NvidiaBackend(NvidiaConfig(), NvmlSource(nvml, nvml.host_root, fake=True), environ={})
    out["nvidia"] = (nvidia, nvidia.close)
    for name, profile, cls, config in (
        ("amd", "mi300x-8x-cpx", AmdBackend, AmdConfig),
        ("hygon", "hygon-dcu-8x", HygonBackend, HygonConfig),
    ):
        fake = FakeAmd(profile)
        for pid in range(processes):
            fake.run_process(300000 + pid, {(g, 0): 1 << 30 for g in range(fake.profile.count)})
        out[name] = (cls(config.model_validate({"hostRoot": str(fake.root)})), fake.cleanup)
    dcmi = FakeDcmi("910b-8x")
    for phy in range(8):
        dcmi.set_usage(phy, processes=[(400000 + phy * 100 + n, 1 << 30) for n in range(processes)])
    ascend_config = AscendConfig.model_validate({"hostRoot": str(dcmi.root)})
    ascend_config.resource_name("huawei.com/Ascend910")
    out["ascend"] = (AscendBackend(ascend_config, DcmiSource(dcmi.root, dcmi)), dcmi.cleanup)
    hlml = FakeHlml("gaudi2-8x")
    gaudi = GaudiBackend(
        GaudiConfig.model_validate({"hostRoot": str(hlml.root)}),
        HlmlSource(hlml, hlml.types, hlml.root, fake=True),
    )
    out["gaudi"] = (gaudi, lambda: _both(gaudi.close, hlml.cleanup))
    neuron = FakeNeuron("trn1-32xl")
    out["neuron"] = (
        NeuronBackend(NeuronConfig.model_validate({"hostRoot": str(neuron.root)})),
        neuron.cleanup,
    )
    tools = FakeNeuron("trn1-32xl-tools")  # one application per NeuronCore (two per device)
    per_device = tools.profile.cores_per_device
    for core in range(tools.profile.count * per_device):
        tools.run_app(600000 + core, {core: (50.0, {"tensors": 1 << 30})})
    monitored = NeuronBackend(
        NeuronConfig.model_validate({"hostRoot": str(tools.root), "neuronMonitor": {"periodSeconds": 1}})
    )
    out["neuron-monitor"] = (monitored, lambda: _both(monitored.close, tools.cleanup))
    mlu = FakeCambricon("mlu370-x8-4x")
    for index in range(4):
        mlu.set_usage(index, processes=[(500000 + index * 100 + n, 1 << 20) for n in range(processes)])
    cambricon = CambriconBackend(
        CambriconConfig.model_validate({"hostRoot": str(mlu.root)}), library=mlu.library, host=Host(mlu.root)
    )
    out["cambricon"] = (cambricon, lambda: _both(cambricon.close, mlu.cleanup))
    return out


def _both(first: Any, second: Any) -> None:
    first()
    second()


def sample_costs(processes: int, samples: int, only: set[str] | None = None) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for name, (backend, cleanup) in vendor_backends(processes).items():
        if only and name not in only:
            cleanup()
            continue
        try:
            backend.discover()
            first = backend.sample()  # warm: the first sample may open files, build caches
            deadline = time.monotonic() + 30
            while name == "neuron-monitor" and not first.processes and time.monotonic() < deadline:
                time.sleep(0.05)  # its first report (the child's start)
                first = backend.sample()
            devices = max(1, len(first.devices))
            started = time.process_time()
            for _ in range(samples):
                backend.sample()
            cpu = time.process_time() - started
            figures[name] = {
                "devices": devices,
                "processes": len(first.processes),
                "cpu_ms_per_device_per_sample": 1000 * cpu / samples / devices,
            }
        finally:
            cleanup()
    return figures


async def daemon_rss(name: str, seconds: float, telemetry: bool = True) -> float:
    resource, section, env = DAEMONS[name]
    base = Path(tempfile.mkdtemp(prefix="kx-bench-", dir="/tmp"))
    try:
        config = base / "config.json"
        doc = {
            "version": "v1",
            "devicePluginDir": str(base / "dp"),
            "resources": [{"name": resource, **section}],
            "podResourcesSocket": str(base / "pr.sock"),
            # not the host's: a node's prepared DRA claims would stop the daemon
            "kubeletPluginsDir": str(base / "plugins"),
            "pluginsRegistryDir": str(base / "registry"),
            "telemetry": {"enabled": telemetry, "intervalSeconds": 0.5},
        }
        config.write_text(json.dumps(doc))
        daemon = DaemonProcess(config, base / "daemon.log", extra_args=["--log-level", "error"], env=env)
        await daemon.start()
        try:
            await asyncio.sleep(seconds)  # a number of ticks: what a long-running daemon holds
            return rss_mb(daemon.pid)
        finally:
            await daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def backends_main(args: argparse.Namespace) -> int:
    only = set(args.only.split(",")) if args.only else None
    costs = sample_costs(args.processes, args.samples, only)
    results: dict[str, float] = {}
    for name, figures in costs.items():
        what = f"{name} ({figures['devices']:.0f} devices, {figures['processes']:.0f} processes)"
        results[f"{what}: CPU ms per device per sample"] = figures["cpu_ms_per_device_per_sample"]
        results[f"{name}: daemon RSS MB, telemetry on"] = asyncio.run(daemon_rss(name, args.rss_seconds))
        # what telemetry itself adds: the same daemon with it off
        results[f"{name}: daemon RSS MB, telemetry off"] = asyncio.run(
            daemon_rss(name, args.rss_seconds, telemetry=False)
        )
    targets = {k: 1.0 for k in results if "CPU ms" in k} | {k: 60.0 for k in results if "RSS" in k}
    report(
        f"kxpu telemetry per backend over its fake, {args.processes} processes per device",
        results,
        targets,
        args.json,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--processes", type=int, default=4, help="processes (pods) per GPU")
    parser.add_argument("--interval", type=float, default=10.0, help="the default sampling interval")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long CPU is measured per run")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--backends", action="store_true", help="every vendor backend over its fake instead")
    parser.add_argument("--samples", type=int, default=200, help="--backends: samples timed per backend")
    parser.add_argument(
        "--rss-seconds", type=float, default=5.0, help="--backends: daemon run before its RSS"
    )
    parser.add_argument("--only", help="--backends: these backends only (comma-separated names)")
    args = parser.parse_args()
    if args.backends:
        return backends_main(args)
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

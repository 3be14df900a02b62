"""Telemetry and MPS through the real daemon process: the nvidia backend over the fake NVML with MPS replicas
run by the stand-in ``nvidia-cuda-mps-control``, the kubelet stand-in (registration, Allocate, PodResources,
the device checkpoint), and processes tied to pods through a fake host's /proc/<pid>/cgroup."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.nvidia.mps import PINNED_MEMORY_ENV, PIPE_ENV
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_mps import commands, install, read_record
from kxpu.testing.fake_nvml import FakeNvml, send_control
from kxpu.testing.process import DaemonProcess
from tests.waiting import wait_until

GPU = "nvidia.com/gpu"
UUIDS = [g.uuid for g in FakeNvml("a100-8x").gpus]
MIB = 1024 * 1024
CONTAINER_ID = "a" * 64


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the first series of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture
def rig(workdir: Path, plugin_dir: Path) -> dict[str, Path]:
    driver = workdir / "driver"
    install(driver)
    host = workdir / "host"
    (host / "proc").mkdir(parents=True)
    return {
        "driver": driver,
        "mps": workdir / "mps",
        "host": host,
        "podres": workdir / "pr" / "kubelet.sock",
        "control": workdir / "nvml.sock",
    }


def nvidia(rig: dict[str, Path], **extra: Any) -> dict[str, Any]:
    section = {
        "deviceIDStrategy": "index",
        "nvidiaDriverRoot": str(rig["driver"]),
        "mpsRoot": str(rig["mps"]),
        "mps": {"shmDir": "/dev/shm", "checkIntervalSeconds": 0.2},
        "sharing": {"mps": {"resources": [{"replicas": 2}]}},
        **extra,
    }
    return {"name": GPU, "nvidia": section}


def telemetry(rig: dict[str, Path]) -> dict[str, Any]:
    return {
        "enabled": True,
        "intervalSeconds": 0.2,
        "hostRoot": str(rig["host"]),
    }


def in_pod(rig: dict[str, Path], pid: int, pod_uid: str) -> None:
    """A process of the pod in the fake host's /proc, as the kubelet's cgroupfs driver names it (v1)."""
    proc = rig["host"] / "proc" / str(pid)
    proc.mkdir(parents=True, exist_ok=True)
    path = f"/kubepods/besteffort/pod{pod_uid}/{CONTAINER_ID}"
    (proc / "cgroup").write_text(f"12:pids:{path}\n4:memory:{path}\n1:name=systemd:{path}\n")


def kill_stand_ins(mps_root: Path) -> None:
    for pid_file in mps_root.glob("*/pipe/nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_mps_replicas_reach_containers_and_telemetry_ties_processes_to_pods(
    plugin_dir: Path, rig: dict[str, Path], write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=rig["podres"])
    await kubelet.start()
    try:
        config = write_config([nvidia(rig)], telemetry=telemetry(rig), podResourcesSocket=str(rig["podres"]))
        env = {"KXPU_FAKE_NVML": "a100-8x", "KXPU_FAKE_NVML_CONTROL": str(rig["control"])}
        daemon: DaemonProcess = await daemons(config, env=env)
        view = await kubelet.wait_registered(GPU, timeout=30)
        # Unhealthy (mps-not-running) until the daemons run, then all healthy.
        await kubelet.wait_devices(GPU, lambda d: len(d) == 16 and set(d.values()) == {"Healthy"}, timeout=30)

        # The daemons: one per GPU, told NVIDIA's equal shares (80 GiB / 2, 100 / 2) for GPU 0 only.
        log0 = rig["mps"] / UUIDS[0] / "log"
        start = next(r for r in read_record(log0) if r["event"] == "start")
        assert start["env"]["CUDA_VISIBLE_DEVICES"] == UUIDS[0]
        assert start["env"][PIPE_ENV] == str(rig["mps"] / UUIDS[0] / "pipe")
        assert "set_default_device_pinned_mem_limit 0 40960M" in commands(log0)
        assert "set_default_active_thread_percentage 50" in commands(log0)

        response = await kubelet.allocate(GPU, ["0::1"], pod=("ml", "train"))
        answer = response.container_responses[0]
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "0"
        assert answer.envs[PIPE_ENV] == f"/mps/{UUIDS[0]}/pipe"
        mounts = {m.container_path: m.host_path for m in answer.mounts}
        assert mounts == {
            f"/mps/{UUIDS[0]}/pipe": str(rig["mps"] / UUIDS[0] / "pipe"),
            "/dev/shm": "/dev/shm",
        }
        assert json.loads(answer.annotations["kxpu.io/grants"]) == [
            {"uuid": UUIDS[0], "memoryMiB": 40960, "cores": 50}
        ]
        with pytest.raises(Exception, match="maximum request size for shared resources is 1"):
            await kubelet.allocate(GPU, ["1::0", "2::0"])

        # A process of the pod's container and one of no pod, on GPU 0, as NVML lists them.
        uid = kubelet.pod_uids[("ml", "train")]
        in_pod(rig, 4242, uid)
        processes = [
            {"pid": 4242, "memoryMiB": 1000, "mps": True, "smUtil": 30},
            {"pid": 999, "memoryMiB": 64},
        ]
        send_control(rig["control"], op="processes", gpu=0, processes=processes)
        send_control(rig["control"], op="telemetry", gpu=0, utilization=[37, 12], powerMw=250000)
        ours = {"resource": GPU, "device": UUIDS[0], "namespace": "ml", "pod": "train", "container": "c0"}
        text = ""

        async def scraped(name: str, value: float, **labels: str) -> None:
            nonlocal text

            async def check() -> bool:
                nonlocal text
                text = (await daemon.http_get("/metrics"))[1]
                return metric(text, name, **labels) == value

            end = asyncio.get_running_loop().time() + 15.0
            while not await check():
                if asyncio.get_running_loop().time() > end:
                    raise AssertionError(f"{name}{labels} never became {value}:\n{text[-3000:]}")
                await asyncio.sleep(0.05)

        await scraped("kxpu_container_memory_used_bytes", 1000 * MIB, **ours)
        assert metric(text, "kxpu_container_memory_granted_bytes", **ours) == 40960 * MIB
        assert metric(text, "kxpu_container_compute_granted_ratio", **ours) == 0.5
        assert metric(text, "kxpu_container_compute_utilization_ratio", **ours) == 0.3
        assert metric(text, "kxpu_container_processes", **ours) == 1
        assert metric(text, "kxpu_container_memory_used_bytes", device=UUIDS[0], pod="") == 64 * MIB
        assert metric(text, "kxpu_device_compute_utilization_ratio", device=UUIDS[0]) == 0.37
        assert metric(text, "kxpu_device_memory_bandwidth_utilization_ratio", device=UUIDS[0]) == 0.12
        assert metric(text, "kxpu_device_power_watts", device=UUIDS[0]) == 250.0
        assert metric(text, "kxpu_device_memory_used_bytes", device=UUIDS[0]) == 1064 * MIB
        assert metric(text, "kxpu_device_processes", device=UUIDS[0]) == 2
        assert metric(text, "kxpu_device_processes", device=UUIDS[3]) == 0
        assert metric(text, "kxpu_container_over_grant", kind="memory", **ours) == 0

        # Above its 40 GiB: flagged once, with a metric and a log line; /status and `kxpu status` show it.
        processes[0]["memoryMiB"] = 50000
        send_control(rig["control"], op="processes", gpu=0, processes=processes)
        await scraped("kxpu_container_over_grant", 1, kind="memory", **ours)
        assert metric(text, "kxpu_container_grant_exceeded_total", kind="memory", **ours) == 1
        status = json.loads((await daemon.http_get("/status"))[1])["telemetry"]
        mine = next(c for c in status["containers"] if c["pod"] == "train")
        assert mine["overGrant"] and mine["pids"] == [4242] and mine["memoryUsedBytes"] == 50000 * MIB
        await wait_until(
            lambda: "container exceeds its grant" in daemon.log_text(), 5, "the excursion logged"
        )
        table = (
            await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable,
                    "-m",
                    "kxpu",
                    "status",
                    "--pod-resources-socket",
                    str(rig["podres"]),
                    "--daemon",
                    f"http://127.0.0.1:{daemon.http_port}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
        ).stdout
        row = next(line for line in table.splitlines() if line.split()[1:2] == ["0::1"])
        assert "37%" in row and "ml/train/c0 (48.8 of 40.0 GiB, 30%, OVER GRANT)" in row, table

        # The MPS daemon of GPU 0 dies: its two replicas turn unhealthy, then healthy once it runs again.
        pid = int((rig["mps"] / UUIDS[0] / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        await kubelet.wait_devices(GPU, lambda d: d["0::0"] == d["0::1"] == "Unhealthy", timeout=10)
        assert sum(h == "Healthy" for h in view.devices.values()) == 14
        await kubelet.wait_devices(GPU, lambda d: set(d.values()) == {"Healthy"}, timeout=10)
        assert len([r for r in read_record(log0) if r["event"] == "start"]) == 2
        assert "mps-daemon-down" in daemon.log_text() or "MPS control daemon died" in daemon.log_text()

        # A clean stop quits every daemon and gives the GPUs their compute mode back.
        assert await daemon.stop() == 0
        for uuid in UUIDS:
            assert not (rig["mps"] / uuid / "pipe" / "nvidia-cuda-mps-control.pid").exists()
        assert commands(log0)[-1] == "quit"
    finally:
        kill_stand_ins(rig["mps"])
        await kubelet.stop()


async def test_mps_unavailable_is_a_clear_error_or_the_chosen_fallback(
    kubelet: KubeletStandIn,
    rig: dict[str, Path],
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    workdir: Path,
) -> None:
    no_binary = nvidia(rig, nvidiaDriverRoot=str(workdir / "nodriver"))
    daemon: DaemonProcess = await daemons(write_config([no_binary]), env={"KXPU_FAKE_NVML": "a100-8x"})
    await wait_until(lambda: "MPS unavailable" in daemon.log_text(), 20, "the MPS error")
    assert f"{workdir / 'nodriver'}/usr/bin/nvidia-cuda-mps-control not found" in daemon.log_text()
    assert "mps.onUnavailable: time-slicing" in daemon.log_text()
    # Nothing served without the isolation the config asked for (at most unhealthy devices, briefly).
    assert all(
        h != "Healthy" for e in getattr(kubelet.plugins.get(GPU), "history", []) for h in e.devices.values()
    )
    await daemon.stop()

    fallback = nvidia(rig, nvidiaDriverRoot=str(workdir / "nodriver"))
    fallback["nvidia"]["mps"]["onUnavailable"] = "time-slicing"
    daemon = await daemons(write_config([fallback], name="fallback.yaml"), env={"KXPU_FAKE_NVML": "a100-8x"})
    await kubelet.wait_devices(GPU, lambda d: len(d) == 16 and set(d.values()) == {"Healthy"}, timeout=30)
    answer = (await kubelet.allocate(GPU, ["3::0"])).container_responses[0]
    assert PIPE_ENV not in answer.envs and PINNED_MEMORY_ENV not in answer.envs
    assert "containers are NOT isolated" in daemon.log_text()


async def test_mig_gpu_with_mps_is_refused(
    kubelet: KubeletStandIn,
    rig: dict[str, Path],
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
) -> None:
    section = nvidia(rig, migStrategy="single")
    daemon: DaemonProcess = await daemons(write_config([section]), env={"KXPU_FAKE_NVML": "h100-mig-single"})
    await wait_until(
        lambda: "is in MIG mode: MPS cannot share it" in daemon.log_text(), 20, "the MIG refusal"
    )
    assert GPU not in kubelet.plugins

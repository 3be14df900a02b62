"""MPS and telemetry on the real cluster: the `nvidia` backend over the fake NVML (8x A100) with
``sharing.mps`` replicas, the MPS control daemons being the stand-in ``nvidia-cuda-mps-control``
(kxpu starts one per GPU as it would the driver's). A pod gets a replica: containerd mounts the
GPU's pipe directory and the MPS /dev/shm and the container sees the daemon's socket there; the
kubelet checkpoints kxpu's grant with the container; a process of the container, listed by the
fake NVML, is tied to the pod through its real cgroup and the kubelet's PodResources API, exported
on /metrics, and flagged with a Warning event when it goes above its grant; a killed MPS daemon
takes its GPU's two replicas out of allocatable until kxpu has restarted it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kube
from e2e.conftest import E2E
from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.testing.fake_mps import FAIL_FILE_ENV, commands, install
from kxpu.testing.fake_nvml import FAKE_NVML_CONTROL_ENV, FAKE_NVML_ENV, FakeNvml, send_control

GPU = "nvidia.com/gpu"
PROFILE = "a100-8x"
UUIDS = [g.uuid for g in FakeNvml(PROFILE).gpus]
METRICS = "http://127.0.0.1:5978/metrics"  # kxpu plugin's default --http-address
MIB = 2**20


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, e2e: E2E) -> Iterator[dict[str, Path]]:
    """The daemons this test starts see the fake GPUs (with a fault socket) and may post events. The MPS
    root is short, as on a node (/run/kxpu/mps): the daemons' sockets live there."""
    control = tmp_path / "nvml-control.sock"
    monkeypatch.setenv(FAKE_NVML_ENV, PROFILE)
    monkeypatch.setenv(FAKE_NVML_CONTROL_ENV, str(control))
    monkeypatch.setenv("KUBECONFIG", str(e2e.cluster.kubeconfig))
    driver = tmp_path / "driver"
    install(driver)
    mps = Path(tempfile.mkdtemp(prefix="kx-mps-", dir="/run"))
    fail = tmp_path / "mps-fail"  # while it exists, the stand-in refuses to start (a restart keeps failing)
    monkeypatch.setenv(FAIL_FILE_ENV, str(fail))
    yield {"control": control, "driver": driver, "mps": mps, "fail": fail}
    for daemon in e2e.daemons:  # first kxpu, or it would start the daemons again
        with contextlib.suppress(Exception):
            daemon.stop()
    for path in mps.glob("*/pipe/nvidia-cuda-mps-control.pid"):  # nothing of ours outlives the test
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(path.read_text()), signal.SIGKILL)
    shutil.rmtree(mps, ignore_errors=True)


def pid_file(mps: Path, uuid: str) -> Path:
    return mps / uuid / "pipe" / "nvidia-cuda-mps-control.pid"


def scrape() -> str:
    with urllib.request.urlopen(METRICS, timeout=5) as response:
        text: str = response.read().decode()
    return text


def value(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return None


def host_pids_of(pod_uid: str) -> list[int]:
    """The pod's processes on this host, from their cgroups (as kxpu finds them)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if f"pod{pod_uid}" in (proc / "cgroup").read_text():
                    pids.append(int(proc.name))
    return sorted(pids)


def test_mps_replicas_pods_and_telemetry(e2e: E2E, rig: dict[str, Path]) -> None:
    resource = {
        "name": GPU,
        "nvidia": {
            "deviceIDStrategy": "index",
            "nvidiaDriverRoot": str(rig["driver"]),
            "mpsRoot": str(rig["mps"]),
            "mps": {"shmDir": "/dev/shm", "checkIntervalSeconds": 0.5},
            "sharing": {"mps": {"resources": [{"replicas": 2}]}},
        },
    }
    daemon = e2e.kxpu([resource], start=False)
    doc = json.loads(daemon.config.read_text())
    doc["telemetry"] = {"enabled": True, "intervalSeconds": 0.5, "events": True}
    daemon.config.write_text(json.dumps(doc, indent=2))
    daemon.start()
    kube.wait_resource(e2e.cluster, GPU, allocatable=16, capacity=16, timeout=90)
    script = (
        'echo "PIPE=$CUDA_MPS_PIPE_DIRECTORY"\n'
        'ls -l "$CUDA_MPS_PIPE_DIRECTORY"\n'
        'echo "PID=$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid")"\n'
        "grep -c ' /dev/shm ' /proc/mounts\n"
        "echo end"
    )
    pod = e2e.pod("replica", script, {GPU: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end")
    (replica,) = kube.devices_by_pod(e2e.cluster, GPU, [pod.name])[pod.name]
    index = int(replica.split("::")[0])
    uuid = UUIDS[index]
    assert f"PIPE=/mps/{uuid}/pipe" in log, log
    # The container sees the GPU's daemon: its control socket and PID file, through the mount.
    assert re.search(r"^s\S+ .* control$", log, re.M), log
    assert f"PID={pid_file(rig['mps'], uuid).read_text().strip()}" in log, log
    assert "set_default_device_pinned_mem_limit 0 40960M" in commands(rig["mps"] / uuid / "log")

    # The kubelet kept the grant kxpu answered with, beside the container.
    uid = kube.get_pod(e2e.cluster, pod.name)["metadata"]["uid"]
    (entry,) = [e for e in kube.read_checkpoint() if e.pod_uid == uid and e.resource == GPU]
    answer = pb.ContainerAllocateResponse.FromString(entry.alloc_response)
    assert json.loads(answer.annotations["kxpu.io/grants"]) == [
        {"uuid": uuid, "memoryMiB": 40960, "cores": 50}
    ]

    # A process of the container as NVML would list it (an MPS client using 50,000 MiB: over 40 GiB).
    pids = host_pids_of(uid)
    assert pids, f"no process of pod {uid} found in /proc"
    processes = [{"pid": pids[0], "memoryMiB": 50000, "mps": True, "smUtil": 20}]
    send_control(rig["control"], op="processes", gpu=index, processes=processes)
    ours = {"device": uuid, "namespace": "default", "pod": pod.name, "container": "main"}
    text = kube.wait_until(
        "the container's memory on /metrics",
        lambda: (
            t if value(t := scrape(), "kxpu_container_memory_used_bytes", **ours) == 50000 * MIB else None
        ),
        timeout=30,
    )
    assert value(text, "kxpu_container_memory_granted_bytes", **ours) == 40960 * MIB
    assert value(text, "kxpu_container_over_grant", kind="memory", **ours) == 1
    assert value(text, "kxpu_device_processes", device=uuid) == 1
    event = kube.wait_until(
        "a KxpuGrantExceeded event on the pod",
        lambda: next(
            (e for e in kube.events_for(e2e.cluster, pod.name) if e.get("reason") == "KxpuGrantExceeded"),
            None,
        ),
        timeout=30,
    )
    assert event["type"] == "Warning" and "granted 40.00 GiB" in event["message"], event

    # The GPU's MPS daemon dies and cannot start for a while: its two replicas leave allocatable (the
    # kubelet updates the node every 10 s) until kxpu has started it again.
    rig["fail"].write_text("start")
    os.kill(int(pid_file(rig["mps"], uuid).read_text()), signal.SIGKILL)
    kube.wait_resource(e2e.cluster, GPU, allocatable=14, capacity=16, timeout=60)
    rig["fail"].unlink()
    kube.wait_resource(e2e.cluster, GPU, allocatable=16, capacity=16, timeout=90)
    assert kube.get_pod(e2e.cluster, pod.name)["status"]["phase"] == "Running"

    # A clean stop quits every daemon.
    assert daemon.stop() == 0
    assert not any(pid_file(rig["mps"], u).exists() for u in UUIDS)

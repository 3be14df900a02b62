"""`make demo` as root: kxpu on a real single-node Kubernetes (the e2e cluster), step by step.

The real kubelet registers kxpu's simulated NPUs, kube-scheduler places a pod asking for two,
containerd starts it with what kxpu's Allocate returned, a health flip lowers the node's
allocatable, an oversized pod stays Pending, and `kxpu status` shows who holds what. The
cluster is reused if one is running, else brought up and torn down at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from e2e import kube
from e2e.cluster import REPO, Cluster, exclusive
from e2e.configs import NPU, simulated

KXPU = REPO / ".venv" / "bin" / "kxpu"
HTTP = "127.0.0.1:9411"


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def show_node(cluster: Cluster) -> None:
    capacity, allocatable = kube.node_resource(cluster, NPU)
    print(f"   node {NPU}: capacity={capacity} allocatable={allocatable}")


def demo(cluster: Cluster, work: Path) -> None:
    state = work / "npu-state.json"
    config = work / "kxpu.yaml"
    config.write_text(json.dumps({"version": "v1", "resources": [simulated(state_file=state)]}, indent=2))
    step("kxpu plugin starts on the host and registers with the real kubelet")
    print(config.read_text())
    log = (work / "kxpu.log").open("ab")
    daemon = subprocess.Popen(
        [str(KXPU), "plugin", "--config", str(config), "--http-address", HTTP, "--http-auth", "none"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        kube.wait_resource(cluster, NPU, allocatable=4, capacity=4)
        show_node(cluster)

        step("a pod asks for 2 NPUs: kube-scheduler places it, the container sees kxpu's env")
        pod = kube.PodSpec(
            "kxpu-demo", 'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"\necho done', {NPU: 2}
        )
        kube.create_pod(cluster, pod)
        kube.wait_pod_phase(cluster, pod.name, "Running")
        print("   " + kube.wait_pod_log(cluster, pod.name, "done").replace("\n", "\n   ").rstrip())

        step("kxpu status: who holds which device (kubelet PodResources + the daemon)")
        status = subprocess.run(
            [str(KXPU), "status", "--daemon", f"http://{HTTP}"], capture_output=True, text=True, check=False
        )
        print("   " + status.stdout.replace("\n", "\n   ").rstrip())

        step("health flip: sim-npu-3 turns Unhealthy; the node's allocatable follows")
        state.write_text(json.dumps({"sim-npu-3": "Unhealthy"}))
        kube.wait_resource(cluster, NPU, allocatable=3, capacity=4)
        show_node(cluster)

        step("a pod asking for 4 stays Pending: only 3 are allocatable")
        big = kube.PodSpec("kxpu-demo-big", "echo never", {NPU: 4})
        kube.create_pod(cluster, big)
        event = kube.wait_until(
            "FailedScheduling",
            lambda: next(
                (e for e in kube.events_for(cluster, big.name) if e["reason"] == "FailedScheduling"), None
            ),
        )
        print(f"   {event['reason']}: {event['message']}")
    finally:
        step("clean up: pods deleted, kxpu stopped with SIGTERM")
        for name in ("kxpu-demo", "kxpu-demo-big"):
            cluster.kubectl("delete", "pod", name, "--ignore-not-found", "--wait=true", check=False)
        daemon.send_signal(signal.SIGTERM)
        print(f"   kxpu exited with {daemon.wait(20)}")
        log.close()


def main() -> int:
    if os.geteuid() != 0:
        print(
            "the real-cluster demo needs root; run `make demo-standin` for the stand-in demo", file=sys.stderr
        )
        return 1
    cluster = Cluster.default()
    with exclusive(900, "make demo"), tempfile.TemporaryDirectory(prefix="kxpu-demo-") as tmp:
        reuse = cluster.state.exists() and all(cluster.running().values())
        if not reuse:
            step("bringing up the single-node cluster (kubelet, API server, scheduler, containerd)")
            cluster.up()
        try:
            demo(cluster, Path(tmp))
        finally:
            if not reuse:
                cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())

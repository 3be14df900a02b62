"""`make demo` as root: kxpu on a real single-node Kubernetes (the e2e cluster), step by step.

Both ways kxpu serves, from one daemon. Device plugin: the real kubelet registers kxpu's simulated NPUs,
kube-scheduler places a pod asking for two, containerd starts it with what kxpu's Allocate returned, a health
flip lowers the node's allocatable, an oversized pod stays Pending. DRA: the same daemon publishes
ResourceSlices with typed attributes, a claim picks a device by CEL on its model, and two claims share one
device by memory and compute (consumable capacity), each container seeing its limits. `kxpu status` shows who
holds what, both ways. The cluster is reused if one is running, else brought up and torn down at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import yaml

from e2e import kube
from e2e.cluster import NODE_NAME, REPO, TEST_IMAGE, Cluster, exclusive
from e2e.configs import NPU, simulated

KXPU = REPO / ".venv" / "bin" / "kxpu"
HTTP = "127.0.0.1:9411"
# DRA: whole devices picked by attributes, and a device shared by capacity (drivers dnpu/vnpu.example.com).
DNPU, VNPU = "example.com/dnpu", "example.com/vnpu"
DNPU_DRIVER, VNPU_DRIVER = "dnpu.example.com", "vnpu.example.com"
DRA_PODS = ("kxpu-demo-pro", "kxpu-demo-share-0", "kxpu-demo-share-1")
DRA_RESOURCES: list[dict[str, Any]] = [
    {
        "name": DNPU,
        "simulated": {
            "count": 2,
            "model": "sim-npu",
            "memoryMiB": 16384,
            "devices": {1: {"model": "sim-npu-pro", "memoryMiB": 65536}},
            "env": {"NPU_VISIBLE_DEVICES": "{ids}"},
        },
        "serve": "dra",
    },
    {
        "name": VNPU,
        "simulated": {
            "count": 1,
            "model": "sim-vnpu",
            "memoryMiB": 16384,
            "env": {"NPU_VISIBLE_DEVICES": "{ids}"},
        },
        "serve": "dra",
        "dra": {"shares": {"memoryStepMiB": 256}},
    },
]


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def show_node(cluster: Cluster) -> None:
    capacity, allocatable = kube.node_resource(cluster, NPU)
    print(f"   node {NPU}: capacity={capacity} allocatable={allocatable}")


def indent(text: str) -> str:
    return textwrap.indent(text.rstrip(), "   ")


def apply(cluster: Cluster, *objects: dict[str, Any]) -> None:
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )


def claim_template(name: str, request: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "npu", "exactly": request}]}}},
    }


def claim_pod(name: str, template: str) -> dict[str, Any]:
    script = 'env | grep -E "^(NPU_VISIBLE_DEVICES|CUDA_DEVICE)" | sort; echo done; sleep 3600'
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "npu", "resourceClaimTemplateName": template}],
            "containers": [
                {
                    "name": "main",
                    "image": TEST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script],
                    "resources": {"claims": [{"name": "npu"}]},
                }
            ],
        },
    }


def kxpu_status() -> str:
    status = subprocess.run(
        [str(KXPU), "status", "--daemon", f"http://{HTTP}"], capture_output=True, text=True, check=False
    )
    return status.stdout


def demo_dra(cluster: Cluster) -> None:
    """The same daemon's DRA side: slices, a claim chosen by CEL on an attribute, a device shared by capacity."""
    step("DRA: the same daemon publishes each device with typed attributes (ResourceSlices)")
    apply(
        cluster,
        *(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": driver},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
            }
            for driver in (DNPU_DRIVER, VNPU_DRIVER)
        ),
    )

    def published() -> list[dict[str, Any]] | None:
        items = cluster.kubectl_json("get", "resourceslices")["items"]
        devices = [
            d
            for s in items
            if s["spec"]["driver"] in (DNPU_DRIVER, VNPU_DRIVER)
            for d in s["spec"]["devices"]
        ]
        return devices if len(devices) == 3 else None

    for device in kube.wait_until("3 devices in ResourceSlices", published, 60):
        attrs = {k: next(iter(v.values())) for k, v in device.get("attributes", {}).items()}
        capacity = {k: v["value"] for k, v in device.get("capacity", {}).items()}
        shared = " shareable" if device.get("allowMultipleAllocations") else ""
        print(f"   {device['name']}: model={attrs.get('model')} capacity={capacity}{shared}")

    step("a claim chosen by CEL on a published attribute: the sim-npu-pro")
    selector = f'device.attributes["{DNPU_DRIVER}"].model == "sim-npu-pro"'
    print(f"   selectors: [{{cel: {{expression: '{selector}'}}}}]")
    apply(
        cluster,
        claim_template(
            "kxpu-demo-pro",
            {"deviceClassName": DNPU_DRIVER, "selectors": [{"cel": {"expression": selector}}]},
        ),
        claim_pod("kxpu-demo-pro", "kxpu-demo-pro"),
    )
    kube.wait_pod_phase(cluster, "kxpu-demo-pro", "Running")
    print(indent(kube.wait_pod_log(cluster, "kxpu-demo-pro", "done")))

    step(
        "a shared device: two claims of 6 GiB and 30 % land on the one 16 GiB sim-vnpu (consumable capacity)"
    )
    share = {"deviceClassName": VNPU_DRIVER, "capacity": {"requests": {"memory": "6Gi", "cores": "30"}}}
    apply(cluster, claim_template("kxpu-demo-share", share))
    apply(cluster, *(claim_pod(f"kxpu-demo-share-{i}", "kxpu-demo-share") for i in range(2)))
    for i in range(2):
        kube.wait_pod_phase(cluster, f"kxpu-demo-share-{i}", "Running")
        log = kube.wait_pod_log(cluster, f"kxpu-demo-share-{i}", "done")
        print(f"   kxpu-demo-share-{i}: " + " ".join(w for w in log.split() if w != "done"))
    print(indent(cluster.kubectl("get", "resourceclaims")))

    step("kxpu status: device-plugin pods and DRA claims, each device with its holders")
    print(indent(kxpu_status()))


def demo(cluster: Cluster, work: Path) -> None:
    state = work / "npu-state.json"
    config = work / "kxpu.yaml"
    resources = [simulated(state_file=state), *DRA_RESOURCES]
    config.write_text(yaml.safe_dump({"version": "v1", "resources": resources}, sort_keys=False))
    step("kxpu plugin starts on the host: a device-plugin resource and two DRA resources")
    print(config.read_text())
    log = (work / "kxpu.log").open("ab")
    # DRA publishes slices and reads claims through the API server, as the chart's DaemonSet does with its
    # node name and service account.
    env = {**os.environ, "NODE_NAME": NODE_NAME, "KUBECONFIG": str(cluster.kubeconfig)}
    daemon = subprocess.Popen(
        [str(KXPU), "plugin", "--config", str(config), "--http-address", HTTP, "--http-auth", "none"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
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
        print(indent(kxpu_status()))

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

        demo_dra(cluster)
    finally:
        step("clean up: pods and claims deleted, kxpu stopped with SIGTERM")
        for name in ("kxpu-demo", "kxpu-demo-big", *DRA_PODS):
            cluster.kubectl("delete", "pod", name, "--ignore-not-found", "--wait=true", check=False)
        cluster.kubectl(
            "delete",
            "resourceclaimtemplate",
            "kxpu-demo-pro",
            "kxpu-demo-share",
            "--ignore-not-found",
            check=False,
        )
        cluster.kubectl("delete", "deviceclass", DNPU_DRIVER, VNPU_DRIVER, "--ignore-not-found", check=False)
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
    with (
        exclusive(float(os.environ.get("KXPU_E2E_LOCK_WAIT", "900")), "make demo"),
        tempfile.TemporaryDirectory(prefix="kxpu-demo-") as tmp,
    ):
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

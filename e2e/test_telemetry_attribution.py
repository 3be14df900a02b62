"""Telemetry attributed on both paths on the real cluster: one daemon serves a resource through DRA (a whole
device and two consumable-capacity shares of another, each by its own claim) and one through the device plugin;
/metrics and ``kxpu status`` name each holder's pod, namespace, container and claim, from the real kubelet's
PodResources API and the claims' reservedFor (never the kubelet's dra_manager_state); after the pods are deleted
their labels go. A MIG partition made for a claim is held under its own UUID."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.conftest import E2E, kxpu_binary
from e2e.test_dra import DRIVER, npus
from e2e.test_mps import host_pids_of
from kxpu.testing.fake_nvml import FAKE_NVML_CONTROL_ENV, FAKE_NVML_ENV, query_control, send_control

FPGA = "example.com/fpga"
ADDRESS = "127.0.0.1:9471"  # not the default: no clash with another daemon's
MIB = 1024 * 1024
SCRIPT = "echo end-of-report"


def scrape() -> str:
    with urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5) as response:
        text: str = response.read().decode()
    return text


def series(text: str, name: str, **labels: str) -> list[dict[str, str]]:
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            have = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("} ")[0]))
            if all(have.get(k) == v for k, v in labels.items()):
                found.append({**have, "value": line.rsplit(" ", 1)[1]})
    return found


def node_status() -> dict[str, Any]:
    """`kxpu status` against a daemon serving /status unchecked (who may read it: e2e/test_http_auth.py)."""
    done = subprocess.run(
        [str(kxpu_binary()), "status", "-o", "json", "--daemon", f"http://{ADDRESS}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_dra_and_device_plugin_pods_carry_pod_container_and_claim(e2e: E2E, tmp_path: Path) -> None:
    npu_figures, fpga_figures = tmp_path / "npu.json", tmp_path / "fpga.json"
    dra.forget_driver(e2e, DRIVER)
    npu = {
        **npus(count=2, telemetryFile=str(npu_figures)),
        "dra": {"shares": {"memoryStepMiB": 256}},
    }
    fpga = {"name": FPGA, "simulated": {"count": 2, "model": "sim-fpga", "telemetryFile": str(fpga_figures)}}
    e2e.kxpu(
        [npu, fpga],
        env={"KXPU_HTTP_ADDRESS": ADDRESS, "KXPU_HTTP_AUTH": "none"},
        telemetry={"enabled": True, "intervalSeconds": 0.5},
    )
    kube.wait_until("kxpu's two DRA devices", lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == 2 or None)
    kube.wait_resource(e2e.cluster, FPGA, allocatable=2, capacity=2, timeout=60)
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    whole_template = dra.claim_template(e2e, "whole", [{"name": "npu", "exactly": dra.exactly(cls)}])
    body = dra.exactly(cls)
    body["capacity"] = {"requests": {"memory": "6Gi", "cores": "30"}}
    share_template = dra.claim_template(e2e, "share", [{"name": "npu", "exactly": body}])

    whole = dra.claim_pod(e2e, "whole", SCRIPT, whole_template)
    kube.wait_pod_phase(e2e.cluster, whole.name, "Running")  # first: the shares then pack on the other device
    shares = [dra.claim_pod(e2e, f"share-{i}", SCRIPT, share_template) for i in range(2)]
    plugin_pod = e2e.pod("plugin", SCRIPT, {FPGA: 1})
    pods = [whole, *shares, plugin_pod]
    for pod in pods:
        kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    claims = {p.name: dra.pod_claim(e2e.cluster, p.name) for p in (whole, *shares)}
    device_of = {name: dra.allocated_devices(c, DRIVER)[0] for name, c in claims.items()}
    assert device_of[shares[0].name] == device_of[shares[1].name] != device_of[whole.name], device_of
    (fpga_device,) = kube.devices_by_pod(e2e.cluster, FPGA, [plugin_pod.name])[plugin_pod.name]

    # Each pod's real processes, as the backend would list them on its device.
    pids = {p.name: host_pids_of(kube.get_pod(e2e.cluster, p.name)["metadata"]["uid"])[0] for p in pods}
    npu_doc: dict[str, Any] = {}
    for n, pod in enumerate((whole, *shares)):
        entry = npu_doc.setdefault(device_of[pod.name], {"processes": []})
        entry["processes"].append({"pid": pids[pod.name], "memoryMiB": 7000 if n == 1 else 1000})
    npu_figures.write_text(json.dumps(npu_doc))
    fpga_figures.write_text(
        json.dumps({fpga_device: {"processes": [{"pid": pids[plugin_pod.name], "memoryMiB": 10}]}})
    )

    def holders(text: str) -> set[tuple[str, str, str, str]] | None:
        found = {
            (h["namespace"], h["pod"], h["container"], h["claim"])
            for h in series(text, "kxpu_device_holder_info")
        }
        return found if {p.name for p in pods} <= {h[1] for h in found} else None

    def claim_ref(pod: kube.PodSpec) -> str:
        return f"default/{claims[pod.name]['metadata']['name']}"

    found = kube.wait_until("every pod on /metrics", lambda: holders(scrape()), timeout=60)
    assert found == {("default", p.name, "main", claim_ref(p) if p is not plugin_pod else "") for p in pods}

    def containers(text: str) -> dict[str, dict[str, str]] | None:
        by_pod = {c["pod"]: c for c in series(text, "kxpu_container_memory_used_bytes", namespace="default")}
        return by_pod if {p.name for p in pods} <= by_pod.keys() else None

    text = kube.wait_until(
        "every pod's processes on /metrics", lambda: t if containers(t := scrape()) else None
    )
    used = containers(text)
    assert used is not None
    for pod in (whole, *shares):
        assert used[pod.name]["claim"] == claim_ref(pod) and used[pod.name]["container"] == "main", used
    assert used[plugin_pod.name]["claim"] == "" and used[plugin_pod.name]["container"] == "main"
    # The share using 7000 MiB of its 6 GiB is over its grant; the other is not. With shares on, the "whole" claim
    # is a share too: it consumed the device's default, all of it (16 GiB, 100 cores).
    over = {c["pod"]: c["value"] for c in series(text, "kxpu_container_over_grant", kind="memory")}
    assert over == {shares[0].name: "1.0", shares[1].name: "0.0", whole.name: "0.0"}, over
    granted = series(text, "kxpu_container_memory_granted_bytes", pod=shares[0].name)
    assert float(granted[0]["value"]) == 6144 * MIB

    # kxpu status agrees: the same containers and claims on the same devices.
    doc = node_status()
    held = {(d["resource"], d["id"]): d["holders"] for d in doc["devices"]}
    assert held[(FPGA, fpga_device)] == [f"default/{plugin_pod.name}/main"], doc
    npu_holders = [h for (r, _), hs in held.items() if r != FPGA for h in hs]
    for pod in (whole, *shares):
        assert any(h.startswith(f"default/{pod.name}/main [claim {claim_ref(pod)}") for h in npu_holders), doc

    # The pods end: their labels go.
    kube.delete_pods(e2e.cluster, f"kxpu-e2e={e2e.label}")
    kube.wait_until(
        "no holder left on /metrics",
        lambda: not series(scrape(), "kxpu_device_holder_info") or None,
        timeout=90,
    )
    text = scrape()
    assert not series(text, "kxpu_container_memory_used_bytes", namespace="default")
    assert len(series(text, "kxpu_device_info")) == 4  # every device still reports


def test_a_mig_partition_made_for_a_claim_carries_its_pod_and_claim(e2e: E2E, tmp_path: Path) -> None:
    """A partition made at prepare (a MIG device over the fake NVML, dynamic MIG) is held under its own UUID by
    its claim's pod, with the claim cache off: the pod UID comes from a GET of the claim's reservedFor."""
    control = tmp_path / "nvml-control.sock"
    gpu_driver = "gpu.nvidia.com"
    dra.forget_driver(e2e, gpu_driver)
    e2e.kxpu(
        [
            {
                "name": "nvidia.com/gpu",
                "nvidia": {"migStrategy": "dynamic"},
                "serve": "dra",
                "dra": {"claimCache": False},
            }
        ],
        env={
            FAKE_NVML_ENV: "h100-mig-dynamic",
            FAKE_NVML_CONTROL_ENV: str(control),
            "KXPU_HTTP_ADDRESS": ADDRESS,
            "KXPU_HTTP_AUTH": "none",
        },
        telemetry={"enabled": True, "intervalSeconds": 0.5},
    )
    kube.wait_until(
        "the MIG placements", lambda: len(dra.pool_devices(e2e.cluster, gpu_driver)) == 51 or None, 60
    )
    attr = f'device.attributes["{gpu_driver}"]'
    cls = dra.device_class(e2e, "kxpu-mig", gpu_driver, f'{attr}.type == "mig"')
    template = dra.claim_template(
        e2e, "mig-1g", [{"name": "gpu", "exactly": dra.exactly(cls, 1, f'{attr}.migProfile == "1g.10gb"')}]
    )
    pod = dra.claim_pod(e2e, "mig", SCRIPT, template)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    claim = f"default/{dra.pod_claim(e2e.cluster, pod.name)['metadata']['name']}"
    (made,) = query_control(control, op="mig-state")
    mig_uuid = made["cis"][0]["uuid"]
    pid = host_pids_of(kube.get_pod(e2e.cluster, pod.name)["metadata"]["uid"])[0]
    processes = [{"pid": pid, "memoryMiB": 300, "gi": made["gi"], "ci": made["cis"][0]["ci"]}]
    send_control(control, op="processes", gpu=made["gpu"], processes=processes)

    def used() -> list[dict[str, str]] | None:
        return series(scrape(), "kxpu_container_memory_used_bytes", pod=pod.name) or None

    (row,) = kube.wait_until("the MIG pod's processes on /metrics", used, timeout=60)
    assert (row["device"], row["namespace"], row["container"], row["claim"]) == (
        mig_uuid,
        "default",
        "main",
        claim,
    ), row
    assert float(row["value"]) == 300 * MIB
    (holder,) = series(scrape(), "kxpu_device_holder_info", pod=pod.name)
    assert (holder["device"], holder["claim"]) == (mig_uuid, claim), holder
    doc = node_status()
    held = [h for d in doc["devices"] for h in d["holders"]]
    assert any(h.startswith(f"default/{pod.name}/main [claim {claim}") for h in held), doc

    # The pod ends: its processes go first (a GPU instance in use cannot be destroyed at unprepare).
    send_control(control, op="processes", gpu=made["gpu"], processes=[])
    kube.delete_pods(e2e.cluster, f"kxpu-e2e={e2e.label}")
    kube.wait_until(
        "no holder left on /metrics",
        lambda: not series(scrape(), "kxpu_device_holder_info", pod=pod.name) or None,
        timeout=90,
    )
    assert not series(scrape(), "kxpu_container_memory_used_bytes", pod=pod.name)

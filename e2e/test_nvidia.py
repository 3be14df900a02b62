"""The `nvidia` backend on the real cluster, over the fake NVML's 8x A100 profile (no GPU here):
the kubelet advertises the GPUs, a scheduled pod gets NVIDIA_VISIBLE_DEVICES naming the GPUs the
kubelet recorded for it, an injected Xid takes one GPU out of allocatable, and time-slicing
replicas multiply the count."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from e2e import kube
from e2e.conftest import E2E, kxpu_binary
from kxpu.testing.fake_nvml import FAKE_NVML_CONTROL_ENV, FAKE_NVML_ENV, send_control
from kxpu.testing.fakes import import_args

GPU = "nvidia.com/gpu"
PROFILE = "a100-8x"


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The daemons this test starts inherit the fake's profile and its fault-injection socket."""
    control = tmp_path / "nvml-control.sock"
    monkeypatch.setenv(FAKE_NVML_ENV, PROFILE)
    monkeypatch.setenv(FAKE_NVML_CONTROL_ENV, str(control))
    return control


def discovered_uuids(tmp: Path, resource: dict[str, Any]) -> list[str]:
    config = tmp / "probe.yaml"
    config.write_text(json.dumps({"version": "v1", "resources": [resource]}))
    out = subprocess.run(
        [str(kxpu_binary()), "devices", "--config", str(config), "-o", "json", *import_args(os.environ)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d["uuid"] for d in json.loads(out)[GPU]["devices"]]


def test_gpus_reach_pods_and_an_xid_takes_one_out(e2e: E2E, fake_nvml: Path, tmp_path: Path) -> None:
    resource: dict[str, Any] = {"name": GPU, "nvidia": {"deviceListStrategy": ["envvar"]}}
    uuids = discovered_uuids(tmp_path, resource)
    assert len(uuids) == 8 and all(u.startswith("GPU-") for u in uuids)
    e2e.kxpu([resource])
    kube.wait_resource(e2e.cluster, GPU, allocatable=8, capacity=8)

    pod = e2e.pod("two-gpus", 'echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"\necho end', {GPU: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end")
    match = re.search(r"^NVIDIA_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert match, log
    visible = set(match.group(1).split(","))
    assert len(visible) == 2 and visible <= set(uuids), log
    # What the container was told is what the kubelet recorded as the pod's devices.
    assert set(kube.devices_by_pod(e2e.cluster, GPU, [pod.name])[pod.name]) == visible

    free = next(u for u in uuids if u not in visible)
    send_control(fake_nvml, op="xid", gpu=uuids.index(free), xid=79)  # fell off the bus: critical
    kube.wait_resource(e2e.cluster, GPU, allocatable=7, capacity=8)
    assert kube.get_pod(e2e.cluster, pod.name)["status"]["phase"] == "Running"


def test_time_slicing_replicas(e2e: E2E, fake_nvml: Path) -> None:
    e2e.kxpu(
        [
            {
                "name": GPU,
                "nvidia": {"sharing": {"timeSlicing": {"resources": [{"replicas": 2, "devices": "all"}]}}},
            }
        ]
    )
    kube.wait_resource(e2e.cluster, GPU, allocatable=16, capacity=16)
    pod = e2e.pod("one-replica", 'echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"\necho end', {GPU: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end")
    granted = kube.devices_by_pod(e2e.cluster, GPU, [pod.name])[pod.name]
    assert len(granted) == 1 and "::" in granted[0], granted  # a replica ID, <uuid>::<n>
    assert f"NVIDIA_VISIBLE_DEVICES={granted[0].split('::')[0]}" in log, log  # replicas name their GPU

"""Device faults as device taints (KEP-5055) on the real 1.37 cluster, over the fake NVML's 8x A100 with kxpu's
health recovery on: a GPU that falls off the bus is tainted ``kxpu.io/device-lost`` with the effect ``dra.taints``
gives it. Under NoExecute the device taint eviction controller (kube-controller-manager) deletes the pod holding
it and the scheduler gives the device to no new claim; once the GPU answers again the taint is lifted and a new
claim gets it, unless an admin's DeviceTaintRule still holds it (kxpu never touches those). Under NoSchedule (an uncorrectable ECC error) the running pod stays and new claims avoid the GPU.
What is asserted is what Kubernetes reports: the slices, the pods' events and conditions, the claims' allocation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e import dra, kube
from e2e.cluster import NODE_NAME
from e2e.conftest import E2E
from kxpu.testing.fake_nvml import FAKE_NVML_CONTROL_ENV, FAKE_NVML_ENV, send_control

GPU = "nvidia.com/gpu"
DRIVER = "gpu.nvidia.com"
QUIET_S = 4  # kxpu's recovery: healthy again after this long without a fault
REPORT = 'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"\necho end-of-report'


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    control = tmp_path / "nvml-control.sock"
    monkeypatch.setenv(FAKE_NVML_ENV, "a100-8x")
    monkeypatch.setenv(FAKE_NVML_CONTROL_ENV, str(control))
    return control


def gpus(effects: dict[str, str], quiet_s: float) -> dict[str, Any]:
    return {
        "name": GPU,
        "nvidia": {
            "deviceIDStrategy": "uuid",
            "health": {"recovery": {"enabled": True, "quietPeriodSeconds": quiet_s}},
        },
        "serve": "dra",
        "dra": {"taints": effects},
    }


def by_name(e2e: E2E) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in dra.pool_devices(e2e.cluster, DRIVER)}


def uuid_of(device: dict[str, Any]) -> str:
    return str(device["attributes"]["uuid"]["string"])


def taints_of(e2e: E2E, name: str) -> list[tuple[str, str]]:
    return [(t["key"], t["effect"]) for t in by_name(e2e).get(name, {}).get("taints") or []]


def pod_or_none(e2e: E2E, name: str) -> dict[str, Any] | None:
    out = e2e.cluster.kubectl("get", "pod", name, "-n", "default", "--ignore-not-found", "-o", "json")
    return json.loads(out) if out.strip() else None


MAINTENANCE = "example.com/maintenance"


def maintenance_rule(e2e: E2E, device: str) -> str:
    """An admin's DeviceTaintRule (NoSchedule) on one of kxpu's devices."""
    name = f"{e2e.label[:40]}-maintenance"
    dra.apply(
        e2e,
        {
            "apiVersion": dra.API,
            "kind": "DeviceTaintRule",
            "metadata": {"name": name},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": NODE_NAME, "device": device},
                "taint": {"key": MAINTENANCE, "value": "planned", "effect": "NoSchedule"},
            },
        },
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl("delete", "devicetaintrule", name, "--ignore-not-found", check=False)
    )
    return name


def failed_scheduling(e2e: E2E, pod: str) -> str | None:
    for event in kube.events_for(e2e.cluster, pod):
        if event.get("reason") == "FailedScheduling":
            return str(event.get("message"))
    return None


def start(e2e: E2E, effects: dict[str, str], quiet_s: float = QUIET_S) -> tuple[str, str]:
    dra.forget_driver(e2e, DRIVER)
    e2e.kxpu([gpus(effects, quiet_s)])
    kube.wait_until("8 GPUs in the pool", lambda: len(by_name(e2e)) == 8 or None, 60)
    cls = dra.device_class(e2e, "kxpu-gpu", DRIVER)
    return cls, dra.claim_template(e2e, "gpu", [{"name": "gpu", "exactly": dra.exactly(cls, 1)}])


def running_on(e2e: E2E, name: str, template: str) -> tuple[kube.PodSpec, str]:
    """A pod with one GPU claim, running; and the DRA device name it got."""
    pod = dra.claim_pod(e2e, name, REPORT, template)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    (device,) = dra.allocated_devices(dra.pod_claim(e2e.cluster, pod.name), DRIVER)
    return pod, device


def test_a_lost_gpu_under_noexecute_evicts_its_pod_and_comes_back_after_recovery(
    e2e: E2E, fake_nvml: Path
) -> None:
    """Before (one NoSchedule taint for every fault): the pod on the lost GPU ran on, never evicted."""
    cls, template = start(e2e, {"deviceLost": "NoExecute"})
    victim, lost = running_on(e2e, "victim", template)
    index = int(by_name(e2e)[lost]["attributes"]["index"]["int"])
    send_control(fake_nvml, op="lose", gpu=index)

    assert kube.wait_until(
        "the lost GPU tainted NoExecute",
        lambda: ("kxpu.io/device-lost", "NoExecute") in taints_of(e2e, lost) or None,
        30,
    )

    # The device taint eviction controller marks the pod and deletes it.
    def evicted() -> bool | None:
        events = kube.events_for(e2e.cluster, victim.name)
        return any(e.get("reason") == "DeviceTaintManagerEviction" for e in events) or None

    kube.wait_until("the DeviceTaintManagerEviction event on the pod", evicted, 60)
    kube.wait_until("the evicted pod gone", lambda: pod_or_none(e2e, victim.name) is None or None, 90)

    # A new claim for exactly that GPU is not allocated while the taint is there.
    wanted = dra.claim_template(
        e2e,
        "that-gpu",
        [
            {
                "name": "gpu",
                "exactly": dra.exactly(
                    cls, 1, f'device.attributes["{DRIVER}"].uuid == "{uuid_of(by_name(e2e)[lost])}"'
                ),
            }
        ],
    )
    waiting = dra.claim_pod(e2e, "waiting", REPORT, wanted)
    message = kube.wait_until(
        "FailedScheduling for the pod wanting the lost GPU", lambda: failed_scheduling(e2e, waiting.name), 60
    )
    assert kube.get_pod(e2e.cluster, waiting.name)["status"].get("phase") == "Pending", message
    # Any other claim lands elsewhere.
    other, elsewhere = running_on(e2e, "other", template)
    assert elsewhere != lost

    # An admin takes the GPU out too (a DeviceTaintRule, which kxpu never touches) while it is down.
    rule = maintenance_rule(e2e, lost)

    # The GPU answers again: after the quiet period kxpu lifts its taint, and only its own.
    send_control(fake_nvml, op="restore", gpu=index)
    kube.wait_until("kxpu's taint lifted", lambda: not taints_of(e2e, lost) or None, 60)
    after = dra.claim_pod(e2e, "after-recovery", REPORT, wanted)
    message = kube.wait_until(
        "FailedScheduling while the admin's rule stands", lambda: failed_scheduling(e2e, after.name), 60
    )
    assert kube.get_pod(e2e.cluster, after.name)["status"].get("phase") == "Pending", message
    assert e2e.cluster.kubectl_json("get", "devicetaintrule", rule)["spec"]["taint"]["key"] == MAINTENANCE
    e2e.cluster.kubectl("delete", "pod", after.name, "--wait=true", "--timeout=60s")
    # The admin lifts the rule: the waiting pod gets the GPU.
    e2e.cluster.kubectl("delete", "devicetaintrule", rule)
    kube.wait_pod_phase(e2e.cluster, waiting.name, "Running", timeout=120)
    assert dra.allocated_devices(dra.pod_claim(e2e.cluster, waiting.name), DRIVER) == [lost]
    assert kube.get_pod(e2e.cluster, other.name)["status"]["phase"] == "Running"


def test_an_ecc_error_under_noschedule_keeps_the_running_pod_and_steers_new_claims_away(
    e2e: E2E, fake_nvml: Path
) -> None:
    # No recovery within the test: the ECC fault stays while new claims are tried.
    cls, template = start(e2e, {"eccFatal": "NoSchedule", "deviceLost": "NoExecute"}, quiet_s=600)
    keeper, sick = running_on(e2e, "keeper", template)
    before = kube.container_state(kube.get_pod(e2e.cluster, keeper.name))
    index = int(by_name(e2e)[sick]["attributes"]["index"]["int"])
    send_control(fake_nvml, op="xid", gpu=index, xid=48)  # double-bit ECC: uncorrectable
    assert kube.wait_until(
        "the GPU tainted ecc-fatal NoSchedule",
        lambda: ("kxpu.io/ecc-fatal", "NoSchedule") in taints_of(e2e, sick) or None,
        30,
    )
    wanted = dra.claim_template(
        e2e,
        "that-gpu",
        [
            {
                "name": "gpu",
                "exactly": dra.exactly(
                    cls, 1, f'device.attributes["{DRIVER}"].uuid == "{uuid_of(by_name(e2e)[sick])}"'
                ),
            }
        ],
    )
    waiting = dra.claim_pod(e2e, "waiting", REPORT, wanted)
    kube.wait_until(
        "FailedScheduling for the pod wanting the sick GPU", lambda: failed_scheduling(e2e, waiting.name), 60
    )
    pod = kube.get_pod(e2e.cluster, keeper.name)
    assert pod["status"]["phase"] == "Running" and kube.container_state(pod) == before
    assert not pod["metadata"].get("deletionTimestamp")
    assert not any(
        e.get("reason") == "DeviceTaintManagerEviction" for e in kube.events_for(e2e.cluster, keeper.name)
    )

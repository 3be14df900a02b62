"""DRA beyond whole devices, on the real cluster with the stock kube-scheduler and no kxpu extender: shares by
consumable capacity, the extended-resource bridge, moving a node from kxpu's device plugin to its DRA driver
with pods running, and device health in pod status."""

from __future__ import annotations

import json
import signal
from functools import partial
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.cluster import NODE_NAME
from e2e.conftest import E2E
from e2e.test_dra import DRIVER, NPU, REPORT, npus, start, visible

LIMITS = 'echo "LIMIT=$CUDA_DEVICE_MEMORY_LIMIT_0 SM=$CUDA_DEVICE_SM_LIMIT"\n' + REPORT


def test_shares_pack_on_devices_with_their_limits(e2e: E2E) -> None:
    """Four pods asking 6 GiB and 30 % each are packed two per 16 GiB device by the stock scheduler; each
    container sees its limits; a fifth does not fit and stays Pending with the scheduler's reason."""
    start(e2e, {**npus(count=2), "dra": {"shares": {"memoryStepMiB": 256}}})
    devices = dra.pool_devices(e2e.cluster, DRIVER)
    assert all(d.get("allowMultipleAllocations") for d in devices)
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    body = dra.exactly(cls, 1)
    body["capacity"] = {"requests": {"memory": "6Gi", "cores": "30"}}
    template = dra.claim_template(e2e, "share", [{"name": "npu", "exactly": body}])
    pods = [dra.claim_pod(e2e, f"share-{i}", LIMITS, template) for i in range(4)]
    placed: dict[str, list[str]] = {}
    for pod in pods:
        kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
        log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
        assert "LIMIT=6144m SM=30" in log, log
        (device,) = visible(log)
        placed.setdefault(device, []).append(pod.name)
        results = dra.pod_claim(e2e.cluster, pod.name)["status"]["allocation"]["devices"]["results"]
        assert results[0].get("shareID") and results[0]["consumedCapacity"]["memory"] == "6Gi"
    assert sorted(len(v) for v in placed.values()) == [2, 2], placed

    fifth = dra.claim_pod(e2e, "share-4", LIMITS, template)

    def reason() -> str | None:
        for event in kube.events_for(e2e.cluster, fifth.name):
            if event.get("reason") == "FailedScheduling":
                return str(event.get("message"))
        return None

    message = kube.wait_until("FailedScheduling for the fifth share", reason, timeout=60)
    assert "cannot allocate all claims" in message, message
    assert kube.get_pod(e2e.cluster, fifth.name)["status"]["phase"] == "Pending"


def _bridge(e2e: E2E) -> str:
    """The DeviceClass that serves ``example.com/npu`` in ``resources.limits`` through kxpu's DRA driver."""
    name = "bridge.npu.example.com"
    dra.apply(
        e2e,
        {
            "apiVersion": dra.API,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {
                "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
                "extendedResourceName": NPU,
            },
        },
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl("delete", "deviceclass", name, "--ignore-not-found", check=False)
    )
    return name


def test_unmodified_limits_pod_is_served_through_the_bridge(e2e: E2E) -> None:
    """A pod written for a device plugin (``example.com/npu: 2`` in its limits) runs on kxpu's DRA driver."""
    start(e2e, npus())
    _bridge(e2e)
    pod = e2e.pod("limits", REPORT, {NPU: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    status = kube.get_pod(e2e.cluster, pod.name)["status"]
    claim_name = status["extendedResourceClaimStatus"]["resourceClaimName"]
    claim = e2e.cluster.kubectl_json("get", "resourceclaim", claim_name, "-n", "default")
    assert visible(log) == sorted(dra.allocated_devices(claim, DRIVER)) and len(visible(log)) == 2


def test_a_node_moves_from_the_device_plugin_to_dra_with_pods_running(e2e: E2E, tmp_path: Path) -> None:
    """kxpu serves example.com/npu through the device plugin; a pod holds a device. The config switches the
    resource to DRA (SIGHUP): the running pod keeps its container, its device stays out of the pool until it
    is gone, and a new pod with the same limits lands on DRA with another device."""
    dra.forget_driver(e2e, DRIVER)
    _bridge(e2e)
    env = {"NODE_NAME": NODE_NAME, "KUBECONFIG": str(e2e.cluster.kubeconfig)}
    plugin = {k: v for k, v in npus().items() if k != "serve"}
    daemon = e2e.kxpu([plugin], env=env)
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    old = e2e.pod("old", REPORT, {NPU: 1})
    kube.wait_pod_phase(e2e.cluster, old.name, "Running")
    (old_device,) = visible(kube.wait_pod_log(e2e.cluster, old.name, "end-of-report"))
    before = kube.container_state(kube.get_pod(e2e.cluster, old.name))

    daemon.config.write_text(json.dumps({"version": "v1", "resources": [npus()]}))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    kube.wait_resource(e2e.cluster, NPU, allocatable=0, timeout=60)

    def held() -> list[str] | None:
        tainted = [d["name"] for d in dra.pool_devices(e2e.cluster, DRIVER) if d.get("taints")]
        return tainted or None

    assert kube.wait_until("the old pod's device kept out of the pool", held, timeout=60) == [old_device]
    new = e2e.pod("new", REPORT, {NPU: 1})
    kube.wait_pod_phase(e2e.cluster, new.name, "Running", timeout=120)
    (new_device,) = visible(kube.wait_pod_log(e2e.cluster, new.name, "end-of-report"))
    assert new_device != old_device
    assert kube.get_pod(e2e.cluster, new.name)["status"].get("extendedResourceClaimStatus"), (
        "not served by DRA"
    )
    assert kube.container_state(kube.get_pod(e2e.cluster, old.name)) == before, (
        "the running pod was disturbed"
    )
    e2e.cluster.kubectl("delete", "pod", old.name, "--wait=true", "--timeout=60s")
    kube.wait_until(
        "the old pod's device back in the pool",
        lambda: not any(d.get("taints") for d in dra.pool_devices(e2e.cluster, DRIVER)) or None,
        timeout=60,
    )


def test_device_health_shows_in_pod_status(e2e: E2E, tmp_path: Path) -> None:
    """A device that turns unhealthy shows as Unhealthy in the status of the pod using it (the kubelet's DRA
    health service), and Healthy again once it recovers."""
    state = tmp_path / "state.json"
    state.write_text("{}")
    start(e2e, npus(state_file=state))
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    template = dra.claim_template(e2e, "one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    pod = dra.claim_pod(e2e, "health", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    (device,) = visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report"))

    def health() -> dict[str, Any]:
        statuses = kube.get_pod(e2e.cluster, pod.name)["status"]["containerStatuses"][0]
        found: dict[str, Any] = {}
        for entry in statuses.get("allocatedResourcesStatus") or []:
            for resource in entry.get("resources") or []:
                found[resource["resourceID"]] = resource
        return found

    kube.wait_until(
        "Healthy in the pod's status",
        lambda: any(r["health"] == "Healthy" for r in health().values()) or None,
        90,
    )
    state.write_text(json.dumps({device: "Unhealthy"}))
    unhealthy = kube.wait_until(
        "Unhealthy in the pod's status",
        lambda: [r for r in health().values() if r["health"] == "Unhealthy"] or None,
        timeout=90,
    )
    # ResourceHealthStatusMessage (beta, on by default since 1.36) carries kxpu's reason into the pod status.
    assert len(unhealthy) == 1 and "state-file" in (unhealthy[0].get("message") or ""), unhealthy
    state.write_text("{}")
    kube.wait_until(
        "Healthy again", lambda: all(r["health"] == "Healthy" for r in health().values()) or None, timeout=90
    )


def test_partitions_never_overlap(e2e: E2E) -> None:
    """Two devices of 7 slices offered whole and as 1-, 2- and 3-slice partitions with shared counters: pods
    asking for a 3-slice partition get non-overlapping placements (two a device), a fifth stays Pending, and
    a pod asking for a whole device waits while its partitions are in use."""
    resource = npus(count=2, memoryMiB=40960, partitions={"slices": 7, "profiles": [1, 2, 3]})
    dra.forget_driver(e2e, DRIVER)
    e2e.kxpu([resource])
    kube.wait_until(
        "two devices and 24 partitions", lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == 26 or None, 60
    )
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    attr = f'device.attributes["{DRIVER}"]'
    three = dra.claim_template(
        e2e, "three", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.profile == "3g"')}]
    )
    pods = [dra.claim_pod(e2e, f"part-{i}", REPORT, three) for i in range(4)]
    got = []
    for pod in pods:
        kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
        (device,) = visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report"))
        got.append(device)
    assert sorted(got) == ["sim-npu-0-3g-0", "sim-npu-0-3g-3", "sim-npu-1-3g-0", "sim-npu-1-3g-3"]
    fifth = dra.claim_pod(e2e, "part-4", REPORT, three)
    whole_cls = dra.claim_template(
        e2e, "whole", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.profile == "7g"')}]
    )
    whole = dra.claim_pod(e2e, "whole", REPORT, whole_cls)

    def unschedulable(name: str) -> str | None:
        for event in kube.events_for(e2e.cluster, name):
            if event.get("reason") == "FailedScheduling":
                return str(event.get("message"))
        return None

    for name in (fifth.name, whole.name):
        kube.wait_until(f"FailedScheduling for {name}", partial(unschedulable, name), timeout=60)
        assert kube.get_pod(e2e.cluster, name)["status"]["phase"] == "Pending"
    one = dra.claim_template(
        e2e, "one-slice", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.profile == "1g"')}]
    )
    small = dra.claim_pod(e2e, "small", REPORT, one)  # slice 6 of either device is still free
    kube.wait_pod_phase(e2e.cluster, small.name, "Running")
    assert visible(kube.wait_pod_log(e2e.cluster, small.name, "end-of-report"))[0].endswith("-1g-6")

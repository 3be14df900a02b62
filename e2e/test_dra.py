"""kxpu as a DRA driver on the real cluster: ResourceSlices, the built-in scheduler's CEL allocation, containerd
applying the per-claim CDI specs, health, restarts, the nvidia backend over the fake NVML.

Every scenario serves a simulated (or fake-NVML) resource with ``serve: dra`` and asserts what Kubernetes
and the container report: the slices in the API, the claim's allocation, the pod's phase and events, the
container's own environment and files.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.cluster import NODE_NAME
from e2e.conftest import E2E

NPU = "example.com/npu"
DRIVER = "npu.example.com"
CDI_DIR = Path("/var/run/cdi")
PLUGINS = Path("/var/lib/kubelet/plugins")
REGISTRY = Path("/var/lib/kubelet/plugins_registry")
REPORT = 'echo "NPU_VISIBLE_DEVICES=$NPU_VISIBLE_DEVICES"\necho end-of-report'


def npus(state_file: Path | None = None, mount_dir: Path | None = None, **simulated: Any) -> dict[str, Any]:
    section: dict[str, Any] = {
        "count": 4,
        "model": "sim-npu",
        "memoryMiB": 16384,
        "env": {"NPU_VISIBLE_DEVICES": "{ids}"},
        **simulated,
    }
    if state_file is not None:
        section["stateFile"] = str(state_file)
    if mount_dir is not None:
        section["mounts"] = [{"hostPath": str(mount_dir), "containerPath": "/sim", "readOnly": True}]
    return {"name": NPU, "simulated": section, "serve": "dra"}


def start(e2e: E2E, resource: dict[str, Any]) -> Any:
    dra.forget_driver(e2e, DRIVER)
    daemon = e2e.kxpu([resource])
    kube.wait_until(
        "kxpu's ResourceSlices for this node",
        lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == resource["simulated"]["count"] or None,
        timeout=60,
    )
    return daemon


def visible(log: str) -> list[str]:
    match = re.search(r"^NPU_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert match, log
    return sorted(filter(None, match.group(1).split(",")))


def test_claim_template_pods_get_their_devices_through_cdi(e2e: E2E, tmp_path: Path) -> None:
    """A DeviceClass + ResourceClaimTemplate pod: placed by the built-in scheduler, prepared by kxpu, started by
    containerd with the claim's CDI spec; deleting it unprepares (the spec goes)."""
    share = tmp_path / "share"
    share.mkdir()
    (share / "marker").write_text("kxpu-dra-ok\n")
    start(e2e, npus(mount_dir=share))
    devices = dra.pool_devices(e2e.cluster, DRIVER)
    assert {d["name"] for d in devices} == {f"sim-npu-{i}" for i in range(4)}
    assert devices[0]["attributes"]["model"] == {"string": "sim-npu"}
    assert devices[0]["capacity"]["memory"]["value"] == "16Gi"
    owners = {o["kind"] for s in dra.slices(e2e.cluster, DRIVER) for o in s["metadata"]["ownerReferences"]}
    assert owners == {"Node"}

    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    template = dra.claim_template(e2e, "two-npus", [{"name": "npu", "exactly": dra.exactly(cls, 2)}])
    pod = dra.claim_pod(
        e2e, "two", REPORT.replace("end-of-report", 'echo "marker=$(cat /sim/marker)"\necho end'), template
    )
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "\nend")
    claim = dra.pod_claim(e2e.cluster, pod.name)
    allocated = sorted(dra.allocated_devices(claim, DRIVER))
    assert len(allocated) == 2
    assert visible(log) == allocated, "the container sees exactly the devices the scheduler allocated"
    assert "marker=kxpu-dra-ok" in log
    uid = claim["metadata"]["uid"]
    spec = CDI_DIR / f"kxpu-dra-{DRIVER}-{uid}.json"
    assert spec.exists()

    kube.delete_pods(e2e.cluster, f"kxpu-e2e={e2e.label}")
    kube.wait_until(
        "the claim's CDI spec removed by NodeUnprepareResources", lambda: not spec.exists() or None, 60
    )
    checkpoint = json.loads((PLUGINS / DRIVER / "checkpoint.json").read_text())
    assert uid not in checkpoint["claims"]


def test_cel_selects_by_model_and_prefers_the_most_memory(e2e: E2E) -> None:
    """Typed attributes in CEL: a request for model X gets X; a prioritized list takes the largest memory first."""
    start(
        e2e,
        npus(devices={"2": {"model": "sim-npu-pro", "memoryMiB": 65536}, "3": {"memoryMiB": 32768}}),
    )
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    attr = f'device.attributes["{DRIVER}"]'
    cap = f'device.capacity["{DRIVER}"]'
    by_model = dra.claim_template(
        e2e, "pro", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.model == "sim-npu-pro"')}]
    )
    pro = dra.claim_pod(e2e, "pro", REPORT, by_model)
    kube.wait_pod_phase(e2e.cluster, pro.name, "Running")
    assert visible(kube.wait_pod_log(e2e.cluster, pro.name, "end-of-report")) == ["sim-npu-2"]

    # "The device with the most memory": try 64 GiB, then 32 GiB, then anything. The pro device is taken,
    # so the next best is the 32 GiB one, then a 16 GiB one.
    most = dra.claim_template(
        e2e,
        "most-memory",
        [
            {
                "name": "npu",
                "firstAvailable": [
                    {"name": "huge", **dra.exactly(cls, 1, f'{cap}.memory.compareTo(quantity("64Gi")) >= 0')},
                    {"name": "big", **dra.exactly(cls, 1, f'{cap}.memory.compareTo(quantity("32Gi")) >= 0')},
                    {"name": "any", **dra.exactly(cls, 1)},
                ],
            }
        ],
    )
    first = dra.claim_pod(e2e, "most-1", REPORT, most)
    kube.wait_pod_phase(e2e.cluster, first.name, "Running")
    assert visible(kube.wait_pod_log(e2e.cluster, first.name, "end-of-report")) == ["sim-npu-3"]
    results = dra.pod_claim(e2e.cluster, first.name)["status"]["allocation"]["devices"]["results"]
    assert [r["request"] for r in results] == ["npu/big"]
    second = dra.claim_pod(e2e, "most-2", REPORT, most)
    kube.wait_pod_phase(e2e.cluster, second.name, "Running")
    assert visible(kube.wait_pod_log(e2e.cluster, second.name, "end-of-report"))[0] in {
        "sim-npu-0",
        "sim-npu-1",
    }


def test_unhealthy_devices_are_tainted_and_not_chosen(e2e: E2E, tmp_path: Path) -> None:
    """A device that turns unhealthy is tainted in its slice within a second, and new claims avoid it."""
    state = tmp_path / "state.json"
    state.write_text("{}")
    start(e2e, npus(state_file=state))
    flipped = time.monotonic()
    state.write_text(
        json.dumps({"sim-npu-0": "Unhealthy", "sim-npu-1": "Unhealthy", "sim-npu-2": "Unhealthy"})
    )

    def tainted() -> set[str] | None:
        names = {d["name"] for d in dra.pool_devices(e2e.cluster, DRIVER) if d.get("taints")}
        return names if len(names) == 3 else None

    assert kube.wait_until("three tainted devices", tainted, timeout=30) == {
        "sim-npu-0",
        "sim-npu-1",
        "sim-npu-2",
    }
    took = time.monotonic() - flipped
    assert took < 5, f"health change reached the API after {took:.1f}s"
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    one = dra.claim_template(e2e, "one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    two = dra.claim_template(e2e, "two", [{"name": "npu", "exactly": dra.exactly(cls, 2)}])
    healthy = dra.claim_pod(e2e, "healthy", REPORT, one)
    kube.wait_pod_phase(e2e.cluster, healthy.name, "Running")
    assert visible(kube.wait_pod_log(e2e.cluster, healthy.name, "end-of-report")) == ["sim-npu-3"]
    waiting = dra.claim_pod(e2e, "waiting", REPORT, two)

    def unschedulable() -> str | None:
        for event in kube.events_for(e2e.cluster, waiting.name):
            if event.get("reason") == "FailedScheduling":
                return str(event.get("message"))
        return None

    message = kube.wait_until("FailedScheduling for the two-device pod", unschedulable, timeout=60)
    assert "cannot allocate all claims" in message or "resourceclaim" in message.lower(), message
    state.write_text("{}")  # recovery: the taints go and the waiting pod is scheduled
    kube.wait_pod_phase(e2e.cluster, waiting.name, "Running", timeout=120)


def test_restarts_keep_prepared_claims(e2e: E2E) -> None:
    """SIGKILL of kxpu and a kubelet restart with a prepared claim: the pod runs on undisturbed, a new pod
    gets other devices, and deleting the first pod still unprepares its claim."""
    daemon = start(e2e, npus())
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    template = dra.claim_template(e2e, "one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    first = dra.claim_pod(e2e, "first", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, first.name, "Running")
    before = kube.container_state(kube.get_pod(e2e.cluster, first.name))
    first_claim = dra.pod_claim(e2e.cluster, first.name)
    first_devices = visible(kube.wait_pod_log(e2e.cluster, first.name, "end-of-report"))

    daemon.stop(signal.SIGKILL)
    daemon.start()
    # kxpu fully back (registered, its pool published) before the kubelet restarts: a starting kubelet deletes
    # every ResourceSlice of its node, and only a driver that watches its slices publishes them again.
    kube.wait_until(
        "the restarted kxpu registered",
        lambda: "registered with the kubelet" in daemon.log_text().rsplit("--- start", 1)[-1] or None,
        60,
    )
    before_uids = {s["metadata"]["uid"] for s in dra.slices(e2e.cluster, DRIVER)}
    assert before_uids
    e2e.cluster.stop_kubelet()
    e2e.cluster.start_kubelet()
    kube.wait_until("node Ready after the kubelet restart", lambda: kube.node_ready(e2e.cluster) or None, 120)
    socket = REGISTRY / f"{DRIVER}-reg.sock"
    kube.wait_until("kxpu's registration socket", lambda: socket.is_socket() or None, 30)

    def published_again() -> bool | None:
        now = dra.slices(e2e.cluster, DRIVER)
        fresh = now and not {s["metadata"]["uid"] for s in now} & before_uids
        return (fresh and len(dra.pool_devices(e2e.cluster, DRIVER)) == 4) or None

    kube.wait_until("the slices the kubelet wiped published again", published_again, 60)

    second = dra.claim_pod(e2e, "second", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, second.name, "Running", timeout=120)
    second_devices = visible(kube.wait_pod_log(e2e.cluster, second.name, "end-of-report"))
    assert not set(first_devices) & set(second_devices), "a device was given twice"
    assert kube.container_state(kube.get_pod(e2e.cluster, first.name)) == before, (
        "the first pod was disturbed"
    )

    spec = CDI_DIR / f"kxpu-dra-{DRIVER}-{first_claim['metadata']['uid']}.json"
    assert spec.exists()
    e2e.cluster.kubectl("delete", "pod", first.name, "--wait=true", "--timeout=60s")
    kube.wait_until("the first claim unprepared after the restarts", lambda: not spec.exists() or None, 60)


def test_nvidia_backend_through_dra(e2e: E2E) -> None:
    """The nvidia backend over the fake NVML (8x A100), unchanged, served through DRA: GPU attributes in the
    slices, NVIDIA_VISIBLE_DEVICES naming the allocated GPU's UUID."""
    driver = "gpu.nvidia.com"
    dra.forget_driver(e2e, driver)
    e2e.kxpu(
        [{"name": "nvidia.com/gpu", "nvidia": {"deviceIDStrategy": "uuid"}, "serve": "dra"}],
        env={"KXPU_FAKE_NVML": "a100-8x"},
    )
    kube.wait_until("8 GPUs in the pool", lambda: len(dra.pool_devices(e2e.cluster, driver)) == 8 or None, 60)
    gpu = dra.pool_devices(e2e.cluster, driver)[0]
    assert "A100" in gpu["attributes"]["model"]["string"]
    assert gpu["attributes"]["uuid"]["string"].startswith("GPU-")
    assert gpu["capacity"]["memory"]["value"] == "80Gi"  # the fake A100-SXM4-80GB: 81920 MiB, as NVML reports
    cls = dra.device_class(e2e, "kxpu-gpu", driver)
    template = dra.claim_template(e2e, "gpu", [{"name": "gpu", "exactly": dra.exactly(cls, 1)}])
    pod = dra.claim_pod(e2e, "gpu", 'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"\necho end-of-report', template)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    (device,) = dra.allocated_devices(dra.pod_claim(e2e.cluster, pod.name), driver)
    uuid = next(d for d in dra.pool_devices(e2e.cluster, driver) if d["name"] == device)["attributes"][
        "uuid"
    ]["string"]
    assert f"GPUS={uuid}" in log, log


def test_bad_claims_are_refused_with_the_reason(e2e: E2E) -> None:
    """An invalid opaque config: the pod does not start, and the reason is in the claim's and the pod's events."""
    start(e2e, npus())
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    template = dra.claim_template(
        e2e,
        "typo",
        [{"name": "npu", "exactly": dra.exactly(cls, 1)}],
        config=[
            {
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": "kxpu.io/v1alpha1", "kind": "DeviceConfig", "evn": {}},
                }
            }
        ],
    )
    pod = dra.claim_pod(e2e, "typo", REPORT, template)

    def refused() -> str | None:
        for event in kube.events_for(e2e.cluster, pod.name):
            if "evn" in str(event.get("message")):
                return str(event.get("message"))
        return None

    message = kube.wait_until("the pod's event naming the bad field", refused, timeout=90)
    assert "Extra inputs are not permitted" in message, message
    assert kube.get_pod(e2e.cluster, pod.name)["status"]["phase"] == "Pending"
    assert not list(CDI_DIR.glob(f"kxpu-dra-{DRIVER}-*.json")), "nothing left behind"
    assert NODE_NAME  # the pool is this node's


def test_publisher_against_the_api_server(e2e: E2E, monkeypatch: Any) -> None:
    """The ResourceSlice publisher on the real API server: a 300-device pool split into slices the server
    accepts (taints included), updated in place with one generation, and garbage-collected with its Node."""
    import asyncio

    from kxpu.dra.publisher import SlicePublisher
    from kxpu.kube.dra import DraKube
    from kxpu.model import Device, Health

    ghost, driver = "kxpu-e2e-ghost", "ghost.example.com"
    monkeypatch.setenv("KUBECONFIG", str(e2e.cluster.kubeconfig))
    dra.apply(
        e2e,
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": ghost, "labels": {"kxpu-e2e": e2e.label}}},
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl("delete", "node", ghost, "--ignore-not-found", check=False)
    )
    dra.forget_driver(e2e, driver)
    devices = [Device(id=f"dev-{i}", model="ghost", memory_mib=1024, index=i) for i in range(300)]

    async def publish(devs: list[Device]) -> SlicePublisher:
        publisher = SlicePublisher(DraKube(driver), driver, ghost, "taint")
        await publisher.publish(devs)
        return publisher

    asyncio.run(publish(devices))
    assert len(dra.pool_devices(e2e.cluster, driver, ghost)) == 300
    assert len(dra.slices(e2e.cluster, driver)) == 5  # 64 per slice once taints may be used
    sick = [devices[0].with_health(Health.UNHEALTHY, "xid-79"), *devices[1:]]
    publisher = asyncio.run(publish(sick))
    pool = dra.pool_devices(e2e.cluster, driver, ghost)
    assert pool[0]["taints"][0]["value"] == "xid-79"
    generations = {s["spec"]["pool"]["generation"] for s in dra.slices(e2e.cluster, driver)}
    assert generations == {publisher.generation}, "every slice of the pool moved to the new generation"

    async def deletion_seen_and_repaired() -> None:
        """The driver's watch (field selectors on spec.driver and spec.nodeName) tells a deletion by someone
        else from the echo of its own writes, and a publish puts the pool back."""
        api = DraKube(driver)
        watcher = SlicePublisher(api, driver, ghost, "taint")
        await watcher.publish(sick)  # up to date: nothing written, the slices known
        victim = sorted(watcher.known)[1]
        events = api.watch_slices(driver, ghost)
        async with asyncio.timeout(30):
            seen: set[str] = set()
            async for kind, obj in events:  # first an ADDED for each slice there: all of them known
                assert watcher.is_current(kind, obj), (kind, obj["metadata"]["name"])
                seen.add(obj["metadata"]["name"])
                if seen >= watcher.known.keys():
                    break
            await asyncio.to_thread(e2e.cluster.kubectl, "delete", "resourceslice", victim)
            async for kind, obj in events:
                if not watcher.is_current(kind, obj):
                    assert (kind, obj["metadata"]["name"]) == ("DELETED", victim)
                    break
        assert await watcher.publish(sick)
        await api.close()

    asyncio.run(deletion_seen_and_repaired())
    assert len(dra.pool_devices(e2e.cluster, driver, ghost)) == 300
    e2e.cluster.kubectl("delete", "node", ghost)
    kube.wait_until(
        "the ghost node's slices garbage-collected", lambda: not dra.slices(e2e.cluster, driver) or None, 90
    )

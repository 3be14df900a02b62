"""kxpu's DRA driver under faults on the real cluster: restarts across config changes while claims are prepared,
and a SIGKILL in the middle of making a partition. What the real kubelet, scheduler and containers report."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.cluster import NODE_NAME
from e2e.conftest import E2E
from e2e.test_dra import CDI_DIR, DRIVER, NPU, PLUGINS, REGISTRY, REPORT, npus, start, visible


def env(e2e: E2E) -> dict[str, str]:
    """What a DRA driver needs, also when the config serves nothing through DRA (its claims left over)."""
    return {"NODE_NAME": NODE_NAME, "KUBECONFIG": str(e2e.cluster.kubeconfig)}


def claim_pods(e2e: E2E, count: int) -> list[tuple[kube.PodSpec, dict[str, Any], list[str]]]:
    cls = dra.device_class(e2e, "kxpu-npu", DRIVER)
    template = dra.claim_template(e2e, "one", [{"name": "npu", "exactly": dra.exactly(cls, 1)}])
    out = []
    for n in range(count):
        pod = dra.claim_pod(e2e, f"dra-{n}", REPORT, template)
        kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
        devices = visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report"))
        out.append((pod, dra.pod_claim(e2e.cluster, pod.name), devices))
    return out


def spec_of(claim: dict[str, Any]) -> Path:
    return CDI_DIR / f"kxpu-dra-{DRIVER}-{claim['metadata']['uid']}.json"


def test_a_restart_onto_the_device_plugin_never_offers_devices_dra_claims_hold(e2e: E2E) -> None:
    """Before: within a second the device plugin offered all four devices and a device-plugin pod got
    sim-npu-0..3 while running DRA pods held two of them."""
    daemon = start(e2e, npus())
    held = claim_pods(e2e, 2)
    taken = sorted(d for _, _, devices in held for d in devices)
    daemon.stop()
    as_device_plugin = {k: v for k, v in npus().items() if k != "serve"}
    kxpu = e2e.kxpu([as_device_plugin], env=env(e2e))
    # The node has four devices, two of them allocatable: the claimed ones are offered Unhealthy.
    kube.wait_resource(e2e.cluster, NPU, allocatable=2, capacity=4)
    assert "DRA claims are still prepared for a driver this config no longer serves" in kxpu.log_text()
    greedy = e2e.pod("greedy", REPORT, {NPU: 4})
    two = e2e.pod("two", REPORT, {NPU: 2})
    kube.wait_pod_phase(e2e.cluster, two.name, "Running")
    assert not set(visible(kube.wait_pod_log(e2e.cluster, two.name, "end-of-report"))) & set(taken), (
        "a device DRA claims hold was given through the device plugin"
    )
    assert kube.get_pod(e2e.cluster, greedy.name)["status"]["phase"] == "Pending"
    for pod, _, _ in held:  # the running DRA pods were not disturbed
        assert kube.get_pod(e2e.cluster, pod.name)["status"]["phase"] == "Running"

    # The claims are released (their pods deleted through the draining driver): the devices are offered again.
    for pod, _, _ in held:
        e2e.cluster.kubectl("delete", "pod", pod.name, "--wait=true", "--timeout=60s")
    specs = [spec_of(claim) for _, claim, _ in held]
    kube.wait_until("the claims' CDI specs removed", lambda: not any(s.exists() for s in specs) or None, 60)
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    e2e.cluster.kubectl("delete", "pod", two.name, "--wait=true", "--timeout=60s")
    kube.wait_pod_phase(e2e.cluster, greedy.name, "Running", timeout=120)
    kube.wait_until(
        "the drained driver's sockets gone",
        lambda: not (REGISTRY / f"{DRIVER}-reg.sock").exists() or None,
        60,
    )


def test_a_claim_orphaned_by_removing_its_resource_is_unprepared(e2e: E2E) -> None:
    """Before: nothing served the unprepare; the deleted pod stayed Terminating and its CDI spec stayed."""
    daemon = start(e2e, npus())
    ((pod, claim, _),) = claim_pods(e2e, 1)
    assert spec_of(claim).exists()
    daemon.stop()
    kxpu = e2e.kxpu([{"name": "example.com/other", "simulated": {"count": 1, "model": "oth"}}], env=env(e2e))
    kube.wait_until(
        "the draining driver registered",
        lambda: "DRA claims are still prepared" in kxpu.log_text() or None,
        60,
    )
    kube.wait_until(
        "no device of the driver published", lambda: not dra.pool_devices(e2e.cluster, DRIVER) or None, 60
    )
    e2e.cluster.kubectl("delete", "pod", pod.name, "--wait=true", "--timeout=90s")
    kube.wait_until("the orphaned claim's CDI spec removed", lambda: not spec_of(claim).exists() or None, 60)
    checkpoint = json.loads((PLUGINS / DRIVER / "checkpoint.json").read_text())
    assert checkpoint["claims"] == {}
    kube.wait_until(
        "the drained driver's registration gone",
        lambda: not (REGISTRY / f"{DRIVER}-reg.sock").exists() or None,
        60,
    )


SP = "example.com/sp"
SP_DRIVER = "sp.example.com"


def test_sigkill_while_making_a_partition_then_the_claim_deleted_leaks_nothing(
    e2e: E2E, tmp_path: Path
) -> None:
    """The daemon is SIGKILLed while NodePrepareResources makes a partition (held half-way by the simulated
    backend's hold file), the claim is deleted while it is down, and it starts again. Before: the partition
    stayed in the hardware but not in the checkpoint, and the whole device could never be allocated again
    (``cannot make the partition: ['sp-1-1g-1'] overlaps it``)."""
    hardware, hold = tmp_path / "hardware.json", tmp_path / "hold"
    resource = {
        "name": SP,
        "simulated": {
            "count": 2,
            "model": "sp",
            "memoryMiB": 40960,
            "env": {"NPU_VISIBLE_DEVICES": "{ids}"},
            "partitions": {
                "slices": 7,
                "profiles": [1, 2, 3],
                "hardwareFile": str(hardware),
                "holdFile": str(hold),
            },
        },
        "serve": "dra",
    }
    dra.forget_driver(e2e, SP_DRIVER)
    daemon = e2e.kxpu([resource])
    kube.wait_until(
        "the partitions published", lambda: len(dra.pool_devices(e2e.cluster, SP_DRIVER)) > 2 or None, 60
    )
    attr = f'device.attributes["{SP_DRIVER}"]'
    cls = dra.device_class(e2e, "kxpu-sp", SP_DRIVER, f'{attr}.parent == "sp-1"')
    small = dra.claim_template(
        e2e, "sp-1g", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.profile == "1g"')}]
    )
    whole = dra.claim_template(
        e2e, "sp-whole", [{"name": "npu", "exactly": dra.exactly(cls, 1, f'{attr}.profile == "7g"')}]
    )

    hold.touch()
    doomed = dra.claim_pod(e2e, "doomed", REPORT, small)

    def made() -> list[str] | None:
        try:
            return list(json.loads(hardware.read_text())) or None
        except (OSError, ValueError):
            return None

    (partition,) = kube.wait_until("the partition made, held half-way", made, 90)
    daemon.stop(signal.SIGKILL)
    hold.unlink()
    claim = dra.pod_claim(e2e.cluster, doomed.name)
    e2e.cluster.kubectl(
        "delete", "pod", doomed.name, "--grace-period=0", "--force", "--wait=false", check=False
    )

    def claim_gone() -> bool | None:
        claims = e2e.cluster.kubectl_json("get", "resourceclaims", "-n", "default").get("items") or []
        return all(c["metadata"]["uid"] != claim["metadata"]["uid"] for c in claims) or None

    kube.wait_until("the claim deleted while the daemon is down", claim_gone, 90)
    assert json.loads(hardware.read_text()) != {}, (
        "the partition is still in the hardware while the daemon is down"
    )

    daemon.start()
    kube.wait_until(
        "the leaked partition destroyed", lambda: json.loads(hardware.read_text()) == {} or None, 60
    )
    restarted = daemon.log_text().rsplit("--- start", 1)[-1]
    assert "destroyed partitions no prepared claim owns" in restarted and partition in restarted
    # The whole device is allocatable again.
    pod = dra.claim_pod(e2e, "whole", REPORT, whole)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running", timeout=120)
    assert visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")) == ["sp-1"]
    assert list(json.loads(hardware.read_text())) == ["sp-1"]

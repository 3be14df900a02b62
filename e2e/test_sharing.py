"""Fractional sharing end to end (issue 5): webhook, second kube-scheduler with kxpu's extender, node handshake.

One chain for the module (``sharing_support.Sharing``); every scenario deletes its pods. What is asserted is
what Kubernetes reports: pod phase and node, events, the signed assignment on the pod, the container's env.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from e2e import kube
from e2e.cluster import NODE_NAME, Cluster
from e2e.conftest import E2E
from e2e.sharing_support import (
    CORES,
    DEVICES,
    LOCK_HARD_EXPIRY_S,
    MEM,
    MEMORY_MIB,
    NS,
    RAW_NS,
    RES,
    SCHEDULER,
    SPLIT,
    Sharing,
    assert_within_capacity,
    events,
    running_chain,
)
from kxpu.sharing import signing


@pytest.fixture(scope="module")
def chain(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sharing]:
    """One chain for the module: starting it (four processes, webhooks, readiness) costs ~4 s."""
    with running_chain(cluster, tmp_path_factory.mktemp("sharing")) as sharing:
        yield sharing


@pytest.fixture
def sharing(chain: Sharing, e2e: E2E) -> Iterator[Sharing]:
    """The chain, its logs attached to a failed scenario's report; every pod deleted afterwards."""
    e2e.logs.update(chain.logs)
    chain.reset()
    yield chain
    chain.delete_pods()


def wait_running(sharing: Sharing, names: list[str], timeout: float = 60) -> dict[str, dict[str, Any]]:
    """Wait until every named pod runs; fail at once on a terminal phase, naming its reason."""
    pods: dict[str, dict[str, Any]] = {}

    def probe() -> bool:
        for pod in sharing.pods():
            name = pod["metadata"]["name"]
            if name in names:
                pods[name] = pod
                phase = pod.get("status", {}).get("phase")
                assert phase not in ("Failed", "Succeeded"), f"{name} ended: {kube.describe(pod)}"
        return all(pods.get(n, {}).get("status", {}).get("phase") == "Running" for n in names)

    try:
        kube.wait_until(f"{len(names)} pods Running", probe, timeout)
    except kube.WaitTimeout as exc:
        waiting = {n: pods.get(n, {}).get("status", {}).get("phase") for n in names}
        raise kube.WaitTimeout(f"{exc}; phases: {waiting}") from None
    return pods


def wait_bound(sharing: Sharing, name: str, namespace: str = NS, timeout: float = 30) -> dict[str, Any]:
    """Wait until the pod is bound (has a node); the binding is the extender's last step."""
    return kube.wait_until(
        f"{name} bound",
        lambda: (p := kube.get_pod(sharing.cluster, name, namespace))["spec"].get("nodeName") and p,
        timeout=timeout,
    )


def test_policies_place_pods_and_containers_see_their_limits(sharing: Sharing) -> None:
    """1. Spread (by annotation) puts two pods on different devices, binpack (the default) two on one device;
    each container gets its memory and core limits and the UUID of the device the signed assignment names."""
    spread = {"kxpu.io/device-policy": "spread"}
    # spread first, on empty devices: each takes a different one
    for n in (1, 2):
        sharing.create(sharing.pod(f"spread-{n}", {RES: 1, MEM: 2000, CORES: 20}, spread))
        wait_bound(sharing, f"spread-{n}")
    # binpack: only memory and cores named; the webhook adds the count and the scheduler name
    for n in (1, 2):
        sharing.create(sharing.pod(f"pack-{n}", {MEM: 3000, CORES: 30}))
        wait_bound(sharing, f"pack-{n}")
    names = ["spread-1", "spread-2", "pack-1", "pack-2"]
    pods = wait_running(sharing, names)
    grants = {n: sharing.granted(pods[n]) for n in names}

    for name, pod in pods.items():
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert pod["spec"]["schedulerName"] == SCHEDULER, pod["spec"]
        assert pod["spec"]["containers"][0]["resources"]["limits"].get(RES) == "1", pod["spec"]
        scheduled = events(sharing.cluster, name, reason="Scheduled")
        assert scheduled, f"{name}: no Scheduled event"
        assigned = events(sharing.cluster, name, reason="KxpuAssigned")
        device = sharing.assignment(pod).containers[0].devices[0].device
        assert any(f"main: {device} (" in m for m in assigned), (name, device, assigned)
    assert grants["spread-1"].uuids != grants["spread-2"].uuids, grants
    assert grants["pack-1"].uuids == grants["pack-2"].uuids, grants
    assert (grants["pack-1"].memory_mib, grants["pack-1"].cores) == (3000, 30)
    assert (grants["spread-1"].memory_mib, grants["spread-1"].cores) == (2000, 20)
    assert_within_capacity(grants.values())


def test_fifty_pods_at_once_never_overcommit(sharing: Sharing) -> None:
    """2. 50 pods of three sizes in one request: what is granted (per the signed assignments and per the
    containers) stays within each device's memory, cores and slots; the rest stay Pending, saying why."""
    sizes = [(500, 5), (3000, 20), (6000, 35)]
    manifests = [
        sharing.pod(f"burst-{i:02d}", {RES: 1, MEM: sizes[i % 3][0], CORES: sizes[i % 3][1]})
        for i in range(50)
    ]
    started = time.monotonic()
    sharing.create(*manifests)
    names = [m["metadata"]["name"] for m in manifests]

    def settled() -> bool:
        pending = 0
        for pod in sharing.pods():
            name, status = pod["metadata"]["name"], pod.get("status", {})
            phase = status.get("phase")
            assert phase not in ("Failed", "Succeeded"), f"{name} ended: {kube.describe(pod)}"
            if phase == "Running":
                continue
            if pod["spec"].get("nodeName"):
                return False  # bound, not running yet
            unschedulable = [c for c in status.get("conditions", []) if c.get("reason") == "Unschedulable"]
            if not unschedulable:
                return False  # not tried yet, or a retry is due
            pending += 1
        return pending > 0

    kube.wait_until("every pod Running or Unschedulable", settled, timeout=90)
    # once every slot a pod could take is taken, no scheduling attempt may change the picture
    pods = {p["metadata"]["name"]: p for p in sharing.pods()}
    running = [n for n in names if pods[n]["status"].get("phase") == "Running"]
    pending = [n for n in names if n not in running]
    grants = [sharing.granted(pods[n]) for n in running]
    usage = assert_within_capacity(grants)
    print(
        f"\n{len(running)} running, {len(pending)} pending after {time.monotonic() - started:.1f}s; usage {usage}"
    )
    # no capacity was lost: no pending pod would fit on any device as granted
    assert len(usage) == DEVICES, usage
    for name in pending:
        memory, cores = sizes[int(name[-2:]) % 3]
        for m, c, s in usage.values():
            assert m + memory > MEMORY_MIB or c + cores > 100 or s + 1 > SPLIT, (name, usage)
    for name in pending:
        messages = events(sharing.cluster, name, reason="FailedScheduling")
        assert messages, f"{name}: Pending without a FailedScheduling event"
        assert any(
            re.search(r"not enough (memory|cores)|split count reached|Insufficient " + re.escape(RES), m)
            for m in messages
        ), (name, messages)
    # a pending pod was never given an assignment
    for name in pending:
        assert signing.ASSIGNMENT_ANNOTATION not in (pods[name]["metadata"].get("annotations") or {}), name


def test_forged_or_unscheduled_pods_get_no_device(sharing: Sharing) -> None:
    """3. A pod bringing its own assignment is denied by the webhook, and so is an edit of one (through the pod
    or its status) or dropping its assigned label; where the
    webhook does not reach (another namespace), a pod bound with nodeName and a copied assignment is refused
    by the node, with an event, and gets no device."""
    started = datetime.now(UTC).replace(microsecond=0)
    sharing.create(sharing.pod("honest", {RES: 1, MEM: 1000, CORES: 10}))
    honest = wait_running(sharing, ["honest"])["honest"]
    honest_grant = sharing.granted(honest)
    stolen = {
        k: honest["metadata"]["annotations"][k]
        for k in (signing.ASSIGNMENT_ANNOTATION, signing.SIGNATURE_ANNOTATION)
    }

    # The webhook: a pod carrying an assignment (even a genuine one), an edit of one, a preset nodeName.
    forged = sharing.pod("forged", {RES: 1, MEM: 1000}, stolen)
    preset = sharing.pod("preset", {RES: 1, MEM: 1000}, nodeName=NODE_NAME)
    for manifest, reason in (
        (forged, "may not carry kxpu's own annotations"),
        (preset, "must be scheduled by the kxpu scheduler"),
    ):
        denied = sharing.tenant_run("create", "-f", "-", input=json.dumps(manifest))
        assert denied.returncode != 0 and reason in denied.stderr, denied
    edit = sharing.tenant_run(
        "annotate", "pod", "honest", "-n", NS, "--overwrite", f"{signing.ASSIGNMENT_ANNOTATION}=forged"
    )
    assert edit.returncode != 0 and "only the kxpu scheduler and node daemon may change" in edit.stderr, edit
    # nor through pods/status, which takes metadata changes too: dropping the label would hide the grant
    unlabel = sharing.tenant_run(
        "patch", "pod", "honest", "-n", NS, "--subresource=status", "--type=json",
        "-p", json.dumps([{"op": "remove", "path": "/metadata/labels/kxpu.io~1assigned"}]),
    )  # fmt: skip
    assert unlabel.returncode != 0 and "only the kxpu scheduler may set or remove" in unlabel.stderr, unlabel
    assert {p["metadata"]["name"] for p in sharing.pods()} == {"honest"}
    after = kube.get_pod(sharing.cluster, "honest", NS)["metadata"]["annotations"]
    assert after[signing.ASSIGNMENT_ANNOTATION] == stolen[signing.ASSIGNMENT_ANNOTATION]

    # Outside the webhook: bound by nodeName, with the honest pod's assignment copied onto it, or bare.
    for name, carried in (("copied", stolen), ("bare", {})):
        sharing.create(sharing.pod(name, {RES: 1, MEM: 1000}, carried, namespace=RAW_NS, nodeName=NODE_NAME))
        failed = kube.wait_pod_phase(sharing.cluster, name, "Failed", RAW_NS, timeout=45)
        message = failed["status"].get("message", "")
        assert "no verified assignment" in message, kube.describe(failed)
        assert not (failed["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("running")
    refused = sharing.cluster.kubectl_json(
        "get",
        "events",
        "-n",
        "default",
        "--field-selector",
        "involvedObject.kind=Node,reason=KxpuAllocationRefused",
    )["items"]
    recent = [
        e
        for e in refused
        if datetime.fromisoformat(str(e.get("lastTimestamp") or e["eventTime"]).replace("Z", "+00:00"))
        >= started
        and "no verified assignment" in e.get("message", "")
    ]
    assert len(recent) >= 2, (
        f"the node daemon recorded no KxpuAllocationRefused event for these pods: {refused}"
    )
    # the honest pod keeps its device, alone
    assert kube.get_pod(sharing.cluster, "honest", NS)["status"]["phase"] == "Running"
    assert sharing.granted(kube.get_pod(sharing.cluster, "honest", NS)) == honest_grant


def test_extender_killed_mid_burst_loses_nothing(sharing: Sharing) -> None:
    """4. SIGKILL the extender while 20 pods (exactly the node's capacity) are being scheduled, start it again:
    every pod runs, nothing is over-committed."""
    manifests = [sharing.pod(f"restart-{i:02d}", {RES: 1, MEM: 1000, CORES: 8}) for i in range(20)]
    names = [m["metadata"]["name"] for m in manifests]
    sharing.create(*manifests)
    kube.wait_until(
        "a few pods bound",
        lambda: sum(1 for p in sharing.pods() if p["spec"].get("nodeName")) >= 3,
        timeout=60,
        interval=0.1,
    )
    sharing.extender.stop(signal.SIGKILL)
    bound_at_kill = sum(1 for p in sharing.pods() if p["spec"].get("nodeName"))
    sharing.extender.start()
    pods = wait_running(sharing, names, timeout=90)
    grants = [sharing.granted(pods[n]) for n in names]
    usage = assert_within_capacity(grants)
    print(f"\n{bound_at_kill} bound when killed; usage {usage}")
    assert sorted(s for _, _, s in usage.values()) == [10, 10], usage


def test_lock_of_a_pod_never_admitted_is_recovered(sharing: Sharing) -> None:
    """5. A pod bound while the kubelet is down never reaches Allocate and holds the node lock; the next pod
    is refused with "locked" until the lock's hard expiry, when the extender's sweeper marks the first pod
    Failed (KxpuAllocationExpired, with an event) and frees the lock: the next pod takes it. With the kubelet
    back, the failed pod stays failed (never admitted under another pod's lock), a running pod is untouched
    and a new pod runs: no lock is left behind."""
    cluster = sharing.cluster
    # A pod admitted now also makes the kubelet prune its device checkpoint of earlier scenarios' pods, which a
    # restarted kubelet would otherwise count as allocated until it has listed its pods ("Available: 0").
    sharing.create(sharing.pod("before", {RES: 1, MEM: 1000, CORES: 10}))
    before = wait_running(sharing, ["before"])["before"]
    cluster.stop_kubelet()
    restarted = datetime.now(UTC).replace(microsecond=0)
    try:
        sharing.create(sharing.pod("stuck", {RES: 1, MEM: 1000, CORES: 10}))
        stuck = wait_bound(sharing, "stuck")
        held = sharing.lock_holder()
        assert stuck["metadata"]["uid"] in held, held
        sharing.create(sharing.pod("next", {RES: 1, MEM: 1000, CORES: 10}))
        kube.wait_until(
            "next refused while the lock is held",
            lambda: any("locked" in m for m in events(cluster, "next", reason="FailedScheduling")),
            timeout=30,
        )
        assert not kube.get_pod(cluster, "next", NS)["spec"].get("nodeName")
        kube.wait_until(
            "the stuck pod failed at the lock's hard expiry",
            lambda: kube.get_pod(cluster, "stuck", NS)["status"].get("reason") == "KxpuAllocationExpired",
            timeout=LOCK_HARD_EXPIRY_S + 30,
        )
        failed = kube.get_pod(cluster, "stuck", NS)["status"]
        assert failed["phase"] == "Failed" and "not admitted on node" in failed["message"], failed
        assert events(cluster, "stuck", reason="KxpuAllocationExpired"), "no Warning event on the stuck pod"
        nxt = wait_bound(sharing, "next", timeout=60)
        assert nxt["metadata"]["uid"] in sharing.lock_holder()
        # The kubelet admits the pods it finds at start-up before its device plugins re-register, and so
        # rejects them ("Available: 0") whatever the plugin: remove this one before the kubelet comes back.
        cluster.kubectl("delete", "pod", "next", "-n", NS, "--grace-period=0", "--force", "--wait=false")
        restarted = datetime.now(UTC).replace(microsecond=0)
    finally:
        if cluster.pid("kubelet") is None:
            cluster.start_kubelet()
    kube.wait_until(
        "a node status from the restarted kubelet",
        lambda: kube.node_ready(cluster) and kube.node_heartbeat(cluster) >= restarted,
        timeout=60,
    )
    sharing.wait_node_ready()
    sharing.create(sharing.pod("after", {RES: 1, MEM: 1000, CORES: 10}))
    pods = wait_running(sharing, ["before", "after"], timeout=60)
    stuck_now = kube.get_pod(cluster, "stuck", NS)[
        "status"
    ]  # the kubelet syncs it, as terminal: no container
    assert (stuck_now["phase"], stuck_now.get("reason")) == ("Failed", "KxpuAllocationExpired"), stuck_now
    assert not [c for c in stuck_now.get("containerStatuses") or [] if c.get("containerID")], stuck_now
    assert kube.container_state(pods["before"]) == kube.container_state(before), kube.describe(pods["before"])
    grants = [sharing.granted(pods["before"]), sharing.granted(pods["after"])]
    assert [(g.memory_mib, g.cores) for g in grants] == [(1000, 10), (1000, 10)]
    assert_within_capacity(grants)
    kube.wait_until("the lock released after Allocate", lambda: not sharing.lock_holder())

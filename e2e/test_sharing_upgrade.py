"""Sharing under change (issue 16): the upgrade from the HMAC key to Ed25519 with pods bound, a key rotation, the
upgrade from the Node-annotation lock to the per-node Lease with a lock held, and the loss of the active
kube-scheduler + extender replica in the middle of a 50-pod burst.

One chain for the module, started as the release before this one ran (HMAC, annotation lock); the scenarios run in
file order and each leaves the chain as the next expects (the upgrades are one-way). What is asserted is what
Kubernetes reports: pod phases, events, the signed assignment on each pod and what its container was told.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import kube
from e2e.cluster import NODE_NAME, Cluster
from e2e.conftest import E2E
from e2e.sharing_support import (
    CORES,
    DEVICES,
    EXTENDER_PORT,
    MEM,
    MEMORY_MIB,
    NS,
    RES,
    SCHEDULER,
    SPLIT,
    Proc,
    Sharing,
    _http_ok,
    assert_within_capacity,
    events,
    kxpu_command,
    running_chain,
)
from e2e.test_sharing import wait_bound, wait_running
from kxpu.sharing import signing
from kxpu.sharing.lock import lease_name, lock_key

NODE_LEASE = lease_name(NODE_NAME, RES)


@pytest.fixture(scope="module")
def chain(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sharing]:
    with running_chain(
        cluster, tmp_path_factory.mktemp("sharing-upgrade"), signing_scheme="hmac", node_lock="annotation"
    ) as sharing:
        yield sharing


@pytest.fixture
def sharing(chain: Sharing, e2e: E2E) -> Iterator[Sharing]:
    e2e.logs.update(chain.logs)
    chain.reset()
    yield chain
    chain.delete_pods()


def restart(sharing: Sharing, *procs: Proc) -> None:
    """Restart processes with the configs as last written (a rolling upgrade, one component at a time)."""
    for proc in procs:
        proc.stop()
        proc.start()
        if proc is sharing.extender:
            kube.wait_until(
                "extender /readyz", lambda: _http_ok(f"http://127.0.0.1:{EXTENDER_PORT}/readyz"), 60
            )
        if proc is sharing.daemon:
            # the kubelet keeps the old registration's allocatable for a while: wait for the new one, or a pod
            # admitted meanwhile finds no endpoint (UnexpectedAdmissionError)
            kube.wait_until(
                "the restarted daemon registered with the kubelet",
                lambda: (
                    "registered with the kubelet" in sharing.daemon.log.read_text().rsplit("--- start", 1)[-1]
                ),
                60,
            )
            sharing.wait_node_ready()


def scheme_of(pod: dict[str, Any]) -> tuple[str, str]:
    """(version, key id) of the pod's signature: v1 HMAC, v2 Ed25519."""
    version, key, _ = pod["metadata"]["annotations"][signing.SIGNATURE_ANNOTATION].split(".")
    return version, key


def wait_log(proc: Proc, pattern: str, timeout: float = 60) -> None:
    kube.wait_until(
        f"{proc.name} logs {pattern!r}", lambda: re.search(pattern, proc.log.read_text()), timeout
    )


def test_upgrade_from_hmac_to_ed25519_with_pods_bound(sharing: Sharing) -> None:
    """1. Pods bound under HMAC keep running and keep counting through the three steps (nodes accept both; the
    extender signs Ed25519; HMAC off on the nodes); new pods get Ed25519 assignments; the node is never
    over-committed, old and new pods together."""
    sharing.create(*[sharing.pod(f"old-{i}", {RES: 1, MEM: 3000, CORES: 20}) for i in range(3)])
    old = wait_running(sharing, [f"old-{i}" for i in range(3)])
    assert {scheme_of(p)[0] for p in old.values()} == {"v1"}
    old_grants = {n: sharing.granted(p) for n, p in old.items()}
    # step 1: the extender publishes its public key and still signs HMAC; the daemon accepts both
    sharing.write_configs(signing_scheme="hmac+ed25519")
    restart(sharing, sharing.extender)
    kube.wait_until("the public key published", lambda: sharing.published_key_ids(), 30)
    restart(sharing, sharing.daemon)
    sharing.create(sharing.pod("step1", {RES: 1, MEM: 3000, CORES: 20}))
    assert scheme_of(wait_running(sharing, ["step1"])["step1"])[0] == "v1"
    # step 2: the extender signs Ed25519; HMAC still verifies (pods bound in step 1, counted by the extender)
    sharing.write_configs(signing_scheme="ed25519+hmac")
    restart(sharing, sharing.extender)
    sharing.create(sharing.pod("step2", {RES: 1, MEM: 3000, CORES: 20}))
    step2 = wait_running(sharing, ["step2"])["step2"]
    assert scheme_of(step2)[0] == "v2" and scheme_of(step2)[1] in sharing.published_key_ids()
    # step 3: HMAC off on the nodes (the extender keeps the HMAC key, verify only, while HMAC pods live)
    sharing.write_configs(node_signing="ed25519")
    restart(sharing, sharing.daemon)
    # fill what is left: every old pod still counts, nothing is over-committed, new pods get Ed25519
    fill = [sharing.pod(f"fill-{i:02d}", {RES: 1, MEM: 3000, CORES: 20}) for i in range(8)]
    sharing.create(*fill)
    names = [f"old-{i}" for i in range(3)] + ["step1", "step2"]

    def settled() -> bool:
        pods = {p["metadata"]["name"]: p for p in sharing.pods()}
        return all(
            pods[m["metadata"]["name"]]["status"].get("phase") == "Running"
            or any(
                c.get("reason") == "Unschedulable"
                for c in pods[m["metadata"]["name"]]["status"].get("conditions", [])
            )
            for m in fill
        )

    kube.wait_until("the fill pods Running or Unschedulable", settled, 90)
    pods = {p["metadata"]["name"]: p for p in sharing.pods()}
    running = [n for n, p in pods.items() if p["status"].get("phase") == "Running"]
    assert set(names) <= set(running), {n: pods[n]["status"].get("phase") for n in names}
    for name in running:
        if name.startswith("fill-"):
            assert scheme_of(pods[name])[0] == "v2", name
    grants = [sharing.granted(pods[n]) for n in running]
    usage = assert_within_capacity(grants)
    # 3000 MiB / 20 % each: 5 per device by memory (16000 MiB), so 10 in all, whatever signed them
    assert len(running) == 2 * (MEMORY_MIB // 3000), (running, usage)
    for name, grant in old_grants.items():
        assert sharing.granted(pods[name]) == grant  # untouched


def test_key_rotation_with_pods_running(sharing: Sharing) -> None:
    """2. Rotate the extender's Ed25519 key: publish the new key beside the old, sign with the new, drop the old.
    Pods admitted under the old key keep running; the node admits pods signed with the new key at once."""
    sharing.write_configs(signing_scheme="ed25519", node_signing="ed25519")
    restart(sharing, sharing.extender, sharing.daemon)  # (the daemon too when this scenario runs alone)
    old_id = next(iter(signing.parse_keyring(sharing.private_pem).public_keys))
    sharing.create(sharing.pod("before", {RES: 1, MEM: 1000, CORES: 10}))
    before = wait_running(sharing, ["before"])["before"]
    assert scheme_of(before) == ("v2", old_id)
    new_pem = signing.generate_private_pem()
    new_id = next(iter(signing.parse_keyring(new_pem).public_keys))
    # 1. the new key published beside the old one (the old one still signs)
    sharing.set_signing_keys(sharing.private_pem + new_pem)
    kube.wait_until("both public keys published", lambda: sharing.published_key_ids() == {old_id, new_id}, 45)
    # 2. the new key signs
    sharing.old_private_pems.append(sharing.private_pem)
    sharing.private_pem = new_pem
    sharing.set_signing_keys(new_pem + sharing.old_private_pems[-1])
    wait_log(sharing.extender, f"signs: v2.{new_id}", 45)
    sharing.create(sharing.pod("after", {RES: 1, MEM: 1000, CORES: 10}))
    after = wait_running(sharing, ["after"])["after"]
    assert scheme_of(after) == ("v2", new_id)
    # 3. the old private key retired (its public block stays while pods signed with it run: they still count)
    old_public = signing.parse_keyring(sharing.old_private_pems[-1]).public_pems()
    sharing.set_signing_keys(new_pem + old_public)
    assert sharing.published_key_ids() == {old_id, new_id}  # both still verify, on the nodes too
    sharing.create(sharing.pod("last", {RES: 1, MEM: 1000, CORES: 10}))
    pods = wait_running(sharing, ["before", "after", "last"])
    assert scheme_of(pods["last"]) == ("v2", new_id)
    assert kube.container_state(pods["before"]) == kube.container_state(before)
    assert_within_capacity(sharing.granted(p) for p in pods.values())
    # 4. once no pod signed with the old key is left, its public key goes too
    sharing.cluster.kubectl("delete", "pod", "before", "-n", NS, "--wait=true", "--timeout=60s")
    sharing.set_signing_keys(new_pem)
    kube.wait_until("only the new key published", lambda: sharing.published_key_ids() == {new_id}, 45)
    sharing.create(sharing.pod("final", {RES: 1, MEM: 1000, CORES: 10}))
    assert scheme_of(wait_running(sharing, ["final"])["final"]) == ("v2", new_id)


def test_lease_lock_upgrade_loses_no_held_lock(sharing: Sharing) -> None:
    """3. The extender holds a node annotation lock for a pod whose Allocate has not come yet (the daemon is
    stopped) when it is upgraded to the Lease lock: the next pod waits ("locked"), the first is admitted under
    the annotation lock once the daemon runs again, and the next is then locked in the node's Lease and runs."""
    assert sharing.node_lock == "annotation"
    assert sharing.daemon.proc is not None
    sharing.daemon.proc.send_signal(signal.SIGSTOP)  # the kubelet's Allocate waits on it
    try:
        sharing.create(sharing.pod("held", {RES: 1, MEM: 1000, CORES: 10}))
        held = wait_bound(sharing, "held")
        assert held["metadata"]["uid"] in sharing.node_annotations().get(lock_key(RES), "")
        sharing.write_configs(node_lock="lease")
        restart(sharing, sharing.extender)
        sharing.create(sharing.pod("next", {RES: 1, MEM: 1000, CORES: 10}))
        kube.wait_until(
            "next refused while the annotation lock is held",
            lambda: any("locked" in m for m in events(sharing.cluster, "next", reason="FailedScheduling")),
            timeout=30,
        )
        assert not kube.get_pod(sharing.cluster, "next", NS)["spec"].get("nodeName")
    finally:
        sharing.daemon.proc.send_signal(signal.SIGCONT)
    pods = wait_running(sharing, ["held", "next"], timeout=60)
    assert lock_key(RES) not in sharing.node_annotations()
    lease = sharing.cluster.kubectl_json("get", "lease", NODE_LEASE, "-n", NS)
    assert lease["spec"].get("acquireTime"), lease  # the next pod's lock was taken in the Lease
    assert not lease["spec"].get("holderIdentity"), lease  # and released after its Allocate
    assert_within_capacity(sharing.granted(p) for p in pods.values())


def test_replica_failover_in_a_burst(sharing: Sharing, tmp_path: Path) -> None:
    """4. Two kube-scheduler + extender replicas, leader-elected; the active pair is SIGKILLed in the middle of a
    50-pod burst: the standby takes over within the lease time, no pod is lost, nothing is over-committed."""
    lease_s, renew_s, retry_s = 6, 4, 1
    work = sharing.work
    config = json.loads((work / "kube-scheduler.yaml").read_text())
    config["leaderElection"] = {
        "leaderElect": True,
        "resourceName": SCHEDULER,
        "resourceNamespace": NS,
        "leaseDuration": f"{lease_s}s",
        "renewDeadline": f"{renew_s}s",
        "retryPeriod": f"{retry_s}s",
    }
    (work / "kube-scheduler-ha.yaml").write_text(json.dumps(config))
    config["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{EXTENDER_PORT + 1}"
    (work / "kube-scheduler-ha-b.yaml").write_text(json.dumps(config))
    scheduler_bin = sharing.scheduler.argv[0]
    sharing.scheduler.stop()
    a = Proc("kube-scheduler-a", [scheduler_bin, "--config", str(work / "kube-scheduler-ha.yaml"),
             "--secure-port", "10362", "--v", "2"], tmp_path / "kube-scheduler-a.log", sharing.env)  # fmt: skip
    b_ext = Proc(
        "extender-b",
        [*kxpu_command(), "scheduler", "--config", str(work / "control-plane.yaml"),
         "--address", f"127.0.0.1:{EXTENDER_PORT + 1}", "--log-level", "debug"],
        tmp_path / "extender-b.log", sharing.env,
    )  # fmt: skip
    b = Proc("kube-scheduler-b", [scheduler_bin, "--config", str(work / "kube-scheduler-ha-b.yaml"),
             "--secure-port", "10363", "--v", "2"], tmp_path / "kube-scheduler-b.log", sharing.env)  # fmt: skip
    try:
        a.start()
        kube.wait_until("replica a leads", lambda: holder(sharing), 30)
        b_ext.start()
        kube.wait_until(
            "extender b ready", lambda: _http_ok(f"http://127.0.0.1:{EXTENDER_PORT + 1}/readyz"), 60
        )
        b.start()
        leader = holder(sharing)
        sizes = [(500, 5), (3000, 20), (6000, 35)]
        manifests = [
            sharing.pod(f"ha-{i:02d}", {RES: 1, MEM: sizes[i % 3][0], CORES: sizes[i % 3][1]})
            for i in range(50)
        ]
        sharing.create(*manifests)
        kube.wait_until(
            "a few pods bound",
            lambda: sum(1 for p in sharing.pods() if p["spec"].get("nodeName")) >= 3,
            timeout=60,
            interval=0.1,
        )
        killed = time.monotonic()
        a.stop(signal.SIGKILL)
        sharing.extender.stop(signal.SIGKILL)
        bound_at_kill = sum(1 for p in sharing.pods() if p["spec"].get("nodeName"))
        kube.wait_until("replica b leads", lambda: (h := holder(sharing)) and h != leader, lease_s + 20, 0.2)
        takeover_s = time.monotonic() - killed
        names = [m["metadata"]["name"] for m in manifests]

        def settled() -> bool:
            for pod in sharing.pods():
                status = pod.get("status", {})
                assert status.get("phase") not in ("Failed", "Succeeded"), kube.describe(pod)
                if status.get("phase") == "Running":
                    continue
                if pod["spec"].get("nodeName"):
                    return False
                if not any(c.get("reason") == "Unschedulable" for c in status.get("conditions", [])):
                    return False
            return True

        kube.wait_until("every pod Running or Unschedulable", settled, timeout=120)
        pods = {p["metadata"]["name"]: p for p in sharing.pods()}
        assert set(names) == set(pods), "a pod was lost"
        running = [n for n in names if pods[n]["status"].get("phase") == "Running"]
        usage = assert_within_capacity(sharing.granted(pods[n]) for n in running)
        assert len(usage) == DEVICES, usage
        for name in set(names) - set(running):  # no capacity lost: nothing pending would fit
            memory, cores = sizes[int(name[-2:]) % 3]
            for m, c, s in usage.values():
                assert m + memory > MEMORY_MIB or c + cores > 100 or s + 1 > SPLIT, (name, usage)
        print(
            f"\nfailover: {bound_at_kill} bound when killed; standby leading after {takeover_s:.1f}s "
            f"(lease {lease_s}s); {len(running)} running, usage {usage}"
        )
        assert takeover_s <= lease_s + 2 * retry_s + 3, takeover_s
    finally:
        for proc in (b, b_ext, a):
            proc.stop()
        sharing.scheduler.start()
        sharing.extender.stop()
        sharing.extender.start()


def holder(sharing: Sharing) -> str:
    try:
        lease = sharing.cluster.kubectl_json("get", "lease", SCHEDULER, "-n", NS)
    except Exception:
        return ""
    return str((lease.get("spec") or {}).get("holderIdentity") or "")

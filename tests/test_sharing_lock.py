"""The node lock's recovery rules and the extender's sweeper that applies them to locks no bind asks for."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kxpu.sharing.control_plane import ControlPlaneConfig, SharingConfigError, load_control_plane_config
from kxpu.sharing.extender import sweep_locks
from kxpu.sharing.lock import (
    HARD_EXPIRED,
    LOCK_PROTOCOL_ANNOTATION,
    LockError,
    NodeLock,
    allocated_key,
    holder_state,
    lease_name,
    lock_key,
)
from kxpu.sharing.state import ClusterState

RES = "example.com/npu"
NODE = "n1"
T0 = 1000.0
LOCK = NodeLock("ns", "p", "uid-1", "extender-a", T0, T0 + 60)


def holder(**changes: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "uid-1", "annotations": {}},
        "spec": {"nodeName": NODE},
        "status": {"phase": "Pending"},
    }
    for path, value in changes.items():
        section, key = path.split("__")
        pod[section][key] = value
    return pod


@pytest.mark.parametrize(
    ("pod", "now", "why"),
    [
        (None, T0, "its pod is gone"),
        (holder(metadata__uid="uid-2"), T0, "its pod was replaced"),
        (holder(metadata__deletionTimestamp="2026-11-22T00:00:00Z"), T0, "its pod is being deleted"),
        (holder(status__phase="Failed"), T0, "its pod has finished"),
        (holder(metadata__annotations={allocated_key(RES): "t"}), T0, "its pod is already allocated"),
        (holder(status__startTime="2026-11-22T00:00:00Z"), T0, "its pod was admitted"),
        (holder(spec__nodeName="n2"), T0, "its pod is bound to n2"),
        (holder(spec__nodeName=None), T0 + 61, "it expired before its pod was bound"),
        (holder(spec__nodeName=None), T0 + 59, None),
        (holder(), T0 + 61, None),  # bound here, awaiting admission: the short expiry does not apply
        (holder(), T0 + 601, HARD_EXPIRED),
    ],
)
def test_a_lock_is_free_only_when_its_pod_can_no_longer_be_admitted_under_it(
    pod: dict[str, Any] | None, now: float, why: str | None
) -> None:
    assert holder_state(LOCK, pod, RES, NODE, now, hard_expiry_s=600) == why


def test_a_forged_lock_never_gets_an_unbound_pod_failed() -> None:
    """Root on a node may rewrite its own lock Lease to name any pending pod with made-up times: that pod is
    never HARD_EXPIRED (the extender would mark it Failed), and the lock ends at the hard expiry at the latest."""
    forged = NodeLock("other-ns", "p", "uid-1", "x", 0.0, 9e18)
    unbound = holder(spec__nodeName=None)
    assert (
        holder_state(forged, unbound, RES, NODE, 601.0, hard_expiry_s=600)
        == "it expired before its pod was bound"
    )
    assert holder_state(forged, unbound, RES, NODE, 500.0, hard_expiry_s=600) is None


def test_the_cache_keeps_every_held_lock_per_node_and_family() -> None:
    state = ClusterState([RES, "example.com/fpga"])
    state.set_node(NODE, {lock_key(RES): "a", lock_key("example.com/fpga"): "b", "other": "x"})
    state.set_node("n2", {"other": "x"})
    assert sorted(state.held_locks()) == [(NODE, "example.com/fpga", "b"), (NODE, RES, "a")]
    assert state.locked(NODE) and not state.locked("n2")
    state.set_node(NODE, {lock_key(RES): "a"})
    assert state.held_locks() == [(NODE, RES, "a")]
    state.remove_node(NODE)
    assert state.held_locks() == [] and not state.locked(NODE)


def test_the_hard_expiry_may_not_be_shorter_than_the_lock_timeout(tmp_path: Path) -> None:
    assert ControlPlaneConfig().lock_hard_expiry_seconds == 600
    path = tmp_path / "cp.yaml"
    path.write_text("lockTimeoutSeconds: 60\nlockHardExpirySeconds: 30\n")
    with pytest.raises(SharingConfigError, match=r"lockHardExpirySeconds \(30\) must be at least"):
        load_control_plane_config(path)


class RecordingSweeper:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []
        self.in_lease: dict[str, bool] = {}
        self.swept = asyncio.Event()

    async def sweep_lock(self, node: str, resource: str, text: str, in_lease: bool = False) -> str | None:
        self.seen.append((node, resource, text))
        self.in_lease[node] = in_lease
        if len(self.seen) >= 3:  # the three old locks of one pass
            self.swept.set()
        if node == "broken":
            raise RuntimeError("API down")
        return None


async def test_the_sweeper_checks_only_locks_older_than_the_lock_timeout() -> None:
    state = ClusterState([RES])
    wall = time.time()
    old = NodeLock("ns", "old", "u-old", "x", wall - 10, wall - 9).encode()
    young = NodeLock("ns", "young", "u-young", "x", wall + 3600, wall + 3601).encode()
    state.set_node("broken", {lock_key(RES): old})  # a failing check must not stop the others
    state.set_node("stale", {lock_key(RES): old})
    state.set_node("fresh", {lock_key(RES): young})
    state.set_node("garbage", {lock_key(RES): "not json"})
    state.set_node("leased", {})
    state.set_lease("leased", RES, "7", old)  # a lock in the node's Lease is swept too, as such
    state.set_lease("leased-young", RES, "8", young)
    sweeper = RecordingSweeper()
    synced = asyncio.Event()
    synced.set()
    task = asyncio.create_task(sweep_locks(state, sweeper, lock_ttl_s=2, synced=synced))
    try:
        await asyncio.wait_for(sweeper.swept.wait(), 10)
    finally:
        task.cancel()
    assert sorted(n for n, _, _ in sweeper.seen[:3]) == ["broken", "leased", "stale"]
    assert all(n in ("broken", "stale", "leased") for n, _, _ in sweeper.seen)
    assert sweeper.in_lease == {"broken": False, "stale": False, "leased": True}


def test_the_cache_counts_a_lease_lock_and_a_heartbeat_does_not_clear_it() -> None:
    state = ClusterState([RES])
    held = NodeLock("ns", "p", "u", "x", 1.0, 2.0).encode()
    state.set_node("n", {LOCK_PROTOCOL_ANNOTATION: "lease"}, "10")
    assert state.lease_node("n") and not state.locked("n") and state.lease_view("n", RES) is None
    state.set_lease("n", RES, "5", held)
    assert state.locked("n") and state.lease_view("n", RES) == ("5", held)
    assert state.held_leases() == [("n", RES, held)]
    state.set_node("n", {LOCK_PROTOCOL_ANNOTATION: "lease"}, "11")  # a heartbeat: the Lease still holds it
    assert state.locked("n")
    state.set_lease("n", RES, "6", None)  # released: the Lease stays, free
    assert not state.locked("n") and state.lease_view("n", RES) == ("6", None) and state.held_leases() == []
    state.set_node("n", {lock_key(RES): held}, "12")  # an older daemon: no protocol, the annotation
    assert not state.lease_node("n") and state.locked("n")
    state.set_lease("n", RES, None, None)  # the Lease deleted
    assert state.lease_view("n", RES) is None and state.locked("n")  # the annotation still holds it


_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@settings(max_examples=300, deadline=None)
@example(node="0", resource="0-/.0")  # "-/." became ".." once
@given(
    st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,250}[a-z0-9])?", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9.-]{1,60}/[A-Za-z0-9_.-]{1,60}", fullmatch=True),
)
def test_lock_lease_names_are_valid_and_distinct(node: str, resource: str) -> None:
    name = lease_name(node, resource)
    assert len(name) <= 253 and _SUBDOMAIN.match(name), name
    assert lease_name(node, resource + "x") != name and lease_name(node + "x", resource) != name


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["lease", "annotation", "node-lease-protocol", "remove-node", "delete-lease"]),
            st.sampled_from(["a", "b"]),
            st.booleans(),
        ),
        max_size=30,
    )
)
def test_the_cache_says_locked_exactly_while_a_lease_or_an_annotation_holds_a_lock(
    ops: list[tuple[str, str, bool]],
) -> None:
    """Any order of Lease and Node watch events: ``locked`` is true exactly while the node's last seen Lease or
    last seen annotation names a pod (a rolling upgrade has both kinds at once), and the sweeper sees each."""
    state = ClusterState([RES])
    held = NodeLock("ns", "p", "u", "x", 1.0, 2.0).encode()
    lease: dict[str, bool] = {}
    annotation: dict[str, bool] = {}
    protocol: dict[str, bool] = {}
    for op, node, flag in ops:
        if op == "lease":
            state.set_lease(node, RES, "1", held if flag else None)
            lease[node] = flag
        elif op == "delete-lease":
            state.set_lease(node, RES, None, None)
            lease[node] = False
        elif op in ("annotation", "node-lease-protocol"):
            if op == "annotation":
                annotation[node] = flag
            else:
                protocol[node] = flag
            annotations = {lock_key(RES): held} if annotation.get(node) else {}
            if protocol.get(node):
                annotations[LOCK_PROTOCOL_ANNOTATION] = "lease"
            state.set_node(node, annotations, "1")
        else:
            state.remove_node(node)
            annotation[node] = protocol[node] = False
        for n in ("a", "b"):
            assert state.locked(n) == (lease.get(n, False) or annotation.get(n, False)), (n, ops)
            assert state.lease_node(n) == protocol.get(n, False)
    assert {n for n, _, _ in state.held_leases()} == {n for n, v in lease.items() if v}
    assert {n for n, _, _ in state.held_locks()} == {n for n, v in annotation.items() if v}


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        ("", "namespace is empty"),
        ("ns/", "pod name is empty"),
        ("ns/../../nodes/n1", "is not a DNS-1123 subdomain"),
        ("../ns/p", "is not a DNS-1123 label"),
        ("NS/p", "is not a DNS-1123 label"),
    ],
)
def test_a_lock_naming_an_impossible_pod_is_unreadable(pod: str, why: str) -> None:
    """The lock's pod names go into API paths (the sweeper reads the holder, the node its pod); node identities
    can reach the objects that hold locks, so a lock is parsed as untrusted input."""
    text = json.dumps({"pod": pod, "uid": "u", "owner": "x", "acquired": 1.0, "expires": 2.0})
    with pytest.raises(LockError, match=why):
        NodeLock.decode(text)

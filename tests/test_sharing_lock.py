"""The node lock's recovery rules and the extender's sweeper that applies them to locks no bind asks for."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from kxpu.sharing.config import ControlPlaneConfig, SharingConfigError, load_control_plane_config
from kxpu.sharing.extender import sweep_locks
from kxpu.sharing.lock import HARD_EXPIRED, NodeLock, allocated_key, holder_state, lock_key
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
        self.swept = asyncio.Event()

    async def sweep_lock(self, node: str, resource: str, text: str) -> str | None:
        self.seen.append((node, resource, text))
        if len(self.seen) >= 2:  # the two old locks of one pass
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
    sweeper = RecordingSweeper()
    synced = asyncio.Event()
    synced.set()
    task = asyncio.create_task(sweep_locks(state, sweeper, lock_ttl_s=2, synced=synced))
    try:
        await asyncio.wait_for(sweeper.swept.wait(), 10)
    finally:
        task.cancel()
    assert sorted(n for n, _, _ in sweeper.seen[:2]) == ["broken", "stale"]
    assert all(n in ("broken", "stale") for n, _, _ in sweeper.seen)

"""The DRA claim cache: what it keeps, when it answers, and that prepare never uses a stale or foreign claim.

The watch itself runs against the real API server in e2e/test_dra_claim_cache.py; here the cache's filter
and lookup, and the preparer over it (the claim the cache has is absent from the API, so a prepare that
succeeds proves it read no claim over the API).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from kxpu.dra import metrics
from kxpu.dra.claim_cache import ClaimCache, trim
from kxpu.dra.prepare import ClaimRef
from kxpu.testing.dra import ApiRefused
from tests.test_dra_prepare import DRIVER, NODE, Rig, result
from tests.waiting import wait_until

PARAMS = {"apiVersion": "kxpu.io/v1alpha1", "kind": "DeviceConfig", "env": {"A": "1"}}


def claim(name: str, uid: str, results: list[dict[str, Any]] | None, **extra_status: Any) -> dict[str, Any]:
    status: dict[str, Any] = dict(extra_status)
    if results is not None:
        status["allocation"] = {
            "devices": {
                "results": results,
                "config": [
                    {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": PARAMS}},
                    {"source": "FromClaim", "opaque": {"driver": "other.io", "parameters": {"x": 1}}},
                ],
            },
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": []}]},
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid,
            "resourceVersion": "7",
            "managedFields": [{"manager": "kube-scheduler", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": status,
    }


def reads(source: str) -> float:
    return float(metrics.CLAIM_READS.labels(DRIVER, source)._value.get())


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    rig = Rig(tmp_path)
    rig.cache = ClaimCache(DRIVER, NODE)  # type: ignore[attr-defined]
    rig.cache.synced = True  # type: ignore[attr-defined]
    rig.preparer.claim_cache = rig.cache  # type: ignore[attr-defined]
    return rig


def test_only_this_nodes_allocated_claims_are_kept_and_only_what_prepare_reads() -> None:
    mixed = [result("sim-0"), result("gpu-0", driver="gpu.io", pool="node-b")]
    kept = trim(claim("a", "u1", mixed, reservedFor=[{"name": "p"}]), DRIVER, NODE)
    assert kept == {
        "metadata": {"namespace": "default", "name": "a", "uid": "u1"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [result("sim-0")],
                    "config": [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": PARAMS}}],
                }
            }
        },
    }
    assert trim(claim("b", "u2", [result("sim-0", pool="node-b")]), DRIVER, NODE) is None
    assert trim(claim("c", "u3", None), DRIVER, NODE) is None  # not allocated
    assert trim(claim("d", "u4", [result("sim-0", driver="gpu.io")]), DRIVER, NODE) is None
    # Another pool's device beside ours is kept: allocation_for refuses such a claim, never half-prepares it.
    split = trim(claim("e", "u5", [result("sim-0"), result("sim-1", pool="node-b")]), DRIVER, NODE)
    assert split is not None and len(split["status"]["allocation"]["devices"]["results"]) == 2


def test_the_cache_answers_only_the_uid_asked_for_while_synced_and_once() -> None:
    cache = ClaimCache(DRIVER, NODE)
    cache.apply("ADDED", claim("a", "u1", [result("sim-0")]))
    assert cache.take("default", "a", "u1") is None, "answered before its first list ended"
    cache.synced = True
    assert cache.take("default", "a", "u-recreated") is None
    assert cache.take("other-ns", "a", "u1") is None
    assert cache.take("default", "a", "u1") is not None
    assert cache.take("default", "a", "u1") is None, "an entry answers one prepare"
    cache.apply("MODIFIED", claim("a", "u1", [result("sim-0")]))
    cache.forget()  # the watch broke
    assert cache.take("default", "a", "u1") is None
    assert len(cache) == 1


def test_an_allocation_that_goes_or_moves_leaves_the_cache() -> None:
    cache = ClaimCache(DRIVER, NODE)
    cache.synced = True
    for kind, body in [
        ("MODIFIED", claim("a", "u1", None)),  # deallocated
        ("MODIFIED", claim("a", "u1", [result("sim-0", pool="node-b")])),  # allocated on another node
        ("DELETED", claim("a", "u1", [result("sim-0")])),
    ]:
        cache.apply("ADDED", claim("a", "u1", [result("sim-0")]))
        cache.apply(kind, body)
        assert len(cache) == 0, kind


def test_the_pods_a_claim_is_reserved_for_outlive_its_prepare_and_follow_the_watch() -> None:
    """Telemetry ties a DRA device's processes to pods by the claim's reservedFor pod UIDs: kept for every claim
    allocated here, after prepare took the entry, updated by the watch, gone with the allocation."""
    cache = ClaimCache(DRIVER, NODE)
    one = [{"resource": "pods", "name": "p", "uid": "pod-1"}]
    cache.apply("ADDED", claim("a", "u1", [result("sim-0")], reservedFor=one))
    assert cache.pods_of("u1") is None, "answered before its first list ended"
    cache.synced = True
    assert cache.pods_of("u1") == frozenset({"pod-1"})
    assert cache.take("default", "a", "u1") is not None
    assert cache.pods_of("u1") == frozenset({"pod-1"}), (
        "prepare took the entry, telemetry still needs the pods"
    )
    two = [*one, {"resource": "pods", "name": "q", "uid": "pod-2"}]
    cache.apply("MODIFIED", claim("a", "u1", [result("sim-0")], reservedFor=two))
    assert cache.pods_of("u1") == frozenset({"pod-1", "pod-2"})
    cache.apply("ADDED", claim("b", "u2", [result("sim-0", pool="node-b")], reservedFor=one))
    assert cache.pods_of("u2") is None, "a claim allocated on another node"
    cache.apply("DELETED", claim("a", "u1", [result("sim-0")], reservedFor=two))
    assert cache.pods_of("u1") is None


async def test_prepare_answers_from_the_cache_without_reading_the_api(rig: Rig) -> None:
    cache: ClaimCache = rig.cache  # type: ignore[attr-defined]
    ref = ClaimRef("default", "u1", "a")  # not in the API at all
    cache.apply("ADDED", claim("a", "u1", [result("sim-2")]))
    api_before = reads("api")
    answer = (await rig.preparer.prepare([ref]))["u1"]
    assert answer.error is None
    assert [d.device for d in answer.devices] == ["sim-2"]
    assert rig.spec("u1")["devices"][0]["containerEdits"]["env"] == ["NPU_VISIBLE_DEVICES=sim-2", "A=1"]
    assert reads("api") == api_before


async def test_a_recreated_claim_is_read_from_the_api_not_the_cache(rig: Rig) -> None:
    cache: ClaimCache = rig.cache  # type: ignore[attr-defined]
    cache.apply("ADDED", claim("a", "old-uid", [result("sim-0")]))  # the claim before it was deleted
    ref = rig.api.add_claim("a", [result("sim-1")])  # created again: a new UID and allocation
    answer = (await rig.preparer.prepare([ref]))[ref.uid]
    assert answer.error is None
    assert [d.device for d in answer.devices] == ["sim-1"]


async def test_a_claim_for_another_node_or_not_allocated_is_never_prepared_from_the_cache(rig: Rig) -> None:
    cache: ClaimCache = rig.cache  # type: ignore[attr-defined]
    elsewhere = rig.api.add_claim("b", [result("sim-0", pool="node-b")])
    cache.apply("ADDED", copy.deepcopy(rig.api.claims[("default", "b")]))
    unallocated = rig.api.add_claim("c", [])
    del rig.api.claims[("default", "c")]["status"]["allocation"]
    cache.apply("ADDED", claim("c", unallocated.uid, [result("sim-3")]))  # the cache saw it allocated…
    cache.apply("MODIFIED", claim("c", unallocated.uid, None))  # …then deallocated
    answers = await rig.preparer.prepare([elsewhere, unallocated])
    assert "not this node's" in (answers[elsewhere.uid].error or "")
    assert "is not allocated" in (answers[unallocated.uid].error or "")
    assert rig.preparer.checkpoint.claims == {}


async def test_a_watch_gap_reads_the_claim_from_the_api(rig: Rig) -> None:
    cache: ClaimCache = rig.cache  # type: ignore[attr-defined]
    ref = rig.api.add_claim("a", [result("sim-1")])
    # What the cache saw before the gap (since then the claim was allocated other devices: a stale entry).
    cache.apply("ADDED", claim("a", ref.uid, [result("sim-0")]))
    cache.forget()
    api_before = reads("api")
    answer = (await rig.preparer.prepare([ref]))[ref.uid]
    assert [d.device for d in answer.devices] == ["sim-1"]
    assert reads("api") == api_before + 1


class GappyWatch:
    """The ClaimWatchApi interface over a list of claims; the first watch ends in 410 Gone."""

    def __init__(self) -> None:
        self.claims: dict[str, dict[str, Any]] = {}
        self.lists = 0
        self.listing = asyncio.Event()
        self.release_list = asyncio.Event()
        self.release_list.set()
        self.events: asyncio.Queue[tuple[str, dict[str, Any]] | Exception] = asyncio.Queue()

    async def list_claims(self, each: Callable[[Mapping[str, Any]], None]) -> str | None:
        self.lists += 1
        self.listing.set()
        await self.release_list.wait()
        for body in self.claims.values():
            each(body)
        return str(self.lists)

    async def watch_claims(self, version: str | None) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        while True:
            event = await self.events.get()
            if isinstance(event, Exception):
                raise event
            yield event


async def test_after_a_410_the_cache_answers_nothing_until_it_has_listed_again() -> None:
    api = GappyWatch()
    api.claims["u1"] = claim("a", "u1", [result("sim-0")])
    cache = ClaimCache(DRIVER, NODE, api)
    task = asyncio.create_task(cache.run())
    try:
        await wait_until(lambda: cache.synced, what="the cache synced")
        api.claims.clear()  # deleted during the gap: the relist must drop it
        api.claims["u2"] = claim("b", "u2", [result("sim-1")])
        api.listing.clear()
        api.release_list.clear()
        api.events.put_nowait(ApiRefused(410, "too old resource version"))
        await asyncio.wait_for(api.listing.wait(), 5)
        assert not cache.synced
        assert cache.take("default", "a", "u1") is None
        api.release_list.set()
        await wait_until(lambda: cache.synced, what="the cache synced")
        assert api.lists == 2
        assert cache.take("default", "a", "u1") is None
        assert cache.take("default", "b", "u2") is not None
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_the_cache_size_on_metrics_follows_its_claims() -> None:
    """``kxpu_dra_claim_cache_claims`` is read when /metrics is asked: events, a prepare's take and a relist all
    show in it without the cache setting it each time."""
    from prometheus_client import REGISTRY

    def size() -> float | None:
        return REGISTRY.get_sample_value("kxpu_dra_claim_cache_claims", {"driver": DRIVER})

    cache = ClaimCache(DRIVER, NODE)
    cache.synced = True
    assert size() == 0
    cache.apply("ADDED", claim("a", "u1", [result("sim-0")]))
    cache.apply("ADDED", claim("b", "u2", [result("sim-1")]))
    cache.apply("ADDED", claim("c", "u3", [result("sim-2", pool="node-b")]))  # not this node's
    assert size() == 2
    assert cache.take("default", "a", "u1") is not None
    assert size() == 1
    cache.apply("DELETED", claim("b", "u2", [result("sim-1")]))
    assert size() == 0

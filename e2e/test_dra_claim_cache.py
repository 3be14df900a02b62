"""The DRA claim cache against the real kube-apiserver: its list and watch (``DraKube``) keep this node's
allocated claims and nothing else, follow deletion and re-creation under the same name, and relist after
the watch breaks. (The preparer's use of it is in tests/test_dra_claim_cache.py; the figures, with 10,000
claims of other nodes, in bench/bench_dra_vs_go.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from e2e.cluster import Cluster
from kxpu.dra.claim_cache import ClaimCache
from kxpu.kube.dra import DraKube

DRIVER = "npu.example.com"
NODE = "kxpu-e2e-claim-cache"


async def eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


class Claims:
    def __init__(self, client: AsyncClient, namespace: str) -> None:
        self.client, self.namespace = client, namespace

    async def create(self, name: str, pool: str | None, device: str = "sim-0") -> str:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": DRIVER}}]}},
        }
        created = await self.client.create(codecs.from_dict(body))
        if pool is not None:
            result = {"request": "npu", "driver": DRIVER, "pool": pool, "device": device}
            await self.client.patch(
                ResourceClaim.Status,
                name,
                {"status": {"allocation": {"devices": {"results": [result]}}}},
                namespace=self.namespace,
                patch_type=PatchType.MERGE,
            )
        return str(created.metadata.uid)  # type: ignore[union-attr]

    async def delete(self, name: str) -> None:
        await self.client.delete(ResourceClaim, name, namespace=self.namespace)


@pytest.fixture
async def claims(cluster: Cluster) -> AsyncIterator[Claims]:
    client = AsyncClient(config=KubeConfig.from_file(cluster.kubeconfig), field_manager="kxpu-test")
    namespace = f"kxpu-cache-{uuid.uuid4().hex[:6]}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    try:
        yield Claims(client, namespace)
    finally:
        with contextlib.suppress(Exception):
            await client.delete(Namespace, namespace)
        await client.close()


class Breakable:
    """DraKube's list and watch, with a watch that can be made to fail (a dropped connection) and a relist
    that waits until let through."""

    def __init__(self, kube: DraKube) -> None:
        self.kube = kube
        self.lists = 0
        self.fail_next_event = False
        self.relist = asyncio.Event()
        self.relist.set()

    async def list_claims(self, each: Callable[[Mapping[str, Any]], None]) -> str | None:
        self.lists += 1
        await self.relist.wait()
        return await self.kube.list_claims(each)

    async def watch_claims(self, version: str | None) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        async for event in self.kube.watch_claims(version):
            if self.fail_next_event:
                self.fail_next_event = False
                raise ConnectionError("the watch connection dropped")
            yield event


@pytest.fixture
async def api(cluster: Cluster) -> AsyncIterator[Breakable]:
    kube = DraKube(DRIVER, AsyncClient(config=KubeConfig.from_file(cluster.kubeconfig)))
    try:
        yield Breakable(kube)
    finally:
        await kube.close()


@pytest.fixture
async def cache(api: Breakable) -> AsyncIterator[ClaimCache]:
    cache = ClaimCache(DRIVER, NODE, api)
    task = asyncio.create_task(cache.run())
    try:
        yield cache
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def held(cache: ClaimCache, name: str, uid: str) -> Callable[[], bool]:
    return lambda: uid in cache._claims and cache._claims[uid]["metadata"]["name"] == name


async def test_the_watch_keeps_this_nodes_allocated_claims_only(cache: ClaimCache, claims: Claims) -> None:
    ns = claims.namespace
    far = await claims.create("far", "another-node")
    unallocated = await claims.create("unallocated", None)
    mine = await claims.create("mine", NODE)
    await eventually(lambda: cache.synced and mine in cache._claims, what="this node's claim in the cache")
    assert far not in cache._claims and unallocated not in cache._claims
    # Deleted and created again under the same name: the old UID leaves, the new one is what is held.
    await claims.delete("mine")
    await eventually(lambda: mine not in cache._claims, what="the deleted claim to leave the cache")
    again = await claims.create("mine", NODE, device="sim-1")
    await eventually(held(cache, "mine", again), what="the re-created claim")
    assert cache.take(ns, "mine", mine) is None
    taken: Any = cache.take(ns, "mine", again)
    assert taken["status"]["allocation"]["devices"]["results"][0]["device"] == "sim-1"


async def test_a_broken_watch_answers_nothing_until_relisted(
    api: Breakable, cache: ClaimCache, claims: Claims
) -> None:
    ns = claims.namespace
    a = await claims.create("a", NODE)
    await eventually(lambda: cache.synced and a in cache._claims, what="the claim in the cache")
    api.relist.clear()
    api.fail_next_event = True
    b = await claims.create("b", NODE)  # its event breaks the watch: only the relist can bring it
    await eventually(lambda: api.lists == 2, what="the relist to start")
    assert not cache.synced
    assert cache.take(ns, "a", a) is None, "answered from the cache while the watch was down"
    api.relist.set()
    await eventually(lambda: cache.synced, what="the relist to end")
    assert cache.take(ns, "b", b) is not None
    assert cache.take(ns, "a", a) is not None

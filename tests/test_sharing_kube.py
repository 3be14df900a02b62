"""The Kubernetes layer of sharing against a real kube-apiserver (the e2e harness's, when it is up).

Uses ``$KXPU_E2E_KUBECONFIG`` or the harness's admin kubeconfig; skipped when no API server
answers. Each test works in its own namespace and on its own fake Node object (no kubelet:
pods bound to it stay Pending, which is all the API-level flow needs), both deleted after.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.models.core_v1 import Container, NodeSpec, PodSpec, ResourceRequirements, Taint
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod, Secret
from lightkube.types import PatchType

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.model import BackendError
from kxpu.sharing import signing
from kxpu.sharing.config import KeySource, SharingConfig
from kxpu.sharing.kube.api import KubeSchedulerAPI, release
from kxpu.sharing.kube.informer import Informer
from kxpu.sharing.kube.keys import KeyStore
from kxpu.sharing.kube.node import KubeNodeLink
from kxpu.sharing.lock import HARD_EXPIRED, allocated_key
from kxpu.sharing.node import SharingBackend, parent_id
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import LockBusy, PodRef, Scheduler
from kxpu.sharing.state import ClusterState

NPU = "example.com/npu"
KEYS = [b"a" * 32]
KUBECONFIG = Path(os.environ.get("KXPU_E2E_KUBECONFIG", "/var/lib/kxpu-e2e/admin.kubeconfig"))
HAVE_KUBECONFIG = KUBECONFIG.exists()


async def eventually(check: Callable[[], Any], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


@dataclass
class Env:
    client: AsyncClient
    namespace: str
    node: str

    async def pod(self, name: str, limits: dict[str, str]) -> PodRef:
        obj = await self.client.create(
            Pod(
                metadata=ObjectMeta(name=name, namespace=self.namespace),
                spec=PodSpec(
                    containers=[
                        Container(
                            name="c0",
                            image="kxpu.local/busybox:v1",
                            resources=ResourceRequirements(limits=limits),
                        )
                    ],
                    schedulerName="kxpu-test-nobody",  # no scheduler picks these up: they stay ours
                ),
            )
        )
        assert obj.metadata is not None and obj.metadata.uid is not None
        return PodRef(self.namespace, name, obj.metadata.uid)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    if not HAVE_KUBECONFIG:
        pytest.skip(f"no kubeconfig at {KUBECONFIG} (the e2e cluster is not up)")
    client = AsyncClient(config=KubeConfig.from_file(KUBECONFIG), field_manager="kxpu-test")
    try:
        await asyncio.wait_for(client.get(Namespace, "default"), 5)
    except Exception as exc:
        pytest.skip(f"the API server does not answer: {exc}")
    suffix = uuid.uuid4().hex[:8]
    namespace, node = f"kxpu-sharing-{suffix}", f"kxpu-sharing-{suffix}"
    await client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    await client.create(
        Node(
            metadata=ObjectMeta(name=node),
            spec=NodeSpec(taints=[Taint(key="kxpu.io/test", effect="NoSchedule", value="true")]),
        )
    )
    try:
        yield Env(client, namespace, node)
    finally:
        await client.delete(Node, node)
        await client.delete(Namespace, namespace)


def sharing_config() -> SharingConfig:
    return SharingConfig.model_validate(
        {"splitCount": 4, "signingKey": {"file": "/dev/null"}, "allocateTimeoutSeconds": 5}
    )


class StaticKeys(KubeNodeLink):
    async def keys(self) -> list[bytes]:
        return KEYS


async def test_node_lock_compare_and_swap_and_recovery(env: Env) -> None:
    takeovers: list[str] = []
    api_a = KubeSchedulerAPI(env.client, "extender-a", on_takeover=takeovers.append)
    api_b = KubeSchedulerAPI(env.client, "extender-b")
    first = await env.pod("first", {})
    second = await env.pod("second", {})
    results = await asyncio.gather(
        api_a.acquire_lock(env.node, NPU, first),
        api_b.acquire_lock(env.node, NPU, second),
        return_exceptions=True,
    )
    assert sum(r is None for r in results) == 1 and sum(isinstance(r, LockBusy) for r in results) == 1
    winner, loser = (first, second) if results[0] is None else (second, first)
    await api_a.release_lock(env.node, NPU, loser)  # not the holder: no effect
    with pytest.raises(LockBusy):
        await api_a.acquire_lock(env.node, NPU, loser)
    await env.client.delete(Pod, winner.name, namespace=env.namespace, grace_period=0)

    async def holder_gone() -> bool:
        try:
            await env.client.get(Pod, winner.name, namespace=env.namespace)
        except Exception:
            return True
        return False

    await eventually(holder_gone)
    assert takeovers == []
    await api_a.acquire_lock(env.node, NPU, loser)  # recovered at once: its pod is gone
    assert takeovers == ["its pod is gone"]  # counted by the extender as kxpu_scheduler_lock_takeovers
    link = StaticKeys(env.node, sharing_config(), env.client)
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == loser.uid and lock.owner == "extender-a"


async def test_a_bind_after_the_hard_expiry_fails_the_unadmitted_holder_first(env: Env) -> None:
    api = KubeSchedulerAPI(env.client, "extender", lock_ttl_s=0.2, hard_expiry_s=0.5)
    stuck = await env.pod("stuck", {})
    await api.acquire_lock(env.node, NPU, stuck)
    await api.bind(stuck, env.node)
    nxt = await env.pod("next", {})
    with pytest.raises(LockBusy):
        await api.acquire_lock(env.node, NPU, nxt)
    await asyncio.sleep(0.6)
    await api.acquire_lock(env.node, NPU, nxt)
    pod = await env.client.get(Pod, "stuck", namespace=env.namespace)
    assert pod.status is not None and (pod.status.phase, pod.status.reason) == (
        "Failed",
        "KxpuAllocationExpired",
    )


async def test_release_with_the_text_read_removes_only_that_lock(env: Env) -> None:
    api = KubeSchedulerAPI(env.client, "extender")
    link = StaticKeys(env.node, sharing_config(), env.client)
    first = await env.pod("first", {})
    await api.acquire_lock(env.node, NPU, first)
    lock = await link.lock(NPU)
    assert lock is not None
    await release(env.client, env.node, NPU, "someone-else", "not the lock's text")  # test fails: kept
    assert await link.lock(NPU) == lock
    reads: list[Any] = []
    real_get = env.client.get

    async def counting_get(*args: Any, **kwargs: Any) -> Any:
        reads.append(args)
        return await real_get(*args, **kwargs)

    env.client.get = counting_get  # type: ignore[method-assign]
    try:
        await release(env.client, env.node, NPU, first.uid, lock.encode())  # one JSON patch, no read
    finally:
        del env.client.get
    assert reads == [] and await link.lock(NPU) is None
    await release(env.client, env.node, NPU, first.uid, lock.encode())  # already gone: no error
    second = await env.pod("second", {})
    await api.acquire_lock(env.node, NPU, second)
    await release(env.client, env.node, NPU, first.uid, lock.encode())  # first's text: second's lock stays
    held = await link.lock(NPU)
    assert held is not None and held.uid == second.uid


async def test_a_stale_cached_view_never_takes_a_held_lock(env: Env) -> None:
    node = await env.client.get(Node, env.node)
    assert node.metadata is not None
    before = str(node.metadata.resourceVersion)  # the node as a cache saw it, lock free
    holder_api = KubeSchedulerAPI(env.client, "extender-a")
    holder = await env.pod("holder", {})
    await holder_api.acquire_lock(env.node, NPU, holder)
    stale = KubeSchedulerAPI(env.client, "extender-b", cached=lambda n, r: (before, None))
    with pytest.raises(LockBusy):  # the CAS at the old version fails, and the read shows the holder
        await stale.acquire_lock(env.node, NPU, await env.pod("other", {}))
    await holder_api.release_lock(env.node, NPU, holder)
    fresh_node = await env.client.get(Node, env.node)
    assert fresh_node.metadata is not None
    current = str(fresh_node.metadata.resourceVersion)
    taker = await env.pod("taker", {})
    await KubeSchedulerAPI(env.client, "extender-b", cached=lambda n, r: (current, None)).acquire_lock(
        env.node, NPU, taker
    )
    lock = await StaticKeys(env.node, sharing_config(), env.client).lock(NPU)
    assert lock is not None and lock.uid == taker.uid


async def test_the_sweeper_fails_a_pod_never_admitted_and_frees_its_node(env: Env) -> None:
    takeovers: list[str] = []
    api = KubeSchedulerAPI(
        env.client, "extender", lock_ttl_s=0.2, hard_expiry_s=1.0, on_takeover=takeovers.append
    )
    stuck = await env.pod("stuck", {})
    await api.acquire_lock(env.node, NPU, stuck)
    await api.bind(stuck, env.node)  # bound to a node with no kubelet: its Allocate never comes
    link = StaticKeys(env.node, sharing_config(), env.client)
    lock = await link.lock(NPU)
    assert lock is not None
    assert await api.sweep_lock(env.node, NPU, lock.encode()) is None  # bound, within the hard expiry
    admitted = await env.pod("admitted", {})
    await asyncio.sleep(1.1)  # past the hard expiry (1 s), measured on the lock's wall-clock stamp
    assert await api.sweep_lock(env.node, NPU, lock.encode()) == HARD_EXPIRED
    pod = await env.client.get(Pod, "stuck", namespace=env.namespace)
    assert pod.status is not None and (pod.status.phase, pod.status.reason) == (
        "Failed",
        "KxpuAllocationExpired",
    )
    assert "within 1 s of being bound" in (pod.status.message or "")
    assert await link.lock(NPU) is None and takeovers == [HARD_EXPIRED]
    events = [e async for e in env.client.list(Event, namespace=env.namespace)]
    assert any(e.reason == "KxpuAllocationExpired" and e.type == "Warning" for e in events)
    # a pod the kubelet admitted (status.startTime) frees the lock at once, and is left alone
    await api.acquire_lock(env.node, NPU, admitted)
    await api.bind(admitted, env.node)
    await env.client.patch(
        Pod.Status, "admitted", {"status": {"startTime": "2026-11-22T00:00:00Z"}}, namespace=env.namespace
    )
    lock = await link.lock(NPU)
    assert lock is not None
    assert await api.sweep_lock(env.node, NPU, lock.encode()) == "its pod was admitted"
    pod = await env.client.get(Pod, "admitted", namespace=env.namespace)
    assert pod.status is not None and pod.status.phase == "Pending"
    assert await link.lock(NPU) is None


async def test_publish_watch_bind_and_handshake(env: Env) -> None:
    family = ResourceFamily.derived(NPU)
    state = ClusterState([NPU])
    informer = Informer(env.client, state, lambda: KEYS)
    informer_task = asyncio.create_task(informer.run())
    cfg = sharing_config()
    link = StaticKeys(env.node, cfg, env.client)
    inner = SimulatedBackend(SimulatedConfig.model_validate({"count": 2, "model": "npu", "memoryMiB": 16000}))
    backend = SharingBackend(inner, NPU, cfg, lambda: link, env.node)
    slots = backend.discover()
    watch_task = asyncio.create_task(_drain(backend))
    try:
        await eventually(lambda: informer.ready)
        await eventually(
            lambda: (n := state.node(env.node)) is not None and len(n.families.get(NPU, [])) == 2
        )

        api = KubeSchedulerAPI(env.client, "extender")
        scheduler = Scheduler(state, [family], keys=lambda: KEYS, api=api)
        ref = await env.pod("p", {NPU: "1", "example.com/npumem": "3000", "example.com/npucores": "20"})
        assert await scheduler.bind(ref.namespace, ref.name, ref.uid, env.node) == ""
        bound = await env.client.get(Pod, ref.name, namespace=ref.namespace)
        assert bound.spec is not None and bound.spec.nodeName == env.node
        # no webhook labelled it, so the scheduler did before binding; the assignment came with the Binding
        assert bound.metadata is not None and (bound.metadata.labels or {}).get("kxpu.io/assigned") == "true"
        assert (bound.metadata.annotations or {}).get("kxpu.io/bind-phase") == "allocating"
        # the watch brings the assignment back into the cache (counted once)
        await eventually(lambda: state.assignment(ref.uid) is not None)
        node_state = state.node(env.node)
        assert node_state is not None and sum(s.memory for s in node_state.families[NPU]) == 3000

        chosen = await backend.preferred_allocation_async(slots, [], 1)
        edits = await backend.allocate_async([d for d in slots if d.id in chosen])
        assert (
            edits.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m" and edits.env["CUDA_DEVICE_SM_LIMIT"] == "20"
        )
        await backend.settled()
        assert await link.lock(NPU) is None
        pod = await env.client.get(Pod, ref.name, namespace=ref.namespace)
        assert pod.metadata is not None and allocated_key(NPU) in (pod.metadata.annotations or {})
        assert (pod.metadata.annotations or {})["kxpu.io/bind-phase"] == "allocated"
        assert {parent_id(c) for c in chosen} <= {"npu-0", "npu-1"}

        # a pod that wrote its own assignment and got the lock some other way is refused, with an event
        forged = await env.pod("forged", {NPU: "1"})
        assignment = signing.decode_assignment(
            (pod.metadata.annotations or {})[signing.ASSIGNMENT_ANNOTATION]
        )
        fake = signing.encode_assignment(
            type(assignment)(
                forged.uid, forged.namespace, forged.name, env.node, assignment.containers, int(time.time())
            )
        )
        forgery = {signing.ASSIGNMENT_ANNOTATION: fake, signing.SIGNATURE_ANNOTATION: "v1.00000000.AAAA"}
        await env.client.patch(  # labelled too, so that the scheduler's pod watch sees it
            Pod,
            forged.name,
            {"metadata": {"annotations": forgery, "labels": {"kxpu.io/assigned": "true"}}},
            namespace=forged.namespace,
            patch_type=PatchType.MERGE,
        )
        await api.acquire_lock(env.node, NPU, forged)
        with pytest.raises(BackendError, match="unknown key"):
            await backend.allocate_async([slots[0]])

        async def warned() -> bool:
            events = [
                e
                async for e in env.client.list(Event, namespace=env.namespace)
                if e.involvedObject.name == "forged" and e.reason == "KxpuAllocationRefused"
            ]
            return bool(events)

        await eventually(warned)
        # the forged assignment does not count in the scheduler's cache either
        assert state.assignment(forged.uid) is None
        # a deleted pod frees its share in the cache
        await env.client.delete(Pod, ref.name, namespace=ref.namespace, grace_period=0)
        await eventually(lambda: state.assignment(ref.uid) is None)
        node_state = state.node(env.node)
        assert node_state is not None and sum(s.memory for s in node_state.families[NPU]) == 0
    finally:
        for task in (informer_task, watch_task):
            task.cancel()
        await asyncio.gather(informer_task, watch_task, return_exceptions=True)


async def _drain(backend: SharingBackend) -> None:
    async for _ in backend.watch():
        pass


async def test_keys_from_a_secret(env: Env) -> None:
    data = base64.b64encode(b"# rotated\n" + b"n" * 32 + b"\n" + b"o" * 32).decode()
    await env.client.create(
        Secret(metadata=ObjectMeta(name="keys", namespace=env.namespace), data={"keys": data})
    )
    store = KeyStore(KeySource(secret=f"{env.namespace}/keys"), lambda: env.client)
    assert await store.get() == [b"n" * 32, b"o" * 32]
    assert store.current()[0] == b"n" * 32

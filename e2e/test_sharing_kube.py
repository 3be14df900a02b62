"""The Kubernetes layer of sharing against the e2e cluster's real kube-apiserver.

Each test works in its own namespace and on its own fake Node object (no kubelet:
pods bound to it stay Pending, which is all the API-level flow needs), both deleted after.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.models.core_v1 import Container, NodeSpec, PodSpec, ResourceRequirements, Taint, Toleration
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod, Secret
from lightkube.types import PatchType

from e2e.cluster import Cluster
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.kube.sharing.api import KubeSchedulerAPI, release
from kxpu.kube.sharing.informer import Informer
from kxpu.kube.sharing.keys import KeyStore, publish_public_keys
from kxpu.kube.sharing.lease import LeaseLocks, LeaseNamespaceMissing
from kxpu.kube.sharing.node import KubeNodeLink
from kxpu.model import BackendError
from kxpu.sharing import signing
from kxpu.sharing.config import KeySource, SharingConfig
from kxpu.sharing.lock import HARD_EXPIRED, allocated_key, lease_name, lock_key
from kxpu.sharing.node import SharingBackend, parent_id
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import LockBusy, PodRef, Scheduler
from kxpu.sharing.state import ClusterState

NPU = "example.com/npu"
KEYS = [b"a" * 32]


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

    async def delete_pod(self, name: str) -> None:
        """Delete a pod at once and wait until the API server no longer has it."""
        await self.client.delete(Pod, name, namespace=self.namespace, grace_period=0)

        async def gone() -> bool:
            try:
                await self.client.get(Pod, name, namespace=self.namespace)
            except Exception:
                return True
            return False

        await eventually(gone)

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
                    # the test node's taints (ours, and not-ready: it has no kubelet) keep everything else off
                    # it; bind checks that the pod tolerates them
                    tolerations=[Toleration(operator="Exists")],
                ),
            )
        )
        assert obj.metadata is not None and obj.metadata.uid is not None
        return PodRef(self.namespace, name, obj.metadata.uid)


@pytest.fixture
async def env(cluster: Cluster) -> AsyncIterator[Env]:
    client = AsyncClient(config=KubeConfig.from_file(cluster.kubeconfig), field_manager="kxpu-test")
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


def sharing_config(lock_namespace: str = "kxpu-system") -> SharingConfig:
    return SharingConfig.model_validate(
        {
            "splitCount": 4,
            "signingKey": {"file": "/dev/null"},
            "allocateTimeoutSeconds": 5,
            "lockNamespace": lock_namespace,
        }
    )


class StaticKeys(KubeNodeLink):
    ring: signing.Keys = KEYS

    async def keys(self, fresh: bool = False) -> signing.Keys:  # type: ignore[override]
        return self.ring


PRIVATE = signing.parse_keyring(signing.generate_private_pem())
PUBLIC = signing.parse_keyring(PRIVATE.public_pems(), private_ok=False)


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
    await env.delete_pod(winner.name)
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


@pytest.mark.parametrize("mode", ["annotation-hmac", "lease-ed25519"])
async def test_publish_watch_bind_and_handshake(env: Env, mode: str) -> None:
    lease = mode.startswith("lease")
    scheduler_keys: signing.Keys = PRIVATE if lease else KEYS
    family = ResourceFamily.derived(NPU)
    state = ClusterState([NPU])
    informer = Informer(env.client, state, lambda: scheduler_keys, env.namespace if lease else None)
    informer_task = asyncio.create_task(informer.run())
    cfg = sharing_config(env.namespace)
    link = StaticKeys(env.node, cfg, env.client)
    link.ring = PUBLIC if lease else KEYS
    inner = SimulatedBackend(SimulatedConfig.model_validate({"count": 2, "model": "npu", "memoryMiB": 16000}))
    backend = SharingBackend(inner, NPU, cfg, lambda: link, env.node)
    slots = backend.discover()
    watch_task = asyncio.create_task(_drain(backend))
    try:
        await eventually(lambda: informer.ready)
        await eventually(
            lambda: (n := state.node(env.node)) is not None and len(n.families.get(NPU, [])) == 2
        )

        api = KubeSchedulerAPI(
            env.client,
            "extender",
            cached=state.lock_view,
            node_lock="lease" if lease else "annotation",
            lock_namespace=env.namespace,
            lease_node=state.lease_node,
            cached_lease=state.lease_view,
        )
        assert state.lease_node(env.node)  # the daemon announced that it reads lock Leases
        scheduler = Scheduler(state, [family], keys=lambda: scheduler_keys, api=api)
        ref = await env.pod("p", {NPU: "1", "example.com/npumem": "3000", "example.com/npucores": "20"})
        assert await scheduler.bind(ref.namespace, ref.name, ref.uid, env.node) == ""
        bound = await env.client.get(Pod, ref.name, namespace=ref.namespace)
        assert bound.spec is not None and bound.spec.nodeName == env.node
        signature = (bound.metadata.annotations or {})[signing.SIGNATURE_ANNOTATION]  # type: ignore[union-attr]
        assert signature.startswith("v2." if lease else "v1.")
        node_obj = await env.client.get(Node, env.node)
        assert (lock_key(NPU) in (node_obj.metadata.annotations or {})) != lease  # type: ignore[union-attr]
        if lease:
            held = await env.client.get(Lease, lease_name(env.node, NPU), namespace=env.namespace)
            assert held.spec is not None and ref.uid in (held.spec.holderIdentity or "")
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
        with pytest.raises(BackendError, match=r"unknown HMAC key|HMAC signatures are no longer accepted"):
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
    store = KeyStore(KeySource(secret=f"{env.namespace}/keys", hmac=True), lambda: env.client)
    assert await store.get() == signing.Keyring.hmac_only([b"n" * 32, b"o" * 32])
    assert store.current().signer == b"n" * 32


async def test_the_extender_publishes_public_keys_and_nodes_read_only_those(env: Env) -> None:
    private = signing.generate_private_pem()
    data = base64.b64encode(private.encode()).decode()
    await env.client.create(
        Secret(metadata=ObjectMeta(name="ed25519", namespace=env.namespace), data={"keys": data})
    )
    scheduler = KeyStore(KeySource(secret=f"{env.namespace}/ed25519"), lambda: env.client)
    ring = await scheduler.get()
    ref = f"{env.namespace}/kxpu-verify-keys"
    assert await publish_public_keys(env.client, ref, ring)
    assert not await publish_public_keys(env.client, ref, ring)  # unchanged: no write
    cm = await env.client.get(ConfigMap, "kxpu-verify-keys", namespace=env.namespace)
    assert "PRIVATE" not in (cm.data or {})["keys"] and "PUBLIC KEY" in (cm.data or {})["keys"]
    node = KeyStore(KeySource(config_map=ref), lambda: env.client, private_ok=False)
    public = await node.get()
    assert public.signer is None and public.public_keys.keys() == ring.public_keys.keys()
    # rotation: a second key published beside the first
    ring2 = signing.parse_keyring(signing.generate_private_pem() + private)
    assert await publish_public_keys(env.client, ref, ring2)
    assert len((await node.load()).public_keys) == 2
    # a node pointed at the private key refuses it, naming the source
    with pytest.raises(
        ValueError, match=f"secret {env.namespace}/ed25519 field keys: entry 0 is a private key"
    ):
        await KeyStore(
            KeySource(secret=f"{env.namespace}/ed25519"), lambda: env.client, private_ok=False
        ).load()


def lease_api(env: Env, owner: str, **kw: Any) -> KubeSchedulerAPI:
    return KubeSchedulerAPI(env.client, owner, node_lock="lease", lock_namespace=env.namespace, **kw)


async def node_version(env: Env) -> str:
    node = await env.client.get(Node, env.node)
    assert node.metadata is not None
    return str(node.metadata.resourceVersion)


async def test_lease_lock_compare_and_swap_and_recovery_without_touching_the_node(env: Env) -> None:
    seen: list[dict[str, str]] = []  # the node's annotations in every Node watch event meanwhile

    async def watch_node() -> None:
        async for _, obj in env.client.watch(Node, fields={"metadata.name": env.node}):
            seen.append(dict((obj.metadata.annotations if obj.metadata else None) or {}))

    watcher = asyncio.create_task(watch_node())
    await asyncio.sleep(0.3)
    takeovers: list[str] = []
    api_a = lease_api(env, "extender-a", on_takeover=takeovers.append)
    api_b = lease_api(env, "extender-b")
    first = await env.pod("first", {})
    second = await env.pod("second", {})
    results = await asyncio.gather(
        api_a.acquire_lock(env.node, NPU, first),
        api_b.acquire_lock(env.node, NPU, second),
        return_exceptions=True,
    )
    assert sum(r is None for r in results) == 1 and sum(isinstance(r, LockBusy) for r in results) == 1, (
        results
    )
    winner, loser = (first, second) if results[0] is None else (second, first)
    link = StaticKeys(env.node, sharing_config(env.namespace), env.client)
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == winner.uid
    await api_a.release_lock(env.node, NPU, loser)  # not the holder: no effect
    with pytest.raises(LockBusy, match=f"locked for {NPU} by pod {winner}"):
        await api_a.acquire_lock(env.node, NPU, loser)
    await env.delete_pod(winner.name)
    await api_a.acquire_lock(env.node, NPU, loser)  # recovered at once: its pod is gone
    assert takeovers == ["its pod is gone"]
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == loser.uid and lock.owner == "extender-a"
    await link.finish(NPU, lock)  # the daemon's release after Allocate
    assert await link.lock(NPU) is None
    got = await LeaseLocks(env.client, env.namespace).read(env.node, NPU)
    assert got is not None and got[1] is None  # the Lease stays, free
    # none of this was a Node update (what every Node watcher in the cluster would have been sent); other
    # controllers may update the Node meanwhile (taints of a node without a kubelet), never with a lock
    await asyncio.sleep(0.5)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert not [a for a in seen if lock_key(NPU) in a], seen


async def test_the_lease_sweeper_fails_a_pod_never_admitted(env: Env) -> None:
    api = lease_api(env, "extender", lock_ttl_s=0.2, hard_expiry_s=1.0)
    stuck = await env.pod("stuck", {})
    await api.acquire_lock(env.node, NPU, stuck)
    await api.bind(stuck, env.node)
    link = StaticKeys(env.node, sharing_config(env.namespace), env.client)
    lock = await link.lock(NPU)
    assert lock is not None
    assert await api.sweep_lock(env.node, NPU, lock.encode(), in_lease=True) is None
    await asyncio.sleep(1.1)  # past the hard expiry
    assert await api.sweep_lock(env.node, NPU, lock.encode(), in_lease=True) == HARD_EXPIRED
    pod = await env.client.get(Pod, "stuck", namespace=env.namespace)
    assert pod.status is not None and pod.status.reason == "KxpuAllocationExpired"
    assert await link.lock(NPU) is None


async def test_a_rolling_upgrade_from_the_annotation_lock_loses_no_held_lock(env: Env) -> None:
    """The old extender holds an annotation lock; the new one (Leases) honours it; the new daemon admits
    under it and releases it; only then the next pod gets the node, in its Lease."""
    old = KubeSchedulerAPI(env.client, "old-extender")  # before the upgrade: the annotation
    held_pod = await env.pod("held", {})
    await old.acquire_lock(env.node, NPU, held_pod)
    await old.bind(held_pod, env.node)
    state = ClusterState([NPU])
    node = await env.client.get(Node, env.node)
    state.set_node(env.node, dict(node.metadata.annotations or {}), await node_version(env))  # type: ignore[union-attr]
    new = lease_api(env, "new-extender", cached=state.lock_view, cached_lease=state.lease_view)
    nxt = await env.pod("next", {})
    with pytest.raises(LockBusy, match=r"by pod .*/held"):
        await new.acquire_lock(env.node, NPU, nxt)
    # the upgraded daemon still finds the pod being admitted (the annotation), and releases it there
    link = StaticKeys(env.node, sharing_config(env.namespace), env.client)
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == held_pod.uid
    await link.finish(NPU, lock)
    node = await env.client.get(Node, env.node)
    assert lock_key(NPU) not in (node.metadata.annotations or {})  # type: ignore[union-attr]
    state.set_node(env.node, dict(node.metadata.annotations or {}), await node_version(env))  # type: ignore[union-attr]
    await new.acquire_lock(env.node, NPU, nxt)
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == nxt.uid and lock.owner == "new-extender"
    held = await env.client.get(Lease, lease_name(env.node, NPU), namespace=env.namespace)
    assert held.spec is not None and nxt.uid in (held.spec.holderIdentity or "")
    # a node whose daemon is not upgraded yet (no kxpu.io/lock-protocol) keeps the annotation
    await link.finish(NPU, lock)
    older = lease_api(env, "new-extender", lease_node=lambda node: False)
    third = await env.pod("third", {})
    await older.acquire_lock(env.node, NPU, third)
    node = await env.client.get(Node, env.node)
    assert third.uid in (node.metadata.annotations or {}).get(lock_key(NPU), "")  # type: ignore[union-attr]
    # a stale annotation lock (its pod gone) is recovered and dropped when the Lease is taken
    await env.client.delete(Pod, "third", namespace=env.namespace, grace_period=0)
    fourth = await env.pod("fourth", {})
    await eventually(lambda: _gone(env, "third"))
    await lease_api(env, "new-extender").acquire_lock(env.node, NPU, fourth)
    node = await env.client.get(Node, env.node)
    assert lock_key(NPU) not in (node.metadata.annotations or {})  # type: ignore[union-attr]
    lock = await link.lock(NPU)
    assert lock is not None and lock.uid == fourth.uid


async def _gone(env: Env, name: str) -> bool:
    try:
        await env.client.get(Pod, name, namespace=env.namespace)
    except Exception:
        return True
    return False


async def test_a_missing_lock_namespace_is_named(env: Env) -> None:
    missing = f"{env.namespace}-missing"
    api = KubeSchedulerAPI(env.client, "extender", node_lock="lease", lock_namespace=missing)
    with pytest.raises(LeaseNamespaceMissing, match=f"namespace '{missing}' does not exist \\(lockNamespace"):
        await api.acquire_lock(env.node, NPU, await env.pod("p", {}))


async def test_a_first_lock_creates_the_lease_in_one_request_and_a_stale_cache_is_safe(env: Env) -> None:
    writes: list[str] = []
    real_create, real_patch, real_get = env.client.create, env.client.patch, env.client.get

    async def create(*args: Any, **kw: Any) -> Any:
        writes.append("create")
        return await real_create(*args, **kw)

    async def patch(*args: Any, **kw: Any) -> Any:
        writes.append("patch")
        return await real_patch(*args, **kw)

    async def get(*args: Any, **kw: Any) -> Any:
        writes.append("get")
        return await real_get(*args, **kw)

    first, second = await env.pod("first", {}), await env.pod("second", {})
    node_view = (await node_version(env), None)  # the node cache: no annotation lock
    synced = lease_api(env, "a", cached=lambda n, r: node_view, lease_cache_synced=lambda: True)
    env.client.create, env.client.patch, env.client.get = create, patch, get  # type: ignore[method-assign]
    try:
        await synced.acquire_lock(env.node, NPU, first)
        assert writes == ["create"]
        # another replica whose Lease cache has not seen it yet: its create conflicts, it reads, it waits
        writes.clear()
        with pytest.raises(LockBusy):
            await lease_api(
                env, "b", cached=lambda n, r: node_view, lease_cache_synced=lambda: True
            ).acquire_lock(env.node, NPU, second)
        assert writes[:2] == ["create", "get"]
    finally:
        del env.client.create, env.client.patch, env.client.get

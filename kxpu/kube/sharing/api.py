"""The extender's writes: node locks (compare-and-swap on resourceVersion; in the node's Lease, or its
annotation for a daemon that reads no Lease), the pod watch label, the
binding that carries the signed assignment, failing a pod stuck unadmitted, events."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from kxpu.kube.client import CAS_ATTEMPTS, annotations_of, get_or_none, is_status, now, post_event, version_of
from kxpu.kube.sharing.lease import LeaseLocks
from kxpu.logs import error_text, get_logger
from kxpu.sharing.lock import (
    ASSIGNED_POD_LABEL,
    HARD_EXPIRED,
    LockError,
    NodeLock,
    holder_state,
    lock_key,
)
from kxpu.sharing.scheduler import LockBusy, PodRef

log = get_logger("kxpu.kube.sharing.api")


def _kept_changing(node: str) -> LockBusy:
    return LockBusy(f"node {node}: the lock kept changing under us")


_Binding = create_namespaced_resource("", "v1", "Binding", "bindings")


class KubeSchedulerAPI:
    def __init__(
        self,
        client: AsyncClient,
        owner: str,
        lock_ttl_s: float = 60.0,
        hard_expiry_s: float = 600.0,
        on_takeover: Callable[[str], None] = lambda why: None,
        cached: Callable[[str, str], tuple[str, str | None] | None] = lambda node, resource: None,
        *,
        node_lock: str = "annotation",
        lock_namespace: str = "kxpu-system",
        lease_node: Callable[[str], bool] = lambda node: True,
        cached_lease: Callable[[str, str], tuple[str, str | None] | None] = lambda node, resource: None,
        lease_cache_synced: Callable[[], bool] = lambda: False,
    ) -> None:
        self.client = client
        self.owner = owner
        self.lock_ttl_s = lock_ttl_s
        self.hard_expiry_s = hard_expiry_s
        self.on_takeover = on_takeover  # told why each stale lock was taken over (the extender counts them)
        # (resourceVersion, lock text) of a node as the node cache last saw it (ClusterState.lock_view)
        self.cached = cached
        # "lease": lock in the node's Lease where its daemon reads Leases (lease_node), else the annotation
        self.node_lock = node_lock
        self.leases = LeaseLocks(client, lock_namespace, lock_ttl_s)
        self.lease_node = lease_node
        # (resourceVersion, lock text) of a lock Lease as the Lease cache last saw it (ClusterState.lease_view)
        self.cached_lease = cached_lease
        self.lease_cache_synced = lease_cache_synced  # whether cached_lease's None means "no such Lease"

    def uses_lease(self, node: str) -> bool:
        return self.node_lock == "lease" and self.lease_node(node)

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        pod = await self.client.get(Pod, name, namespace=namespace)
        return pod.to_dict()

    async def _holder(self, lock: NodeLock) -> Mapping[str, Any] | None:
        pod = await get_or_none(self.client, Pod, lock.name, lock.namespace)
        return pod.to_dict() if pod is not None else None

    def _new_lock(self, pod: PodRef) -> str:
        t = now()
        return NodeLock(pod.namespace, pod.name, pod.uid, self.owner, t, t + self.lock_ttl_s).encode()

    async def _may_take(self, held: str, node: str, resource: str, pod: PodRef) -> bool:
        """Whether the lock text ``held`` may be replaced by ``pod``'s (False: look again); LockBusy if held."""
        try:
            lock = NodeLock.decode(held)
        except LockError as exc:
            log.warning("replacing an unreadable node lock", node=node, error=str(exc))
            return True
        if lock.uid == pod.uid:
            return True
        why = holder_state(lock, await self._holder(lock), resource, node, now(), self.hard_expiry_s)
        if why is None:
            raise LockBusy(f"node {node} is locked for {resource} by pod {lock.pod} (until it is admitted)")
        if why == HARD_EXPIRED and not await self._fail_unadmitted(lock, node, resource):
            return False  # the holder changed meanwhile: look again
        log.info("taking over a node lock", node=node, previous=lock.pod, because=why)
        self.on_takeover(why)
        return True

    async def acquire_lock(self, node: str, resource: str, pod: PodRef) -> None:
        if self.uses_lease(node):
            await self._acquire_lease(node, resource, pod)
        else:
            await self._acquire_annotation(node, resource, pod)

    async def _acquire_lease(self, node: str, resource: str, pod: PodRef) -> None:
        view = self.cached(node, resource)
        if view is None or view[1] is not None:
            # A lock taken in the node annotation (before the upgrade, or by an older replica) binds its
            # pod until it is admitted, as it did: wait for it, or recover it and drop it.
            await self._clear_annotation(node, resource, pod)
        view = self.cached_lease(node, resource)
        if view is None and self.lease_cache_synced():
            # The Lease cache has never seen this node's lock Lease: its first lock creates it (one request;
            # a 409 means another replica was first, and the long way below reads it).
            if await self.leases.create(node, resource, self._new_lock(pod)):
                return
        elif (
            view is not None
            and view[1] is None
            and await self.leases.cas(node, resource, view[0], self._new_lock(pod))
        ):
            return  # free as the cache last saw it: one compare-and-swap at that version, no read
        for _ in range(CAS_ATTEMPTS):
            got = await self.leases.read(node, resource)
            if got is None:
                if await self.leases.create(node, resource, self._new_lock(pod)):
                    return
                continue
            version, held = got
            if held is not None and not await self._may_take(held, node, resource, pod):
                continue
            if await self.leases.cas(node, resource, version, self._new_lock(pod)):
                return
        raise _kept_changing(node)

    async def _clear_annotation(self, node: str, resource: str, pod: PodRef) -> None:
        """Remove the node's annotation lock for ``resource`` once it binds nobody; LockBusy while it does."""
        key = lock_key(resource)
        for _ in range(CAS_ATTEMPTS):
            obj = await self.client.get(Node, node)
            held = annotations_of(obj).get(key)
            if held is None:
                return
            if not await self._may_take(held, node, resource, pod):
                continue
            if await self._cas(node, version_of(obj), {key: None}):
                return
        raise _kept_changing(node)

    async def _acquire_annotation(self, node: str, resource: str, pod: PodRef) -> None:
        key = lock_key(resource)
        view = self.cached(node, resource)
        # Free as the cache last saw it: one compare-and-swap at that version, no read. If the node
        # moved on since (a lock, a heartbeat), the 409 sends us the long way below.
        if (
            view is not None
            and view[1] is None
            and await self._cas(node, view[0], {key: self._new_lock(pod)})
        ):
            return
        for _ in range(CAS_ATTEMPTS):
            obj = await self.client.get(Node, node)
            held = annotations_of(obj).get(key)
            if held is not None and not await self._may_take(held, node, resource, pod):
                continue
            if await self._cas(node, version_of(obj), {key: self._new_lock(pod)}):
                return
        raise _kept_changing(node)

    async def release_lock(self, node: str, resource: str, pod: PodRef) -> None:
        if self.uses_lease(node):
            await self.leases.release(node, resource, pod.uid)
        else:
            await release(self.client, node, resource, pod.uid)

    async def sweep_lock(self, node: str, resource: str, text: str, in_lease: bool = False) -> str | None:
        """Recover one node lock that nobody asks for (acquire_lock recovers the ones a bind wants).

        ``text`` is the lock as the node cache last saw it. Returns why it was released, or None
        if it still binds its pod. A pod bound here but never admitted by the hard expiry is
        marked Failed first (reason ``KxpuAllocationExpired``, with a Warning event), so that a
        kubelet that comes back later never admits it while the lock names another pod; its
        controller, if any, replaces it.
        """
        try:
            lock = NodeLock.decode(text)
        except LockError:
            return None  # the next bind on this node replaces it (acquire_lock)
        holder = await self._holder(lock)
        why = holder_state(lock, holder, resource, node, now(), self.hard_expiry_s)
        if why is None:
            return None
        if (
            why == HARD_EXPIRED
            and holder is not None
            and not await self._fail_unadmitted(lock, node, resource)
        ):
            return None  # gone or replaced meanwhile: the next sweep sees that
        if in_lease:
            await self.leases.release(node, resource, lock.uid, text)
        else:
            await release(self.client, node, resource, lock.uid, text)
        log.info("released a stale node lock", node=node, resource=resource, pod=lock.pod, because=why)
        self.on_takeover(why)
        return why

    async def _fail_unadmitted(self, lock: NodeLock, node: str, resource: str) -> bool:
        """Mark the lock's pod Failed (bound here, never admitted by the hard expiry), with a Warning event.

        Before its lock goes to another pod, so that a kubelet that comes back never admits it under
        that pod's lock (it would get the other pod's grant). False if the pod is gone or replaced.
        """
        message = (
            f"not admitted on node {node} within {self.hard_expiry_s:g} s of being bound (is its kubelet "
            f"down?); failed so that the node's {resource} lock can go to the next pod"
        )
        status = {"phase": "Failed", "reason": "KxpuAllocationExpired", "message": message}
        try:
            await self.client.patch(
                Pod.Status,
                lock.name,
                {"metadata": {"uid": lock.uid}, "status": status},
                namespace=lock.namespace,
                patch_type=PatchType.MERGE,
            )
        except ApiError as exc:
            if not is_status(exc, 404, 409):
                raise
            return False
        try:
            await post_event(
                self.client,
                "Pod",
                lock.namespace,
                lock.name,
                lock.uid,
                "KxpuAllocationExpired",
                message,
                "kxpu-scheduler",
            )
        except ApiError as exc:
            log.warning("could not post an event", pod=lock.pod, error=error_text(exc))
        return True

    async def _cas(self, node: str, version: str | None, annotations: Mapping[str, str | None]) -> bool:
        return await cas_node_annotations(self.client, node, version, annotations)

    async def label_pod(self, pod: PodRef) -> None:
        patch = {"metadata": {"uid": pod.uid, "labels": {ASSIGNED_POD_LABEL: "true"}}}
        await self.client.patch(Pod, pod.name, patch, namespace=pod.namespace, patch_type=PatchType.MERGE)

    async def bind(self, pod: PodRef, node: str, annotations: Mapping[str, str] | None = None) -> None:
        # POST .../bindings answers with a Status, which lightkube's typed Binding cannot decode;
        # a generic resource takes the same request and any answer. The UID is a precondition, and
        # the API server copies the Binding's annotations onto the pod in the same update as nodeName.
        binding = _Binding(
            metadata=ObjectMeta(
                name=pod.name, namespace=pod.namespace, uid=pod.uid, annotations=dict(annotations or {})
            ),
            target={"apiVersion": "v1", "kind": "Node", "name": node},
        )
        await self.client.create(binding)

    async def event(self, pod: PodRef, reason: str, message: str, warning: bool = False) -> None:
        await post_event(
            self.client, "Pod", pod.namespace, pod.name, pod.uid, reason, message, "kxpu-scheduler", warning
        )


async def cas_node_annotations(
    client: AsyncClient, node: str, version: str | None, annotations: Mapping[str, str | None]
) -> bool:
    """Merge-patch node annotations if the node is still at ``version`` (False on a conflict)."""
    patch = {"metadata": {"resourceVersion": version, "annotations": dict(annotations)}}
    try:
        await client.patch(Node, node, patch, patch_type=PatchType.MERGE)
    except ApiError as exc:
        if is_status(exc, 409):
            return False
        raise
    return True


async def release(client: AsyncClient, node: str, resource: str, uid: str, held: str | None = None) -> None:
    """Remove the node lock if it still names the pod ``uid`` (compare-and-swap).

    With ``held`` (the lock's text as the caller read it) one JSON patch does it: test that the
    annotation is still that text, then remove it; anything else falls back to read and compare.
    """
    key = lock_key(resource)
    if held is not None:
        path = "/metadata/annotations/" + key.replace("~", "~0").replace("/", "~1")
        ops = [{"op": "test", "path": path, "value": held}, {"op": "remove", "path": path}]
        try:
            await client.patch(Node, node, ops, patch_type=PatchType.JSON)
            return
        except ApiError as exc:
            if not is_status(exc, 409, 422):
                raise
    for _ in range(CAS_ATTEMPTS):
        obj = await client.get(Node, node)
        held = annotations_of(obj).get(key)
        if held is None:
            return
        try:
            if NodeLock.decode(held).uid != uid:
                return  # someone else's now
        except LockError:
            return
        if await cas_node_annotations(client, node, version_of(obj), {key: None}):
            return
    log.warning("could not release a node lock: it kept changing", node=node, resource=resource)

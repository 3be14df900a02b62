"""The node daemon's link to the API server (``kxpu.sharing.node.NodeLink``): its own Node, lock Leases and pods."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from kxpu.kube.client import annotations_of, get_or_none, is_status, make_client, now, post_event
from kxpu.kube.sharing.api import release
from kxpu.kube.sharing.keys import KeyStore
from kxpu.kube.sharing.lease import LeaseLocks
from kxpu.sharing.config import SharingConfig
from kxpu.sharing.inventory import SHARING_NODE_LABEL
from kxpu.sharing.lock import (
    BIND_PHASE_ANNOTATION,
    LOCK_PROTOCOL_ANNOTATION,
    LockError,
    NodeLock,
    allocated_key,
    lock_key,
)
from kxpu.sharing.signing import Keyring


class KubeNodeLink:
    def __init__(self, node: str, config: SharingConfig, client: AsyncClient | None = None) -> None:
        self.node = node
        self._client = client
        self._keys = KeyStore([config.signing_key, *config.extra_keys], lambda: self.client, private_ok=False)
        self.lock_namespace = config.lock_namespace
        self._leases: LeaseLocks | None = None
        self._from_lease: dict[str, bool] = {}  # pod uid → whether its lock was read from the Lease

    @property
    def client(self) -> AsyncClient:
        if self._client is None:  # created on the event loop, on first use
            self._client = make_client()
        return self._client

    @property
    def leases(self) -> LeaseLocks:
        if self._leases is None:
            self._leases = LeaseLocks(self.client, self.lock_namespace)
        return self._leases

    async def publish(self, resource: str, key: str, value: str) -> None:
        # kxpu.io/lock-protocol: this daemon reads lock Leases, so the extender may lock this node there
        annotations = {key: value, LOCK_PROTOCOL_ANNOTATION: "lease"}
        patch = {"metadata": {"labels": {SHARING_NODE_LABEL: "true"}, "annotations": annotations}}
        await self.client.patch(Node, self.node, patch, patch_type=PatchType.MERGE)

    async def lock(self, resource: str) -> NodeLock | None:
        """The lock in the node's Lease, else in its annotation (taken by an extender before the upgrade)."""
        got = await self.leases.read(self.node, resource)
        from_lease = got is not None and got[1] is not None
        held = got[1] if got is not None and got[1] is not None else None
        if held is None:
            held = annotations_of(await self.client.get(Node, self.node)).get(lock_key(resource))
        if held is None:
            return None
        try:
            lock = NodeLock.decode(held)
        except LockError:
            return None
        if len(self._from_lease) > 64:
            self._from_lease.clear()
        self._from_lease[lock.uid] = from_lease
        return lock

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        pod = await get_or_none(self.client, Pod, name, namespace)
        return pod.to_dict() if pod is not None else None

    async def finish(self, resource: str, lock: NodeLock) -> None:
        annotations = {allocated_key(resource): str(int(now())), BIND_PHASE_ANNOTATION: "allocated"}
        patch = {"metadata": {"uid": lock.uid, "annotations": annotations}}
        try:
            await self.client.patch(
                Pod, lock.name, patch, namespace=lock.namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            if not is_status(exc, 404, 409, 422):
                raise
        where = self._from_lease.pop(lock.uid, None)  # None: not read here; try both
        if where is not False:
            await self.leases.release(self.node, resource, lock.uid, lock.encode())
        if where is not True:
            await release(self.client, self.node, resource, lock.uid, lock.encode())

    async def warn(self, lock: NodeLock | None, reason: str, message: str) -> None:
        if lock is not None:
            await post_event(
                self.client, "Pod", lock.namespace, lock.name, lock.uid, reason, message, "kxpu-node"
            )
        else:
            await post_event(self.client, "Node", "default", self.node, None, reason, message, "kxpu-node")

    async def keys(self, fresh: bool = False) -> Keyring:
        return await self._keys.get(fresh)

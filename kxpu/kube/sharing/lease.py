"""Node locks in per-node ``coordination.k8s.io/v1`` Leases (``kxpu.sharing.lock``): read, compare-and-swap, release.

One Lease per node and family in the lock namespace, named by ``lock.lease_name``, labelled
``kxpu.io/node-lock`` (the extender watches only these) and annotated with its node and resource.
``spec.holderIdentity`` is the lock's text, absent while free; the Lease itself stays, so taking
and releasing a lock is one update of an object only the extender watches.
"""

from __future__ import annotations

from datetime import UTC, datetime

from lightkube import ApiError, AsyncClient
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.types import PatchType

from kxpu.kube.client import CAS_ATTEMPTS, get_or_none, is_status, version_of
from kxpu.sharing.lock import (
    LEASE_LABEL,
    LEASE_NODE_ANNOTATION,
    LEASE_RESOURCE_ANNOTATION,
    LockError,
    NodeLock,
    lease_name,
)


class LeaseNamespaceMissing(RuntimeError):
    """The lock namespace does not exist (a config error, named in the message)."""


class LeaseLocks:
    def __init__(self, client: AsyncClient, namespace: str, ttl_s: float = 60.0) -> None:
        self.client = client
        self.namespace = namespace
        self.ttl_s = ttl_s

    async def read(self, node: str, resource: str) -> tuple[str | None, str | None] | None:
        """(resourceVersion, lock text or None) of the node's lock Lease; None if there is no Lease."""
        lease = await get_or_none(self.client, Lease, lease_name(node, resource), self.namespace)
        if lease is None:
            return None
        return version_of(lease), (lease.spec.holderIdentity if lease.spec is not None else None) or None

    def _spec(self, text: str) -> dict[str, object]:
        return {
            "holderIdentity": text,
            "acquireTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "leaseDurationSeconds": max(1, round(self.ttl_s)),
        }

    async def create(self, node: str, resource: str, text: str | None) -> bool:
        """Create the Lease holding ``text``; False if it exists already (someone was first)."""
        lease = Lease(
            metadata=ObjectMeta(
                name=lease_name(node, resource),
                namespace=self.namespace,
                labels={LEASE_LABEL: "true"},
                annotations={LEASE_NODE_ANNOTATION: node, LEASE_RESOURCE_ANNOTATION: resource},
            ),
            spec=LeaseSpec(**self._spec(text)) if text is not None else LeaseSpec(),  # type: ignore[arg-type]
        )
        try:
            await self.client.create(lease)
        except ApiError as exc:
            if is_status(exc, 409):
                return False
            if is_status(exc, 404):
                raise LeaseNamespaceMissing(
                    f"cannot create the node lock Lease: namespace {self.namespace!r} does not exist "
                    "(lockNamespace in the config)"
                ) from None
            raise
        return True

    async def cas(self, node: str, resource: str, version: str | None, text: str) -> bool:
        """Set the lock to ``text`` if the Lease is still at ``version`` (False on a conflict or if it is gone)."""
        patch = {"metadata": {"resourceVersion": version}, "spec": self._spec(text)}
        try:
            await self.client.patch(
                Lease, lease_name(node, resource), patch, namespace=self.namespace, patch_type=PatchType.MERGE
            )
        except ApiError as exc:
            if is_status(exc, 404, 409):
                return False
            raise
        return True

    async def release(self, node: str, resource: str, uid: str, held: str | None = None) -> None:
        """Free the lock if it still names the pod ``uid`` (compare-and-swap), as ``api.release`` does."""
        name = lease_name(node, resource)
        if held is not None:
            ops = [
                {"op": "test", "path": "/spec/holderIdentity", "value": held},
                {"op": "remove", "path": "/spec/holderIdentity"},
            ]
            try:
                await self.client.patch(Lease, name, ops, namespace=self.namespace, patch_type=PatchType.JSON)
                return
            except ApiError as exc:
                if is_status(exc, 404):
                    return
                if not is_status(exc, 409, 422):
                    raise
        for _ in range(CAS_ATTEMPTS):
            got = await self.read(node, resource)
            if got is None or got[1] is None:
                return
            try:
                if NodeLock.decode(got[1]).uid != uid:
                    return  # someone else's now
            except LockError:
                return
            patch = {"metadata": {"resourceVersion": got[0]}, "spec": {"holderIdentity": None}}
            try:
                await self.client.patch(
                    Lease, name, patch, namespace=self.namespace, patch_type=PatchType.MERGE
                )
                return
            except ApiError as exc:
                if is_status(exc, 404):
                    return
                if not is_status(exc, 409):
                    raise

"""The DRA driver's API calls, through kxpu's one Kubernetes client (``kxpu.kube``): its node's UID, its
ResourceSlices, the claims it prepares and the events it posts on them.

Objects cross this boundary as plain dicts (the JSON the API serves), so everything above it
(``slices``, ``publisher``, ``claims``, ``prepare``) is pure and tested without lightkube.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from kxpu.dra.prepare import ClaimRef
from kxpu.kube.watch import list_version
from kxpu.logs import error_text, get_logger

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = get_logger("kxpu.kube.dra")

COMPONENT = "kxpu-dra"

# lightkube and its models (~80 ms of imports) load on the driver's first API call, in a worker thread: the
# driver binds its sockets and registers with the kubelet meanwhile, instead of after.
_lk: Any = None
_loading = threading.Lock()


def _load() -> Any:
    global _lk
    with _loading:
        if _lk is not None:
            return _lk
        from lightkube import ApiError
        from lightkube.core.resource import ApiInfo
        from lightkube.generic_resource import (
            GenericGlobalResource,
            GenericNamespacedResource,
            GenericNamespacedStatus,
            create_api_info,
        )
        from lightkube.resources.core_v1 import Node

        from kxpu.kube import client

        # The resources as plain JSON dicts (lightkube's generic resources), not its typed models: a claim
        # read on every NodePrepareResources and slices of up to 128 devices would otherwise be parsed into
        # objects only to be turned back into dicts (milliseconds a claim, most of the driver's CPU per prepare).
        class Claim(GenericNamespacedResource):
            _api_info = create_api_info("resource.k8s.io", "v1", "ResourceClaim", "resourceclaims")

        class Slice(GenericGlobalResource):
            _api_info = create_api_info("resource.k8s.io", "v1", "ResourceSlice", "resourceslices")

        class ClaimStatus(GenericNamespacedStatus):
            _api_info = ApiInfo(
                resource=Claim._api_info.resource,
                parent=Claim._api_info.resource,
                plural="resourceclaims",
                verbs=["get", "patch", "put"],
                action="status",
            )

        _lk = SimpleNamespace(
            ApiError=ApiError, Node=Node, Claim=Claim, ClaimStatus=ClaimStatus, Slice=Slice, kube=client
        )
        return _lk


def _apply_patch() -> Any:
    from lightkube.types import PatchType

    return PatchType.APPLY


class DraKube:
    """One per driver; the lightkube client is made on first use, on the running event loop."""

    def __init__(self, driver: str, client: AsyncClient | None = None) -> None:
        self.driver = driver
        self._client = client

    async def close(self) -> None:
        """Close the connection pool (each start of the resource's DRA half makes a new DraKube)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = _load().kube.make_client()
        return self._client

    async def _api(self) -> tuple[Any, AsyncClient]:
        """lightkube (imported in a thread the first time) and the client."""
        lk = _lk if _lk is not None else await asyncio.to_thread(_load)
        return lk, self.client

    # -- SliceApi ---------------------------------------------------------------------------------------
    async def node_uid(self, node: str) -> str:
        lk, client = await self._api()
        obj = await client.get(lk.Node, node)
        if obj.metadata is None or not obj.metadata.uid:
            raise RuntimeError(f"node {node} has no UID")
        return str(obj.metadata.uid)

    async def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        lk, client = await self._api()
        fields: dict[str, Any] = {"spec.driver": driver, "spec.nodeName": node}
        return [dict(obj) async for obj in client.list(lk.Slice, fields=fields)]

    async def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        lk, client = await self._api()
        return dict(await client.create(lk.Slice.from_dict(body)))

    async def replace_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        lk, client = await self._api()
        return dict(await client.replace(lk.Slice.from_dict(body)))

    async def watch_slices(self, driver: str, node: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        lk, client = await self._api()
        fields: dict[str, Any] = {"spec.driver": driver, "spec.nodeName": node}
        async for kind, obj in client.watch(lk.Slice, fields=fields):
            yield kind, dict(obj)

    async def delete_slice(self, name: str) -> None:
        lk, client = await self._api()
        try:
            await client.delete(lk.Slice, name)
        except lk.ApiError as exc:
            if not lk.kube.is_status(exc, 404):
                raise

    # -- ClaimSource ------------------------------------------------------------------------------------
    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        lk, client = await self._api()
        claim = await lk.kube.get_or_none(client, lk.Claim, name, namespace)
        return dict(claim) if claim is not None else None

    # -- ClaimWatchApi (the claim cache) ----------------------------------------------------------------
    async def list_claims(self, each: Callable[[Mapping[str, Any]], None]) -> str | None:
        # Paged, so a cluster of many claims is never one answer in memory.
        lk, client = await self._api()
        listing = client.list(lk.Claim, namespace="*", chunk_size=500)
        async for claim in listing:
            each(claim)
        return list_version(listing)

    async def watch_claims(self, version: str | None) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        lk, client = await self._api()
        async for kind, claim in client.watch(lk.Claim, namespace="*", resource_version=version):
            yield kind, claim

    # -- ClaimStatusApi ---------------------------------------------------------------------------------
    async def apply_claim_status(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> bool:
        """Server-side apply of the status subresource, as field manager ``kxpu-<driver>``: it owns this driver's
        entries and no others, so applying none removes them. The UID in the body makes a claim recreated under
        the same name refuse the write."""
        from kxpu.dra.claim_status import StatusWriteError

        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "status": {"devices": list(devices)} if devices else {},
        }
        try:
            lk, client = await self._api()
            await client.patch(
                lk.ClaimStatus,
                name,
                body,
                namespace=namespace,
                patch_type=_apply_patch(),
                field_manager=f"kxpu-{self.driver}",
                force=True,
            )
        except Exception as exc:
            lk = _lk
            if lk is not None and isinstance(exc, lk.ApiError):
                code = int(getattr(exc.status, "code", 0) or 0)
                if code in (404, 409) or (code == 422 and not devices and "uid" in str(exc).lower()):
                    return False  # the claim (with this UID) is gone
                raise StatusWriteError(error_text(exc), transient=code == 429 or code >= 500) from None
            raise StatusWriteError(error_text(exc), transient=True) from None
        return True

    async def claim_event(self, claim: ClaimRef, reason: str, message: str) -> None:
        try:
            lk, client = await self._api()
            await lk.kube.post_event(
                client,
                "ResourceClaim",
                claim.namespace,
                claim.name,
                claim.uid,
                reason,
                message,
                COMPONENT,
                api_version="resource.k8s.io/v1",
            )
        except Exception as exc:  # an event is a courtesy; never fail the call for it
            log.warning("cannot post an event on the claim", claim=claim.ref, error=error_text(exc))

"""One lightkube AsyncClient per process, and the few helpers every kxpu component needs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from lightkube import ApiError, AsyncClient
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event

FIELD_MANAGER = "kxpu"
# Kinds kxpu posts events about that live in a namespace (the rest, such as Node, are cluster-scoped).
NAMESPACED_EVENT_KINDS = frozenset({"Pod", "ResourceClaim"})


def make_client() -> AsyncClient:
    """In-cluster service account, else $KUBECONFIG / ~/.kube/config (lightkube's KubeConfig.from_env)."""
    return AsyncClient(field_manager=FIELD_MANAGER)


def is_status(exc: BaseException, *codes: int) -> bool:
    return isinstance(exc, ApiError) and exc.status.code in codes


def name_of(obj: Any) -> str:
    return str(obj.metadata.name) if obj.metadata is not None else ""


def uid_of(obj: Any) -> str:
    return str(obj.metadata.uid) if obj.metadata is not None else ""


def version_of(obj: Any) -> str | None:
    return obj.metadata.resourceVersion if obj.metadata is not None else None


def annotations_of(obj: Any) -> Mapping[str, str]:
    meta = getattr(obj, "metadata", None)
    return (meta.annotations if meta is not None else None) or {}


async def post_event(
    client: AsyncClient,
    kind: str,
    namespace: str,
    name: str,
    uid: str | None,
    reason: str,
    message: str,
    component: str,
    warning: bool = True,
    api_version: str = "v1",
) -> None:
    """An Event about an object: ``namespace`` is where the event lives (and the object's own namespace for
    namespaced kinds); cluster-scoped objects such as Nodes get theirs in ``default``."""
    now = datetime.now(UTC)
    await client.create(
        Event(
            metadata=ObjectMeta(generateName=f"{name}.", namespace=namespace),
            involvedObject=ObjectReference(
                apiVersion=api_version,
                kind=kind,
                name=name,
                namespace=namespace if kind in NAMESPACED_EVENT_KINDS else None,
                uid=uid,
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=EventSource(component=component),
            firstTimestamp=now,
            lastTimestamp=now,
            count=1,
            reportingComponent=component,
        )
    )


async def get_raw(client: AsyncClient, path: str) -> str:
    """GET a non-resource path of the API server (``/metrics``, ``/readyz``) with the client's credentials.

    lightkube has no call for these; its HTTP client (httpx, with the cluster's base URL and auth) does.
    """
    http = client._client._client  # lightkube's GenericAsyncClient → httpx.AsyncClient
    response = await http.get(path)
    response.raise_for_status()
    return str(response.text)


def now() -> float:
    return time.time()

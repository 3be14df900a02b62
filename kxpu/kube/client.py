"""One lightkube AsyncClient per process, and the few helpers every kxpu component needs."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar, cast

from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig, operators
from lightkube.models.core_v1 import EventSource, ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod

T = TypeVar("T")

FIELD_MANAGER = "kxpu"
# How many times a read-then-compare-and-swap is tried before giving up on an object that keeps changing
# (each 409 Conflict means someone else wrote it in between: read it again and decide again).
CAS_ATTEMPTS = 5
# Kinds kxpu posts events about that live in a namespace (the rest, such as Node, are cluster-scoped).
NAMESPACED_EVENT_KINDS = frozenset({"Pod", "ResourceClaim"})


# What make_client and check_access raise when there are no credentials to reach the API server with
# (no service account, no kubeconfig, or one that cannot be read); the message says which.
ACCESS_ERRORS: tuple[type[Exception], ...] = (ConfigError, OSError)


def make_client(kubeconfig: Path | None = None) -> AsyncClient:
    """The kubeconfig named; else the in-cluster service account, else $KUBECONFIG / ~/.kube/config
    (lightkube's KubeConfig.from_env)."""
    config = KubeConfig.from_file(kubeconfig) if kubeconfig else None
    return AsyncClient(config=config, field_manager=FIELD_MANAGER)


def check_access() -> None:
    """Raise one of ACCESS_ERRORS when make_client() would find no credentials at all."""
    KubeConfig.from_env()


def kubeconfig_token(kubeconfig: Path) -> str | None:
    """The bearer token of the kubeconfig's current user (its token, else its token file); None when it has
    none. ValueError when the kubeconfig cannot be read."""
    try:
        single = KubeConfig.from_file(kubeconfig).get()
    except (ConfigError, OSError, ValueError):
        raise ValueError(f"{kubeconfig}: cannot read it") from None
    user = single.user if single is not None else None
    if user is None:
        return None
    if user.token:
        return str(user.token)
    if user.token_file:
        try:
            return Path(user.token_file).read_text().strip() or None
        except OSError:
            return None
    return None


def is_status(exc: BaseException, *codes: int) -> bool:
    """Whether ``exc`` is the API server's answer with one of these HTTP status codes."""
    return isinstance(exc, ApiError) and exc.status.code in codes


async def get_or_none(
    client: AsyncClient, resource: type[T], name: str, namespace: str | None = None
) -> T | None:
    """The object, or None when the API server answers 404 (any other refusal is raised)."""
    try:
        got: T = await client.get(cast(Any, resource), name, namespace=namespace)
    except ApiError as exc:
        if is_status(exc, 404):
            return None
        raise
    return got


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


async def nodes_and_placed_pods(client: AsyncClient) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every Node, and every pod placed on a node and not finished (only those can hold devices: the API
    server leaves the rest out), as the JSON the API serves."""
    nodes = [n.to_dict() async for n in client.list(Node)]
    placed: dict[str, str | operators.BinaryOperator | operators.SequenceOperator] = {
        "spec.nodeName": operators.not_equal(""),
        "status.phase": operators.not_in(["Succeeded", "Failed"]),
    }
    pods = [p.to_dict() async for p in client.list(Pod, namespace="*", fields=placed)]
    return nodes, pods


def now() -> float:
    return time.time()

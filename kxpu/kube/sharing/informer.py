"""Informer-style caches for the extender: list then watch nodes, pods and lock Leases, feeding ClusterState.

Only nodes labelled ``kxpu.io/sharing`` (set by node daemons that publish an inventory) and
pods labelled ``kxpu.io/assigned`` (set by the webhook at admission, or by the extender before
it binds) are watched, so a large cluster's other objects cost nothing. A watch that fails (410 Gone, a dropped connection)
is followed by a fresh list that *replaces* the cache, then a new watch. A pod's
assignment counts once its signature verifies (age is not checked here: a running pod
keeps its devices) and while the pod is live and not bound elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Hashable
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Node, Pod

from kxpu.kube.client import annotations_of, name_of, uid_of, version_of
from kxpu.kube.watch import keep_watching, list_then_watch
from kxpu.logs import get_logger
from kxpu.sharing import signing
from kxpu.sharing.inventory import SHARING_NODE_LABEL
from kxpu.sharing.lock import (
    ASSIGNED_POD_LABEL,
    LEASE_LABEL,
    LEASE_NODE_ANNOTATION,
    LEASE_RESOURCE_ANNOTATION,
    lease_name,
)
from kxpu.sharing.model import Assignment
from kxpu.sharing.placement import NodeFacts
from kxpu.sharing.state import ClusterState

log = get_logger("kxpu.kube.sharing.informer")


def live_assignment(pod: Any, keys: signing.Keys) -> Assignment | None:
    meta = pod.metadata
    annotations = annotations_of(pod)
    if signing.ASSIGNMENT_ANNOTATION not in annotations:
        return None
    if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
        return None
    try:
        assignment = signing.verify(
            annotations.get(signing.ASSIGNMENT_ANNOTATION),
            annotations.get(signing.SIGNATURE_ANNOTATION),
            keys,
            pod_uid=meta.uid,
            namespace=meta.namespace,
            name=meta.name,
            node=annotations_node(annotations),
            now=time.time(),
            max_age_s=math.inf,
        )
    except signing.SignatureError as exc:
        log.warning(
            "ignoring an assignment that does not verify", pod=f"{meta.namespace}/{meta.name}", error=str(exc)
        )
        return None
    bound = pod.spec.nodeName if pod.spec is not None else None
    # Only a bound pod's assignment holds devices. The extender writes the assignment with the
    # Binding (one update), so an unbound pod carrying one did not get it from a bind: counting it
    # would hold devices for nobody, and keep the pod itself from fitting again on a full node.
    if not bound or bound != assignment.node:
        return None
    beyond = _beyond_request(pod, assignment)
    if beyond:
        log.warning("ignoring an assignment the pod does not ask for", pod=f"{meta.namespace}/{meta.name}",
                    error=beyond)  # fmt: skip
        return None
    return assignment


def _beyond_request(pod: Any, assignment: Assignment) -> str | None:
    """Why ``assignment`` grants more than the pod's own containers ask for (None: it does not).

    A node only ever allocates what a container requests (the kubelet calls Allocate for the requested count),
    so devices granted beyond it are used by nobody: counting them would pin them as used. That is what a
    signature minted with a key nodes no longer accept (an HMAC key a node read before the switch to
    Ed25519), written on any pod, would otherwise do. The extender's own grants always match the request.
    """
    asked: dict[tuple[str, str], int] = {}
    for container in (pod.spec.containers if pod.spec is not None else None) or []:
        resources = container.resources
        for source in (resources.requests, resources.limits) if resources is not None else ():
            for resource, quantity in (source or {}).items():
                try:
                    asked[(container.name, resource)] = int(str(quantity))
                except ValueError:
                    continue
    for c in assignment.containers:
        count = asked.get((c.container, c.resource), 0)
        if len(c.devices) > count:
            return f"container {c.container!r} is granted {len(c.devices)} {c.resource} but asks for {count}"
    return None


def annotations_node(annotations: Any) -> str:
    try:
        return signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).node
    except (signing.SignatureError, KeyError):
        return ""


class Informer:
    def __init__(
        self,
        client: AsyncClient,
        state: ClusterState,
        keys: Callable[[], signing.Keys],
        lock_namespace: str | None = None,
    ) -> None:
        self.client = client
        self.state = state
        self.keys = keys
        self.lock_namespace = lock_namespace  # watch the lock Leases there (nodeLock: lease)
        self._synced = {"nodes": False, "pods": False}
        if lock_namespace is not None:
            self._synced["leases"] = False
        self.synced_event = asyncio.Event()

    def synced(self, what: str) -> bool:
        """Whether the cache of ``what`` (nodes, pods, leases) has been listed (and is watched since)."""
        return self._synced.get(what, False)

    @property
    def ready(self) -> bool:
        return all(self._synced.values())

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            nodes = {"labels": {SHARING_NODE_LABEL: "true"}}
            tasks.create_task(
                self._follow("nodes", Node, nodes, self._set_node, self._drop_node, self._keep_nodes)
            )
            pods = {"namespace": "*", "labels": {ASSIGNED_POD_LABEL: "true"}}
            tasks.create_task(self._follow("pods", Pod, pods, self._set_pod, self._drop_pod, self._keep_pods))
            if self.lock_namespace is not None:
                leases = {"namespace": self.lock_namespace, "labels": {LEASE_LABEL: "true"}}
                tasks.create_task(
                    self._follow(
                        "leases", Lease, leases, self._set_lease, self._drop_lease, self._keep_leases
                    )
                )

    async def _follow(
        self,
        what: str,
        resource: type,
        selector: dict[str, Any],
        put: Callable[[Any], Hashable | None],
        drop: Callable[[Any], object],
        keep_only: Callable[[set[Any]], object],
    ) -> None:
        """Keep the cache of ``what`` following the API server: list, then watch; list again after any break."""

        async def watch_round(delivered: Callable[[], None]) -> None:
            await list_then_watch(
                self.client,
                resource,
                selector,
                put=put,
                drop=drop,
                keep_only=keep_only,
                synced=functools.partial(self._mark, what),
                delivered=delivered,
            )

        def failed(error: str, retry_in_s: float) -> None:
            log.warning("watch failed; listing again", what=what, error=error, retry_in_s=retry_in_s)

        await keep_watching(watch_round, failed)

    def _mark(self, what: str) -> None:
        if not self._synced[what]:
            self._synced[what] = True
            log.info("cache synced", what=what)
            if self.ready:
                self.synced_event.set()

    def _drop_node(self, node: Any) -> None:
        self.state.remove_node(name_of(node))

    def _keep_nodes(self, seen: set[str]) -> None:
        for gone in set(self.state.node_names) - seen:
            self.state.remove_node(gone)

    def _drop_pod(self, pod: Any) -> None:
        self.state.remove_pod(uid_of(pod))

    def _keep_pods(self, seen: set[str]) -> None:
        for gone in self.state.pod_uids() - seen:
            self.state.remove_pod(gone)

    def _drop_lease(self, lease: Any) -> None:
        self._set_lease(lease, deleted=True)

    def _keep_leases(self, seen: set[tuple[str, str]]) -> None:
        for node, resource in self.state.lease_keys() - seen:
            self.state.set_lease(node, resource, None, None)

    def _set_pod(self, pod: Any) -> str:
        uid = uid_of(pod)
        self.state.set_pod(uid, live_assignment(pod, self.keys()))
        return uid

    def _set_node(self, node: Any) -> str:
        name = name_of(node)
        self.state.set_node(name, annotations_of(node), version_of(node))
        spec = node.spec
        taints = [
            {"key": t.key or "", "value": t.value or "", "effect": t.effect or ""}
            for t in ((spec.taints if spec is not None else None) or [])
        ]
        labels = dict((node.metadata.labels if node.metadata is not None else None) or {})
        unschedulable = bool(spec is not None and spec.unschedulable)
        self.state.set_node_facts(name, NodeFacts(labels, tuple(taints), unschedulable))
        return name

    def _set_lease(self, lease: Any, deleted: bool = False) -> tuple[str, str] | None:
        meta = lease.metadata
        annotations = annotations_of(lease)
        node, resource = annotations.get(LEASE_NODE_ANNOTATION), annotations.get(LEASE_RESOURCE_ANNOTATION)
        if not node or not resource or resource not in self.state.resources:
            return None
        if meta is None or meta.name != lease_name(node, resource):
            log.warning(
                "ignoring a lock Lease whose name does not match its node", lease=name_of(lease), node=node
            )
            return None
        if deleted:
            self.state.set_lease(node, resource, None, None)
        else:
            holder = lease.spec.holderIdentity if lease.spec is not None else None
            self.state.set_lease(node, resource, version_of(lease) or "", holder or None)
        return node, resource

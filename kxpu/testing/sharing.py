"""Helpers for testing and benchmarking fractional sharing without a cluster.

Builders for inventories and pod objects, and an in-memory stand-in for the API server
that the extender's bind and the node wrapper's handshake talk to (pods, node locks,
annotations, events), with the same compare-and-swap semantics as the real layer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kxpu.sharing.lock import (
    ASSIGNED_POD_LABEL,
    HARD_EXPIRED,
    NodeLock,
    allocated_key,
    holder_state,
    lock_key,
)
from kxpu.sharing.model import NodeInventory, SharedDevice
from kxpu.sharing.scheduler import LockBusy, PodRef
from kxpu.sharing.signing import Keys


def inventory(
    resource: str = "nvidia.com/gpu",
    count: int = 8,
    memory_mib: int = 16384,
    split: int = 10,
    model: str = "NVIDIA A100",
    numa: Sequence[int | None] | None = None,
    memory_scaling: float = 1.0,
    core_scaling: float = 1.0,
    prefix: str = "gpu",
) -> NodeInventory:
    return NodeInventory(
        resource,
        tuple(
            SharedDevice(
                id=f"{prefix}-{i}",
                uuid=f"{prefix.upper()}-{i:08d}",
                model=model,
                memory_mib=memory_mib,
                memory_capacity_mib=int(memory_mib * memory_scaling),
                core_capacity=int(100 * core_scaling),
                split_count=split,
                numa=(numa[i] if numa is not None else i * 2 // count),
                index=i,
            )
            for i in range(count)
        ),
        published_at=time.time(),
    )


def pod(
    name: str = "p",
    containers: Sequence[Mapping[str, int | str]] = ({"nvidia.com/gpu": 1},),
    namespace: str = "default",
    uid: str | None = None,
    annotations: Mapping[str, str] | None = None,
    node: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A pod object as the API serves it; each container's limits are the mapping given."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "containers": [
                {
                    "name": f"c{n}",
                    "image": "busybox",
                    "resources": {"limits": {k: str(v) for k, v in c.items()}},
                }
                for n, c in enumerate(containers)
            ],
            **({"nodeName": node} if node else {}),
            **spec,
        },
        "status": {"phase": "Pending"},
    }


@dataclass
class FakeCluster:
    """Pods and nodes in memory, with the lock and annotation semantics of ``kxpu.kube.sharing``."""

    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    node_annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (pod, reason, message)
    lock_ttl_s: float = 60.0
    hard_expiry_s: float = 600.0
    fail_bind: bool = False
    clock: Any = time.time
    keyring: Keys = field(default_factory=lambda: [b"k" * 32])
    writes: list[str] = field(default_factory=list)  # the bind path's API writes, in order: lock, label, bind

    def add_pod(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self.pods[(meta["namespace"], meta["name"])] = copy.deepcopy(dict(obj))

    # SchedulerAPI
    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            return copy.deepcopy(self.pods[(namespace, name)])
        except KeyError:
            raise LookupError(f"pod {namespace}/{name} not found") from None

    def _holder(self, lock: NodeLock) -> dict[str, Any] | None:
        return self.pods.get((lock.namespace, lock.name))

    async def acquire_lock(self, node: str, resource: str, pod: PodRef) -> None:
        annotations = self.node_annotations.setdefault(node, {})
        held = annotations.get(lock_key(resource))
        now = self.clock()
        if held is not None:
            lock = NodeLock.decode(held)
            free = lock.uid == pod.uid or holder_state(
                lock, self._holder(lock), resource, node, now, self.hard_expiry_s
            )
            if not free:
                raise LockBusy(f"{node} is locked for {resource} by {lock.pod}")
            holder = self._holder(lock)
            if free == HARD_EXPIRED and holder is not None:  # as the real API: failed before the handover
                holder.setdefault("status", {}).update(phase="Failed", reason="KxpuAllocationExpired")
        annotations[lock_key(resource)] = NodeLock(
            pod.namespace, pod.name, pod.uid, "test", now, now + self.lock_ttl_s
        ).encode()
        self.writes.append("lock")

    async def release_lock(self, node: str, resource: str, pod: PodRef) -> None:
        annotations = self.node_annotations.setdefault(node, {})
        held = annotations.get(lock_key(resource))
        if held is not None and NodeLock.decode(held).uid == pod.uid:
            del annotations[lock_key(resource)]

    async def label_pod(self, pod: PodRef) -> None:
        self.pods[(pod.namespace, pod.name)]["metadata"].setdefault("labels", {})[ASSIGNED_POD_LABEL] = "true"
        self.writes.append("label")

    async def bind(self, pod: PodRef, node: str, annotations: Mapping[str, str] | None = None) -> None:
        self.writes.append("bind")
        if self.fail_bind:
            raise RuntimeError("binding refused (test)")
        obj = self.pods[(pod.namespace, pod.name)]
        if obj["spec"].get("nodeName"):  # as the API server answers (409)
            raise RuntimeError(f"pod {pod.name} is already assigned to node {obj['spec']['nodeName']!r}")
        obj["spec"]["nodeName"] = node  # with the annotations, in one write, as the API server does
        obj["metadata"].setdefault("annotations", {}).update(annotations or {})

    async def event(self, pod: PodRef, reason: str, message: str, warning: bool = False) -> None:
        self.events.append((str(pod), reason, message))

    def lock_holder(self, node: str, resource: str) -> NodeLock | None:
        held = self.node_annotations.get(node, {}).get(lock_key(resource))
        return None if held is None else NodeLock.decode(held)

    def link(self, node: str) -> FakeNodeLink:
        return FakeNodeLink(self, node)


@dataclass
class FakeNodeLink:
    """``kxpu.sharing.node.NodeLink`` over a FakeCluster, for one node."""

    cluster: FakeCluster
    node: str
    published: list[tuple[str, str]] = field(default_factory=list)

    async def publish(self, resource: str, key: str, value: str) -> None:
        self.cluster.node_annotations.setdefault(self.node, {})[key] = value
        self.published.append((key, value))

    async def lock(self, resource: str) -> NodeLock | None:
        return self.cluster.lock_holder(self.node, resource)

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        obj = self.cluster.pods.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    async def finish(self, resource: str, lock: NodeLock) -> None:
        obj = self.cluster.pods.get((lock.namespace, lock.name))
        if obj is not None and obj["metadata"]["uid"] == lock.uid:
            annotations = obj["metadata"].setdefault("annotations", {})
            annotations[allocated_key(resource)] = str(self.cluster.clock())
            annotations["kxpu.io/bind-phase"] = "allocated"
        await self.cluster.release_lock(self.node, resource, PodRef(lock.namespace, lock.name, lock.uid))

    async def warn(self, lock: NodeLock | None, reason: str, message: str) -> None:
        self.cluster.events.append((lock.pod if lock else f"node/{self.node}", reason, message))

    async def keys(self, fresh: bool = False) -> Keys:
        return self.cluster.keyring

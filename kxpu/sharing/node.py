"""The node side of sharing: a backend wrapper that turns devices into slots and admits by handshake.

``SharingBackend`` decorates any vendor backend (the daemon never knows):

- each device becomes ``split_count`` slot devices ``<id>::<n>`` with the parent's
  attributes, so the kubelet's allocatable count is devices x split count;
- every snapshot is published as the node's inventory annotation (``inventory.py``) at
  once when it changes and every ``publish_interval_seconds`` as a heartbeat;
- GetPreferredAllocation steers the kubelet to slots of the devices the scheduler
  assigned to the container being admitted;
- Allocate is a handshake: the node lock names the pod being admitted; its assignment
  must carry a valid signature for this pod UID and node, be recent, and give the next
  container devices whose slots the kubelet offers. The answer is the vendor's edits for
  the parent devices plus the visible UUIDs, ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` (``3000m``)
  and ``CUDA_DEVICE_SM_LIMIT`` (HAMi-core's names) and configured env and mounts; a vendor
  backend that enforces shares itself (``ShareAllocator``: NVIDIA MPS) is handed the grants,
  and the grants are recorded as the ``kxpu.io/grants`` annotation for telemetry. A
  missing, stale, forged or mismatched assignment is refused with a message naming the
  pod and the reason, and a Warning event on the pod.

The API server is behind ``NodeLink`` (``kxpu.kube.sharing.node`` for real; tests use an
in-memory one). Kubelet call order makes "the next container" well defined: for one pod it
admits containers in spec order, each with GetPreferredAllocation then Allocate per resource,
so an Allocate goes to the first container not yet allocated whose devices are those offered.

Which containers are allocated is kept in memory only. A wrapper that starts after the lock
was taken (the lock's ``acquired``, by the extender's clock, against ours: a daemon restart, a
rebuilt backend) may have missed some of the pod's Allocate calls, which the kubelet does not
repeat, and nothing it sees tells which. When several containers it has not seen have the
offered devices but different grants, it refuses rather than guess (one container with
another's limits over-commits the device): the pod fails admission and its controller
replaces it. The limit: such a pod is refused also when the restart came before its admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kxpu.backoff import Backoff
from kxpu.logs import error_text, get_logger
from kxpu.model import (
    GRANT_ANNOTATION,
    SUB_DEVICE_SEPARATOR,
    Backend,
    BackendError,
    Closable,
    ContainerEdits,
    Device,
    DeviceShare,
    Grant,
    Mount,
    ShareAllocator,
    Watcher,
    encode_grants,
    numa_packed,
    share_limit_env,
)
from kxpu.sharing import inventory, signing
from kxpu.sharing.config import SharingConfig
from kxpu.sharing.lock import NodeLock
from kxpu.sharing.model import Assignment, ContainerAssignment, NodeInventory, SharedDevice
from kxpu.timeouts import wait_event

log = get_logger("kxpu.sharing.node")

SLOT_SEPARATOR = SUB_DEVICE_SEPARATOR
MIB = 1024 * 1024
_STEERED_REUSE_S = 1.0  # how long GetPreferredAllocation's verified pod serves the Allocate after it


class NodeLink(Protocol):
    """What the node wrapper needs from the API server."""

    async def publish(self, resource: str, key: str, value: str) -> None:
        """Set one annotation on this node."""

    async def lock(self, resource: str) -> NodeLock | None:
        """The node lock for ``resource`` as the API server has it now."""

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    async def finish(self, resource: str, lock: NodeLock) -> None:
        """Mark the pod allocated for ``resource`` and release the lock if it still names it."""

    async def warn(self, lock: NodeLock | None, reason: str, message: str) -> None:
        """A Warning event on the pod (or the node when no pod is known)."""

    async def keys(self, fresh: bool = False) -> signing.Keys:
        """The keys that verify assignments; ``fresh``: read them again now (a rotation may be under way)."""


class NotYet(Exception):
    """The handshake cannot complete yet (the lock or the assignment is not visible); retry until the deadline."""


@dataclass(slots=True)
class _Pending:
    lock: NodeLock
    assignment: Assignment
    done: list[str]  # containers of this resource already allocated, in order
    complete: bool  # this wrapper saw every Allocate of the pod, so ``done`` is all of them


def slot_id(device_id: str, n: int) -> str:
    return f"{device_id}{SLOT_SEPARATOR}{n}"


def parent_id(slot: str) -> str:
    return slot.rpartition(SLOT_SEPARATOR)[0] or slot


class SharingBackend(Backend):
    def __init__(
        self,
        inner: Backend,
        resource: str,
        config: SharingConfig,
        link: Callable[[], NodeLink],
        node_name: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.inner = inner
        self.resource = resource
        self.config = config
        self.node_name = node_name
        self.clock = clock
        self._make_link = link
        self._link: NodeLink | None = None
        self._parents: dict[str, Device] = {}
        self._published: tuple[SharedDevice, ...] | None = None
        self._inventory_changed: asyncio.Event | None = None
        self._pending: dict[str, _Pending] = {}  # pod uid → progress
        # What GetPreferredAllocation just verified, and when: the kubelet's Allocate for the same
        # container follows at once, so it need not read the lock again (_allocate).
        self._steered: tuple[_Pending, float] | None = None
        self._started = clock()  # locks taken before this may have had Allocate calls we never saw
        self._background: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # where the background tasks run
        self._key = inventory.annotation_key(resource)

    # -- devices -------------------------------------------------------------------------------

    def _slots(self, parents: Sequence[Device]) -> list[Device]:
        self._parents = {d.id: d for d in parents}
        # Slots carry no NUMA topology: the extender already chose the device (numa-bind included);
        # hints would let the kubelet's TopologyManager narrow the offer away from the assigned slots.
        return [
            replace(d, id=slot_id(d.id, n), numa_nodes=())
            for d in parents
            for n in range(self.config.split_count)
        ]

    def discover(self) -> list[Device]:
        return self._slots(self.inner.discover())

    def inventory(self) -> NodeInventory:
        devices = []
        for position, d in enumerate(self._parents.values()):
            memory = d.memory_mib or 0
            devices.append(
                SharedDevice(
                    id=d.id,
                    uuid=d.uuid or d.id,
                    model=d.model or "unknown",
                    memory_mib=memory,
                    memory_capacity_mib=int(memory * self.config.memory_scaling),
                    core_capacity=int(100 * self.config.core_scaling),
                    split_count=self.config.split_count,
                    numa=d.numa_nodes[0] if d.numa_nodes else None,
                    healthy=d.healthy,
                    index=d.index if d.index is not None else position,
                    cores=d.cores,
                )
            )
        return NodeInventory(self.resource, tuple(devices), self.clock())

    @property
    def link(self) -> NodeLink:
        if self._link is None:
            self._link = self._make_link()
        return self._link

    async def watch(self) -> AsyncIterator[list[Device]]:
        """The inner backend's snapshots as slots; meanwhile publish the inventory (runs until cancelled)."""
        self._inventory_changed = asyncio.Event()
        publisher = asyncio.create_task(self._publish_loop(self._inventory_changed))
        try:
            if isinstance(self.inner, Watcher):
                async for parents in self.inner.watch():
                    slots = self._slots(parents)
                    self._inventory_changed.set()
                    yield slots
            else:
                self._inventory_changed.set()
                yield self._slots(list(self._parents.values()))  # the list discover() found
            await publisher  # keeps the heartbeat going after a static backend's single list
        finally:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await publisher

    async def _publish_loop(self, changed: asyncio.Event) -> None:
        backoff = Backoff(initial=0.5, maximum=10.0)
        while True:
            await wait_event(changed, self.config.publish_interval_seconds)
            changed.clear()
            inv = self.inventory()
            try:
                await self.link.publish(self.resource, self._key, inventory.encode(inv))
            except Exception as exc:
                log.warning(
                    "could not publish the inventory; retrying", resource=self.resource, error=error_text(exc)
                )
                await asyncio.sleep(backoff.next_delay())
                changed.set()
                continue
            backoff.reset()
            if inv.devices != self._published:
                log.info("inventory published", resource=self.resource, devices=len(inv.devices))
                self._published = inv.devices

    # -- the handshake -------------------------------------------------------------------------

    async def _current(self) -> _Pending:
        """The pod being admitted, verified; NotYet while it is not visible, BackendError if refused."""
        lock = await self.link.lock(self.resource)
        if lock is None:
            raise NotYet(f"no pod holds the {self.resource} lock of node {self.node_name}")
        pending = self._pending.get(lock.uid)
        if pending is not None and pending.lock == lock:
            return pending
        pod = await self.link.get_pod(lock.namespace, lock.name)
        if pod is None:
            raise NotYet(f"pod {lock.pod} named by the node lock is not visible")
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if meta.get("uid") != lock.uid:
            raise _Refusal(
                lock,
                f"the node lock names pod {lock.pod} UID {lock.uid}, but that pod has UID {meta.get('uid')}",
            )
        if signing.ASSIGNMENT_ANNOTATION not in annotations:
            raise NotYet(f"pod {lock.pod} has no assignment yet")
        for fresh in (False, True):
            try:
                assignment = signing.verify(
                    annotations.get(signing.ASSIGNMENT_ANNOTATION),
                    annotations.get(signing.SIGNATURE_ANNOTATION),
                    await self.link.keys(fresh),
                    pod_uid=str(meta.get("uid")),
                    namespace=str(meta.get("namespace")),
                    name=str(meta.get("name")),
                    node=self.node_name,
                    now=self.clock(),
                    max_age_s=self.config.max_assignment_age_seconds,
                )
                break
            except signing.SignatureError as exc:
                # signed with a key we do not hold (yet): the keys may have been rotated since we read
                # them; read them again once before refusing
                if not fresh and signing.is_unknown_key(exc):
                    continue
                raise _Refusal(lock, f"pod {lock.pod}: assignment refused: {exc}") from None
        if not assignment.for_resource(self.resource):
            raise _Refusal(lock, f"pod {lock.pod}: its assignment gives no {self.resource} devices")
        previous = self._pending.get(lock.uid)
        if previous is not None:
            pending = _Pending(lock, assignment, previous.done, previous.complete)
        else:
            pending = _Pending(lock, assignment, [], lock.acquired >= self._started)
        self._pending = {lock.uid: pending}  # one pod per node and family at a time
        return pending

    async def _wait_current(self) -> _Pending:
        deadline = time.monotonic() + self.config.allocate_timeout_seconds
        delay = 0.02
        while True:
            try:
                return await self._current()
            except NotYet as exc:
                if time.monotonic() + delay > deadline:
                    raise _Refusal(None, f"no verified assignment for this allocation: {exc}") from None
            await asyncio.sleep(delay)  # the lock/pod update may trail the kubelet by a few ms
            delay = min(delay * 2, 0.5)

    def _remaining(self, pending: _Pending) -> list[ContainerAssignment]:
        return [c for c in pending.assignment.for_resource(self.resource) if c.container not in pending.done]

    def _candidates(self, pending: _Pending, offered: Sequence[str]) -> list[ContainerAssignment]:
        """Containers not yet allocated whose devices are exactly the offered parents."""
        return [c for c in self._remaining(pending) if sorted(g.device for g in c.devices) == sorted(offered)]

    async def preferred_allocation_async(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        try:
            pending = await self._wait_current()
        except (_Refusal, BackendError) as exc:
            log.warning("no assignment to steer by; the NUMA default is offered", error=str(exc))
            return numa_packed(available, must_include, size)
        self._steered = (pending, time.monotonic())
        for container in self._remaining(pending):
            if len(container.devices) != size:
                continue
            chosen = [d.id for d in must_include]
            for grant in container.devices:
                if any(parent_id(c) == grant.device for c in chosen):
                    continue
                slot = next(
                    (d.id for d in available if parent_id(d.id) == grant.device and d.id not in chosen), None
                )
                if slot is not None:
                    chosen.append(slot)
            if len(chosen) == size:
                return chosen
        return numa_packed(available, must_include, size)

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        return numa_packed(available, must_include, size)  # the daemon awaits the async one instead

    async def allocate_async(self, devices: Sequence[Device]) -> ContainerEdits:
        try:
            return await self._allocate(devices)
        except _Refusal as exc:
            with contextlib.suppress(Exception):
                await self.link.warn(exc.lock, "KxpuAllocationRefused", str(exc))
            raise BackendError(str(exc)) from None

    async def _allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        offered = [parent_id(d.id) for d in devices]
        if len(set(offered)) != len(offered):
            raise _Refusal(
                None, f"the kubelet offered two slots of one device: {', '.join(d.id for d in devices)}"
            )
        steered, self._steered = self._steered, None
        pending: _Pending | None = None
        if (
            steered is not None
            and time.monotonic() - steered[1] < _STEERED_REUSE_S
            and self._pending.get(steered[0].lock.uid) is steered[0]
        ):
            pending = steered[0]  # verified by this container's GetPreferredAllocation a moment ago
            if not self._candidates(pending, offered):
                pending = None  # not what it steered to: read the lock again rather than refuse on it
        if pending is None:
            pending = await self._wait_current()
        remaining = self._remaining(pending)
        candidates = self._candidates(pending, offered)
        match = candidates[0] if candidates else None
        if match is None:
            wanted = "; ".join(f"{c.container}: {', '.join(g.device for g in c.devices)}" for c in remaining)
            raise _Refusal(
                pending.lock,
                f"pod {pending.lock.pod}: the kubelet offered {', '.join(offered)} but the assignment gives "
                f"{wanted or 'nothing more'} (kubelet and scheduler disagree; was the pod scheduled by kxpu?)",
            )
        if not pending.complete and any(set(c.devices) != set(match.devices) for c in candidates):
            raise _Refusal(
                pending.lock,
                f"pod {pending.lock.pod}: containers {', '.join(c.container for c in candidates)} have the same "
                "devices but different limits, and the node daemon restarted after the pod was bound: which "
                "of them the kubelet already allocated cannot be told, so none is guessed",
            )
        pending.done.append(match.container)
        edits = self._edits(match)
        log.info(
            "allocated shared devices",
            pod=pending.lock.pod,
            container=match.container,
            devices={g.device: f"{g.memory_mib}MiB/{g.cores}%" for g in match.devices},
        )
        if not self._remaining(pending):
            self._spawn(self._finish(pending.lock))
        return edits

    def _edits(self, container: ContainerAssignment) -> ContainerEdits:
        granted = [g for g in container.devices if g.device in self._parents]
        if isinstance(self.inner, ShareAllocator):  # the vendor enforces the grant itself (MPS limits)
            base = self.inner.allocate_shares(
                [DeviceShare(self._parents[g.device], g.memory_mib, g.cores) for g in granted]
            )
        else:
            base = self.inner.allocate([self._parents[g.device] for g in granted])
        env = {self.config.visible_devices_env: ",".join(g.uuid for g in container.devices)}
        shares = [
            DeviceShare(self._parents.get(g.device) or Device(id=g.device), g.memory_mib, g.cores)
            for g in container.devices
        ]
        env.update(share_limit_env(shares, self.config.memory_limit_env, self.config.core_limit_env))
        env.update(self.config.env)
        mounts = [Mount(m.container_path, m.host_path, m.read_only) for m in self.config.mounts]
        # What the container was granted, kept by the kubelet with the container: telemetry compares it
        # with what the container uses.
        grants = encode_grants(
            [Grant(g.uuid, g.memory_mib * MIB, g.cores / 100 if g.cores else None) for g in container.devices]
        )
        return ContainerEdits(env=env, mounts=mounts, annotations={GRANT_ANNOTATION: grants}).merge(base)

    async def _finish(self, lock: NodeLock) -> None:
        try:
            await self.link.finish(self.resource, lock)
        except Exception as exc:
            log.warning(
                "could not release the node lock (it will be recovered)", pod=lock.pod, error=error_text(exc)
            )

    def _spawn(self, coro: Any) -> None:
        self._loop = asyncio.get_running_loop()
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def settled(self) -> None:
        """Wait for background lock releases (tests)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        raise BackendError("shared devices are allocated through the signed-assignment handshake")

    def close(self) -> None:
        # The daemon calls close() from a worker thread: cancel on the loop, from a snapshot of the set.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for task in list(self._background):
                loop.call_soon_threadsafe(task.cancel)
        if isinstance(self.inner, Closable):
            self.inner.close()


class _Refusal(Exception):
    def __init__(self, lock: NodeLock | None, message: str) -> None:
        super().__init__(message)
        self.lock = lock

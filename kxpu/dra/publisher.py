"""Keeping one node's ResourceSlices for one driver in step with the backend's devices.

Level-triggered: each ``publish`` lists the driver's slices for this node and makes them equal to
``slices.pool_content`` for the current devices — update in place, create what is missing, delete
what is extra (and any slice owned by an older incarnation of the Node, whose UID is read again before
every write). ``is_current`` tells the driver's watch of its slices whether an event is the echo of its
own write or something to repair (the kubelet deletes a node's slices when it starts and a driver's
slices 30 s after losing it; an admin may delete them). The pool's generation
moves only when the published devices change, and always past every generation seen, so consumers
(the scheduler) never mistake a new pool for an old one. Slices are owned by the Node object, so the
API server's garbage collector removes them with a deleted node, as the API expects.

If the API server drops the device taints kxpu writes (a release or cluster without device taints),
the publisher says so once and withdraws unhealthy devices instead (all but those whose fault's effect is
``None``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol

from kxpu.dra.slices import PoolContent, SharePolicy, Unhealthy, pool_content, same_devices
from kxpu.dra.taints import TaintPolicy
from kxpu.logs import get_logger
from kxpu.model import CounterSet, Device

log = get_logger("kxpu.dra.publisher")

_NAME_UNSAFE = re.compile(r"[^a-z0-9.-]+")
MAX_NAME = 253


class SliceApi(Protocol):
    """The ResourceSlice calls the publisher makes (``kxpu.kube.dra.DraKube`` against the API server)."""

    async def node_uid(self, node: str) -> str: ...

    async def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]: ...

    async def create_slice(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def replace_slice(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def delete_slice(self, name: str) -> None: ...

    def watch_slices(self, driver: str, node: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Every change to the driver's slices of the node (``ADDED``/``MODIFIED``/``DELETED``, the object),
        starting with an ``ADDED`` for each slice there now; raises when the watch breaks."""
        ...


def slice_name(node: str, driver: str, index: int) -> str:
    """``<node>-<driver>-<hash>-<index>``: stable (updated in place), a DNS subdomain, and unique per node and
    driver: the hash of the pair keeps node ``a-b`` with driver ``c.io`` apart from node ``a`` with driver
    ``b-c.io`` (both ``a-b-c.io`` once joined), and names cut to fit apart."""
    digest = hashlib.sha256(f"{node}\x00{driver}".encode()).hexdigest()[:8]
    raw = _NAME_UNSAFE.sub("-", f"{node}-{driver}".lower()).strip("-.")
    suffix = f"-{digest}-{index}"
    return raw[: MAX_NAME - len(suffix)].rstrip("-.") + suffix


def _slice_order(obj: Mapping[str, Any]) -> tuple[int, str]:
    """Slices by the index their name ends in (``…-10`` after ``…-9``), other names last."""
    name = str(obj["metadata"]["name"])
    tail = name.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 30, name)


def _generation(obj: Mapping[str, Any]) -> int:
    try:
        return int(obj["spec"]["pool"]["generation"])
    except (KeyError, TypeError, ValueError):
        return 0


def _owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("kind") == "Node" and r.get("uid") == uid for r in refs)


def _taints_dropped(sent: Mapping[str, Any], got: Mapping[str, Any]) -> bool:
    sent_taints = [bool(d.get("taints")) for d in sent.get("devices", [])]
    got_taints = [bool(d.get("taints")) for d in (got.get("spec") or {}).get("devices", []) or []]
    return any(sent_taints) and sent_taints != got_taints


def _keep_taint_times(spec: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """A taint already on the device keeps the ``timeAdded`` the API server gave it (a republish for another
    device's sake must not make every old taint look new)."""
    if old is None:
        return
    # By key and effect, not value: a fault whose reason changes within its class (xid-79, then gpu-lost) is the
    # same fault, and a NoExecute toleration's seconds count from when it began.
    before = {
        (d.get("name"), t.get("key"), t.get("effect")): t.get("timeAdded")
        for d in (old.get("spec") or {}).get("devices") or []
        for t in d.get("taints") or []
    }
    for device in spec.get("devices", []):
        for taint in device.get("taints", []):
            added = before.get((device["name"], taint["key"], taint["effect"]))
            if added:
                taint["timeAdded"] = added


class SlicePublisher:
    def __init__(
        self,
        api: SliceApi,
        driver: str,
        node: str,
        unhealthy: Unhealthy = "taint",
        shares: SharePolicy | None = None,
        taints: TaintPolicy | None = None,
    ) -> None:
        self.api = api
        self.taints = taints or TaintPolicy()
        self.driver = driver
        self.node = node
        self.unhealthy: Unhealthy = unhealthy
        self.shares = shares
        self.generation = 0  # the highest this process published or saw
        self.published: PoolContent | None = None
        self._node_uid: str | None = None
        # Each slice as this process last wrote or read it (name → resourceVersion): a watch event that
        # matches is the echo of our own write, anything else (a deletion by the kubelet or an admin, another
        # writer) means the pool must be checked again.
        self.known: dict[str, str | None] = {}
        self.log = log.bind(driver=driver, node=node)

    def is_current(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Whether a watch event only repeats what this publisher already knows."""
        metadata = obj.get("metadata") or {}
        name = metadata.get("name")
        if kind == "DELETED":
            return name not in self.known
        return name in self.known and self.known[name] == metadata.get("resourceVersion")

    async def publish(
        self,
        devices: Sequence[Device],
        held: frozenset[str] = frozenset(),
        counter_sets: Sequence[CounterSet] = (),
    ) -> bool:
        """Make the API match ``devices`` (``held``: IDs device-plugin pods still hold; ``counter_sets``: what
        partitions draw from); True if anything was written."""
        if self._node_uid is None:
            self._node_uid = await self.api.node_uid(self.node)
        existing = sorted(await self.api.list_slices(self.driver, self.node), key=_slice_order)
        self.known = {o["metadata"]["name"]: o["metadata"].get("resourceVersion") for o in existing}
        foreign = [o for o in existing if not _owned_by(o, self._node_uid)]
        mine = [o for o in existing if _owned_by(o, self._node_uid)]
        self.generation = max([self.generation, *(_generation(o) for o in existing)])

        def content_at(generation: int) -> PoolContent:
            return pool_content(
                self.driver,
                self.node,
                devices,
                generation,
                self.unhealthy,
                self.shares,
                held,
                counter_sets,
                self.taints,
            )

        current = content_at(self.generation)
        specs = [o.get("spec") or {} for o in mine]
        up_to_date = (
            not foreign
            and len(mine) == len(current.slices)
            and same_devices(specs, current.slices)
            and all(_generation(o) == self.generation for o in mine)
            and all(s.get("pool", {}).get("resourceSliceCount") == len(mine) for s in specs)
            and [o["metadata"]["name"] for o in mine]
            == [slice_name(self.node, self.driver, i) for i in range(len(mine))]
        )
        if up_to_date:
            self.published = current
            return False
        # About to write: the Node may have been deleted and created again since its UID was read (slices
        # owned by the dead UID would be garbage-collected right after being written).
        uid = await self.api.node_uid(self.node)
        if uid != self._node_uid:
            self.log.info("the Node object was created again; its slices get the new owner", uid=uid)
            self._node_uid = uid
            foreign = [o for o in existing if not _owned_by(o, uid)]
            mine = [o for o in existing if _owned_by(o, uid)]
        for obj in foreign:  # a previous Node object of the same name: its slices go with it
            await self.api.delete_slice(obj["metadata"]["name"])
            self.known.pop(obj["metadata"]["name"], None)
        self.generation += 1
        content = content_at(self.generation)
        by_name = {o["metadata"]["name"]: o for o in mine}
        wanted = {slice_name(self.node, self.driver, i): spec for i, spec in enumerate(content.slices)}
        for name, spec in wanted.items():
            _keep_taint_times(spec, by_name.get(name))
            body = self._body(name, spec, by_name.get(name))
            got = await (self.api.replace_slice(body) if name in by_name else self.api.create_slice(body))
            self.known[name] = (got.get("metadata") or {}).get("resourceVersion")
            if self.unhealthy == "taint" and _taints_dropped(spec, got):
                self.log.warning(
                    "the API server dropped device taints (DRADeviceTaints off or unsupported); unhealthy devices "
                    "are withdrawn from the ResourceSlice instead"
                )
                self.unhealthy = "withdraw"
                return await self.publish(devices, held, counter_sets) or True
        for name in by_name.keys() - wanted.keys():
            await self.api.delete_slice(name)
            self.known.pop(name, None)
        self.published = content
        self.log.info(
            "ResourceSlices published",
            generation=self.generation,
            slices=len(content.slices),
            devices=sum(len(s.get("devices") or ()) for s in content.slices),
        )
        return True

    def _body(self, name: str, spec: dict[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": name,
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": self.node,
                    "uid": self._node_uid,
                    "controller": True,
                }
            ],
        }
        if old is not None:
            metadata["resourceVersion"] = old["metadata"].get("resourceVersion")
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": spec,
        }

    async def withdraw(self) -> None:
        """Delete every slice of this driver on this node (the resource is no longer served here)."""
        for obj in await self.api.list_slices(self.driver, self.node):
            await self.api.delete_slice(obj["metadata"]["name"])
        self.published = None
        self.known = {}
        self.log.info("ResourceSlices withdrawn")

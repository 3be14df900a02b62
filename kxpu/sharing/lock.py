"""The node lock: at most one pod per node and family between bind and Allocate.

The kubelet's Allocate carries no pod identity, so the node daemon learns which pod it is
admitting from a lock the extender takes at bind, holding
``{"pod": "ns/name", "uid": …, "owner": …, "acquired": t, "expires": t}``. It lives in a
``coordination.k8s.io/v1`` Lease per node and family (``lease_name``: ``spec.holderIdentity``
is the lock, absent when free), so that a lock and its release are not Node updates sent to
every Node watcher of the cluster (CNI agents, kube-proxy, …). Before this release it lived in
the node annotation ``kxpu.io/lock.<domain>_<name>`` (e.g. ``kxpu.io/lock.nvidia.com_gpu``);
the extender keeps using that on nodes whose daemon does not announce
``kxpu.io/lock-protocol: lease`` (an older daemon during a rolling upgrade), and honours an
annotation lock still held when it switches. Either is written with a compare-and-swap on
the object's resourceVersion and released by the node daemon once the pod's last container
of that family is allocated (which also marks the pod ``kxpu.io/allocated.<domain>_<name>``).

Recovery (``holder_state``), so a lost release never stalls a node for minutes as HAMi's
5-minute lock does, yet a lock is never handed over while its pod may still be admitted
(HAMi #3096, where an expired lock swapped two pods' limits): the lock is free at once
when its pod is gone, replaced (other UID), finished, deleted, already allocated, or bound
to another node, or admitted (the kubelet sets ``status.startTime`` only after admission, so
after every Allocate); it expires if the pod was never bound; and if the pod is bound here
but the kubelet never admits it (the kubelet or its node is down), only after
``hard_expiry_s`` (``lockHardExpirySeconds``). Then the extender's sweeper marks that pod
Failed before releasing the lock (``HARD_EXPIRED``), so a kubelet that comes back never
admits it under another pod's lock; its controller replaces it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kxpu.sharing.placement import check_pod_names

LOCK_PREFIX = "kxpu.io/lock."
# On pods whose devices kxpu assigns: set by the webhook at admission (by the extender at bind if the
# webhook did not; before this release, only then, hence the name). The extender's pod watch selects on
# it, so once set only kxpu may change it (the webhook enforces that): a pod that dropped it would vanish
# from the bookkeeping, its grant free. Renaming it would hide every running pod's grant after an upgrade.
ASSIGNED_POD_LABEL = "kxpu.io/assigned"
# Where a pod is between bind and admission ("allocating" → "allocated"), written by kxpu only.
BIND_PHASE_ANNOTATION = "kxpu.io/bind-phase"
ALLOCATED_PREFIX = "kxpu.io/allocated."


def _suffix(resource: str) -> str:
    from kxpu.sharing.inventory import annotation_key

    return annotation_key(resource).removeprefix("kxpu.io/devices.")


def lock_key(resource: str) -> str:
    return LOCK_PREFIX + _suffix(resource)


# On a node: which lock its daemon reads ("lease": the Lease and, for locks taken before, the annotation).
LOCK_PROTOCOL_ANNOTATION = "kxpu.io/lock-protocol"
# On lock Leases: what the extender's Lease watch selects on, and which node and family each is for.
LEASE_LABEL = "kxpu.io/node-lock"
LEASE_NODE_ANNOTATION = "kxpu.io/node"
LEASE_RESOURCE_ANNOTATION = "kxpu.io/resource"
_NOT_NAME = re.compile(r"[^a-z0-9.-]+")


def lease_name(node: str, resource: str) -> str:
    """The lock Lease of ``node`` and ``resource``: a DNS subdomain name, readable, and unique by a hash."""
    readable = _NOT_NAME.sub("-", f"kxpu-lock.{node}.{resource}".lower().replace("/", "."))
    digest = hashlib.sha256(f"{node}\0{resource}".encode()).hexdigest()[:8]
    readable = re.sub(r"[.-]*\.[.-]*", ".", readable)[:240].strip(".-")  # every run of . and - holding a dot
    return f"{readable}.{digest}"


def allocated_key(resource: str) -> str:
    return ALLOCATED_PREFIX + _suffix(resource)


# holder_state's answer when the pod is bound here, alive, and still not admitted at the hard expiry.
HARD_EXPIRED = "the kubelet never admitted its pod"


class LockError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class NodeLock:
    namespace: str
    name: str
    uid: str
    owner: str
    acquired: float
    expires: float

    @property
    def pod(self) -> str:
        return f"{self.namespace}/{self.name}"

    def encode(self) -> str:
        return json.dumps(
            {
                "pod": self.pod,
                "uid": self.uid,
                "owner": self.owner,
                "acquired": self.acquired,
                "expires": self.expires,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, text: str) -> NodeLock:
        """Parse a lock; its pod's names are checked as the API server checks them, since they go into API paths
        (a lock is written by the extender, but node identities can reach the objects that hold it)."""
        try:
            doc = json.loads(text)
            namespace, _, name = str(doc["pod"]).partition("/")
            bad = check_pod_names(namespace, name)
            if bad:
                raise ValueError(bad)
            return cls(
                namespace,
                name,
                str(doc["uid"]),
                str(doc["owner"]),
                float(doc["acquired"]),
                float(doc["expires"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise LockError(f"unreadable node lock {text[:80]!r}: {exc}") from None


def holder_state(
    lock: NodeLock,
    holder: Mapping[str, Any] | None,
    resource: str,
    node: str,
    now: float,
    hard_expiry_s: float,
) -> str | None:
    """Why ``lock`` no longer binds anyone (None: it is held). ``holder``: its pod as the API shows it."""
    if holder is None:
        return "its pod is gone"
    meta = holder.get("metadata") or {}
    if meta.get("uid") != lock.uid:
        return "its pod was replaced"
    if meta.get("deletionTimestamp"):
        return "its pod is being deleted"
    if (holder.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return "its pod has finished"
    if allocated_key(resource) in (meta.get("annotations") or {}):
        return "its pod is already allocated"
    if (holder.get("status") or {}).get("startTime"):
        return "its pod was admitted"
    bound = (holder.get("spec") or {}).get("nodeName")
    if bound and bound != node:
        return f"its pod is bound to {bound}"
    if not bound:
        # A lock's times are only as honest as whoever wrote it (a node may rewrite its own lock Lease): a pod
        # never bound here is never failed for it, and no lock outlives the hard expiry.
        if now > min(lock.expires, lock.acquired + hard_expiry_s):
            return "it expired before its pod was bound"
        return None
    if now > lock.acquired + hard_expiry_s:
        return HARD_EXPIRED
    return None

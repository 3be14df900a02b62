"""A watch-fed cache of this node's allocated ResourceClaims, so NodePrepareResources needs no API round trip.

The API server keeps every claim of the cluster; the cache keeps only those whose ``status.allocation``
names a device of this driver in this node's pool, and of each only what ``claims.allocation_for`` reads
(its name, namespace, UID and this driver's results and opaque configs): its memory follows the node's
claims, not the cluster's. There is no field selector for a claim's allocation, so the watch still carries
every claim; the filter runs on each event and drops the rest at once.

It never answers with a stale or foreign object:

- a hit needs the UID the kubelet asked for (a claim deleted and created again under the same name misses);
- the entry holds an allocation for this node's pool (a claim for another node, or not allocated, is absent);
- it answers only while synced: from the end of a list until the watch breaks (410 Gone, a dropped
  connection); until the next list ends, every prepare reads the claim from the API server;
- an entry answers one prepare and is then dropped: after that the checkpoint answers repeats, and a claim
  deallocated and allocated again (same UID, new devices) is read from the API server, or from the watch
  event that brought the new allocation — never from the entry the first prepare used.

What remains: the cache is as fresh as its watch. A claim allocated here, never prepared, then deallocated
and allocated again here to other devices (same UID) while the watch lags behind all of that would be
answered with its first allocation; the kubelet asks only once the scheduler has placed the pod, so the
watch would have to trail the scheduler, the binding and the kubelet's own read of the claim.

A miss is never an error: the preparer reads the claim from the API server (a GET), as without a cache.
``allocation_for`` checks a hit exactly as it checks a GET's answer.

Telemetry reads one more thing of each claim allocated here: the UIDs of the pods in its ``status.reservedFor``
(``pods_of``), kept apart from the prepare entries (a frozenset per claim, kept after ``take``), so that samples
of a DRA-allocated device are tied to the pods whose processes run on it.

The cache needs ``list`` and ``watch`` on resourceclaims (read-only).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol

from kxpu.dra import metrics
from kxpu.dra.metadata import POD_CLAIM_NAME
from kxpu.kube.watch import keep_watching
from kxpu.logs import get_logger

log = get_logger("kxpu.dra.claim_cache")

# What allocation_for reads of each of this driver's results.
_RESULT_KEYS = ("driver", "request", "device", "pool", "shareID", "adminAccess", "consumedCapacity")


class ClaimWatchApi(Protocol):
    """Listing and watching every ResourceClaim (``kxpu.kube.dra.DraKube`` against the API server)."""

    async def list_claims(self, each: Callable[[Mapping[str, Any]], None]) -> str | None:
        """Call ``each`` for every claim of the cluster (paged); the list's resourceVersion."""
        ...

    def watch_claims(self, version: str | None) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
        """Every change after ``version`` (``ADDED``/``MODIFIED``/``DELETED``, the object); raises when the
        watch breaks, 410 Gone included."""
        ...


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def reserved_pods(claim: Mapping[str, Any]) -> frozenset[str]:
    """The UIDs of the pods ``status.reservedFor`` names (entries ``{resource: pods, name, uid}`` of the core
    group; other consumers are not pods)."""
    reserved = _get(claim, "status", "reservedFor")
    if not isinstance(reserved, Sequence):
        return frozenset()
    return frozenset(
        r["uid"]
        for r in reserved
        if isinstance(r, Mapping)
        and r.get("resource") == "pods"
        and not r.get("apiGroup")
        and isinstance(r.get("uid"), str)
    )


def trim(claim: Mapping[str, Any], driver: str, pool: str) -> dict[str, Any] | None:
    """The part of ``claim`` prepare reads, or None when its allocation has no device of ``driver`` in
    ``pool`` (not allocated, or allocated elsewhere). Every result of the driver is kept, other pools' too:
    ``allocation_for`` refuses a claim that puts any of this driver's devices in another pool."""
    meta = claim.get("metadata")
    allocation = _get(claim, "status", "allocation")
    if not isinstance(meta, Mapping) or not isinstance(allocation, Mapping):
        return None
    results = _get(allocation, "devices", "results")
    if not isinstance(results, Sequence):
        return None
    mine = [
        {k: r[k] for k in _RESULT_KEYS if k in r}
        for r in results
        if isinstance(r, Mapping) and r.get("driver") == driver
    ]
    if not any(r.get("pool") == pool for r in mine):
        return None
    configs = _get(allocation, "devices", "config")
    kept_meta: dict[str, Any] = {k: meta.get(k) for k in ("namespace", "name", "uid")}
    # A template claim's name in its pod: where the container finds its device metadata (kxpu.dra.metadata).
    pod_claim = _get(meta, "annotations", POD_CLAIM_NAME)
    if isinstance(pod_claim, str):
        kept_meta["annotations"] = {POD_CLAIM_NAME: pod_claim}
    return {
        "metadata": kept_meta,
        "status": {
            "allocation": {
                "devices": {
                    "results": mine,
                    "config": [
                        c
                        for c in (configs if isinstance(configs, Sequence) else ())
                        if _get(c, "opaque", "driver") == driver
                    ],
                }
            }
        },
    }


class ClaimCache:
    """This node's allocated claims of one driver, by UID (see the module's docstring)."""

    def __init__(self, driver: str, pool: str, api: ClaimWatchApi | None = None) -> None:
        self.driver = driver
        self.pool = pool
        self.api = api
        self.synced = False
        self._claims: dict[str, dict[str, Any]] = {}  # UID → trimmed claim
        self._pods: dict[str, frozenset[str]] = {}  # UID → its reservedFor pod UIDs, while allocated here
        # Read when /metrics is asked, not set on every event and prepare.
        self._reading = metrics.Reading(metrics.CLAIM_CACHE_CLAIMS, (driver,), lambda: len(self._claims))
        self.log = log.bind(driver=driver)

    def stop_reporting(self) -> None:
        """Stopped: /metrics says it holds nothing (it no longer follows the watch) without holding this cache."""
        self._reading.stop(0)

    def __len__(self) -> int:
        return len(self._claims)

    def take(self, namespace: str, name: str, uid: str) -> Mapping[str, Any] | None:
        """The claim the kubelet names, allocated on this node, if the cache has it now; dropped from the cache
        (see the module's docstring). None: read it from the API server."""
        claim = self._claims.get(uid) if self.synced else None
        if claim is None or claim["metadata"]["namespace"] != namespace or claim["metadata"]["name"] != name:
            return None
        del self._claims[uid]
        return claim

    def pods_of(self, uid: str) -> frozenset[str] | None:
        """The UIDs of the pods claim ``uid`` is reserved for, while it is allocated on this node and the cache
        is synced; None: ask the API server."""
        return self._pods.get(uid) if self.synced else None

    def apply(self, kind: str, claim: Mapping[str, Any]) -> None:
        """One watch event."""
        uid = _get(claim, "metadata", "uid")
        if not isinstance(uid, str):
            return
        kept = trim(claim, self.driver, self.pool) if kind != "DELETED" else None
        if kept is None:
            self._claims.pop(uid, None)
            self._pods.pop(uid, None)
        else:
            self._claims[uid] = kept
            self._pods[uid] = reserved_pods(claim)

    def forget(self) -> None:
        """The watch broke: answer nothing until the next list has ended."""
        self.synced = False

    async def relist(self) -> str | None:
        """Replace the cache with a fresh list; its resourceVersion (to watch from)."""
        assert self.api is not None
        self.synced = False
        fresh: dict[str, dict[str, Any]] = {}
        pods: dict[str, frozenset[str]] = {}

        def keep(claim: Mapping[str, Any]) -> None:
            uid = _get(claim, "metadata", "uid")
            kept = trim(claim, self.driver, self.pool)
            if isinstance(uid, str) and kept is not None:
                fresh[uid] = kept
                pods[uid] = reserved_pods(claim)

        version = await self.api.list_claims(keep)
        self._claims, self._pods = fresh, pods
        self.synced = True
        return version

    async def run(self) -> None:
        """List, then follow the watch; on any break, list again (with backoff while it keeps failing)."""
        assert self.api is not None
        api = self.api

        async def watch_round(delivered: Callable[[], None]) -> None:
            version = await self.relist()
            self.log.debug("claim cache synced", claims=len(self._claims))
            async for kind, claim in api.watch_claims(version):
                delivered()
                self.apply(kind, claim)

        def failed(error: str, retry_in_s: float) -> None:  # 410 Gone, the connection, a 403: GET meanwhile
            self.log.warning(
                "watching ResourceClaims failed; prepare reads claims from the API server until it is back",
                error=error,
                retry_in_s=retry_in_s,
            )

        await keep_watching(watch_round, failed, after=self.forget)

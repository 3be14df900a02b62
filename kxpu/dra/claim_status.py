"""Claims that report back (``ResourceClaim.status.devices``, KEP-4817, GA in Kubernetes 1.37): after a claim is
prepared, one entry per device of this driver (conditions, and data: ID, UUID, model, memory, the share granted,
the partition, health), so ``kubectl get resourceclaim -o yaml`` answers "what did I get" without node access;
removed at unprepare.

Off the critical path and best effort: prepare only queues the entries; a background task writes them, one
server-side apply of the ``status`` subresource per claim (field manager ``kxpu-<driver>``: the apply owns this
driver's entries and no others, so removing them is applying none). A write that fails is one warning line and
never fails a prepare. Nor does it slow one: entries go out a second after the prepare (``SETTLE_S``), once the
kubelet has paused calling (``QUIET_S``: a burst of pods starting is served first), at most ``MAX_DEFER_S``
later; and writes coalesce per claim, so a claim unprepared before its entries went out costs no call at all.

The API server checks each write (``pkg/registry/resource/resourceclaim/strategy.go``, 1.37): every entry names
a device allocated to the claim (driver, pool, device, shareID), at most 8 conditions, data a JSON object of at
most 10 KiB; with DRAResourceClaimGranularStatusAuthorization (beta, on, 1.36+) the caller also needs
``associated-node:patch`` on ``resourceclaims/driver`` named after the driver (a token bound to a pod on the
claim's node) — what the chart grants, and no more (docs/dra.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kxpu.dra.checkpoint import PreparedDevice
from kxpu.dra.prepare import ClaimRef
from kxpu.logs import get_logger, one_line
from kxpu.model import Device

log = get_logger("kxpu.dra.claim_status")

MAX_DATA = 10 * 1024  # resource.AllocatedDeviceStatusDataMaxLength
CONCURRENCY = 4  # writes in flight at once: a burst of prepares is not one long queue
SETTLE_S = 1.0  # entries go out a second after prepare: a claim unprepared sooner costs no call
QUIET_S = 0.1  # and while the kubelet is calling (a burst of pods starting), once it has been quiet this long
MAX_DEFER_S = 5.0  # but never later than this past their time, however busy the node
RETRY_DELAYS = (0.5, 2.0)  # a transient failure (5xx, 429, a broken connection) is tried again, twice


class StatusWriteError(Exception):
    """The API server refused a status write (or could not be reached); ``transient``: worth another try."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class ClaimStatusApi(Protocol):
    async def apply_claim_status(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> bool:
        """Server-side apply of this driver's ``status.devices`` entries (none: remove them). False: the claim
        (with this UID) is gone, nothing to do. Raises StatusWriteError."""
        ...


def _timestamp(at: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def device_status(
    driver: str, node: str, prepared: PreparedDevice, device: Device | None, at: float | None = None
) -> dict[str, Any]:
    """One ``status.devices`` entry: the device as prepared for the claim (at ``at``, a ``time.time()``: now)."""
    now = _timestamp(at)
    data: dict[str, Any] = {"id": prepared.id}
    healthy = True
    reason = ""
    if device is not None:
        if device.uuid:
            data["uuid"] = device.uuid
        if device.model:
            data["model"] = device.model
        if device.memory_mib is not None:
            data["memoryMiB"] = device.memory_mib
        if device.index is not None:
            data["index"] = device.index
        if device.pci_bus_id:
            data["pciBusID"] = device.pci_bus_id
        healthy, reason = device.healthy, device.health_reason or ""
    if prepared.share_id:
        data["granted"] = {"memoryMiB": prepared.memory_mib, "cores": prepared.cores}
    if prepared.partition:
        data["partition"] = {"parent": prepared.parent} if prepared.parent else {}
        if device is not None and device.extra.get("profile"):
            data["partition"]["profile"] = str(device.extra["profile"])
    if prepared.admin_access:
        data["adminAccess"] = True
    data["health"] = "Healthy" if healthy else "Unhealthy"
    if len(json.dumps(data)) > MAX_DATA:
        data = {"id": prepared.id[:1024], "health": data["health"]}
    entry: dict[str, Any] = {
        "driver": driver,
        "pool": prepared.pool,
        "device": prepared.device,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": f"prepared on node {node}",
                "lastTransitionTime": now,
            },
            {
                "type": "Healthy",
                "status": "True" if healthy else "False",
                "reason": "DeviceHealthy" if healthy else "DeviceUnhealthy",
                "message": one_line(reason)[:1024] if reason else "",
                "lastTransitionTime": now,
            },
        ],
        "data": data,
    }
    if prepared.share_id:
        entry["shareID"] = prepared.share_id
    return entry


@dataclass(slots=True)
class _Pending:
    ref: ClaimRef
    # The entries, or what makes them when they go out (most claims of a burst are never sent); None: remove this
    # driver's entries.
    devices: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]] | None
    due: float  # time.monotonic() from which it may be sent


class ClaimStatusWriter:
    """Queues and writes one driver's ``status.devices`` entries; ``run`` is the writer (a task of the plugin)."""

    def __init__(
        self,
        driver: str,
        api: ClaimStatusApi,
        concurrency: int = CONCURRENCY,
        settle_s: float = SETTLE_S,
        quiet_s: float = QUIET_S,
        max_defer_s: float = MAX_DEFER_S,
    ) -> None:
        self.driver = driver
        self.api = api
        self.settle_s, self.quiet_s, self.max_defer_s = settle_s, quiet_s, max_defer_s
        self._activity = 0.0  # time.monotonic() of the kubelet's last prepare or unprepare
        self._pending: dict[str, _Pending] = {}
        self._written: set[str] = set()  # claim UIDs whose entries this process wrote (and did not remove)
        self._inflight: set[str] = set()
        self._wake = asyncio.Event()
        # When the writer wakes by itself (time.monotonic(); inf: only when woken): an entry due no earlier needs no
        # wake-up of its own (a wake-up per prepare is a task and a timer on every claim).
        self._wakes_at = 0.0
        self._slots = asyncio.Semaphore(concurrency)
        self._idle = asyncio.Event()
        self._idle.set()
        self.writes = 0  # API calls made (tests, and the bench's call count)
        self.log = log.bind(driver=driver)

    def prepared(
        self, ref: ClaimRef, node: str, devices: Sequence[tuple[PreparedDevice, Device | None]]
    ) -> None:
        """A claim was just prepared: queue its entries, made when they go out (never blocks)."""
        if not devices:
            return
        at, held = time.time(), tuple(devices)
        self.report(ref, lambda: [device_status(self.driver, node, p, d, at) for p, d in held])

    def report(
        self, ref: ClaimRef, devices: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]]
    ) -> None:
        """Entries for a claim, or what makes them (never blocks)."""
        if not devices:
            return
        due = time.monotonic() + self.settle_s
        self._pending[ref.uid] = _Pending(ref, devices, due)
        if due < self._wakes_at:
            self._kick()
        else:
            self._idle.clear()

    def busy(self) -> None:
        """The kubelet is calling (prepare, unprepare): writes wait for a quiet moment, off its way."""
        self._activity = time.monotonic()

    def clear(self, ref: ClaimRef) -> None:
        """Remove the claim's entries (it was unprepared); free when they were never sent."""
        queued = self._pending.get(ref.uid)
        if queued is not None and ref.uid not in self._written and ref.uid not in self._inflight:
            del self._pending[ref.uid]
            self._settle()
            return
        # Written (or being written), or not known to this process (maybe written by the one before a restart):
        # one call removes them.
        self._pending[ref.uid] = _Pending(ref, None, time.monotonic())
        self._kick()

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    def _settle(self) -> None:
        if not self._pending and not self._inflight:
            self._idle.set()

    async def drained(self) -> None:
        """Until every queued write is done (tests; a clean stop)."""
        await self._idle.wait()

    async def run(self) -> None:
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                self._wake.clear()
                waiting = [p for u, p in self._pending.items() if u not in self._inflight]
                if not waiting:
                    self._wakes_at = math.inf
                    await self._wake.wait()
                    self._wakes_at = 0.0
                    continue
                now = time.monotonic()
                due = min(p.due for p in waiting)
                quiet_at = self._activity + self.quiet_s
                if due > now or (quiet_at > now and now < due + self.max_defer_s):
                    self._wakes_at = max(due, min(quiet_at, due + self.max_defer_s))
                    await _sleep_or(self._wake, self._wakes_at - now)
                    self._wakes_at = 0.0
                    continue
                for uid in [u for u, p in self._pending.items() if u not in self._inflight and p.due <= now]:
                    await self._slots.acquire()
                    item = self._pending.pop(uid, None)
                    if item is None:  # cleared for free while waiting for a slot
                        self._slots.release()
                        continue
                    self._inflight.add(uid)
                    task = asyncio.create_task(self._write(item))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._settle()
        finally:
            for task in tasks:
                task.cancel()

    async def _write(self, item: _Pending) -> None:
        ref = item.ref
        try:
            for attempt in range(len(RETRY_DELAYS) + 1):
                try:
                    self.writes += 1
                    if callable(item.devices):
                        item.devices = item.devices()
                    await self.api.apply_claim_status(ref.namespace, ref.name, ref.uid, item.devices or [])
                except StatusWriteError as exc:
                    if exc.transient and attempt < len(RETRY_DELAYS):
                        await asyncio.sleep(RETRY_DELAYS[attempt])
                        continue
                    self.log.warning(
                        "cannot write the claim's status.devices (the claim stays prepared)"
                        if item.devices
                        else "cannot remove this driver's entries from the claim's status.devices",
                        claim=ref.ref,
                        error=one_line(str(exc)),
                    )
                except Exception as exc:  # never let a status write take the writer down
                    self.log.warning(
                        "cannot write the claim's status.devices", claim=ref.ref, error=one_line(repr(exc))
                    )
                else:
                    if item.devices:
                        self._written.add(ref.uid)
                    else:
                        self._written.discard(ref.uid)
                break
        finally:
            self._inflight.discard(ref.uid)
            self._slots.release()
            if ref.uid in self._pending:
                self._wake.set()  # a newer state came while this one was in flight
            self._settle()


async def _sleep_or(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less if ``event`` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), max(seconds, 0.0))

"""NodePrepareResources and NodeUnprepareResources for one kxpu DRA driver, apart from gRPC.

Prepare: read the claim from the API server, keep only this driver's devices in this node's pool
(``claims.allocation_for`` refuses anything else), look each device up in the backend's current
snapshot (unknown → refused; unhealthy → refused unless its taint lets the claim have it: ``kxpu.dra.taints``), refuse a device another claim already holds here (the
driver is the last line of defence against a double allocation), ask the backend for the container
edits of each request's devices, write one CDI spec file for the claim and record the claim in the
checkpoint. Answered per claim: one claim's failure, whatever it is (a refusal, the API server's error, a
vendor library's exception), is that claim's one-line error and a Warning event on it, never the call's.
A prepare that fails or is cancelled (the kubelet's deadline) after making partitions releases them and
removes what it wrote. Admin-access allocations (monitoring) are recorded but hold nothing.

Unprepare releases the claim's partitions, removes its CDI spec and then its checkpoint entry; a claim
that is not prepared is not an error (the kubelet repeats calls). A crash between the release and the
checkpoint write releases again on the next unprepare (``Partitioner.release`` is idempotent).

Write-ahead order, so that a crash (SIGKILL) at any point leaves nothing that cannot be undone: the
partitions a claim is about to get are recorded (``Checkpoint.making``) before the backend makes them, the
CDI spec is written next, and the claim is recorded last (dropping its ``making``): one durable checkpoint write
for all the claims of a call, before any of them is answered (a write that fails undoes and fails each of them;
a call cancelled before it undoes those it recorded). ``reconcile`` (at start,
and when making a partition fails) destroys the partitions of every ``making`` no prepared claim owns, through
the backend's ``PartitionReclaimer`` capability, and releases ``unreleased`` handles; ``release_deleted_claims``
(at start) unprepares checkpointed claims the API no longer has (deleted while the daemon was down, the
kubelet may never ask). A driver the config no longer serves through DRA (``draining``) keeps answering the
claims prepared before and unprepares them, but prepares no new one.

Calls are serialized (one lock) once the claims are read (outside it, as the events are posted): the
checkpoint is one file and the double-allocation check must see every earlier prepare. The CDI spec and
the checkpoint (a few KiB, on local disk or tmpfs) are written on
the event loop: each write takes tens of microseconds, less than handing it to a worker thread, which on a
busy node is most of a prepare's latency. Backends' partition calls (vendor libraries) do go to threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kxpu.cdi.spec import InvalidSpec, qualified_name, write_device_spec
from kxpu.dra import metrics
from kxpu.dra.checkpoint import (
    Checkpoint,
    CheckpointError,
    Making,
    PreparedClaim,
    PreparedDevice,
    held_devices,
)
from kxpu.dra.claim_cache import ClaimCache
from kxpu.dra.claims import AllocatedDevice, ClaimAllocation, ClaimError, allocation_for
from kxpu.dra.config import DraSharesConfig
from kxpu.dra.metadata import CDI_CLASS, MetadataDevice, MetadataWriter, pod_claim_name
from kxpu.dra.names import claim_cdi_device, claim_cdi_kind, device_name, parent_request
from kxpu.dra.quantity import as_mib, parse_quantity
from kxpu.dra.slices import SharePolicy, device_attributes
from kxpu.dra.taints import TaintPolicy, tolerates
from kxpu.logs import error_text, get_logger, one_line
from kxpu.model import (
    AsyncAllocator,
    Backend,
    BackendError,
    ContainerEdits,
    Device,
    DeviceShare,
    Partitioner,
    PartitionReclaimer,
    ShareAllocator,
    share_limit_env,
)

log = get_logger("kxpu.dra.prepare")


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class ClaimSource(Protocol):
    """Where claims are read and their events posted (the API server; a stand-in in unit tests)."""

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim as the API returns it, or None if it does not exist; raises on other API errors."""
        ...

    async def claim_event(self, claim: ClaimRef, reason: str, message: str) -> None:
        """A Warning event on the claim (best effort: never raises)."""
        ...


class StatusReporter(Protocol):
    """Where prepared claims are reported back (``kxpu.dra.claim_status.ClaimStatusWriter``): never blocks."""

    def busy(self) -> None:
        """The kubelet is calling."""
        ...

    def prepared(
        self, ref: ClaimRef, node: str, devices: Sequence[tuple[PreparedDevice, Device | None]]
    ) -> None: ...

    def clear(self, ref: ClaimRef) -> None: ...


@dataclass(frozen=True, slots=True)
class Prepared:
    devices: tuple[PreparedDevice, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class _Unsaved:
    """A claim recorded in the checkpoint in memory but not yet on disk, with what undoing it takes."""

    ref: ClaimRef
    allocation: ClaimAllocation
    spec_path: str | None
    handles: list[Mapping[str, str | int]]
    making: Making | None  # its write-ahead partition record, dropped by the record
    devices: tuple[PreparedDevice, ...]
    held: tuple[tuple[PreparedDevice, Device | None], ...] = ()  # what status.devices reports once saved


class Preparer:
    def __init__(
        self,
        driver: str,
        pool: str,
        backend: Backend,
        devices: Mapping[str, Device] | None,
        checkpoint: Checkpoint,
        cdi_dir: Path,
        claims: ClaimSource,
        shares: DraSharesConfig | None = None,
        taints: TaintPolicy | None = None,
    ) -> None:
        self.driver = driver
        self.taints = taints or TaintPolicy()
        self.shares = shares
        self.pool = pool
        self.backend = backend
        # Asked once (a runtime protocol check costs tens of microseconds, on every claim otherwise).
        self._allocate_async = backend.allocate_async if isinstance(backend, AsyncAllocator) else None
        self._by_name: dict[str, Device] = {}
        self.status: StatusReporter | None = None
        self.update_devices(devices or {})
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.claims = claims
        self.claim_cache: ClaimCache | None = None  # set by the plugin when it watches the node's claims
        # dra.deviceMetadata: each request's devices as a file in the container (kxpu.dra.metadata); the files
        # live under metadata_dir (the driver's directory in the kubelet's plugins directory).
        self.metadata: MetadataWriter | None = None
        self.metadata_dir = cdi_dir
        # dra.claimStatus: the claim's status.devices, written in the background (kxpu.dra.claim_status); set by
        # the plugin (declared above, before the first update_devices)
        self.cdi_kind = claim_cdi_kind(driver)
        self.held: frozenset[str] = frozenset()  # IDs pods still hold through the device plugin
        # Devices claims of another driver of this node still hold (a driver renamed across a restart, its claims
        # drained: kxpu.dra.leftover) → why: never prepared for this one until they are released.
        self.elsewhere: Callable[[], Mapping[str, str]] = dict
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Future[Any]] = set()  # releases of partitions a cancelled prepare made
        self._realizing: set[str] = set()  # claim UIDs whose partitions a worker thread is making right now
        # Served only for the claims prepared before: the config no longer serves this driver through DRA.
        self.draining = False
        self.changed = asyncio.Event()  # set whenever claims were unprepared
        self.log = log.bind(driver=driver)
        # This driver's series, looked up once (a labels() call takes a lock and a dict lookup on every claim).
        self._prepare_seconds = metrics.PREPARE_SECONDS.labels(driver)
        self._unprepare_seconds = metrics.UNPREPARE_SECONDS.labels(driver)
        self._prepare_errors = metrics.PREPARE_ERRORS.labels(driver)
        # Read when /metrics is asked (what the checkpoint holds, whichever process wrote it), not set per call.
        self._prepared_reading = metrics.Reading(
            metrics.CLAIMS_PREPARED, (driver,), lambda: len(self.checkpoint.claims)
        )
        self._reads_cache = metrics.CLAIM_READS.labels(driver, "cache")
        self._reads_api = metrics.CLAIM_READS.labels(driver, "api")
        self._spec_prefix = f"kxpu-dra-{driver}-"
        self._metadata_ids = f"{driver}/{CDI_CLASS}="  # how the CDI IDs of metadata files start

    def stop_reporting(self) -> None:
        """Stopped: /metrics keeps the count prepared now (the claims stay prepared) without holding this preparer."""
        self._prepared_reading.stop()

    @property
    def _policy(self) -> SharePolicy:
        shares = self.shares or DraSharesConfig()
        return SharePolicy(
            shares.memory_step_mib, shares.min_memory_mib, shares.memory_scaling, shares.core_scaling
        )

    def update_devices(self, devices: Mapping[str, Device]) -> None:
        """The backend's latest snapshot (ID → device). A device whose health changed is reported again in the
        status of the claims prepared with it."""
        before, self._by_name = self._by_name, {device_name(d.id): d for d in devices.values()}
        if self.status is None or not before:
            return
        changed = {
            name
            for name, device in self._by_name.items()
            if name in before
            and (before[name].healthy, before[name].health_reason) != (device.healthy, device.health_reason)
        }
        if not changed:
            return
        for uid, claim in self.checkpoint.claims.items():
            devices_of = [(d, self._by_name.get(d.device)) for d in claim.devices]
            if any(d.device in changed for d, _ in devices_of) and all(found for _, found in devices_of):
                self.status.prepared(ClaimRef(claim.namespace, uid, claim.name), self.pool, devices_of)

    def spec_path(self, uid: str) -> Path:
        return Path(self._spec_file(uid))

    def _spec_file(self, uid: str) -> str:
        """The claim's CDI spec file (a string: a Path made and turned back into text costs more than the name)."""
        return f"{os.fspath(self.cdi_dir)}/{self._spec_prefix}{uid}.json"

    # -- prepare ----------------------------------------------------------------------------------------
    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, Prepared]:
        """One answer per claim; nothing one claim does fails another's (an unexpected error included: it
        becomes that claim's one-line error). The claims are read from the API server before the lock is
        taken, and events posted after it is released: a slow API server never holds up the node's other
        prepares and unprepares."""
        if self.status is not None:
            self.status.busy()
        fetched = await self._fetch([r for r in refs if not self._known(r)])
        results: dict[str, Prepared] = {}
        failed: list[tuple[ClaimRef, str]] = []
        async with self._lock, self.checkpoint.exclusive():
            # Known when looked at, gone since: another process of this driver (kxpu.dra.instances) unprepared it.
            missing = [r for r in refs if r.uid not in fetched and not self._known(r)]
            if missing:
                fetched.update(await self._fetch(missing))
            unsaved: list[_Unsaved] = []  # recorded in memory, not yet on disk: undone if the call stops
            try:
                for ref in refs:
                    started = time.perf_counter()
                    try:
                        devices = await self._prepare_one(ref, fetched.get(ref.uid), unsaved)
                        results[ref.uid] = Prepared(devices=devices)
                        self._prepare_seconds.observe(time.perf_counter() - started)
                    except Exception as exc:
                        self._prepare_errors.inc()
                        message = self._failure_text(ref, exc)
                        results[ref.uid] = Prepared(error=message)
                        failed.append((ref, message))
                failed += await self._save_prepared(unsaved, results)
            except BaseException:  # cancelled (the kubelet's deadline): what is not on disk is undone
                while unsaved:
                    await self._undo(unsaved.pop())
                raise
        for ref, message in failed:
            await self.claims.claim_event(ref, "KxpuPrepareFailed", message)
        return results

    def _known(self, ref: ClaimRef) -> bool:
        known = self.checkpoint.claims.get(ref.uid)
        return known is not None and _spec_present(known)

    async def _fetch(self, refs: Sequence[ClaimRef]) -> dict[str, Mapping[str, Any] | Exception | None]:
        """Each claim as the API server has it (None: it does not exist; an exception: reading it failed): from
        the node's claim cache where it has the claim with this UID allocated here, else by a GET."""
        out: dict[str, Mapping[str, Any] | Exception | None] = {}
        if self.claim_cache is not None:  # this node's allocated claims, watch-fed: no round trip
            for ref in refs:
                if (hit := self.claim_cache.take(ref.namespace, ref.name, ref.uid)) is not None:
                    out[ref.uid] = hit
            self._reads_cache.inc(len(out))
            refs = [r for r in refs if r.uid not in out]
        if not refs:
            return out
        self._reads_api.inc(len(refs))
        answers = await asyncio.gather(
            *(self.claims.get_claim(r.namespace, r.name) for r in refs), return_exceptions=True
        )
        for ref, answer in zip(refs, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # cancelled: the kubelet gave up on the call
            out[ref.uid] = answer
        return out

    def _failure_text(self, ref: ClaimRef, exc: Exception) -> str:
        """The claim's error for the kubelet, one line; logged once (a traceback only for what kxpu did not
        expect, and only at debug level)."""
        if isinstance(exc, ClaimError | BackendError | CheckpointError):
            message = one_line(str(exc))
        elif isinstance(exc, OSError):
            message = f"ResourceClaim {ref.ref}: {one_line(str(exc.strerror or exc))}"
        else:  # the API server's refusal (403, 429, 5xx), a broken connection, a vendor library's surprise
            message = f"ResourceClaim {ref.ref}: cannot prepare it: {one_line(error_text(exc))}"
            self.log.debug("claim not prepared: traceback", claim=ref.ref, exc_info=exc)
        self.log.warning("claim not prepared", claim=ref.ref, uid=ref.uid, reason=message)
        return message

    async def _save_prepared(
        self, unsaved: list[_Unsaved], results: dict[str, Prepared]
    ) -> list[tuple[ClaimRef, str]]:
        """One durable checkpoint write for every claim this call recorded, before any of them is answered; if
        it fails, each of them is undone and answered with the error (the kubelet retries). Empties
        ``unsaved``; returns the claims that failed, with their message."""
        if not unsaved:
            return []
        try:
            self.checkpoint.save()
        except CheckpointError as exc:
            failed = []
            while (
                unsaved
            ):  # each taken off before it is undone: a cancellation meanwhile undoes the rest once
                claim = unsaved.pop()
                self._prepare_errors.inc()
                message = self._failure_text(claim.ref, exc)
                results[claim.ref.uid] = Prepared(error=message)
                failed.append((claim.ref, message))
                await self._undo(claim)
            return failed[::-1]
        logged = self.log.is_enabled_for(logging.INFO)  # its fields are not built for nothing
        for claim in unsaved:
            if logged:
                self.log.info(
                    "claim prepared",
                    claim=claim.ref.ref,
                    uid=claim.ref.uid,
                    devices={d.device: d.id for d in claim.devices},
                    cdi=[c for d in claim.devices for c in d.cdi_device_ids],
                )
            if self.status is not None:  # only a claim on disk is announced in its status
                self.status.prepared(claim.ref, self.pool, list(claim.held))
        unsaved.clear()
        return []

    async def _undo(self, claim: _Unsaved) -> None:
        """Forget a claim prepared in memory whose record did not reach the disk: its entry, its CDI spec and
        its partitions go, its write-ahead partition record comes back until they are released."""
        uid = claim.ref.uid
        self.checkpoint.claims.pop(uid, None)
        if claim.making is not None:
            self.checkpoint.making[uid] = claim.making
        if claim.spec_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim.spec_path)
        if self.metadata is not None:
            with contextlib.suppress(OSError):
                requests = {parent_request(a.request) for a in claim.allocation.devices}
                self.metadata.remove(claim.ref.namespace, claim.ref.name, uid, requests)
        if await self._release_quietly(claim.allocation, claim.handles):
            self._forget_making(uid)

    async def _prepare_one(
        self, ref: ClaimRef, claim: Mapping[str, Any] | Exception | None, unsaved: list[_Unsaved]
    ) -> tuple[PreparedDevice, ...]:
        """Prepare one claim and record it in memory (``unsaved``): ``prepare`` writes the checkpoint once for
        the call's claims."""
        known = self.checkpoint.claims.get(ref.uid)
        if known is not None and _spec_present(known):
            return known.devices  # the kubelet asks again after a restart or a timeout: same answer
        if self.draining:
            raise ClaimError(
                f"ResourceClaim {ref.ref}: driver {self.driver} is no longer served through DRA on this node (its "
                "config changed); it only unprepares the claims prepared before: serve it through DRA again"
            )
        if isinstance(claim, Exception):
            raise claim
        if claim is None:
            raise ClaimError(f"ResourceClaim {ref.ref} does not exist (deleted while the pod was starting?)")
        allocation = allocation_for(claim, ref.uid, self.driver, self.pool)
        chosen = self._lookup(allocation)
        if known is not None:
            # Prepared before, but its CDI spec is gone (a tmpfs cleared, removed by hand): prepared again from
            # the start, so the partitions it had are destroyed first; the new ones would overlap them.
            await self._release([dict(d.partition) for d in known.devices if d.partition])
        chosen, handles = await self._realize(allocation, chosen)
        # From here on, whatever stops this prepare (a refusal, the backend, the kubelet's deadline cancelling
        # the call) releases the partitions just made and removes what was written: nothing is left behind.
        spec_path: str | None = None
        by_name = {allocated.device: device for allocated, device in chosen}
        try:
            prepared, entries = await self._devices_and_edits(ref, allocation, chosen, handles)
            if self.metadata is not None:
                prepared = self._write_metadata(ref, claim, chosen, prepared)
            spec_path = self._write_spec(ref.uid, entries) if entries else None
        except BaseException:
            await self._undo(_Unsaved(ref, allocation, spec_path, list(handles.values()), None, ()))
            raise
        devices = tuple(prepared)
        self.checkpoint.claims[ref.uid] = PreparedClaim(ref.namespace, ref.name, spec_path, devices)
        making = self.checkpoint.making.pop(ref.uid, None)  # the record replaces it (in the same write)
        held = tuple((p, by_name.get(p.device)) for p in devices)
        unsaved.append(_Unsaved(ref, allocation, spec_path, list(handles.values()), making, devices, held))
        return devices

    def _write_metadata(
        self,
        ref: ClaimRef,
        claim: Mapping[str, Any],
        chosen: list[tuple[AllocatedDevice, Device]],
        prepared: list[PreparedDevice],
    ) -> list[PreparedDevice]:
        """The metadata files and their CDI specs; each request's CDI device is added to its first device. Best
        effort, as upstream's helper: a claim whose files cannot be written is prepared without them."""
        assert self.metadata is not None
        devices = [
            MetadataDevice(allocated.request, allocated.pool, allocated.device, device_attributes(device))
            for allocated, device in chosen
        ]
        try:
            ids = self.metadata.write(ref.namespace, ref.name, ref.uid, pod_claim_name(claim), devices)
        except OSError as exc:
            self.log.warning(
                "cannot write the device metadata files; the container starts without them",
                claim=ref.ref,
                error=one_line(str(exc.strerror or exc)),
            )
            with contextlib.suppress(OSError):
                self.metadata.remove(
                    ref.namespace, ref.name, ref.uid, {parent_request(d.request) for d in devices}
                )
            return prepared
        out = []
        for device in prepared:
            request = device.requests[0]
            if request in ids:
                device = replace(device, cdi_device_ids=(*device.cdi_device_ids, ids.pop(request)))
            out.append(device)
        return out

    async def _devices_and_edits(
        self,
        ref: ClaimRef,
        allocation: ClaimAllocation,
        chosen: list[tuple[AllocatedDevice, Device]],
        handles: Mapping[str, Mapping[str, str | int]],
    ) -> tuple[list[PreparedDevice], list[tuple[str, ContainerEdits]]]:
        by_request: dict[str, list[tuple[AllocatedDevice, Device]]] = {}
        for allocated, device in chosen:
            by_request.setdefault(parent_request(allocated.request), []).append((allocated, device))
        edits_of: dict[str, ContainerEdits] = {}
        grants_of: dict[str, list[DeviceShare]] = {}
        for request, members in by_request.items():
            grants_of[request] = [self._grant(allocation, allocated, device) for allocated, device in members]
            edits_of[request] = await self._edits(allocation, request, grants_of[request])
        self._apply_opaque_env(allocation, edits_of)
        entries: list[tuple[str, ContainerEdits]] = []
        prepared: list[PreparedDevice] = []
        for request, members in by_request.items():
            edits, grants = edits_of[request], grants_of[request]
            cdi_name = claim_cdi_device(ref.uid, request)
            has_edits = any((edits.env, edits.device_nodes, edits.mounts))
            if has_edits:
                entries.append((cdi_name, edits))
            for n, ((allocated, device), grant) in enumerate(zip(members, grants, strict=True)):
                # The request's edits once (on its first device): the kubelet gives a container the CDI IDs of
                # every device of the requests it uses, and the same CDI device twice would apply twice.
                ids = (qualified_name(self.cdi_kind, cdi_name),) if has_edits and n == 0 else ()
                prepared.append(
                    PreparedDevice(
                        requests=(request,),
                        pool=allocated.pool,
                        device=allocated.device,
                        id=device.id,
                        cdi_device_ids=ids,
                        share_id=allocated.share_id,
                        memory_mib=grant.memory_mib if allocated.share_id else None,
                        cores=grant.cores if allocated.share_id else None,
                        partition=handles.get(allocated.device),
                        admin_access=allocated.admin_access,
                        parent=_parent(device),
                    )
                )
        return prepared, entries

    def _admits_faulty(self, device: Device, allocated: AllocatedDevice) -> bool:
        """An unhealthy device is still prepared where its taint lets the scheduler choose it: the fault's effect
        is None (informational), or the request tolerates the taint kxpu publishes for it (a diagnostics pod).
        A claim allocated before the taint reached the scheduler tolerates nothing: refused, retried."""
        taint = self.taints.fault_taint(device)
        return taint is not None and (taint["effect"] == "None" or tolerates(allocated.tolerations, taint))

    def _lookup(self, allocation: ClaimAllocation) -> list[tuple[AllocatedDevice, Device]]:
        chosen: list[tuple[AllocatedDevice, Device]] = []
        for allocated in allocation.devices:
            device = self._by_name.get(allocated.device)
            if device is None:
                raise ClaimError(
                    f"ResourceClaim {allocation.ref}: device {allocated.device} is not one of driver {self.driver}'s "
                    f"devices on this node (it may have been removed since the scheduler allocated it)"
                )
            if (
                not device.healthy
                and not allocated.admin_access
                and not self._admits_faulty(device, allocated)
            ):
                raise ClaimError(
                    f"ResourceClaim {allocation.ref}: device {allocated.device} ({device.id}) is unhealthy "
                    f"({device.health_reason or 'no reason given'}); the kubelet retries once it recovers"
                )
            if device.id in self.held:
                raise ClaimError(
                    f"ResourceClaim {allocation.ref}: device {allocated.device} ({device.id}) is still used by a pod that "
                    "got it through the device plugin; it is offered once that pod is gone"
                )
            elsewhere = self.elsewhere()
            held_by = elsewhere.get(device.id) or (elsewhere.get(device.uuid) if device.uuid else None)
            if held_by and not allocated.admin_access:
                raise ClaimError(
                    f"ResourceClaim {allocation.ref}: device {allocated.device} ({device.id}) is {held_by}; it is "
                    "prepared once that claim is released"
                )
            if not allocated.admin_access:
                self._check_not_taken(allocation, allocated, device)
            chosen.append((allocated, device))
        return chosen

    async def _realize(
        self, allocation: ClaimAllocation, chosen: list[tuple[AllocatedDevice, Device]]
    ) -> tuple[list[tuple[AllocatedDevice, Device]], dict[str, dict[str, str | int]]]:
        """Partitions that exist only while used are made now (``Partitioner.realize``); the devices come back
        as they now are (a MIG device's UUID), with what releasing them needs, by DRA device name."""
        partitions = [(a, d) for a, d in chosen if d.consumes]
        if not partitions:
            return chosen, {}
        if not isinstance(self.backend, Partitioner):
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: driver {self.driver}'s backend makes no partitions"
            )
        await self._check_counters(allocation, [d for _, d in partitions])
        # Written ahead: a crash inside realize leaves a partition only the record says is kxpu's.
        self.checkpoint.making[allocation.uid] = Making(allocation.ref, tuple(d.id for _, d in partitions))
        try:
            self.checkpoint.save()
        except CheckpointError:
            self.checkpoint.making.pop(allocation.uid, None)
            raise
        try:
            made = await self._make(allocation, [d for _, d in partitions])
        except asyncio.CancelledError:
            raise
        except Exception:
            # Making failed: maybe on a partition a crash left behind (it overlaps). Reconcile and try once more.
            # This claim's own record is out of it (realize is all or none: nothing was made): what is at its
            # placements now is not kxpu's to destroy unless another record says so.
            mine = self.checkpoint.making.pop(allocation.uid)
            if not await self._reconcile_locked():
                with contextlib.suppress(CheckpointError):
                    self.checkpoint.save()
                raise
            self.checkpoint.making[allocation.uid] = mine
            try:
                self.checkpoint.save()
                made = await self._make(allocation, [d for _, d in partitions])
            except asyncio.CancelledError:
                raise
            except Exception:
                self._forget_making(allocation.uid)
                raise
        if len(made) != len(partitions):
            if await self._release_quietly(allocation, [h for _, h in made]):
                self._forget_making(allocation.uid)
            raise BackendError(f"the backend made {len(made)} partitions for {len(partitions)} asked")
        realized = {
            a.device: (device, dict(handle))
            for (a, _), (device, handle) in zip(partitions, made, strict=True)
        }
        devices = [(a, realized[a.device][0] if a.device in realized else d) for a, d in chosen]
        return devices, {name: handle for name, (_, handle) in realized.items()}

    async def _make(
        self, allocation: ClaimAllocation, devices: list[Device]
    ) -> Sequence[tuple[Device, Mapping[str, str | int]]]:
        assert isinstance(self.backend, Partitioner)
        realizing = asyncio.ensure_future(asyncio.to_thread(self.backend.realize, devices))
        self._realizing.add(allocation.uid)
        self._background.add(realizing)
        realizing.add_done_callback(self._background.discard)
        try:
            made = await asyncio.shield(realizing)
        except asyncio.CancelledError:
            # The kubelet's deadline: the worker thread goes on making the partitions; release them once made.
            realizing.add_done_callback(lambda done: self._release_when_made(allocation, done))
            raise
        except BaseException:
            self._realizing.discard(allocation.uid)
            raise
        self._realizing.discard(allocation.uid)
        return made

    def _forget_making(self, uid: str) -> None:
        """The claim's partitions are released (or were never made): its write-ahead record goes; a failure to
        save keeps it on disk, which costs one harmless reclaim later."""
        if self.checkpoint.making.pop(uid, None) is not None:
            try:
                self.checkpoint.save()
            except CheckpointError as exc:
                self.log.warning("cannot drop a partition record from the checkpoint", error=str(exc))

    # -- reconciliation -----------------------------------------------------------------------------------
    async def reconcile(self) -> list[str]:
        """Destroy the partitions no prepared claim owns that a crash left in the hardware (each recorded in
        ``making`` before it was made; nothing else is touched), and release the ``unreleased`` handles; one
        log line names what was reclaimed. Returns it. Called at start, before serving."""
        async with self._lock, self.checkpoint.exclusive():
            return await self._reconcile_locked()

    async def _reconcile_locked(self) -> list[str]:
        reclaimed: list[str] = []
        dirty = False
        if self.checkpoint.unreleased and isinstance(self.backend, Partitioner):
            handles = list(self.checkpoint.unreleased)
            try:
                await asyncio.to_thread(self.backend.release, handles)
            except Exception as exc:
                self.log.error(
                    "cannot destroy partitions of claims unprepared earlier; retrying at the next reconciliation",
                    error=one_line(error_text(exc)),
                )
            else:
                reclaimed += [str(h.get("id") or h.get("uuid") or dict(h)) for h in handles]
                self.checkpoint.unreleased = [h for h in self.checkpoint.unreleased if h not in handles]
                dirty = True
        interrupted = [
            ClaimRef(c.namespace, uid, c.name)
            for uid in self.checkpoint.releasing
            if (c := self.checkpoint.claims.get(uid)) is not None
        ]
        if len(interrupted) != len(self.checkpoint.releasing):
            self.checkpoint.releasing = [r.uid for r in interrupted]
            dirty = True
        if interrupted:
            self.log.info("finishing unprepares a crash interrupted", claims=[r.ref for r in interrupted])
            done = await self._unprepare_locked(interrupted)
            reclaimed += [f"{r.ref} (unprepared)" for r in interrupted if done.get(r.uid) is None]
        by_id = {d.id: d for d in self._by_name.values()}
        for uid, making in list(self.checkpoint.making.items()):
            if uid in self._realizing:
                continue  # a worker thread is making them now (a cancelled prepare): released when made
            if uid not in self.checkpoint.claims and not isinstance(self.backend, Partitioner):
                continue  # a draining driver: kept for the backend that can destroy them, once it is back
            if uid not in self.checkpoint.claims:
                held = held_devices(self.checkpoint.claims)
                devices = [by_id[i] for i in making.devices if i in by_id and i not in held]
                if devices and isinstance(self.backend, PartitionReclaimer):
                    try:
                        reclaimed += await asyncio.to_thread(self.backend.reclaim, devices)
                    except Exception as exc:
                        self.log.error(
                            "cannot destroy partitions left by an interrupted prepare; retrying later",
                            claim=making.claim,
                            error=one_line(error_text(exc)),
                        )
                        continue
            self.checkpoint.making.pop(uid, None)
            dirty = True
        if dirty:
            try:
                self.checkpoint.save()
            except CheckpointError as exc:
                self.log.warning("cannot record the reconciliation in the checkpoint", error=str(exc))
        if reclaimed:
            self.log.warning(
                "destroyed partitions no prepared claim owns (left by an interrupted prepare or unprepare)",
                partitions=reclaimed,
            )
        return reclaimed

    async def release_deleted_claims(self) -> list[str]:
        """Unprepare the checkpointed claims the API server no longer has (deleted, or deleted and made again,
        while the daemon was down): nothing uses them, and the kubelet may never ask. A claim that cannot be
        read stays as it is. Never raises; returns the claims unprepared."""
        try:
            refs = [ClaimRef(c.namespace, uid, c.name) for uid, c in list(self.checkpoint.claims.items())]
            answers = await self._fetch(refs)
            gone = [ref for ref in refs if _deleted(ref, answers.get(ref.uid))]
            if not gone:
                return []
            self.log.info(
                "unpreparing claims deleted from the API server while the driver was down",
                claims=[r.ref for r in gone],
            )
            results = await self.unprepare(gone)
            return [r.ref for r in gone if results.get(r.uid) is None]
        except Exception as exc:
            self.log.error(
                "cannot check prepared claims against the API server", error=one_line(error_text(exc))
            )
            return []

    async def _check_counters(self, allocation: ClaimAllocation, devices: list[Device]) -> None:
        """The last line of defence for partitions: what prepared partitions and these draw from each counter
        set never exceeds it (the scheduler's job, checked again here)."""
        assert isinstance(self.backend, Partitioner)
        capacity = {c.name: dict(c.counters) for c in await asyncio.to_thread(self.backend.counter_sets)}
        drawn: dict[tuple[str, str], int] = {}
        prepared = [
            self._by_name[d.device]
            for uid, claim in self.checkpoint.claims.items()
            if uid != allocation.uid
            for d in claim.devices
            if d.device in self._by_name and not d.admin_access
        ]
        for device in [*prepared, *devices]:
            for counter_set, counters in device.consumes.items():
                for counter, amount in counters.items():
                    drawn[(counter_set, counter)] = drawn.get((counter_set, counter), 0) + amount
        over = sorted(k for k, v in drawn.items() if v > capacity.get(k[0], {}).get(k[1], 0))
        if over:
            used_up = ", ".join(f"{s}/{c}" for s, c in over)
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: {', '.join(d.id for d in devices)} would overlap partitions "
                f"already prepared on this node ({used_up} used up); refusing"
            )

    async def _release(self, handles: Sequence[Mapping[str, str | int]]) -> None:
        handles = [h for h in handles if h]
        if handles and isinstance(self.backend, Partitioner):
            await asyncio.to_thread(self.backend.release, handles)

    async def _release_quietly(
        self, allocation: ClaimAllocation, handles: Sequence[Mapping[str, str | int]]
    ) -> bool:
        """Release partitions of a prepare that failed; a failure to release is logged, never raised over the
        prepare's own error, and a cancelled prepare still releases (in the background). True once released."""
        if not any(handles):
            return True
        task = asyncio.ensure_future(self._release(handles))
        self._background.add(task)
        task.add_done_callback(lambda t: self._released(allocation, t))
        with contextlib.suppress(Exception):
            await asyncio.shield(task)
            return True
        return False

    def _released(self, allocation: ClaimAllocation, task: asyncio.Future[None]) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            if allocation.uid not in self.checkpoint.claims:
                self._forget_making(allocation.uid)
        else:
            self.log.error(
                "cannot release the partitions of a claim that was not prepared",
                claim=allocation.ref,
                error=one_line(error_text(exc)),
            )

    def _release_when_made(self, allocation: ClaimAllocation, done: asyncio.Future[Any]) -> None:
        self._realizing.discard(allocation.uid)
        if done.cancelled() or done.exception() is not None:
            return
        handles = [h for _, h in done.result()]
        task = asyncio.ensure_future(self._release(handles))
        self._background.add(task)
        task.add_done_callback(lambda t: self._released(allocation, t))

    def _check_not_taken(
        self, allocation: ClaimAllocation, allocated: AllocatedDevice, device: Device
    ) -> None:
        """The last line of defence against a double allocation: a whole device is one claim's; shares of a
        device never add up to more than the capacity kxpu published for it."""
        # Admin access (adminAccess: true) uses a device beside its users, for monitoring: it takes nothing.
        others = [
            h
            for h in self.checkpoint.holders_of(allocated.device)
            if h[0] != allocation.uid and not h[2].admin_access
        ]
        whole = [h for h in others if h[2].share_id is None]
        if others and (allocated.share_id is None or whole):
            _, claim, _ = (whole or others)[0]
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: device {allocated.device} is already prepared for ResourceClaim "
                f"{claim.ref}; refusing a second allocation of it"
            )
        if allocated.share_id is None:
            return
        grant = self._grant(allocation, allocated, device)
        memory = grant.memory_mib + sum(h[2].memory_mib or 0 for h in others)
        cores = grant.cores + sum(h[2].cores or 0 for h in others)
        assert self.shares is not None  # _grant refused a share otherwise
        memory_cap = int((device.memory_mib or 0) * self.shares.memory_scaling)
        core_cap = int(100 * self.shares.core_scaling)
        if (device.memory_mib is not None and memory > memory_cap) or cores > core_cap:
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: a share of {grant.memory_mib} MiB and {grant.cores}% on device "
                f"{allocated.device} would bring its prepared shares to {memory} MiB of {memory_cap} and {cores}% of "
                f"{core_cap}; refusing to over-commit it (was it allocated against another ResourceSlice?)"
            )

    def _grant(self, allocation: ClaimAllocation, allocated: AllocatedDevice, device: Device) -> DeviceShare:
        """What the claim gets of the device: all of it, or the share the scheduler accounted (consumed capacity)."""
        whole = DeviceShare(device, device.memory_mib or 0, 100)
        if allocated.share_id is None:
            return whole
        if self.shares is None:
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: device {allocated.device} was allocated as a share, but driver "
                f"{self.driver} does not publish shares (dra.shares)"
            )
        try:
            memory = (
                as_mib(allocated.consumed["memory"]) if "memory" in allocated.consumed else whole.memory_mib
            )
            cores = int(parse_quantity(allocated.consumed["cores"])) if "cores" in allocated.consumed else 100
        except ValueError as exc:
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: consumed capacity of {allocated.device}: {exc}"
            ) from None
        # A claim naming no amount consumed the published default: the capacity rounded down to the step.
        # That is the whole device's memory, not a share of it (no limit for the few MiB below the step).
        default = self._policy.memory_default_mib(device)
        if default is not None and memory >= default:
            memory = max(memory, device.memory_mib or 0)
        return DeviceShare(device, memory, cores)

    async def _edits(
        self, allocation: ClaimAllocation, request: str, grants: list[DeviceShare]
    ) -> ContainerEdits:
        devices = [g.device for g in grants]
        shared = self.shares is not None and any(
            g.cores < 100 or g.memory_mib < (g.device.memory_mib or 0) for g in grants
        )
        strategy = next(
            (
                c.sharing.strategy
                for r, c in allocation.configs.items()
                if parent_request(r) == request and c.sharing is not None
            ),
            None,
        )
        if strategy == "MPS" and not isinstance(self.backend, ShareAllocator):
            raise ClaimError(
                f"ResourceClaim {allocation.ref}: sharing strategy MPS asked, but driver {self.driver}'s backend cannot "
                "enforce shares itself (for nvidia: sharing.mps in its config)"
            )
        # Unset: the backend's own way (MPS where it enforces shares itself), else HAMi-core's variables. (The
        # protocol checks are asked only when they matter: each costs tens of microseconds.)
        if shared and strategy in (None, "MPS") and isinstance(self.backend, ShareAllocator):
            edits = self.backend.allocate_shares(grants)  # the vendor enforces the grant itself (MPS limits)
        elif self._allocate_async is not None:
            edits = await self._allocate_async(devices)
        else:
            edits = self.backend.allocate(devices)
        if shared:
            assert self.shares is not None
            edits.env.update(
                share_limit_env(grants, self.shares.memory_limit_env, self.shares.core_limit_env)
            )
            edits.env.update(self.shares.env)
        return edits

    def _apply_opaque_env(self, allocation: ClaimAllocation, edits_of: Mapping[str, ContainerEdits]) -> None:
        """Each request's opaque env, refused where it names a variable the driver sets for any request of the
        claim: a container using two requests gets both CDI devices, and one request's config must not
        override what the driver set for the other's devices."""
        driver_env = {name for edits in edits_of.values() for name in edits.env}
        extras: dict[str, dict[str, str]] = {}
        for allocated_request, config in allocation.configs.items():
            extras.setdefault(parent_request(allocated_request), {}).update(config.env)
        for request, extra in extras.items():
            clash = sorted(set(extra) & driver_env)
            if clash:
                raise ClaimError(
                    f"ResourceClaim {allocation.ref}: opaque config of request {request} sets {', '.join(clash)}, "
                    f"which driver {self.driver} sets itself for this claim's devices"
                )
        for request, edits in edits_of.items():
            edits.env.update(extras.get(request, {}))

    def _write_spec(self, uid: str, entries: list[tuple[str, ContainerEdits]]) -> str:
        path = self._spec_file(uid)
        try:
            write_device_spec(path, self.cdi_kind, entries)
        except InvalidSpec as exc:
            raise BackendError(f"the container edits make an invalid CDI spec: {exc}") from None
        return path

    # -- unprepare --------------------------------------------------------------------------------------
    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        if self.status is not None:
            self.status.busy()
        async with self._lock, self.checkpoint.exclusive():
            return await self._unprepare_locked(refs)

    async def _unprepare_locked(self, refs: Sequence[ClaimRef]) -> dict[str, str | None]:
        results: dict[str, str | None] = {}
        removed: dict[str, PreparedClaim] = {}
        # Written ahead: a claim whose partitions are being destroyed is marked, so that a crash before its entry
        # goes is finished at the next start (the partitions gone, the claim still recorded, is no state to keep).
        marking = [
            r.uid
            for r in refs
            if r.uid not in self.checkpoint.releasing
            and any(d.partition for d in getattr(self.checkpoint.claims.get(r.uid), "devices", ()))
        ]
        if marking:
            self.checkpoint.releasing.extend(marking)
            try:
                self.checkpoint.save()
            except CheckpointError as exc:
                self.checkpoint.releasing = [u for u in self.checkpoint.releasing if u not in marking]
                results.update(dict.fromkeys(marking, str(exc)))
        for ref in refs:
            if ref.uid in results:
                continue
            started = time.perf_counter()
            known = self.checkpoint.claims.get(ref.uid)
            if known is not None:
                # Released before the checkpoint is saved: a crash in between releases again (at the next start,
                # or the next unprepare), which Partitioner.release must take (it is idempotent); never the
                # other way round, which would leak the partition.
                handles = [dict(d.partition) for d in known.devices if d.partition]
                try:
                    if handles and not isinstance(self.backend, Partitioner):
                        # Draining a driver whose resource left the config: no backend can destroy them now.
                        # Kept on disk and destroyed once the resource is served through DRA again.
                        self.checkpoint.unreleased.extend(
                            h for h in handles if h not in self.checkpoint.unreleased
                        )
                        self.log.warning(
                            "the claim's partitions stay in the hardware until its resource is served through "
                            "DRA again (no configured backend can destroy them)",
                            claim=ref.ref,
                            partitions=[str(h.get("id") or h.get("uuid") or h) for h in handles],
                        )
                    elif handles:
                        await self._release(handles)
                except Exception as exc:
                    results[ref.uid] = self._unprepare_failure(ref, "cannot destroy its partitions", exc)
                    continue
            path = self._spec_file(ref.uid)
            paths = {path, known.cdi_spec or path} if known is not None else {path}
            try:
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                if known is not None:
                    self._remove_metadata(ref.uid, known)
            except OSError as exc:
                results[ref.uid] = self._unprepare_failure(ref, "cannot remove its CDI spec", exc)
                continue
            if known is not None:
                removed[ref.uid] = self.checkpoint.claims.pop(ref.uid)
            results[ref.uid] = None
            self._unprepare_seconds.observe(time.perf_counter() - started)
            if known is not None and self.log.is_enabled_for(logging.INFO):
                self.log.info("claim unprepared", claim=ref.ref, uid=ref.uid)
        if removed:
            releasing = self.checkpoint.releasing
            self.checkpoint.releasing = [u for u in releasing if u not in removed]
            try:
                self.checkpoint.save()
            except CheckpointError as exc:
                # Memory stays what the disk says: the claims are still prepared, the kubelet retries.
                self.checkpoint.claims.update(removed)
                self.checkpoint.releasing = releasing
                for uid in removed:
                    results[uid] = str(exc)
            else:
                self.changed.set()
                if self.status is not None:
                    for uid, claim in removed.items():
                        self.status.clear(ClaimRef(claim.namespace, uid, claim.name))
        return results

    def _remove_metadata(self, uid: str, known: PreparedClaim) -> None:
        """The claim's metadata files, if it was prepared with them (its CDI IDs say so, whatever
        dra.deviceMetadata says now)."""
        ids = [c for d in known.devices for c in d.cdi_device_ids if c.startswith(self._metadata_ids)]
        if not ids:
            return
        writer = self.metadata or MetadataWriter(self.driver, self.metadata_dir, self.cdi_dir)
        requests = writer.requests_of(ids)
        if requests:
            writer.remove(known.namespace, known.name, uid, requests)

    def _unprepare_failure(self, ref: ClaimRef, what: str, exc: Exception) -> str:
        detail = exc.strerror or str(exc) if isinstance(exc, OSError) else error_text(exc)
        message = f"ResourceClaim {ref.ref}: {what}: {one_line(str(detail))}"
        self.log.warning("claim not unprepared", claim=ref.ref, uid=ref.uid, reason=message)
        if not isinstance(exc, BackendError | OSError):
            self.log.debug("claim not unprepared: traceback", claim=ref.ref, exc_info=exc)
        return message

    def remove_orphan_specs(self) -> list[Path]:
        """CDI spec files of this driver whose claim is not in the checkpoint (a crash between writing the
        spec and the checkpoint); called at start, before serving. Nothing is removed when the checkpoint
        had to be set aside: those specs may serve running containers."""
        if self.checkpoint.set_aside:
            return []
        prefix = self._spec_prefix
        removed = []
        try:
            candidates = list(self.cdi_dir.glob(f"{prefix}*.json"))
        except OSError:
            return []
        for path in candidates:
            uid = path.name[len(prefix) : -len(".json")]
            # "kxpu-dra-x.io-*" also matches driver x.io-y's specs ("kxpu-dra-x.io-y-<uid>"): only a spec of
            # this driver's CDI kind is this driver's.
            if uid not in self.checkpoint.claims and _spec_kind(path) == self.cdi_kind:
                path.unlink(missing_ok=True)
                removed.append(path)
        writer = self.metadata or MetadataWriter(self.driver, self.metadata_dir, self.cdi_dir)
        for path in writer.orphans(set(self.checkpoint.claims)):
            writer.remove_orphan(path)
            removed.append(path)
        return removed


def _deleted(ref: ClaimRef, answer: Mapping[str, Any] | Exception | None) -> bool:
    """The API server has no claim of this UID any more (an error reading it says nothing)."""
    if answer is None:
        return True
    if isinstance(answer, Exception):
        return False
    return bool((answer.get("metadata") or {}).get("uid") != ref.uid)


def _parent(device: Device) -> str | None:
    """The physical device a partition is cut from, when that is not the device itself."""
    parent = device.extra.get("parent")
    return str(parent) if parent is not None and str(parent) != device.id else None


def _spec_present(claim: PreparedClaim) -> bool:
    """A prepared claim whose CDI spec is gone (removed by hand, a tmpfs cleared) is prepared again."""
    return claim.cdi_spec is None or os.path.exists(claim.cdi_spec)


def _spec_kind(path: Path) -> str | None:
    try:
        kind = json.loads(path.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None

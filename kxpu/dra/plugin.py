"""One resource served as a DRA driver: its sockets, its registration, its ResourceSlices, its claims.

The resource runner (``kxpu.daemon.resource``) builds the backend and keeps the device snapshot;
this plugin is the DRA half that serves it, in place of the device-plugin server:

- the DRA services (``service.py``) on ``<kubeletPluginsDir>/<driver>/dra.sock``, and plugin
  registration on ``<pluginsRegistryDir>/<driver>-reg.sock``, each bound under a private name and
  renamed into place (gRPC unlinks the path it bound when it stops: never someone else's socket);
- level-triggered like the device-plugin side: an inotify watch on both directories (and a resync
  every ``RESYNC_SECONDS``) re-serves a socket that was removed, and a live socket of another
  process at our path (a DaemonSet update with ``maxSurge``, or a second daemon started by hand) makes
  this one stand by: it publishes nothing, and reloads the checkpoint when it takes over;
- ResourceSlices follow the snapshot (``publisher.py``), retried with backoff on API errors, and are
  published again whenever they stop being what was written (a watch of the driver's slices: a starting
  kubelet deletes its node's slices, it deletes a driver's 30 s after losing it, an admin may delete them);
- prepared claims survive restarts in ``<kubeletPluginsDir>/<driver>/checkpoint.json``.

Ready means: registered with the kubelet (it called ``NotifyRegistrationStatus`` with success) and
the current devices published.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import glob
import os
import re
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import grpc

from kxpu.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from kxpu.backoff import Backoff
from kxpu.daemon.holders import HolderError, list_pod_resources
from kxpu.daemon.registration import FileIdentity, file_identity
from kxpu.daemon.serving import stop_server
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra import metrics
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.claim_cache import ClaimCache, reserved_pods
from kxpu.dra.claim_status import ClaimStatusApi, ClaimStatusWriter
from kxpu.dra.config import DraConfig, check_dra_socket_paths, check_instance, dra_socket, registration_socket
from kxpu.dra.instances import HostLock
from kxpu.dra.metadata import MetadataWriter
from kxpu.dra.prepare import ClaimSource, Preparer
from kxpu.dra.publisher import SliceApi, SlicePublisher
from kxpu.dra.service import RegistrationServicer, add_dra_services
from kxpu.dra.slices import SharePolicy
from kxpu.dra.taints import TaintPolicy
from kxpu.fswatch import ENTRY_EVENTS, directory_changes
from kxpu.kube.watch import keep_watching
from kxpu.logs import error_text, get_logger
from kxpu.model import SUB_DEVICE_SEPARATOR, Backend, Partitioner
from kxpu.sockets import MAX_SOCKET_PATH, live_socket
from kxpu.timeouts import wait_event

log = get_logger("kxpu.dra.plugin")

RESYNC_SECONDS = 30.0
# The per-pod sockets an earlier pod may have left (a pod UID is a UUID; nothing else is ever removed).
_POD_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# A process waiting to publish (the other one of a rolling update holds the lock) tries again this often.
PUBLISH_LOCK_POLL_SECONDS = 0.5
HELD_POLL_SECONDS = 5.0
# The watch of the driver's slices repairs deletions at once; a full re-list this often as well, in case a
# watch event was lost (one filtered LIST per node and driver).
RELIST_SECONDS = 300.0
# Registration first: the API side (lightkube's import, the claim cache, the slices' watch and publication) waits
# until the kubelet has accepted the driver, or this long after the start if it has not, rather than take the
# CPU from the registration (on two cores, a thread importing lightkube halves what the loop gets).
API_AFTER_SECONDS = 1.0
# gRPC messages: a NodePrepareResources call names at most a few hundred claims; nothing legitimate is near this.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class DraPhase(enum.StrEnum):
    STARTING = "starting"
    WAITING_FOR_KUBELET = "waiting-for-kubelet"
    REGISTERED = "registered"
    STANDBY = "standby"


class _Served:
    """One gRPC server bound at one path, remembered by the path's identity."""

    def __init__(self, path: Path, add_services: Callable[[grpc.aio.Server], None], what: str) -> None:
        self.path = path
        self.add_services = add_services
        self.what = what
        self.server: grpc.aio.Server | None = None
        self.identity: FileIdentity | None = None

    def intact(self) -> bool:
        return self.server is not None and file_identity(self.path) == self.identity

    def taken_by_another(self) -> bool:
        current = file_identity(self.path)
        return current is not None and current != self.identity and live_socket(self.path)

    async def serve(self) -> None:
        await self.stop()
        self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)  # the kubelet (root) dials in
        private = self.path.parent / f".kxpu-{os.getpid()}-{self.path.name}"
        if len(str(private).encode()) > MAX_SOCKET_PATH:
            private = self.path.parent / f".kxpu-{os.getpid()}.sock"
        private.unlink(missing_ok=True)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self.add_services(server)
        server.add_insecure_port(f"unix://{private}")
        await server.start()
        try:
            os.replace(private, self.path)
        except OSError:
            await stop_server(server, 0)
            raise
        self.server, self.identity = server, file_identity(self.path)
        log.info("serving", what=self.what, socket=str(self.path))

    async def stop(self, grace: float | None = 0) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await stop_server(server, grace)
        if self.identity is not None and file_identity(self.path) == self.identity:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.identity = None


class DraPlugin:
    def __init__(
        self,
        resource: str,
        driver: str,
        node: str,
        backend: Backend,
        snapshot: DeviceSnapshot,
        plugins_dir: Path,
        registry_dir: Path,
        slices: SliceApi,
        claims: ClaimSource,
        settings: DraConfig | None = None,
        pod_resources: Path | None = None,
        close: Callable[[], Awaitable[None]] | None = None,
        claim_cache: ClaimCache | None = None,
        status_api: ClaimStatusApi | None = None,
        instance: str | None = None,
    ) -> None:
        settings = settings or DraConfig()
        # This process's own socket names (the pod UID: a rolling update's two pods both serve, kxpu.dra.instances).
        self.instance = instance
        if instance is not None:
            check_instance(instance)
            check_dra_socket_paths(plugins_dir, registry_dir, driver, instance)
        self._close = close  # what this plugin's API client needs when the plugin stops
        self.backend = backend
        self.pod_resources = pod_resources
        # Devices pods still hold through the device plugin (this node served the resource that way before):
        # tainted, never prepared, until those pods are gone.
        self.held: frozenset[str] = frozenset()
        self._held_changed = asyncio.Event()
        self.resource = resource
        self.driver = driver
        self.node = node
        self.snapshot = snapshot
        self.plugin_dir = plugins_dir / driver
        self.checkpoint = Checkpoint(self.plugin_dir / "checkpoint.json", driver)
        taints = TaintPolicy(settings.taints.effects())
        self.preparer = Preparer(
            driver,
            node,
            backend,
            snapshot.devices,
            self.checkpoint,
            settings.cdi_spec_dir,
            claims,
            settings.shares,
            taints,
        )
        self.claim_cache = self.preparer.claim_cache = claim_cache
        self.preparer.metadata_dir = self.plugin_dir
        if settings.device_metadata:
            self.preparer.metadata = MetadataWriter(driver, self.plugin_dir, settings.cdi_spec_dir)
        self.claim_status = (
            ClaimStatusWriter(driver, status_api)
            if status_api is not None and settings.claim_status
            else None
        )
        self.preparer.status = self.claim_status
        shares = settings.shares
        policy = (
            SharePolicy(
                shares.memory_step_mib, shares.min_memory_mib, shares.memory_scaling, shares.core_scaling
            )
            if shares is not None
            else None
        )
        self.slice_api = slices
        self.publisher = SlicePublisher(slices, driver, node, settings.unhealthy, policy, taints)
        self._republish = asyncio.Event()  # the slices in the API may no longer be what was published
        self._active = asyncio.Event()  # serving (not standing by): only then are slices published
        # One process of the driver writes its slices at a time: the other waits for this lock (kxpu.dra.instances).
        self.publish_lock = HostLock(self.plugin_dir / "publish.lock")
        self.publish_deferred = False  # another process holds the publish lock; this one waits for it
        self.phase = DraPhase.STARTING
        self.registered = False
        self.registrations = 0  # how often the kubelet accepted the registration (the runner's backoff)
        self.registration_error = ""
        self.published_revision = -1
        self._poked = asyncio.Event()
        self._registered_changed = asyncio.Event()
        self._registered_once = asyncio.Event()  # the kubelet accepted this driver (since the start)
        self.dra = _Served(
            dra_socket(plugins_dir, driver, instance),
            lambda server: add_dra_services(server, self.preparer, snapshot, node),
            "DRA services",
        )
        self.registration = _Served(
            registration_socket(registry_dir, driver, instance),
            lambda server: reg_grpc.add_RegistrationServicer_to_server(
                RegistrationServicer(driver, str(self.dra.path), self._on_registration), server
            ),
            "plugin registration",
        )
        self.log = log.bind(resource=resource, driver=driver)

    @property
    def ready(self) -> bool:
        """Registered, and the current devices published (by this process, or by the other one of a rolling
        update that still holds the publish lock: its slices stay, and this one takes them over)."""
        published = self.published_revision == self.snapshot.revision or self.publish_deferred
        return self.registered and published

    @property
    def publishing(self) -> bool:
        """This process writes the driver's slices (False while another process of the driver does)."""
        return self.publish_lock.held

    def poke(self) -> None:
        self._poked.set()

    def _on_registration(self, registered: bool, error: str) -> None:
        self.registered, self.registration_error = registered, error
        metrics.DRIVER_REGISTERED.labels(self.driver).set(1 if registered else 0)
        if registered:
            self.registrations += 1
            self._registered_once.set()
            self.log.info("registered with the kubelet")
        else:
            self.log.error("the kubelet refused the registration", reason=error or "no reason given")
        self._registered_changed.set()
        if registered:  # a kubelet that (re)started wipes the node's slices: look again
            self._republish.set()
        self.poke()

    async def run(self) -> None:
        """Serve until cancelled; the sockets are removed on the way out, the slices and checkpoint kept
        (a restarted daemon takes over without a gap in what the scheduler sees). Stopped while it starts (a
        reload, SIGTERM), it cleans up all the same."""
        try:
            if self.instance is not None:
                removed_sockets = await asyncio.to_thread(self._remove_dead_sockets)
                if removed_sockets:
                    self.log.info(
                        "removed the sockets of earlier instances nobody serves",
                        sockets=[str(p) for p in removed_sockets],
                    )
            await self._load_checkpoint()
            removed = await asyncio.to_thread(self.preparer.remove_orphan_specs)
            if removed:
                self.log.info(
                    "removed CDI specs of claims that were never checkpointed",
                    files=[str(p) for p in removed],
                )
            self.log.info("DRA driver starting", node=self.node, prepared_claims=len(self.checkpoint.claims))
            if self.pod_resources is not None:
                await self._read_held()  # before the first publish: never offer a device a pod still uses
            api_after = asyncio.get_running_loop().time() + API_AFTER_SECONDS
            async with asyncio.TaskGroup() as tasks:
                if self.held:
                    tasks.create_task(self._follow_held())
                tasks.create_task(self._after_registration(self._publish_loop, api_after))
                tasks.create_task(self._after_registration(self._release_deleted_claims, api_after))
                if self.claim_cache is not None:
                    tasks.create_task(self._after_registration(self.claim_cache.run, api_after))
                if self.claim_status is not None:
                    tasks.create_task(self._after_registration(self.claim_status.run, api_after))
                tasks.create_task(self._after_registration(self._watch_slices, api_after))
                tasks.create_task(self._watch_dirs())
                tasks.create_task(self._serve_loop())
        finally:
            await self.registration.stop(0.5)
            await self.dra.stop(0.5)
            self.publish_lock.release()  # the other process of a rolling update publishes from here on
            self.registered = False
            metrics.DRIVER_REGISTERED.labels(self.driver).set(0)
            if self._close is not None:
                try:
                    await self._close()
                except Exception as exc:
                    self.log.warning("cannot close the API client", error=error_text(exc))
            self.preparer.stop_reporting()
            if self.claim_cache is not None:
                self.claim_cache.stop_reporting()

    async def _after_registration(self, work: Callable[[], Awaitable[None]], deadline: float) -> None:
        """``work`` once the kubelet accepted the driver, or from ``deadline`` (API_AFTER_SECONDS)."""
        await wait_event(self._registered_once, deadline - asyncio.get_running_loop().time())
        await work()

    def _remove_dead_sockets(self) -> list[Path]:
        """Per-pod sockets of this driver left by a killed pod (SIGKILL, a node's power loss): the kubelet would
        dial them forever. Only a socket nobody accepts on is removed; a live one is another pod's."""
        candidates = [
            p
            for p in self.registration.path.parent.glob(f"{glob.escape(self.driver)}-*-reg.sock")
            if _POD_UID.fullmatch(p.name[len(self.driver) + 1 : -len("-reg.sock")])
        ]
        candidates += [p for p in self.dra.path.parent.glob("dra-*.sock") if _POD_UID.fullmatch(p.name[4:-5])]
        removed = []
        for path in candidates:
            if path in (self.dra.path, self.registration.path) or live_socket(path):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        return removed

    async def _load_checkpoint(self) -> None:
        await asyncio.to_thread(
            self.checkpoint.load
        )  # kxpu_dra_claims_prepared reads it (the preparer's gauge)

    async def _serve_loop(self) -> None:
        backoff = Backoff(initial=0.1, maximum=10.0)
        while True:
            self._poked.clear()
            try:
                if self.registration.taken_by_another() or self.dra.taken_by_another():
                    if self.phase is not DraPhase.STANDBY:
                        self.log.warning("another process serves this DRA driver's sockets; standing by")
                    self._active.clear()
                    self.phase, self.registered = DraPhase.STANDBY, False
                    metrics.DRIVER_REGISTERED.labels(self.driver).set(0)
                    await self.registration.stop()
                    await self.dra.stop()
                elif not (self.dra.intact() and self.registration.intact()):
                    if self.phase is DraPhase.STANDBY:
                        # The other process prepared and unprepared claims meanwhile: its checkpoint is the truth.
                        await self._load_checkpoint()
                        self.log.info(
                            "the other process is gone; taking over",
                            prepared_claims=len(self.checkpoint.claims),
                        )
                    for served in (self.dra, self.registration):
                        if served.identity is not None and not served.intact():
                            self.log.warning(
                                "a DRA socket was removed; serving it again", socket=str(served.path)
                            )
                    if self.phase in (DraPhase.STARTING, DraPhase.STANDBY):
                        await self.preparer.reconcile()  # what a crash left in the hardware, before serving
                    if not self.dra.intact():  # the endpoint first: the kubelet dials it once it has our info
                        await self.dra.serve()
                    self.registered = False
                    await self.registration.serve()
                    self.phase = DraPhase.WAITING_FOR_KUBELET
                    self._active.set()
                elif self.registered:
                    self.phase = DraPhase.REGISTERED
                backoff.reset()
            except (OSError, RuntimeError) as exc:  # gRPC's bind failure is a RuntimeError ("Failed to bind")
                delay = backoff.next_delay()
                self.log.error(
                    "cannot serve the DRA sockets; retrying",
                    error=error_text(exc),
                    retry_in_s=round(delay, 2),
                )
                await wait_event(self._poked, delay)
                continue
            await wait_event(self._poked, RESYNC_SECONDS)

    async def _release_deleted_claims(self) -> None:
        """Once serving (never while another process does): claims deleted while the driver was down."""
        await self._active.wait()
        await self.preparer.release_deleted_claims()

    async def _watch_dirs(self) -> None:
        directories = [self.dra.path.parent, self.registration.path.parent]
        # Only the sockets matter, and only their names coming and going: the checkpoint beside the DRA socket is
        # rewritten on every prepare and unprepare, and each of those writes would wake the socket check.
        sockets = {self.dra.path, self.registration.path}
        backoff = Backoff(initial=1.0, maximum=30.0)
        while True:
            try:
                async for _ in directory_changes(lambda: directories, sockets.__contains__, ENTRY_EVENTS):
                    self.poke()
            except Exception as exc:  # inotify limits: the resync still re-checks every RESYNC_SECONDS
                delay = backoff.next_delay()
                self.log.error("cannot watch the DRA directories", error=error_text(exc))
                await asyncio.sleep(delay)

    async def _read_held(self) -> bool:
        """The devices of this resource that pods hold through the device plugin, from the kubelet's
        PodResources API; True if that set changed. Unreadable: the last answer stays (a warning)."""
        assert self.pod_resources is not None
        try:
            placed = await list_pod_resources(self.pod_resources)
        except HolderError as exc:
            self.log.warning(
                "cannot tell which devices pods hold through the device plugin; assuming the last answer",
                error=str(exc),
                held=sorted(self.held),
            )
            return False
        # A slot of kxpu's sharing, a time-slicing replica or a generic share is ``<device>::<n>``: a pod holding
        # one holds part of that device (an extender-shared pod while the node moves to DRA shares).
        held = frozenset(
            device.split(SUB_DEVICE_SEPARATOR, 1)[0]
            for (resource, device) in placed
            if resource == self.resource
        )
        if held == self.held:
            return False
        if held or self.held:
            self.log.info("devices held by device-plugin pods", held=sorted(held))
        self.held = held
        self.preparer.held = held
        self._held_changed.set()
        return True

    async def _follow_held(self) -> None:
        """Until the last pod that got a device through the device plugin is gone (they are not replaced:
        this resource is served through DRA now)."""
        while self.held:
            await asyncio.sleep(HELD_POLL_SECONDS)
            await self._read_held()

    async def _watch_slices(self) -> None:
        """Wake the publisher whenever the API's slices of this driver and node stop being what it wrote:
        deleted by a starting kubelet (it wipes the node's slices), by the kubelet 30 s after losing this
        driver, by an admin, or by the garbage collector with a Node created again."""

        async def watch_round(delivered: Callable[[], None]) -> None:
            async for kind, obj in self.slice_api.watch_slices(self.driver, self.node):
                delivered()
                if not self.publisher.is_current(kind, obj):
                    self._republish.set()

        def failed(error: str, retry_in_s: float) -> None:
            self.log.warning("watching ResourceSlices failed; retrying", error=error, retry_in_s=retry_in_s)

        # A watch that ended without an error starts again after a second (the publisher checks meanwhile).
        await keep_watching(watch_round, failed, after=self._republish.set, pause_s=1.0)

    async def _take_publish_lock(self) -> None:
        if self.publish_lock.try_acquire():
            return
        self.publish_deferred = True
        self.log.info("another process of this driver publishes its ResourceSlices; waiting for it to stop")
        await self.publish_lock.acquire(poll_max_s=PUBLISH_LOCK_POLL_SECONDS)
        self.publish_deferred = False
        self.log.info("publishing ResourceSlices: the other process stopped")

    async def _publish_loop(self) -> None:
        backoff = Backoff(initial=0.2, maximum=30.0)
        while True:
            await self._active.wait()  # a standby process leaves the slices to the one serving
            revision = self.snapshot.revision
            self._held_changed.clear()
            self._republish.clear()
            self.preparer.update_devices(self.snapshot.devices)
            try:
                if not self.publish_lock.held:
                    await self._take_publish_lock()
                counter_sets = (
                    await asyncio.to_thread(self.backend.counter_sets)
                    if isinstance(self.backend, Partitioner)
                    else ()
                )
                written = await self.publisher.publish(
                    list(self.snapshot.devices.values()), self.held, counter_sets
                )
                metrics.SLICE_WRITES.labels(self.driver, "written" if written else "unchanged").inc()
                metrics.POOL_GENERATION.labels(self.driver).set(self.publisher.generation)
                self.published_revision = revision
                backoff.reset()
                delay = None
            except Exception as exc:  # the API server's answer or the connection's failure: retried
                metrics.SLICE_WRITES.labels(self.driver, "failed").inc()
                delay = backoff.next_delay()
                self.log.error(
                    "publishing ResourceSlices failed; retrying",
                    error=error_text(exc),
                    retry_in_s=round(delay, 2),
                )
            changes = [
                asyncio.ensure_future(self.snapshot.wait_revision_newer_than(revision)),
                asyncio.ensure_future(self._held_changed.wait()),
                asyncio.ensure_future(self._republish.wait()),
            ]
            try:
                await asyncio.wait(
                    changes,
                    timeout=RELIST_SECONDS if delay is None else delay,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for change in changes:
                    change.cancel()

    async def claim_pods(self, uids: Collection[str]) -> dict[str, frozenset[str]]:
        """Prepared claim UID → the UIDs of the pods it is reserved for (``status.reservedFor``), for telemetry:
        from the claim cache while it is synced, else one GET per claim. A claim gone or replaced (another UID)
        is left out; an API failure raises (the caller says which source failed)."""
        cache, found = self.claim_cache, {}
        wanted = [u for u in uids if u in self.checkpoint.claims]
        for uid in wanted:
            if cache is not None and (pods := cache.pods_of(uid)) is not None:
                found[uid] = pods
        for uid in (u for u in wanted if u not in found):
            prepared = self.checkpoint.claims[uid]
            claim = await self.preparer.claims.get_claim(prepared.namespace, prepared.name)
            meta = claim.get("metadata") if claim is not None else None
            if isinstance(meta, Mapping) and meta.get("uid") == uid:
                found[uid] = reserved_pods(claim or {})
        return found

    def describe(self) -> dict[str, Any]:
        """The driver, its pool and what is prepared (read from the HTTP thread: plain reads only)."""
        return {
            "driver": self.driver,
            "pool": self.node,
            "registered": self.registered,
            # A rolling update's two pods: which one writes the slices (the other waits for it to exit).
            "publishing": self.publishing,
            **({"instance": self.instance} if self.instance is not None else {}),
            "generation": self.publisher.generation,
            "claims": {
                uid: {
                    "claim": claim.ref,
                    "devices": [d.id for d in claim.devices],
                    **(
                        {
                            "shares": {
                                d.id: {"memoryMiB": d.memory_mib, "cores": d.cores}
                                for d in claim.devices
                                if d.share_id
                            }
                        }
                        if any(d.share_id for d in claim.devices)
                        else {}
                    ),
                }
                for uid, claim in list(self.checkpoint.claims.items())
            },
        }

    async def withdraw(self) -> None:
        """The resource is no longer served as DRA on this node (removed from the config): remove its
        slices so the scheduler stops allocating its devices. Prepared claims stay until unprepared."""
        try:
            await self.publisher.withdraw()
        except Exception as exc:
            self.log.error("could not withdraw ResourceSlices", error=error_text(exc))

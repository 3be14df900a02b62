"""One resource's life: build its backend, follow its changes, serve its socket, stay registered.

The serve/register half is level-triggered: whenever anything in the device-plugin
directory changes the runner is poked and compares what is (our socket file, the
kubelet's socket file) with what it last did, so a kubelet restart, a late kubelet and a
deleted socket are all handled by the same few lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hashlib
import itertools
import os
import secrets
import socket
import stat
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.backoff import Backoff
from kxpu.config import Handover, ResourceConfig
from kxpu.daemon import metrics
from kxpu.daemon.registration import FileIdentity, file_identity, register
from kxpu.daemon.servicer import DevicePluginServicer
from kxpu.daemon.serving import stop_server
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.daemon.wire import KUBELET_SOCKET, SERVER_OPTIONS
from kxpu.logs import error_text, get_logger, log_failure
from kxpu.model import Backend, BackendError, Closable, Device, Health, Watcher
from kxpu.sockets import MAX_SOCKET_PATH, live_socket
from kxpu.timeouts import wait_event

if TYPE_CHECKING:
    from kxpu.dra.checkpoint import Checkpoint

log = get_logger("kxpu.daemon.resource")

BackendFactory = Callable[[ResourceConfig], Backend]


class DraServer(Protocol):
    """A resource's DRA half (``kxpu.dra.plugin.DraPlugin``), serving the snapshot this runner keeps."""

    driver: str
    checkpoint: Checkpoint  # its prepared claims: telemetry reads them to tie pods to devices

    @property
    def phase(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def registrations(self) -> int:
        """How often the kubelet accepted this server's registration."""
        ...

    async def run(self) -> None: ...

    def poke(self) -> None: ...

    async def withdraw(self) -> None: ...

    async def claim_pods(self, uids: Collection[str]) -> dict[str, frozenset[str]]:
        """Prepared claim UID → the UIDs of the pods its ``status.reservedFor`` names (telemetry's pod UIDs)."""
        ...

    def describe(self) -> dict[str, Any]:
        """For the daemon's /status: the driver, its pool and the prepared claims."""
        ...


class Withheld(Protocol):
    """Devices prepared DRA claims hold for a driver the config no longer serves through DRA
    (``kxpu.dra.leftover.Leftovers``): the device plugin offers them as Unhealthy until they are released."""

    version: int

    def withheld(self, driver: str) -> Mapping[str, str]:
        """Device ID or UUID → why it is not offered."""
        ...

    async def wait_newer_than(self, version: int) -> None: ...


# (resource, backend, snapshot) → its DRA server; the CLI wires the Kubernetes client and directories in.
DraFactory = Callable[[ResourceConfig, Backend, DeviceSnapshot], DraServer]


class Phase(enum.StrEnum):
    STARTING = "starting"
    WAITING_FOR_KUBELET = "waiting-for-kubelet"
    REGISTERED = "registered"
    # Registered, but the kubelet has no ListAndWatch stream open that was sent the current device list
    # (it has not opened one yet, or it closed it): the node does not have the devices.
    AWAITING_LIST_AND_WATCH = "awaiting-list-and-watch"
    STANDBY = "standby"  # another live process serves this resource's socket
    FAILED = "failed"
    STOPPED = "stopped"


# Handover alongside: re-registrations after the kubelet let go of us back off from 50 ms; after this long without
# one, the next starts at 50 ms again.
DROP_RESET_SECONDS = 30.0

# A ServeError that persists (a directory kxpu may not write) is logged once, then at this interval.
BLOCKED_RELOG_SECONDS = 600.0

# A failed resource is retried after 0.5 s, then 1, 2, 4 ... at most 30 s apart; a resource that registered
# (served) again before failing starts over at 0.5 s.
RETRY_INITIAL_SECONDS = 0.5
RETRY_MAX_SECONDS = 30.0

_HASH_HEX = 16
# handover alongside: each serve gets a socket of its own, ``…@<8 hex>.sock`` (``@`` is never in a resource name)
_INSTANCE_HEX = 8
_INSTANCE_TAIL = len("@") + _INSTANCE_HEX + len(".sock")
_SHORTEST_NAME = len("kxpu-") + _HASH_HEX + len(".sock")  # a hashed socket name without a hint
# The longest device-plugin directory in which every resource gets a socket name: a hashed name always fits,
# and so does the private bind name (``.kxpu-<pid>-<n>``: a pid has at most 7 digits).
MAX_PLUGIN_DIR = MAX_SOCKET_PATH - 1 - _SHORTEST_NAME
MAX_PLUGIN_DIR_ALONGSIDE = MAX_PLUGIN_DIR - (_INSTANCE_TAIL - len(".sock"))


def _path_bytes(path: Path) -> int:
    return len(os.fsencode(path))


def socket_name(resource: str, plugin_dir: Path | None = None, instance: str | None = None) -> str:
    """``example.com/npu`` → ``kxpu-example.com_npu.sock``: one socket per resource, and one resource
    per socket, since a domain cannot contain ``_`` (``a.com/b-c`` and ``a.com-b/c`` stay apart). With
    ``instance`` (handover alongside), ``kxpu-example.com_npu@<instance>.sock``: one per serving process.

    A name whose path in ``plugin_dir`` would pass the unix limit (a valid resource name can be 308
    characters) gets ``kxpu-<name part, shortened>-<16 hex of its SHA-256>.sock`` instead: the kubelet only
    needs the endpoint it is told at registration. Such names contain no ``_``, so they never meet a
    readable one, and the hash keeps two long names apart.
    """
    tail = f"@{instance}.sock" if instance else ".sock"
    readable = "kxpu-" + resource.replace("/", "_", 1) + tail
    if plugin_dir is None or _path_bytes(plugin_dir / readable) <= MAX_SOCKET_PATH:
        return readable
    digest = hashlib.sha256(resource.encode()).hexdigest()[:_HASH_HEX]
    # 1: the "-" before the hash
    room = MAX_SOCKET_PATH - _path_bytes(plugin_dir) - 1 - len("kxpu-") - _HASH_HEX - len(tail) - 1
    hint = resource.rpartition("/")[2].replace("_", "-")[: max(room, 0)]
    return f"kxpu-{hint}-{digest}{tail}" if hint else f"kxpu-{digest}{tail}"


def _new_instance() -> str:
    return secrets.token_hex(_INSTANCE_HEX // 2)


def remove_dead_instances(plugin_dir: Path, resource: str, keep: Path | None = None) -> list[str]:
    """Handover alongside: remove this resource's sockets that nobody accepts on (a killed daemon's, whichever
    handover it used); a live one (the pod being replaced) is left alone. Returns the names removed."""
    prefix = socket_name(resource, plugin_dir, "0" * _INSTANCE_HEX).rpartition("@")[0] + "@"
    shared = socket_name(resource, plugin_dir)  # what a daemon with handover standby served
    removed = []
    try:
        entries = list(plugin_dir.iterdir())
    except OSError:
        return []
    for entry in entries:
        ours = entry.name == shared or (entry.name.startswith(prefix) and entry.name.endswith(".sock"))
        if not ours or entry == keep:
            continue
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(entry.lstat().st_mode) and not live_socket(entry):
                entry.unlink()
                removed.append(entry.name)
    return removed


def check_socket_paths(plugin_dir: Path, resources: list[str], handover: Handover = "standby") -> None:
    """Refuse at load what bind() would refuse at serve time: a directory too long for any socket name."""
    limit = MAX_PLUGIN_DIR if handover == "standby" else MAX_PLUGIN_DIR_ALONGSIDE
    if _path_bytes(plugin_dir) > limit:
        hint = (
            " (or devicePluginHandover: standby, whose socket names are shorter)"
            if handover != "standby"
            else ""
        )
        raise ValueError(
            f"devicePluginDir {plugin_dir} is {_path_bytes(plugin_dir)} bytes; kxpu needs at most "
            f"{limit} (unix socket paths are limited to {MAX_SOCKET_PATH} bytes): use a shorter "
            f"device-plugin directory{hint}"
        )
    names = [socket_name(r, plugin_dir) for r in resources]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:  # 64 bits of SHA-256 apart: never seen, but two resources must never share a socket
        raise ValueError(f"resources would share the socket {', '.join(clashes)}; rename one")


# Each server binds a name never used before in this process (see ResourceRunner._serve).
_bind_serial = itertools.count()


class ServeError(Exception):
    """The resource's socket cannot be served; the message says why and what to do."""


def _obstacle(path: Path) -> str | None:
    """What non-socket occupies ``path`` (kxpu never deletes what is not a socket), or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"


class ResourceRunner:
    def __init__(
        self,
        config: ResourceConfig,
        plugin_dir: Path,
        build: BackendFactory,
        dra: DraFactory | None = None,
        withheld: Withheld | None = None,
        handover: Handover = "standby",
    ) -> None:
        self.config = config
        self.handover = handover
        self.withheld = withheld
        self._discovered: list[Device] = []
        self.plugin_dir = plugin_dir
        self.build = build
        self.dra_factory = dra
        self.dra: DraServer | None = None  # while serving through DRA
        self._last_dra: DraServer | None = None  # for withdraw() after the runner stopped
        self.socket_path = self._socket_path()
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._phase = Phase.STARTING
        self.registrations = 0  # with the kubelet's device manager
        self._dra_registrations = 0  # of the DRA servers that have stopped
        self.snapshot = DeviceSnapshot()
        self.backend: Backend | None = None  # while the resource runs (telemetry samples it)
        self._servicer: DevicePluginServicer | None = None
        self._poked = asyncio.Event()
        self._dropped = False  # handover alongside: the kubelet closed our last ListAndWatch stream
        self._drop_backoff = Backoff(initial=0.05, maximum=5.0)
        self._last_drop = -DROP_RESET_SECONDS
        self._last_served: Path | None = None
        self._reported: dict[str, Device] = {}  # what metrics last saw, across restarts of this runner
        # Set by stop(): what tells a requested stop from a failure. A task's cancelling() count cannot: on
        # Python 3.11 and 3.12 a TaskGroup whose child failed leaves its parent's count at 1 for good.
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.log = log.bind(resource=config.name)

    def _socket_path(self) -> Path:
        """standby: the resource's one socket; alongside: a new name for each serve, never another process's."""
        if self.handover == "standby":
            return self.plugin_dir / socket_name(self.config.name, self.plugin_dir)
        while True:
            path = self.plugin_dir / socket_name(self.config.name, self.plugin_dir, _new_instance())
            if not os.path.lexists(path):
                return path

    def _next_instance(self) -> None:
        """Handover alongside: serve a name no other process serves, nor this one served before (the kubelet may
        still hold the last one's endpoint), and clear away what killed daemons left."""
        # A name never served (the first, or one whose serve failed) is kept: `kxpu status` shows what is served.
        if self.socket_path == self._last_served or os.path.lexists(self.socket_path):
            self.socket_path = self._socket_path()
        if removed := remove_dead_instances(self.plugin_dir, self.config.name, self.socket_path):
            self.log.info("removed sockets nobody serves (a killed daemon's)", sockets=removed)

    @property
    def phase(self) -> Phase:
        """The device-plugin side's phase, or the DRA server's while one serves this resource (registered
        only once the kubelet accepted it and the current devices are published)."""
        if self.dra is not None and self._phase not in (Phase.FAILED, Phase.STOPPED):
            if self.dra.ready:
                return Phase.REGISTERED
            return Phase(self.dra.phase) if self.dra.phase != Phase.REGISTERED else Phase.STARTING
        return self._phase

    @phase.setter
    def phase(self, value: Phase) -> None:
        self._phase = value

    @property
    def state(self) -> Phase:
        """The phase as probes and ``kxpu status`` report it: a device-plugin resource counts as registered
        only once the kubelet's ListAndWatch stream has the current device list (the node has the devices)."""
        phase = self.phase
        synced = self._servicer is not None and self._servicer.kubelet_synced()
        if self.dra is None and phase is Phase.REGISTERED and not synced:
            return Phase.AWAITING_LIST_AND_WATCH
        return phase

    @property
    def settled(self) -> bool:
        """Past its start: the kubelet has its devices (device plugin: registered and its ListAndWatch stream
        has the list; DRA: the kubelet accepted the driver), or it stands by, failed, or waits for a kubelet that
        is not there. The daemon loads what registering does not need once every resource has settled."""
        if self._phase in (Phase.FAILED, Phase.STOPPED):
            return True
        if self.dra is not None:
            return self.dra.registrations > 0 or self.dra.phase == Phase.STANDBY
        return self.state in (Phase.REGISTERED, Phase.STANDBY, Phase.WAITING_FOR_KUBELET)

    def poke(self) -> None:
        """Something in the device-plugin directory changed: re-check socket and registration."""
        self._poked.set()
        if self.dra is not None:
            self.dra.poke()

    def _kubelet_dropped(self) -> None:
        self._dropped = True
        self._poked.set()

    def _delay_after_drop(self) -> float:
        """How long to wait before registering again after the kubelet let go of us: 50 ms (the kubelet is done
        disconnecting by then; a registration in the middle of it would be dropped too), backing off if it repeats."""
        now = asyncio.get_running_loop().time()
        if now - self._last_drop > DROP_RESET_SECONDS:
            self._drop_backoff.reset()
        self._last_drop = now
        delay = self._drop_backoff.next_delay()
        self.log.warning(
            "the kubelet let go of this plugin; registering again on a new socket (a kubelet before "
            "1.37 does that when the plugin it replaced goes: set devicePluginHandover: standby there)",
            retry_in_s=round(delay, 2),
        )
        return delay

    def stop(self) -> None:
        """Ask the runner to stop (SIGTERM, a reload): its task is cancelled, and a failure torn down meanwhile
        ends the runner instead of being retried. Safe to call again (a swallowed cancellation is asked again)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Run until stop(); a failure is logged and retried with backoff, never propagated to other resources."""
        self._task = asyncio.current_task()
        backoff = Backoff(initial=RETRY_INITIAL_SECONDS, maximum=RETRY_MAX_SECONDS)
        try:
            while not self._stopping:  # stop() before this task first ran had no task to cancel
                served_before = self._times_served()
                try:
                    await self._run_once()
                    if self._stopping:
                        return
                    raise RuntimeError("the resource stopped serving without an error")  # retried below
                except Exception as exc:
                    if self._stopping:
                        # Stopped (SIGTERM, a reload) while this failure was being torn down: asyncio's
                        # TaskGroup then raises the child's error and drops the cancellation. Retrying
                        # would serve and register again after "stopping" and never end.
                        log_failure(self.log, "resource failed as it was stopped", exc)
                        raise asyncio.CancelledError from None
                    self.phase = Phase.FAILED
                    metrics.RESOURCE_FAILURES.labels(self.config.name).inc()
                    if self._times_served() > served_before:
                        backoff.reset()  # it worked for a while: a new failure starts the backoff over
                    delay = backoff.next_delay()
                    log_failure(self.log, "resource failed; retrying", exc, retry_in_s=delay)
                    await asyncio.sleep(delay)
        finally:
            self.phase = Phase.STOPPED
            metrics.forget_resource(self.config.name, self.snapshot.devices)

    def _times_served(self) -> int:
        """Registrations with the kubelet, through the device plugin or DRA."""
        return self.registrations + self._dra_registrations + (self.dra.registrations if self.dra else 0)

    async def _run_once(self) -> None:
        backend = await self._build_backend()
        self.backend = backend
        try:
            self.snapshot = DeviceSnapshot()
            await self._update(await asyncio.to_thread(backend.discover))
            # Serving again after a failure: the DRA half's phase shows through only while ours is not FAILED.
            self.phase = Phase.STARTING
            if self.config.serve == "dra":
                await self._run_dra(backend)
                return
            if any(d.consumes for d in self.snapshot.devices.values()):
                raise BackendError(
                    f"{self.config.name} offers overlapping partitions, which only DRA can serve (the device plugin's "
                    "kubelet would hand them out together): set serve: dra"
                )
            servicer = DevicePluginServicer(
                self.config.name,
                backend,
                self.snapshot,
                on_dropped=self._kubelet_dropped if self.handover == "alongside" else None,
            )
            self._servicer = servicer
            self.log.info(
                "backend ready",
                backend=self.config.backend,
                devices=len(self.snapshot.devices),
                preferred_allocation=servicer.options.get_preferred_allocation_available,
                pre_start=servicer.options.pre_start_required,
            )
            async with asyncio.TaskGroup() as tasks:
                if isinstance(backend, Watcher):
                    tasks.create_task(self._follow(backend))
                tasks.create_task(self._serve_and_register(servicer))
                if self.withheld is not None:
                    tasks.create_task(self._follow_withheld(self.withheld))
                tasks.create_task(self._fail_with_streams(servicer))
        finally:
            self.backend = None
            self._servicer = None
            if isinstance(backend, Closable):
                await asyncio.to_thread(backend.close)

    async def _run_dra(self, backend: Backend) -> None:
        if self.dra_factory is None:
            raise RuntimeError(
                f"{self.config.name} is served through DRA, but this daemon was started without DRA"
            )
        self.dra = self._last_dra = self.dra_factory(self.config, backend, self.snapshot)
        self.log.info(
            "backend ready", backend=self.config.backend, devices=len(self.snapshot.devices), serve="dra"
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                if isinstance(backend, Watcher):
                    tasks.create_task(self._follow(backend))
                tasks.create_task(self.dra.run())
        finally:
            self._dra_registrations += self.dra.registrations
            self.dra = None

    @property
    def last_dra(self) -> DraServer | None:
        """The DRA server serving this resource now, or the last one (between a failure and the retry)."""
        return self.dra or self._last_dra

    async def withdraw(self) -> None:
        """Called after the runner stopped because its resource left the config."""
        if self._last_dra is not None:
            await self._last_dra.withdraw()

    async def _build_backend(self) -> Backend:
        """Build in a worker thread; if we are cancelled meanwhile (stop, reload), the thread still
        finishes, and what it built is closed then rather than leaked (an NVML handle, a thread)."""
        building = asyncio.ensure_future(asyncio.to_thread(self.build, self.config))
        try:
            return await asyncio.shield(building)
        except asyncio.CancelledError:
            building.add_done_callback(_close_built)
            raise

    async def _follow(self, backend: Watcher) -> None:
        async for devices in backend.watch():
            if await self._update(devices):
                unhealthy = {d.id: d.health_reason or "unknown" for d in devices if not d.healthy}
                self.log.info("devices changed", devices=len(devices), unhealthy=unhealthy)
        self.log.debug("backend stopped watching; the device list is static from now on")

    async def _fail_with_streams(self, servicer: DevicePluginServicer) -> None:
        """A ListAndWatch stream that could not send fails the resource: the kubelet would otherwise keep
        the dead stream's devices unhealthy with nothing logged and nothing retried."""
        raise await servicer.stream_failure()

    async def _follow_withheld(self, withheld: Withheld) -> None:
        seen = withheld.version
        while True:
            await withheld.wait_newer_than(seen)
            seen = withheld.version  # read before the update: a change meanwhile is waited for again
            if await self._update(self._discovered):
                self.log.info("devices held by DRA claims changed", withheld=sorted(self._withheld_now()))

    def _withheld_now(self) -> Mapping[str, str]:
        if self.withheld is None or self.config.serve == "dra":
            return {}
        try:
            return self.withheld.withheld(self.config.dra_driver)
        except ValueError:  # no DRA driver name can be derived from this resource's name
            return {}

    async def _update(self, devices: list[Device]) -> bool:
        self._discovered = devices
        held = self._withheld_now()
        if held:  # never offered through the device plugin while a DRA claim holds them
            devices = [
                d.with_health(Health.UNHEALTHY, reason=held.get(d.id) or held[str(d.uuid)])
                if d.id in held or (d.uuid is not None and d.uuid in held)
                else d
                for d in devices
            ]
        changed = await self.snapshot.update(devices)
        if changed:
            metrics.observe_devices(self.config.name, devices, self._reported)
            self._reported = dict(self.snapshot.devices)
        return changed

    async def _serve_and_register(self, servicer: DevicePluginServicer) -> None:
        server: grpc.aio.Server | None = None
        served: FileIdentity | None = None
        registered_with: FileIdentity | None = None
        backoff = Backoff(initial=0.1, maximum=10.0)
        serve_backoff = Backoff(initial=0.5, maximum=10.0)
        waiting_logged = False
        blocked: str | None = None  # the last ServeError logged, so that a retry loop logs it once
        blocked_relog = 0.0  # ... and again at this loop time if it still holds
        try:
            while True:
                self._poked.clear()
                if self._dropped and server is not None and registered_with is not None:
                    # Handover alongside on a kubelet before 1.37: when the plugin it replaced goes, it disconnects
                    # this one. Serve a new socket and register again.
                    delay = self._delay_after_drop()
                    await self._retire(server, served)
                    server, served, registered_with = None, None, None
                    metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
                    await asyncio.sleep(delay)
                self._dropped = False
                current = file_identity(self.socket_path)
                if server is None or current != served:
                    if (
                        self.handover == "standby"
                        and current is not None
                        and current != served
                        and live_socket(self.socket_path)
                    ):
                        # Another kxpu (a rolling update's new pod, a manual run) serves this resource:
                        # leave it be rather than fight over the socket; take over when it goes.
                        if self.phase is not Phase.STANDBY:
                            self.log.warning("another process serves this resource's socket; standing by")
                        self.phase = Phase.STANDBY
                        metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
                        if server is not None:
                            await stop_server(server, 0)
                            server, served = None, None
                        await self._poked.wait()
                        continue
                    if server is not None:
                        self.log.warning("our socket was removed (kubelet restart?); serving again")
                        await stop_server(server, 0)
                        server, served = None, None
                    if self.handover == "alongside":
                        self._next_instance()
                    registered_with = None
                    metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
                    try:
                        server, served = await self._serve(servicer)
                        self._last_served = self.socket_path
                    except ServeError as exc:
                        # An obstacle in the directory (a directory where our socket goes): the backend keeps
                        # running, and the directory watch pokes us the moment the obstacle is gone.
                        self.phase = Phase.FAILED
                        now = asyncio.get_running_loop().time()
                        if (
                            str(exc) != blocked or now >= blocked_relog
                        ):  # once, then every BLOCKED_RELOG_SECONDS
                            blocked, blocked_relog = str(exc), now + BLOCKED_RELOG_SECONDS
                            metrics.RESOURCE_FAILURES.labels(self.config.name).inc()
                            self.log.error("cannot serve; retrying when the directory changes", error=blocked)
                        else:
                            self.log.debug("still cannot serve", error=blocked)
                        await self._wait_poke(serve_backoff.next_delay())
                        continue
                    blocked = None
                    serve_backoff.reset()
                kubelet = file_identity(self.kubelet_socket)
                if kubelet is None:
                    self.phase = Phase.WAITING_FOR_KUBELET
                    if not waiting_logged:
                        self.log.info("waiting for the kubelet", socket=str(self.kubelet_socket))
                        waiting_logged = True
                    await self._poked.wait()
                    continue
                if kubelet != registered_with:
                    try:
                        await register(
                            self.kubelet_socket, self.socket_path.name, self.config.name, servicer.options
                        )
                    except grpc.RpcError as exc:
                        self.phase = Phase.WAITING_FOR_KUBELET
                        metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
                        if self.handover == "alongside":
                            # The call may have registered this socket before it failed (a lost answer), and a
                            # 1.37 kubelet asked twice for one socket refuses and forgets the first: a new one.
                            await self._retire(server, served)
                            server, served = None, None
                        delay = backoff.next_delay()
                        self.log.warning(
                            "registration failed; retrying",
                            reason=_rpc_reason(exc),
                            retry_in_s=round(delay, 2),
                        )
                        await self._wait_poke(delay)
                        continue
                    registered_with = kubelet
                    waiting_logged = False
                    backoff.reset()
                    self.registrations += 1
                    self.phase = Phase.REGISTERED
                    metrics.REGISTRATIONS.labels(self.config.name).inc()
                    metrics.RESOURCE_REGISTERED.labels(self.config.name).set(1)
                    self.log.info("registered with the kubelet", endpoint=self.socket_path.name)
                await self._poked.wait()
        finally:
            if server is not None:
                servicer.close_streams()  # first: the kubelet lets go of this plugin at once
            await self._retire(server, served, grace=0.5)

    async def _retire(
        self, server: grpc.aio.Server | None, served: FileIdentity | None, grace: float = 0
    ) -> None:
        """Stop serving, and remove our socket unless someone else's has replaced it since."""
        if server is not None:
            await stop_server(server, grace)
        if served is not None and file_identity(self.socket_path) == served:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    async def _serve(self, servicer: DevicePluginServicer) -> tuple[grpc.aio.Server, FileIdentity]:
        """Serve before registering: the kubelet dials back before it answers Register.

        The server binds a private name that is then renamed into place: gRPC unlinks the path it
        bound when it stops, and that must never be a socket someone else has put there since. The
        name is short (a long socket name would pass the unix limit) and never reused in this process.
        Raises ServeError, naming the obstacle and what to do, when the directory does not let us serve.
        """
        if not self.plugin_dir.is_dir():
            try:
                self.plugin_dir.mkdir(parents=True, exist_ok=True)  # it may have been removed under us
            except OSError as exc:
                raise ServeError(
                    f"cannot create the device-plugin directory {self.plugin_dir}: {exc.strerror or exc}"
                ) from None
        obstacle = _obstacle(self.socket_path)
        if obstacle is not None:
            raise ServeError(
                f"{self.socket_path} is {obstacle}, not a socket; kxpu does not delete it: remove it, and "
                "the resource is served at once"
            )
        bound = self.plugin_dir / f".kxpu-{os.getpid()}-{next(_bind_serial)}"
        with contextlib.suppress(FileNotFoundError):
            bound.unlink()
        _check_bindable(self.plugin_dir, bound)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
        try:
            server.add_insecure_port(f"unix://{bound}")
        except RuntimeError as exc:  # gRPC says only "Failed to bind"; the directory is what to look at
            raise ServeError(f"cannot bind a socket in {self.plugin_dir}: {exc}") from None
        await server.start()
        try:
            os.replace(bound, self.socket_path)  # also replaces a stale socket from a killed run
        except OSError as exc:
            await stop_server(server, 0)
            with contextlib.suppress(FileNotFoundError):
                bound.unlink()
            raise ServeError(f"cannot put the socket at {self.socket_path}: {exc.strerror or exc}") from None
        identity = file_identity(self.socket_path)
        if identity is None:
            await stop_server(server, 0)
            raise ServeError(f"gRPC server started but {self.socket_path} does not exist")
        self.log.info("serving", socket=str(self.socket_path))
        return server, identity

    async def _wait_poke(self, timeout: float) -> None:
        await wait_event(self._poked, timeout)


def _check_bindable(directory: Path, path: Path) -> None:
    """Bind a plain socket where gRPC is about to: gRPC's failure says only "Failed to bind" (and prints a line
    of its own at each try), while the operator needs the system's reason, e.g. Permission denied."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.bind(str(path))
    except OSError as exc:
        hint = (
            " (kxpu needs to create its sockets there: run it as root or as the directory's owner)"
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
            else ""
        )
        raise ServeError(
            f"cannot create a socket in the device-plugin directory {directory}: {exc.strerror or exc}{hint}"
        ) from None
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _close_built(building: asyncio.Future[Backend]) -> None:
    if building.cancelled() or building.exception() is not None:
        return
    backend = building.result()
    if isinstance(backend, Closable):
        try:
            backend.close()
        except Exception as exc:
            log.error("closing a backend built after its resource stopped failed", error=error_text(exc))


def _rpc_reason(exc: grpc.RpcError) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)

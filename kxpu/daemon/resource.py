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
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.config import ResourceConfig
from kxpu.daemon import metrics
from kxpu.daemon.backoff import Backoff
from kxpu.daemon.registration import FileIdentity, file_identity, register
from kxpu.daemon.servicer import DevicePluginServicer, DeviceSnapshot
from kxpu.daemon.wire import KUBELET_SOCKET
from kxpu.logs import get_logger
from kxpu.model import Backend, BackendError, Closable, Device, Watcher
from kxpu.timeouts import wait_event

log = get_logger("kxpu.daemon.resource")

BackendFactory = Callable[[ResourceConfig], Backend]


class DraServer(Protocol):
    """A resource's DRA half (``kxpu.dra.plugin.DraPlugin``), serving the snapshot this runner keeps."""

    @property
    def phase(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    async def run(self) -> None: ...

    def poke(self) -> None: ...

    async def withdraw(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """For the daemon's /status: the driver, its pool and the prepared claims."""
        ...


# (resource, backend, snapshot) → its DRA server; the CLI wires the Kubernetes client and directories in.
DraFactory = Callable[[ResourceConfig, Backend, DeviceSnapshot], DraServer]


class Phase(enum.StrEnum):
    STARTING = "starting"
    WAITING_FOR_KUBELET = "waiting-for-kubelet"
    REGISTERED = "registered"
    STANDBY = "standby"  # another live process serves this resource's socket
    FAILED = "failed"
    STOPPED = "stopped"


def socket_name(resource: str) -> str:
    """``example.com/npu`` → ``kxpu-example.com_npu.sock``: one socket per resource, and one resource
    per socket, since a domain cannot contain ``_`` (``a.com/b-c`` and ``a.com-b/c`` stay apart)."""
    return "kxpu-" + resource.replace("/", "_", 1) + ".sock"


def _live_socket(path: Path) -> bool:
    """Someone accepts connections there (a stale file from a killed process refuses them)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True  # backlog full: alive, just busy
        except OSError:
            return False
        return True


# sockaddr_un holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def check_socket_paths(plugin_dir: Path, resources: list[str]) -> None:
    """Refuse up front what bind() would refuse later with an obscure error."""
    for resource in resources:
        path = plugin_dir / socket_name(resource)
        if len(str(path).encode()) > MAX_SOCKET_PATH:
            raise ValueError(
                f"socket path {path} for {resource} is {len(str(path).encode())} bytes; unix sockets allow "
                f"{MAX_SOCKET_PATH}: use a shorter device-plugin directory or resource name"
            )


class ResourceRunner:
    def __init__(
        self, config: ResourceConfig, plugin_dir: Path, build: BackendFactory, dra: DraFactory | None = None
    ) -> None:
        self.config = config
        self.plugin_dir = plugin_dir
        self.build = build
        self.dra_factory = dra
        self.dra: DraServer | None = None  # while serving through DRA
        self._last_dra: DraServer | None = None  # for withdraw() after the runner stopped
        self.socket_path = plugin_dir / socket_name(config.name)
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self._phase = Phase.STARTING
        self.registrations = 0
        self.snapshot = DeviceSnapshot()
        self.backend: Backend | None = None  # while the resource runs (telemetry samples it)
        self._poked = asyncio.Event()
        self._reported: dict[str, Device] = {}  # what metrics last saw, across restarts of this runner
        self.log = log.bind(resource=config.name)

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

    def poke(self) -> None:
        """Something in the device-plugin directory changed: re-check socket and registration."""
        self._poked.set()
        if self.dra is not None:
            self.dra.poke()

    async def run(self) -> None:
        """Run until cancelled; a failure is logged and retried, never propagated to other resources."""
        backoff = Backoff(initial=0.5, maximum=30.0)
        try:
            while True:
                registered_before = self.registrations
                try:
                    await self._run_once()
                    return
                except Exception as exc:
                    self.phase = Phase.FAILED
                    metrics.RESOURCE_FAILURES.labels(self.config.name).inc()
                    if self.registrations > registered_before:
                        backoff.reset()  # it worked for a while: a new failure starts the backoff over
                    delay = backoff.next_delay()
                    self.log.error(
                        "resource failed; retrying",
                        error=f"{type(exc).__name__}: {exc}",
                        retry_in_s=delay,
                        exc_info=not isinstance(
                            exc, grpc.RpcError | OSError | BackendError
                        ),  # a message, not a bug
                    )
                    await asyncio.sleep(delay)
        finally:
            self.phase = Phase.STOPPED
            metrics.forget_resource(self.config.name, self.snapshot.devices)

    async def _run_once(self) -> None:
        backend = await self._build_backend()
        self.backend = backend
        try:
            self.snapshot = DeviceSnapshot()
            await self._update(await asyncio.to_thread(backend.discover))
            if self.config.serve == "dra":
                await self._run_dra(backend)
                return
            if any(d.consumes for d in self.snapshot.devices.values()):
                raise BackendError(
                    f"{self.config.name} offers overlapping partitions, which only DRA can serve (the device plugin's "
                    "kubelet would hand them out together): set serve: dra"
                )
            servicer = DevicePluginServicer(self.config.name, backend, self.snapshot)
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
        finally:
            self.backend = None
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
            self.dra = None

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

    async def _update(self, devices: list[Device]) -> bool:
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
        waiting_logged = False
        try:
            while True:
                self._poked.clear()
                current = file_identity(self.socket_path)
                if server is None or current != served:
                    if current is not None and current != served and _live_socket(self.socket_path):
                        # Another kxpu (a rolling update's new pod, a manual run) serves this resource:
                        # leave it be rather than fight over the socket; take over when it goes.
                        if self.phase is not Phase.STANDBY:
                            self.log.warning("another process serves this resource's socket; standing by")
                        self.phase = Phase.STANDBY
                        metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
                        if server is not None:
                            await server.stop(0)
                            server, served = None, None
                        await self._poked.wait()
                        continue
                    if server is not None:
                        self.log.warning("our socket was removed (kubelet restart?); serving again")
                        await server.stop(0)
                    server, served = await self._serve(servicer)
                    registered_with = None
                    metrics.RESOURCE_REGISTERED.labels(self.config.name).set(0)
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
                await server.stop(0.5)
            if served is not None and file_identity(self.socket_path) == served:
                with contextlib.suppress(FileNotFoundError):
                    self.socket_path.unlink()

    async def _serve(self, servicer: DevicePluginServicer) -> tuple[grpc.aio.Server, FileIdentity]:
        """Serve before registering: the kubelet dials back before it answers Register.

        The server binds a private name that is then renamed into place: gRPC unlinks the path it
        bound when it stops, and that must never be a socket someone else has put there since.
        """
        self.plugin_dir.mkdir(parents=True, exist_ok=True)  # it may have been removed under us
        bound = self.plugin_dir / f".{self.socket_path.name}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            bound.unlink()
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{bound}")
        await server.start()
        try:
            os.replace(bound, self.socket_path)  # also replaces a stale socket from a killed run
        except OSError:
            await server.stop(0)
            raise
        identity = file_identity(self.socket_path)
        if identity is None:
            await server.stop(0)
            raise OSError(f"gRPC server started but {self.socket_path} does not exist")
        self.log.info("serving", socket=str(self.socket_path))
        return server, identity

    async def _wait_poke(self, timeout: float) -> None:
        await wait_event(self._poked, timeout)


def _close_built(building: asyncio.Future[Backend]) -> None:
    if building.cancelled() or building.exception() is not None:
        return
    backend = building.result()
    if isinstance(backend, Closable):
        try:
            backend.close()
        except Exception:
            log.exception("closing a backend built after its resource stopped failed")


def _rpc_reason(exc: grpc.RpcError) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)

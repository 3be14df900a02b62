"""The node daemon: one runner per resource, the device-plugin directory watch, signals and reload."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kxpu.backoff import Backoff
from kxpu.config import Config, ConfigError, ResourceConfig
from kxpu.daemon import late_metrics, metrics
from kxpu.daemon.http_listen import Listener
from kxpu.daemon.kubelet_wait import warn_while_no_kubelet
from kxpu.daemon.registration import file_identity
from kxpu.daemon.resource import (
    BackendFactory,
    DraFactory,
    Phase,
    ResourceRunner,
    Withheld,
    check_socket_paths,
)
from kxpu.daemon.wire import KUBELET_SOCKET
from kxpu.fswatch import directory_changes
from kxpu.logs import error_text, get_logger, log_failure
from kxpu.model import ConfigWarner, find_capability
from kxpu.timeouts import wait_event

if TYPE_CHECKING:
    from kxpu.daemon.http import Authorizer, HealthServer
    from kxpu.daemon.telemetry import ExceededHandler, SourceView, TelemetrySampler

log = get_logger("kxpu.daemon")
_T = TypeVar("_T")

RESYNC_SECONDS = 30.0
# How long a stop waits, after every resource has stopped, for backend calls still running in worker
# threads (discovery, pre-start, close) before the process exits without them.
WORKER_GRACE_SECONDS = 2.0
# How long a stop (SIGTERM, a reload removing a resource) waits for a resource to finish. A resource
# stops in well under a second (its server's grace is 0.5 s); one that does not (a backend that ignores
# cancellation) is abandoned with an error rather than holding up a rolling update or every later reload.
STOP_SECONDS = 5.0
# Registration first: what registering with the kubelet does not need (prometheus-client and the metrics, the
# HTTP server, telemetry) loads once every resource has settled (``ResourceRunner.settled``), or after this long
# from the start if one has not (slow discovery, a kubelet that does not answer). The HTTP port is taken at the
# start all the same: a probe that connects meanwhile waits for its answer.
LATE_START_SECONDS = 1.0
SETTLE_POLL_SECONDS = 0.01


class _TrackingExecutor(ThreadPoolExecutor):
    """The loop's default executor (``asyncio.to_thread``), knowing when no call is in flight: a vendor call
    that never returns (NVML on a GPU that fell off the bus) must not hold the process at exit, where
    asyncio would join its thread forever."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(thread_name_prefix="kxpu-worker")
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._loop = loop
        self._count = threading.Lock()

    def _changed(self, delta: int) -> None:
        with self._count:
            self.in_flight += delta
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._update_idle)

    def _update_idle(self) -> None:
        if self.in_flight:
            self.idle.clear()
        else:
            self.idle.set()

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        def counted() -> _T:
            try:
                return fn(*args, **kwargs)
            finally:
                self._changed(-1)

        self._changed(+1)  # counted from submission: a queued call is in flight too
        try:
            return super().submit(counted)
        except BaseException:
            self._changed(-1)
            raise


class Leftovers(Withheld, Protocol):
    """DRA drivers the config no longer serves whose claims are still prepared (``kxpu.dra.leftover``)."""

    def __bool__(self) -> bool: ...

    async def run(self) -> None: ...

    async def hand_over(self, drivers: set[str]) -> None: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class _Running:
    runner: ResourceRunner
    task: asyncio.Task[None]


class Daemon:
    """Serves every configured resource; SIGHUP reloads, SIGTERM/SIGINT stop cleanly."""

    def __init__(
        self,
        config: Config,
        reload_config: Callable[[], Config],
        build: BackendFactory,
        http_address: str | None = None,
        dra: DraFactory | None = None,
        on_grant_exceeded: ExceededHandler | None = None,
        http_authorize: Authorizer | None = None,
        http_protect_metrics: bool = False,
        leftovers: Leftovers | None = None,
    ) -> None:
        self.config = config
        self._http_authorize = http_authorize
        self._http_protect_metrics = http_protect_metrics
        # DRA drivers the config no longer serves whose claims are still prepared (kxpu.dra.leftover).
        self._leftovers = leftovers
        self._dra = dra
        self.http_address = http_address
        self._on_grant_exceeded = on_grant_exceeded
        self._telemetry: TelemetrySampler | None = None
        self._reload_config = reload_config
        self._build = build
        self._running: dict[str, _Running] = {}
        self._stop = asyncio.Event()
        self._reload_lock = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self.abandoned: list[str] = []  # resources that did not stop within STOP_SECONDS
        self.stuck_calls = 0  # backend calls still running in worker threads when the daemon stopped

    @property
    def runners(self) -> list[ResourceRunner]:
        return [r.runner for r in self._running.values()]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_log_loop_error)
        workers = _TrackingExecutor(loop)
        loop.set_default_executor(workers)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        late_metrics.defer()
        listener = Listener(self.http_address) if self.http_address else None
        http: HealthServer | None = None
        try:
            if listener is not None:
                await listener.open()  # HttpAddressError (one line) when the port is taken
            _make_plugin_dir(self.config.device_plugin_dir)
            log.info(
                "starting",
                device_plugin_dir=str(self.config.device_plugin_dir),
                resources=[r.name for r in self.config.resources],
            )
            for resource in self.config.resources:
                self._start(resource)
            self._watcher = asyncio.create_task(self._watch_plugin_dir())
            resync = asyncio.create_task(self._resync())
            no_kubelet = asyncio.create_task(
                warn_while_no_kubelet(lambda: self.config.device_plugin_dir, self._waiting_for_kubelet)
            )
            background = [self._watcher, resync, no_kubelet]
            if self._leftovers is not None:
                background.append(asyncio.create_task(self._leftovers.run(), name="draining DRA drivers"))
            await self._settle(loop.time() + LATE_START_SECONDS)
            late_metrics.load()
            if not self._stop.is_set():
                if listener is not None:
                    http = await self._serve_http(listener)
                background += self._start_telemetry()
            await self._stop.wait()
            log.info("stopping")
            for task in background:
                task.cancel()
            await self._stop_all(list(self._running))
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            try:  # a failed start defers nothing any more (in-process tests run daemons again)
                late_metrics.load()
            except Exception as exc:  # never in the way of closing the listener and the signal handlers
                log.error("cannot load the metrics library", reason=error_text(exc))
            if http is not None:
                await http.stop()
            elif listener is not None:
                await listener.close()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        await wait_event(workers.idle, WORKER_GRACE_SECONDS)
        self.stuck_calls = workers.in_flight
        if self.stuck_calls:
            log.error(
                "a backend call did not return (discovery, pre-start or close); exiting without waiting for it",
                calls=self.stuck_calls,
                waited_s=WORKER_GRACE_SECONDS,
            )
        if self.abandoned:
            log.error("stopped, abandoning resources that did not stop in time", resources=self.abandoned)
        if self.abandoned or self.stuck_calls:
            return 1
        log.info("stopped")
        return 0

    def stop(self) -> None:
        self._stop.set()

    async def _settle(self, deadline: float) -> None:
        """Until every resource has settled (registered, standing by, failed, or waiting for a kubelet that is
        not there), a stop, or ``deadline``. Polled: a runner has no event for it, and this lasts at most
        LATE_START_SECONDS once per start."""
        loop = asyncio.get_running_loop()
        while not self._stop.is_set() and loop.time() < deadline:
            if all(r.runner.settled for r in self._running.values()):
                return
            await wait_event(self._stop, SETTLE_POLL_SECONDS)

    async def _serve_http(self, listener: Listener) -> HealthServer:
        """/metrics, the probes and /status on the port taken at the start (h11 and the exposition load here)."""
        from kxpu.daemon.http import HealthServer

        http = HealthServer(
            listener.address,
            self.readiness,
            self.status,
            self._http_authorize,
            self._http_protect_metrics,
        )
        await http.start(listener)
        return http

    def _start_telemetry(self) -> list[asyncio.Task[None]]:
        """The sampler (imported only when on: it registers its metrics). Turning telemetry on or off
        takes a restart; a reload changes its interval and paths."""
        if not self.config.telemetry.enabled:
            return []
        from kxpu.daemon.telemetry import TelemetrySampler

        self._telemetry = TelemetrySampler(
            lambda: self.config, self._telemetry_sources, self._on_grant_exceeded
        )
        return [asyncio.create_task(self._telemetry.run(), name="telemetry")]

    def _telemetry_sources(self) -> list[SourceView]:
        from kxpu.daemon.telemetry import SourceView

        return [
            SourceView(
                name,
                r.runner.backend,
                dict(r.runner.snapshot.devices),
                # DRA: the driver's prepared claims, read (copied) from its checkpoint
                r.runner.dra.driver if r.runner.dra is not None else None,
                dict(r.runner.dra.checkpoint.claims) if r.runner.dra is not None else {},
                r.runner.dra.claim_pods if r.runner.dra is not None else None,
            )
            for name, r in list(self._running.items())
            if r.runner.backend is not None and r.runner.phase not in (Phase.FAILED, Phase.STOPPED)
        ]

    def _start(self, resource: ResourceConfig) -> None:
        runner = ResourceRunner(
            resource,
            self.config.device_plugin_dir,
            self._build,
            self._dra,
            self._leftovers,
            handover=self.config.device_plugin_handover,
        )
        task = asyncio.create_task(runner.run(), name=f"resource {resource.name}")
        self._running[resource.name] = _Running(runner, task)

    async def _stop_all(self, names: list[str]) -> dict[str, ResourceRunner]:
        """Stop these resources, in parallel and within STOP_SECONDS: a stop never hangs. Returns the runners
        stopped, by resource name."""
        stopping = [self._running.pop(name) for name in names if name in self._running]
        if not stopping:
            return {}
        for running in stopping:
            running.runner.stop()
        deadline = asyncio.get_running_loop().time() + STOP_SECONDS
        pending = {running.task for running in stopping}
        while pending:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            _, pending = await asyncio.wait(pending, timeout=min(left, 0.5))
            for running in stopping:  # a swallowed cancellation is asked again
                if running.task in pending:
                    running.runner.stop()
        for running in stopping:
            if running.task in pending:
                name = running.runner.config.name
                self.abandoned.append(name)
                log.error(
                    "resource did not stop in time; abandoning it (its backend ignores cancellation)",
                    resource=name,
                    waited_s=STOP_SECONDS,
                )
                _remove_socket(running.runner.socket_path)
            elif not running.task.cancelled() and running.task.exception() is not None:
                exc = running.task.exception()
                assert exc is not None
                log_failure(log, "resource failed while stopping", exc, resource=running.runner.config.name)
        return {running.runner.config.name: running.runner for running in stopping}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = every resource discovered its devices and is registered with the kubelet, or stands by while
        another process serves it: a DaemonSet rolled with maxSurge removes the old pod only once the new one
        is Ready, and the one standing by takes over the moment the old one's socket goes."""
        phases = {name: r.runner.state.value for name, r in self._running.items()}
        ready = bool(phases) and all(p in (Phase.REGISTERED, Phase.STANDBY) for p in phases.values())
        return ready, {"ready": ready, "resources": phases}

    def _waiting_for_kubelet(self) -> list[str]:
        return [
            name
            for name, r in self._running.items()
            if r.runner.dra is None and r.runner.phase is Phase.WAITING_FOR_KUBELET
        ]

    def status(self) -> dict[str, Any]:
        """What this daemon serves, for `kxpu status` (answered on the event loop)."""
        resources: dict[str, Any] = {}
        for name, running in list(self._running.items()):
            runner = running.runner
            resources[name] = {
                "backend": runner.config.backend,
                "phase": runner.state.value,
                "registrations": runner.registrations,
                "socket": str(runner.socket_path),
                "devices": [
                    {
                        "id": d.id,
                        "health": d.health.value,
                        **({"reason": d.health_reason} if d.health_reason else {}),
                        **({"numa_nodes": list(d.numa_nodes)} if d.numa_nodes else {}),
                        **({"uuid": d.uuid} if d.uuid else {}),
                        **({"memory_mib": d.memory_mib} if d.memory_mib is not None else {}),
                    }
                    for d in list(runner.snapshot.devices.values())
                ],
            }
            if runner.dra is not None:
                resources[name]["dra"] = runner.dra.describe()
            backend = runner.backend
            warner = (
                find_capability(backend, ConfigWarner)  # type: ignore[type-abstract]  # mypy#4717
                if backend is not None
                else None
            )
            if warner is not None and (warnings := warner.config_warnings()):
                resources[name]["warnings"] = warnings
        doc: dict[str, Any] = {"devicePluginDir": str(self.config.device_plugin_dir), "resources": resources}
        if self._telemetry is not None:
            doc["telemetry"] = self._telemetry.status()
        if self._leftovers is not None and self._leftovers:
            doc["drainingDrivers"] = self._leftovers.describe()
        return doc

    def _poke_all(self) -> None:
        for running in self._running.values():
            running.runner.poke()

    async def _resync(self) -> None:
        """A safety net under inotify (a lost watch, an exhausted inotify limit): every resource
        re-checks its socket and registration now and then; each check is two stat calls."""
        while True:
            await asyncio.sleep(RESYNC_SECONDS)
            self._poke_all()

    async def _watch_plugin_dir(self) -> None:
        """Poke every resource on any change in the device-plugin directory; survive watch failures."""
        backoff = Backoff(initial=1.0, maximum=30.0)
        while True:
            try:
                await self._follow_plugin_dir()
            except Exception as exc:  # e.g. EMFILE: the node's inotify instances are exhausted
                delay = backoff.next_delay()
                log.error(
                    "cannot watch the device-plugin directory; retrying (resync continues meanwhile)",
                    error=error_text(exc),
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)

    async def _follow_plugin_dir(self) -> None:
        directory = self.config.device_plugin_dir
        last_kubelet = file_identity(directory / KUBELET_SOCKET)
        async for _ in directory_changes(lambda: [directory], lambda path: path.parent == directory):
            now = file_identity(directory / KUBELET_SOCKET)
            if now is not None and now != last_kubelet:
                if last_kubelet is not None:
                    metrics.KUBELET_RESTARTS.inc()
                log.info("kubelet socket created", restart=last_kubelet is not None)
                last_kubelet = now
            self._poke_all()

    async def reload(self) -> None:
        """Apply a changed config; resources whose config did not change keep serving without a gap.

        Always finishes: a file that cannot be used leaves the running config as it is, and stopping a
        resource is bounded (STOP_SECONDS)."""
        async with self._reload_lock:
            try:
                await self._reload()
            except Exception as exc:  # a bug, not a bad file; the running config stays
                log_failure(log, "reload failed; keeping the running config", exc)

    async def _reload(self) -> None:
        try:
            new = await asyncio.to_thread(self._reload_config)
            check_socket_paths(
                new.device_plugin_dir, [r.name for r in new.resources], new.device_plugin_handover
            )
        except (ConfigError, ValueError) as exc:
            log.error("reload failed; keeping the running config", error=str(exc))
            return
        old = self.config
        draining = self._dra_claims_left({r.name: r for r in new.resources})
        if draining:
            # Its prepared claims could no longer be unprepared (their pods would stay Terminating) and the
            # device plugin would hand out devices DRA containers still hold: the operator drains first.
            log.error(
                "reload refused; keeping the running config: resources would stop being served through DRA "
                "while claims are still prepared on their devices (delete those pods first)",
                claims=draining,
            )
            return
        if new.device_plugin_dir != old.device_plugin_dir:
            log.info("device-plugin directory changed; restarting every resource")
            await self._stop_all(list(self._running))
            self.config = new
            _make_plugin_dir(new.device_plugin_dir)
            if self._watcher is not None:  # watch the new directory, not the old one
                self._watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._watcher
                self._watcher = asyncio.create_task(self._watch_plugin_dir())
            for resource in new.resources:
                self._start(resource)
            log.info("config reloaded", device_plugin_dir=str(new.device_plugin_dir))
            return
        wanted = {r.name: r for r in new.resources}
        current = {name: r.runner.config for name, r in self._running.items()}
        self.config = new
        if new.device_plugin_handover != old.device_plugin_handover:
            # It decides how a daemon starting later takes over; restarting what serves now would only open a gap.
            log.info(
                "devicePluginHandover changed; resources keep their sockets, and resources started from now "
                "on (and the next daemon) use it",
                handover=new.device_plugin_handover,
            )
        removed = [name for name in current if name not in wanted]
        changed = [name for name in current if name in wanted and wanted[name] != current[name]]
        added = [name for name in wanted if name not in current]
        stopped = await self._stop_all(removed + changed)
        for name, runner in stopped.items():
            # No longer served through DRA here: take its ResourceSlices away so the scheduler stops allocating
            # its devices (a restart or a config change that keeps DRA keeps them).
            if runner.config.serve == "dra" and (name not in wanted or wanted[name].serve != "dra"):
                await runner.withdraw()
        if self._leftovers is not None:  # a draining driver served through DRA again takes its claims back
            await self._leftovers.hand_over(
                {wanted[n].dra_driver for n in changed + added if wanted[n].serve == "dra"}
            )
        for name in changed + added:
            self._start(wanted[name])
        kept = len(current) - len(removed) - len(changed)
        log.info("config reloaded", added=added, changed=changed, removed=removed, unchanged=kept)

    def _dra_claims_left(self, wanted: dict[str, ResourceConfig]) -> dict[str, list[str]]:
        """Per resource that the new config stops serving through DRA: the claims still prepared for it."""
        left: dict[str, list[str]] = {}
        for name, running in self._running.items():
            dra = running.runner.last_dra  # a DRA half failing and retrying still has its claims
            if dra is None or (name in wanted and wanted[name].serve == "dra"):
                continue
            claims = sorted(c["claim"] for c in dra.describe().get("claims", {}).values())
            if claims:
                left[name] = claims
        return left


def _make_plugin_dir(directory: Path) -> None:
    """The kubelet makes it; we make it if it is missing. If we cannot, say so once: each resource keeps
    retrying (naming the obstacle) and the directory watch follows the nearest existing parent."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error(
            "cannot create the device-plugin directory", path=str(directory), error=exc.strerror or str(exc)
        )


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """asyncio's last-resort reports ("Task exception was never retrieved") as one line, not a traceback."""
    exc = context.get("exception")
    message = context.get("message", "unexpected error")
    if isinstance(exc, BaseException):
        log_failure(log, "unexpected error in the event loop", exc, detail=message)
    else:
        log.error("unexpected error in the event loop", detail=message)

"""The node daemon: one runner per resource, the device-plugin directory watch, signals and reload."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kxpu.config import Config, ConfigError, ResourceConfig
from kxpu.daemon import metrics
from kxpu.daemon.backoff import Backoff
from kxpu.daemon.http import HealthServer
from kxpu.daemon.registration import file_identity
from kxpu.daemon.resource import BackendFactory, DraFactory, Phase, ResourceRunner, check_socket_paths
from kxpu.daemon.wire import KUBELET_SOCKET
from kxpu.fswatch import directory_changes
from kxpu.logs import get_logger

if TYPE_CHECKING:
    from kxpu.daemon.telemetry import ExceededHandler, SourceView, TelemetrySampler

log = get_logger("kxpu.daemon")

RESYNC_SECONDS = 30.0


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
    ) -> None:
        self.config = config
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

    @property
    def runners(self) -> list[ResourceRunner]:
        return [r.runner for r in self._running.values()]

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        http = (
            HealthServer(self.http_address, loop, self.readiness, self.status) if self.http_address else None
        )
        try:
            if http is not None:
                http.start()
            self.config.device_plugin_dir.mkdir(parents=True, exist_ok=True)
            log.info(
                "starting",
                device_plugin_dir=str(self.config.device_plugin_dir),
                resources=[r.name for r in self.config.resources],
            )
            for resource in self.config.resources:
                self._start(resource)
            self._watcher = asyncio.create_task(self._watch_plugin_dir())
            resync = asyncio.create_task(self._resync())
            background = [self._watcher, resync, *self._start_telemetry()]
            await self._stop.wait()
            log.info("stopping")
            for task in background:
                task.cancel()
            await self._stop_all(list(self._running))
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            if http is not None:
                http.stop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
        log.info("stopped")
        return 0

    def stop(self) -> None:
        self._stop.set()

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
            SourceView(name, r.runner.backend, dict(r.runner.snapshot.devices))
            for name, r in list(self._running.items())
            if r.runner.backend is not None and r.runner.phase not in (Phase.FAILED, Phase.STOPPED)
        ]

    def _start(self, resource: ResourceConfig) -> None:
        runner = ResourceRunner(resource, self.config.device_plugin_dir, self._build, self._dra)
        task = asyncio.create_task(runner.run(), name=f"resource {resource.name}")
        self._running[resource.name] = _Running(runner, task)

    async def _stop_all(self, names: list[str]) -> dict[str, ResourceRunner]:
        stopping = [self._running.pop(name) for name in names if name in self._running]
        for running in stopping:
            running.task.cancel()
        for running in stopping:
            with contextlib.suppress(asyncio.CancelledError):
                await running.task
        return {running.runner.config.name: running.runner for running in stopping}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready = every resource discovered its devices and is registered with the kubelet."""
        phases = {name: r.runner.phase.value for name, r in self._running.items()}
        ready = bool(phases) and all(p == Phase.REGISTERED for p in phases.values())
        return ready, {"ready": ready, "resources": phases}

    def status(self) -> dict[str, Any]:
        """What this daemon serves, for `kxpu status` (read from the HTTP thread: plain reads only)."""
        resources: dict[str, Any] = {}
        for name, running in list(self._running.items()):
            runner = running.runner
            resources[name] = {
                "backend": runner.config.backend,
                "phase": runner.phase.value,
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
        doc: dict[str, Any] = {"devicePluginDir": str(self.config.device_plugin_dir), "resources": resources}
        if self._telemetry is not None:
            doc["telemetry"] = self._telemetry.status()
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
                    error=f"{type(exc).__name__}: {exc}",
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
        """Apply a changed config; resources whose config did not change keep serving without a gap."""
        async with self._reload_lock:
            try:
                new = await asyncio.to_thread(self._reload_config)
            except ConfigError as exc:
                log.error("reload failed; keeping the running config", error=str(exc))
                return
            try:
                check_socket_paths(new.device_plugin_dir, [r.name for r in new.resources])
            except ValueError as exc:
                log.error("reload failed; keeping the running config", error=str(exc))
                return
            old = self.config
            if new.device_plugin_dir != old.device_plugin_dir:
                log.info("device-plugin directory changed; restarting every resource")
                await self._stop_all(list(self._running))
                self.config = new
                new.device_plugin_dir.mkdir(parents=True, exist_ok=True)
                if self._watcher is not None:  # watch the new directory, not the old one
                    self._watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._watcher
                    self._watcher = asyncio.create_task(self._watch_plugin_dir())
                for resource in new.resources:
                    self._start(resource)
                return
            self.config = new
            wanted = {r.name: r for r in new.resources}
            current = {name: r.runner.config for name, r in self._running.items()}
            removed = [name for name in current if name not in wanted]
            changed = [name for name in current if name in wanted and wanted[name] != current[name]]
            added = [name for name in wanted if name not in current]
            stopped = await self._stop_all(removed + changed)
            for name, runner in stopped.items():
                # No longer served through DRA here: take its ResourceSlices away so the scheduler stops
                # allocating its devices (a restart or a config change that keeps DRA keeps them).
                if runner.config.serve == "dra" and (name not in wanted or wanted[name].serve != "dra"):
                    await runner.withdraw()
            for name in changed + added:
                self._start(wanted[name])
            kept = len(current) - len(removed) - len(changed)
            log.info("config reloaded", added=added, changed=changed, removed=removed, unchanged=kept)

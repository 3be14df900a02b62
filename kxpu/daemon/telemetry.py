"""Device telemetry: sample every backend that can measure its devices, tie processes to pods, compare with grants.

Runs as one task on the daemon's loop when ``telemetry.enabled``. Each tick (every
``intervalSeconds``) it calls ``sample()`` of each running resource's ``TelemetrySource`` (found
through wrappers, ``find_capability``) in a worker thread, joins the processes with the pods that
hold the devices (``holders.py``: cgroups, the kubelet's checkpoint, PodResources), and publishes one
immutable snapshot that ``/metrics`` (``telemetry_metrics.py``) and ``/status`` read. Between ticks
nothing runs; the checkpoint is parsed and PodResources asked only when the checkpoint changed (or
once a minute), so a tick costs the backends' queries and a small file read per process.

A container that uses more than its grant (memory, or compute beyond ``COMPUTE_MARGIN``) is counted
once per excursion (``kxpu_container_grant_exceeded_total``), logged, and reported to ``on_exceeded``
(the CLI posts a Warning event on the pod when ``telemetry.events`` is on). The daemon names no vendor:
what a device is, and what its processes are, the backend says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kxpu.config import Config
from kxpu.daemon import telemetry_metrics as metrics
from kxpu.daemon.holders import (
    CheckpointReader,
    DraClaims,
    DraStateReader,
    Holder,
    HolderError,
    PodResourcesView,
    ProcessOwner,
    attribute,
    build_dra_holders,
    build_holders,
    owner_of,
    read_pod_resources,
)
from kxpu.daemon.telemetry_snapshot import ContainerKey, ContainerUsage, GrantExceeded, ProcessView, Snapshot
from kxpu.logs import error_text, get_logger, log_failure
from kxpu.model import Backend, Device, DeviceUsage, Grant, ProcessUsage, TelemetrySource, find_capability

log = get_logger("kxpu.daemon.telemetry")

PLACEMENT_REFRESH_S = 60.0
# The kubelet records an allocation (its checkpoints, the driver's prepared claims) before the container starts,
# and PodResources lists the container only once it runs: for a while after a change, ask again every few seconds.
PLACEMENT_SETTLE_S = 60.0
PLACEMENT_SETTLE_EVERY_S = 2.0


@dataclass(frozen=True, slots=True)
class SourceView:
    """What the sampler needs of one running resource."""

    resource: str
    backend: Backend
    devices: Mapping[str, Device]  # the resource's snapshot: kubelet device ID → device
    driver: str | None = None  # served through DRA: the driver's name
    claims: Mapping[str, Any] = field(default_factory=dict)  # DRA: claim UID → PreparedClaim (its checkpoint)


ExceededHandler = Callable[[GrantExceeded], Awaitable[None]]


class TelemetrySampler:
    def __init__(
        self,
        config: Callable[[], Config],
        sources: Callable[[], Sequence[SourceView]],
        on_exceeded: ExceededHandler | None = None,
    ) -> None:
        self._config = config
        self._sources = sources
        self._on_exceeded = on_exceeded
        self.latest = Snapshot()
        self._checkpoint: CheckpointReader | None = None
        self._dra_state: DraStateReader | None = None
        self._placed = PodResourcesView()
        self._placed_at = 0.0
        self._placed_generation: tuple[int, int, frozenset[str]] | None = None
        self._changed_at = 0.0  # when the kubelet's or a driver's records last changed
        self._logged_errors: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        metrics.COLLECTOR.source = lambda: self.latest
        log.info("telemetry on", interval_s=self._config().telemetry.interval_seconds)
        try:
            while True:
                started = time.monotonic()
                try:
                    await self.tick()
                except Exception as exc:  # a bug here must not stop telemetry for good
                    log_failure(log, "telemetry tick failed", exc)
                interval = self._config().telemetry.interval_seconds
                await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))
        finally:
            metrics.COLLECTOR.source = None

    # ------------------------------------------------------------------ one tick
    async def tick(self) -> Snapshot:
        started = time.monotonic()
        config = self._config()
        errors: list[str] = []
        samples: list[tuple[SourceView, list[DeviceUsage], list[ProcessUsage]]] = []
        for view in self._sources():
            source = find_capability(view.backend, TelemetrySource)  # type: ignore[type-abstract]  # mypy#4717
            if source is None:
                continue
            try:
                sample = await asyncio.to_thread(source.sample)
            except Exception as exc:
                self._error(errors, "backend", f"{view.resource}: sampling failed: {exc}")
                continue
            samples.append((view, list(sample.devices), list(sample.processes)))
        holders: dict[str, list[Holder]] = {}
        if samples:
            holders = await self._holders(config, [v for v, _, _ in samples], errors)
        host_root = config.telemetry.host_root
        pids = {proc.pid for _, _, procs in samples for proc in procs}
        owners: dict[int, ProcessOwner | None] = (
            await asyncio.to_thread(lambda: {pid: owner_of(host_root, pid) for pid in pids}) if pids else {}
        )
        processes: list[ProcessView] = []
        grouped: dict[ContainerKey, list[tuple[ProcessUsage, str, Grant | None]]] = {}
        for view, _, procs in samples:
            for proc in procs:
                who = attribute(owners.get(proc.pid), proc.uuid, holders)
                processes.append(
                    ProcessView(view.resource, proc, who.namespace, who.pod, who.container, who.claim)
                )
                key = (view.resource, proc.uuid, who.namespace, who.pod, who.container, who.claim)
                grouped.setdefault(key, []).append((proc, who.pod_uid, who.grant))
        containers = tuple(_container(key, members) for key, members in sorted(grouped.items()))
        over = frozenset(
            (c.key, kind)
            for c in containers
            if c.pod
            for kind, flag in (("memory", c.memory_exceeded), ("compute", c.compute_exceeded))
            if flag
        )
        snapshot = Snapshot(
            taken_at=time.time(),
            duration_s=time.monotonic() - started,
            devices=tuple((v.resource, d) for v, devices, _ in samples for d in devices),
            processes=tuple(processes),
            containers=containers,
            holders=tuple(h for hs in holders.values() for h in hs),
            errors=tuple(errors),
            over=over,
        )
        self._report_excursions(self.latest, snapshot)
        self.latest = snapshot
        metrics.SAMPLE_SECONDS.observe(snapshot.duration_s)
        return snapshot

    async def _holders(
        self, config: Config, views: Sequence[SourceView], errors: list[str]
    ) -> dict[str, list[Holder]]:
        """Pod UID → the containers holding the sampled resources' devices ("" for DRA holders whose pod UID
        the kubelet's DRA checkpoint does not tell)."""
        path = config.kubelet_checkpoint
        if self._checkpoint is None or self._checkpoint.path != path:
            self._checkpoint = CheckpointReader(path)
        reader = self._checkpoint
        try:
            await asyncio.to_thread(reader.refresh)
        except HolderError as exc:
            self._error(errors, "checkpoint", str(exc))
        dra_views = [v for v in views if v.driver is not None]
        dra_state: DraStateReader | None = None
        if dra_views:
            dra_path = config.kubelet_dra_checkpoint
            if self._dra_state is None or self._dra_state.path != dra_path:
                self._dra_state = DraStateReader(dra_path)
            dra_state = self._dra_state
            try:
                await asyncio.to_thread(dra_state.refresh)
            except HolderError as exc:
                self._error(errors, "checkpoint", str(exc))
        # PodResources is asked again when what the kubelet or a DRA driver recorded changed, every few seconds for
        # a minute after that (containers start after their allocation is recorded), and every minute.
        generation = (
            reader.generation,
            dra_state.generation if dra_state is not None else 0,
            frozenset(uid for v in dra_views for uid in v.claims),
        )
        now = time.monotonic()
        if generation != self._placed_generation:
            self._changed_at = now
        since_asked = now - self._placed_at
        settling = now - self._changed_at < PLACEMENT_SETTLE_S and since_asked >= PLACEMENT_SETTLE_EVERY_S
        if generation != self._placed_generation or since_asked > PLACEMENT_REFRESH_S or settling:
            try:
                self._placed = await read_pod_resources(config.pod_resources_socket)
                self._placed_generation = generation
                self._placed_at = time.monotonic()
            except HolderError as exc:
                self._error(errors, "pod-resources", str(exc))
        uuid_of = {v.resource: {i: d.uuid or d.id for i, d in v.devices.items()} for v in views}
        by_pod = build_holders(reader.entries, self._placed.devices, uuid_of)
        if dra_views:
            known = {(h.namespace, h.pod): uid for uid, hs in by_pod.items() for h in hs}
            for holder in build_dra_holders(
                [DraClaims(v.resource, v.driver or "", v.claims, uuid_of[v.resource]) for v in dra_views],
                self._placed.claims,
                dra_state.value if dra_state is not None else {},
                known,
            ):
                by_pod.setdefault(holder.pod_uid, []).append(holder)
        return by_pod

    def _error(self, errors: list[str], source: str, message: str) -> None:
        errors.append(message)
        metrics.ERRORS.labels(source).inc()
        if message not in self._logged_errors:  # once per distinct problem, not every tick
            self._logged_errors.add(message)
            log.warning("telemetry incomplete", source=source, error=message)

    def _report_excursions(self, before: Snapshot, now: Snapshot) -> None:
        by_key = {c.key: c for c in now.containers}
        for key, kind in sorted(now.over - before.over):
            usage = by_key[key]
            event = GrantExceeded(usage, kind)
            metrics.count_exceeded(key, kind)
            log.warning("container exceeds its grant", detail=event.message, kind=kind)
            if self._on_exceeded is not None:
                task = asyncio.get_running_loop().create_task(self._notify(event))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        gone = {c.key for c in before.containers} - by_key.keys()
        for key in gone:  # counters of containers that are gone would only pile up series
            for kind in ("memory", "compute"):
                metrics.forget_exceeded(key, kind)

    async def _notify(self, event: GrantExceeded) -> None:
        assert self._on_exceeded is not None
        try:
            await self._on_exceeded(event)
        except Exception as exc:
            log.warning("could not report a grant excursion", error=error_text(exc))

    # ------------------------------------------------------------------ /status
    def status(self) -> dict[str, Any]:
        snap = self.latest
        return {
            "sampledAt": snap.taken_at or None,
            "devices": [_device_json(resource, d) for resource, d in snap.devices],
            "containers": [_container_json(c, (c.key, "memory") in snap.over) for c in snap.containers],
            "holders": [_holder_json(h) for h in snap.holders],
            "errors": list(snap.errors),
        }


def _container(key: ContainerKey, members: list[tuple[ProcessUsage, str, Grant | None]]) -> ContainerUsage:
    resource, uuid, namespace, pod, container, claim = key
    memory = [p.memory_used_bytes for p, _, _ in members if p.memory_used_bytes is not None]
    compute = [p.compute_utilization for p, _, _ in members if p.compute_utilization is not None]
    return ContainerUsage(
        resource=resource,
        uuid=uuid,
        namespace=namespace,
        pod=pod,
        container=container,
        claim=claim,
        pod_uid=next((uid for _, uid, _ in members if uid), ""),
        pids=tuple(sorted(p.pid for p, _, _ in members)),
        memory_used_bytes=sum(memory) if memory else None,
        compute_utilization=min(1.0, sum(compute)) if compute else None,
        grant=next((g for _, _, g in members if g is not None), None),
    )


def _device_json(resource: str, d: DeviceUsage) -> dict[str, Any]:
    return {
        "resource": resource,
        "uuid": d.uuid,
        "index": d.index,
        "model": d.model,
        "vendor": d.vendor,
        "computeUtilization": d.compute_utilization,
        "memoryBandwidthUtilization": d.memory_bandwidth_utilization,
        "memoryUsedBytes": d.memory_used_bytes,
        "memoryTotalBytes": d.memory_total_bytes,
        "powerWatts": d.power_watts,
        "temperatureCelsius": d.temperature_celsius,
    }


def _container_json(c: ContainerUsage, over_memory: bool) -> dict[str, Any]:
    g = c.grant
    return {
        "resource": c.resource,
        "uuid": c.uuid,
        "namespace": c.namespace,
        "pod": c.pod,
        "container": c.container,
        "claim": c.claim,
        "pids": list(c.pids),
        "memoryUsedBytes": c.memory_used_bytes,
        "computeUtilization": c.compute_utilization,
        "memoryGrantedBytes": None if g is None else g.memory_bytes,
        "computeGranted": None if g is None else g.compute_ratio,
        "overGrant": over_memory or c.compute_exceeded,
    }


def _holder_json(h: Holder) -> dict[str, Any]:
    return {
        "resource": h.resource,
        "uuids": sorted(h.uuids),
        "namespace": h.namespace,
        "pod": h.pod,
        "container": h.container,
        "claim": h.claim,
        "grants": {
            u: {"memoryBytes": g.memory_bytes, "computeRatio": g.compute_ratio}
            for u, g in sorted(h.grants.items())
        },
    }

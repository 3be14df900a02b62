"""GPU health from NVML events, in one daemon thread per backend, with optional recovery.

The thread blocks in ``nvmlEventSetWait`` (no polling: NVML wakes it on an event, or at
the timeout). Xid critical errors and double-bit ECC errors mark a GPU, or the one MIG
device whose GPU/compute instance the event names, unhealthy; NVIDIA's application Xids
are ignored by default, and the ``DP_DISABLE_HEALTHCHECKS`` / ``DP_ENABLE_HEALTHCHECKS``
variables of NVIDIA's plugin are honoured so kxpu can replace it without relearning.

Each wake-up at the timeout also probes the watched GPUs with a cheap NVML query: that is
how a GPU that fell off the bus without an event is noticed, and what recovery rests on.
Unlike NVIDIA's plugin (where an unhealthy GPU stays so until a restart), a fault can be
cleared once the GPU has been quiet — no new fault, every probe answered — for the
configured quiet period.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kxpu.backends.nvidia.discovery import GpuInfo
from kxpu.backends.nvidia.nvml import Nvml, describe, is_code, text
from kxpu.backends.recovery import HealthRecovery
from kxpu.logs import get_logger, log_failure

log = get_logger("kxpu.backends.nvidia.health")

ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"
NO_INSTANCE = 0xFFFFFFFF
DEFAULT_WAIT_MS = 5000
MAX_FAILURE_BACKOFF_S = 30.0

# (GPU UUID, GPU instance, compute instance); (uuid, None, None) is the whole GPU.
HealthKey = tuple[str, int | None, int | None]


def _parse_xids(raw: str, var: str) -> tuple[bool, frozenset[int]]:
    everything = False
    xids: set[int] = set()
    for token in raw.lower().split(","):
        token = token.strip()
        if not token:
            continue
        if token in ("all", "xids"):
            everything = True
        elif token.isdigit():
            xids.add(int(token))
        else:
            log.warning("ignoring a malformed Xid", variable=var, value=token)
    return everything, frozenset(xids)


@dataclass(frozen=True, slots=True)
class XidPolicy:
    """Which Xids are acted on. An explicitly enabled Xid wins over every way of disabling it."""

    ignored: frozenset[int]
    disabled_all: bool = False
    enabled_all: bool = False
    enabled: frozenset[int] = frozenset()

    @classmethod
    def from_env(cls, ignored: Iterable[int], environ: Mapping[str, str]) -> XidPolicy:
        disabled_all, disabled = _parse_xids(environ.get(ENV_DISABLE, ""), ENV_DISABLE)
        enabled_all, enabled = _parse_xids(environ.get(ENV_ENABLE, ""), ENV_ENABLE)
        return cls(frozenset(ignored) | disabled, disabled_all, enabled_all, enabled)

    def ignores(self, xid: int) -> bool:
        if self.enabled_all or xid in self.enabled:
            return False
        return self.disabled_all or xid in self.ignored

    @property
    def checks_off(self) -> bool:
        """``DP_DISABLE_HEALTHCHECKS=all`` with nothing re-enabled: no event set at all, as NVIDIA does."""
        return self.disabled_all and not self.enabled_all and not self.enabled


@dataclass(slots=True)
class Fault:
    reason: str
    since: float
    last_bad: float  # the quiet period counts from here


def _handle_key(handle: Any) -> object:
    """Compare NVML handles by the address they point at (pynvml returns a new ctypes object each time)."""
    try:
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    except (TypeError, ctypes.ArgumentError):
        try:
            hash(handle)
        except TypeError:
            return None
        return ("obj", handle)


class HealthMonitor:
    def __init__(
        self,
        nvml: Nvml,
        gpus: Sequence[GpuInfo],
        policy: XidPolicy,
        recovery: HealthRecovery,
        on_change: Callable[[], None],
        wait_ms: int = DEFAULT_WAIT_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nvml = nvml
        self.gpus = {g.uuid: g for g in gpus if g.handle is not None}
        self.policy = policy
        self.recovery = recovery
        self.on_change = on_change
        self.wait_ms = wait_ms
        self.clock = clock
        self.faults: dict[HealthKey, Fault] = {}
        self.xids: dict[str, dict[int, int]] = {}  # GPU → Xid → times seen (ignored ones too), for telemetry
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_exit: Callable[[], None] | None = None
        self._handles: dict[object, str] = {}
        for gpu in self.gpus.values():
            key = _handle_key(gpu.handle)
            if key is not None:
                self._handles[key] = gpu.uuid

    # ------------------------------------------------------------------ state, read from any thread
    def snapshot(self) -> dict[HealthKey, str]:
        with self._lock:
            return {key: fault.reason for key, fault in self.faults.items()}

    def xid_counts(self) -> dict[str, dict[int, int]]:
        with self._lock:
            return {uuid: dict(counts) for uuid, counts in self.xids.items()}

    def _count_xid(self, uuid: str | None, xid: int) -> None:
        if uuid is None:
            return
        with self._lock:
            counts = self.xids.setdefault(uuid, {})
            counts[xid] = counts.get(xid, 0) + 1

    def _set_fault(self, key: HealthKey, reason: str, now: float) -> bool:
        with self._lock:
            fault = self.faults.get(key)
            if fault is None:
                self.faults[key] = Fault(reason, now, now)
                return True
            fault.last_bad = now
            return False

    def _fault(self, keys: Iterable[HealthKey], reason: str, detail: str = "") -> None:
        """Mark ``keys`` unhealthy; ``reason`` is a short code (``xid-79``) fit for metrics labels."""
        now = self.clock()
        changed = False
        for key in keys:
            if self._set_fault(key, reason, now):
                changed = True
                log.warning(
                    "device marked unhealthy", gpu=key[0], gi=key[1], ci=key[2], reason=reason, detail=detail
                )
        if changed:
            self.on_change()

    def _all_gpus(self) -> list[HealthKey]:
        return [(uuid, None, None) for uuid in self.gpus]

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and return once its event registrations are in place."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kxpu-nvidia-health", daemon=True)
        self._thread.start()
        self.ready.wait(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, on_exit: Callable[[], None] | None = None, join_timeout: float = 0.2) -> None:
        """Ask the thread to end; it frees the event set (and runs ``on_exit``) when its wait returns.

        NVML cannot interrupt a wait from another thread, so this does not block for it.
        """
        self._on_exit = on_exit
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_timeout)
        elif on_exit is not None:
            on_exit()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        nvml = self.nvml
        event_set: Any = None
        try:
            try:
                event_set = nvml.nvmlEventSetCreate()
            except nvml.NVMLError as exc:
                self._fault(self._all_gpus(), "nvml-events-unavailable", describe(exc))
                return
            self._register(event_set)
            self.ready.set()
            self._loop(event_set)
        except Exception as exc:
            log_failure(log, "health thread crashed; marking every GPU unhealthy", exc)
            self._fault(self._all_gpus(), "health-thread-crashed")
        finally:
            self.ready.set()
            if event_set is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlEventSetFree(event_set)
            if self._on_exit is not None:
                with contextlib.suppress(Exception):
                    self._on_exit()

    def _register(self, event_set: Any) -> None:
        nvml = self.nvml
        wanted = int(nvml.nvmlEventTypeXidCriticalError) | int(nvml.nvmlEventTypeDoubleBitEccError)
        for gpu in self.gpus.values():
            try:
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle))
                nvml.nvmlDeviceRegisterEvents(gpu.handle, wanted & supported, event_set)
            except nvml.NVMLError as exc:
                if is_code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED"):
                    log.warning("GPU too old for event health checks; probing only", gpu=gpu.uuid)
                    continue
                self._fault([(gpu.uuid, None, None)], "nvml-events-unavailable", describe(exc))

    def _loop(self, event_set: Any) -> None:
        nvml = self.nvml
        backoff = 1.0
        while not self._stop.is_set():
            try:
                event = nvml.nvmlEventSetWait(event_set, self._next_wait_ms())
            except nvml.NVMLError as exc:
                if self._stop.is_set():
                    return
                if is_code(nvml, exc, "NVML_ERROR_TIMEOUT"):
                    self._quiet_tick()
                    continue
                self._fault(self._all_gpus(), "nvml-event-wait-failed", describe(exc))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_FAILURE_BACKOFF_S)
                continue
            backoff = 1.0
            if self._stop.is_set():
                return
            self._handle(event)

    def _next_wait_ms(self) -> int:
        if not self.recovery.enabled:
            return self.wait_ms
        with self._lock:
            if not self.faults:
                return self.wait_ms
            due = min(f.last_bad for f in self.faults.values()) + self.recovery.quiet_period_seconds
        left_ms = int((due - self.clock()) * 1000) + 1
        return max(10, min(self.wait_ms, left_ms))

    def _uuid_of(self, handle: Any) -> str | None:
        key = _handle_key(handle)
        if key is not None and key in self._handles:
            return self._handles[key]
        try:
            return text(self.nvml.nvmlDeviceGetUUID(handle))
        except self.nvml.NVMLError:
            return None

    def _handle(self, event: Any) -> None:
        nvml = self.nvml
        event_type = int(event.eventType)
        if event_type & int(nvml.nvmlEventTypeXidCriticalError):
            xid = int(event.eventData)
            self._count_xid(self._uuid_of(event.device), xid)
            if self.policy.ignores(xid):
                log.info("ignoring Xid", xid=xid)
                return
            reason = f"xid-{xid}"
        elif event_type & int(nvml.nvmlEventTypeDoubleBitEccError):
            reason = "ecc-double-bit"
        else:
            return
        uuid = self._uuid_of(event.device)
        if uuid is None:
            self._fault(self._all_gpus(), reason, "on a GPU NVML cannot name: marking every GPU")
            return
        gpu = self.gpus.get(uuid)
        if gpu is None:
            log.info("event for a GPU this resource does not serve", gpu=uuid, reason=reason)
            return
        gi, ci = int(event.gpuInstanceId), int(event.computeInstanceId)
        if gpu.mig_enabled and gi != NO_INSTANCE and ci != NO_INSTANCE:
            if not any(m.gi == gi and m.ci == ci for m in gpu.migs):
                log.info("event for an unknown MIG instance", gpu=uuid, gi=gi, ci=ci, reason=reason)
                return
            self._fault([(uuid, gi, ci)], reason)
        else:
            self._fault([(uuid, None, None)], reason)

    def _probe(self, gpu: GpuInfo) -> tuple[str, str] | None:
        """None if the GPU answers NVML as it should, else (reason code, detail)."""
        try:
            if text(self.nvml.nvmlDeviceGetUUID(gpu.handle)) != gpu.uuid:
                return "nvml-probe-failed", "the GPU answers with another UUID"
            self.nvml.nvmlDeviceGetMemoryInfo(gpu.handle)
        except self.nvml.NVMLError as exc:
            code = "gpu-lost" if is_code(self.nvml, exc, "NVML_ERROR_GPU_IS_LOST") else "nvml-probe-failed"
            return code, describe(exc)
        return None

    def _quiet_tick(self) -> None:
        failing: set[str] = set()
        for gpu in self.gpus.values():
            problem = self._probe(gpu)
            if problem is not None:
                failing.add(gpu.uuid)
                self._fault([(gpu.uuid, None, None)], *problem)
        if not self.recovery.enabled:
            return
        now = self.clock()
        recovered: list[HealthKey] = []
        with self._lock:
            for key, fault in list(self.faults.items()):
                if key[0] in failing or now - fault.last_bad < self.recovery.quiet_period_seconds:
                    continue
                del self.faults[key]
                recovered.append(key)
        for key in recovered:
            log.info("device healthy again after a quiet period", gpu=key[0], gi=key[1], ci=key[2])
        if recovered:
            self.on_change()

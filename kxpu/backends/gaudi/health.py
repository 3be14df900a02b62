"""Gaudi health from HLML events, in one daemon thread per backend, with optional recovery.

As Habana's plugin does, the thread registers ``HLML_EVENT_CRITICAL_ERR`` on every device (kxpu
adds the double-bit ECC and DRAM events) and blocks in ``hlmlEventSetWait``; unlike it, it waits
without a 10 s sleep in between, maps the event's device handle to the device (Habana's plugin
compares a serial number with a UUID, so no event ever matched a device), and at each timeout
probes every device with a cheap query: a device that stops answering (``AIP_IS_LOST``) is
marked without an event, and with recovery on, a fault clears after a quiet period in which
the device answered every probe.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kxpu.backends.gaudi.config import HealthConfig
from kxpu.backends.gaudi.hlml import HlmlSource, describe, handle_key, is_code, text
from kxpu.logs import get_logger, log_failure

log = get_logger("kxpu.backends.gaudi.health")

MAX_FAILURE_BACKOFF_S = 30.0


@dataclass(frozen=True, slots=True)
class Watched:
    serial: str
    handle: Any


@dataclass(slots=True)
class Fault:
    reason: str
    last_bad: float  # the quiet period counts from here


class HealthMonitor:
    def __init__(
        self,
        source: HlmlSource,
        devices: Sequence[Watched],
        config: HealthConfig,
        on_change: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.hlml, self.defines = source, source.module, source.types.HLML_DEFINES
        self.devices = {d.serial: d for d in devices}
        self._by_handle = {handle_key(d.handle): d.serial for d in devices}
        self.config, self.on_change, self.clock = config, on_change, clock
        self.faults: dict[str, Fault] = {}
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_exit: Callable[[], None] | None = None

    def snapshot(self) -> dict[str, str]:
        with self._lock:
            return {serial: fault.reason for serial, fault in self.faults.items()}

    def _fault(self, serials: Iterable[str], reason: str, detail: str = "") -> None:
        now, changed = self.clock(), False
        with self._lock:
            for serial in serials:
                fault = self.faults.get(serial)
                if fault is None:
                    self.faults[serial] = Fault(reason, now)
                    changed = True
                    log.warning("device marked unhealthy", serial=serial, reason=reason, detail=detail)
                else:
                    fault.last_bad = now
        if changed:
            self.on_change()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kxpu-gaudi-health", daemon=True)
            self._thread.start()
            self.ready.wait(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, on_exit: Callable[[], None] | None = None, join_timeout: float = 0.2) -> None:
        """Ask the thread to end at its next wake-up (HLML cannot interrupt a wait from another thread);
        ``on_exit`` (HLML's shutdown) runs once the thread no longer uses HLML."""
        self._on_exit = on_exit
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_timeout)
        elif on_exit is not None:
            on_exit()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        event_set: Any = None
        try:
            try:
                event_set = self.hlml.hlmlEventSetCreate()
            except self.hlml.HLMLError as exc:
                self._fault(self.devices, "hlml-events-unavailable", describe(exc))
                return
            wanted = self.defines.HLML_EVENT_CRITICAL_ERR | self.defines.HLML_EVENT_ECC_DERR
            wanted |= self.defines.HLML_EVENT_DRAM_DERR
            for device in self.devices.values():
                try:
                    self.hlml.hlmlDeviceRegisterEvents(device.handle, wanted, event_set)
                except self.hlml.HLMLError as exc:  # as Habana's plugin: unwatchable means unhealthy
                    self._fault([device.serial], "hlml-events-unavailable", describe(exc))
            self.ready.set()
            self._loop(event_set)
        except Exception as exc:
            log_failure(log, "health thread crashed; marking every device unhealthy", exc)
            self._fault(self.devices, "health-thread-crashed")
        finally:
            self.ready.set()
            if event_set is not None:
                with contextlib.suppress(Exception):
                    self.hlml.hlmlEventSetFree(event_set)
            if self._on_exit is not None:
                with contextlib.suppress(Exception):
                    self._on_exit()

    def _loop(self, event_set: Any) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                event = self.hlml.hlmlEventSetWait(event_set, self._next_wait_ms())
            except self.hlml.HLMLError as exc:
                if self._stop.is_set():
                    return
                if is_code(self.source, exc, "HLML_ERROR_TIMEOUT"):
                    self._quiet_tick()
                    continue
                self._fault(self.devices, "hlml-event-wait-failed", describe(exc))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_FAILURE_BACKOFF_S)
                continue
            backoff = 1.0
            self._handle(event)

    def _next_wait_ms(self) -> int:
        wait_ms, recovery = self.config.event_wait_ms, self.config.recovery
        with self._lock:
            if not recovery.enabled or not self.faults:
                return wait_ms
            due = min(f.last_bad for f in self.faults.values()) + recovery.quiet_period_seconds
        return max(10, min(wait_ms, int((due - self.clock()) * 1000) + 1))

    def _handle(self, event: Any) -> None:
        kind = int(event.event_type)
        if kind & self.defines.HLML_EVENT_CRITICAL_ERR:
            reason = "hlml-critical"
        elif kind & self.defines.HLML_EVENT_ECC_DERR:
            reason = "hlml-ecc-double-bit"
        elif kind & self.defines.HLML_EVENT_DRAM_DERR:
            reason = "hlml-dram-double-bit"
        else:
            return
        serial = self._by_handle.get(handle_key(event.device))
        if serial is None:
            self._fault(self.devices, reason, "on a device HLML cannot name: marking every device")
        else:
            self._fault([serial], reason)

    def _probe(self, device: Watched) -> tuple[str, str] | None:
        try:
            if text(self.hlml.hlmlDeviceGetSerial(device.handle)) != device.serial:
                return "hlml-probe-failed", "the device answers with another serial number"
            self.hlml.hlmlDeviceGetMemoryInfo(device.handle)
        except self.hlml.HLMLError as exc:
            lost = is_code(self.source, exc, "HLML_ERROR_AIP_IS_LOST")
            return ("aip-lost" if lost else "hlml-probe-failed"), describe(exc)
        return None

    def _quiet_tick(self) -> None:
        failing = set()
        for device in self.devices.values():
            problem = self._probe(device)
            if problem is not None:
                failing.add(device.serial)
                self._fault([device.serial], *problem)
        recovery = self.config.recovery
        if not recovery.enabled:
            return
        now, recovered = self.clock(), []
        with self._lock:
            for serial, fault in list(self.faults.items()):
                if serial not in failing and now - fault.last_bad >= recovery.quiet_period_seconds:
                    del self.faults[serial]
                    recovered.append(serial)
        for serial in recovered:
            log.info("device healthy again after a quiet period", serial=serial)
        if recovered:
            self.on_change()

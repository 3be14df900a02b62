"""Cambricon MLUs through libcndev, served as Cambricon's own device plugin serves them.

What a container gets follows cambricon-k8s-device-plugin (``pkg/mlu/server.go``,
``cambricon.go``, ``const.go``): in its default mode the device nodes only,
``/dev/cambricon_ctl`` and ``/dev/cambricon_gdr`` once, then per MLU ``/dev/cambr-msgq:<N>``,
``/dev/cambr-rpc:<N>``, ``/dev/cmsg_ctrl<N>``, ``/dev/commu<N>``, ``/dev/cambricon_ipcm<N>``,
``/dev/ttyMS<N>`` (``enableConsole``) and ``/dev/cambricon_dev<N>``, all ``rw``; the plugin adds a
kind when any node of it exists on the host, kxpu adds each node that exists (a listed node that
does not would fail the container's start). ``useRuntime`` gives only
``CAMBRICON_VISIBLE_DEVICES=<slots>`` for Cambricon's container runtime to act on. No
``MLU_VISIBLE_DEVICES`` is set: it is CNRT's per-process selector (like CUDA_VISIBLE_DEVICES),
the plugin never sets it, and the device cgroup already limits the container to its MLUs.
Device IDs are the plugin's (``MLU-<uuid>``; env-share copies ``MLU-<uuid>-_-<n>``), so the
kubelet's checkpoint survives swapping one plugin for the other.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from kxpu.backends.cambricon.cndev import Card, Cndev, CndevError, Telemetry, load_library
from kxpu.backends.fakes import Seam
from kxpu.backends.host import Host, HostBackendConfig, host_changes
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import register_backend
from kxpu.backends.templates import EnvTemplates, render_env
from kxpu.logs import get_logger
from kxpu.model import (
    Backend,
    BackendError,
    ContainerEdits,
    Device,
    DeviceNode,
    DeviceUsage,
    Health,
    Mount,
    ProcessUsage,
    TelemetrySample,
    numa_packed,
)

_MIB = 1024 * 1024
log = get_logger("kxpu.backends.cambricon")

VISIBLE_DEVICES_ENV = "CAMBRICON_VISIBLE_DEVICES"
SHARE_SEPARATOR = "-_-"  # env-share copies: <uuid>-_-<n>, n from 1 (cambricon.go generateFakeDevs)
GLOBAL_NODES = ("/dev/cambricon_ctl", "/dev/cambricon_gdr")
PER_MLU_NODES = (
    "/dev/cambr-msgq:{n}",
    "/dev/cambr-rpc:{n}",
    "/dev/cmsg_ctrl{n}",
    "/dev/commu{n}",
    "/dev/cambricon_ipcm{n}",
)
CONSOLE_NODE = "/dev/ttyMS{n}"
RPMSG_DIR = "/dev/cambricon/"
_DEV = re.compile(r"^cambricon_dev(\d+)$")


class CambriconConfig(HostBackendConfig):
    """Keys follow the plugin's flags (``--mode``, ``--virtualization-num``, ``--use-runtime``, …)."""

    mode: Literal["default", "env-share"] = "default"
    virtualization_num: int = Field(default=1, ge=1, le=1000, description="env-share: copies of each MLU")
    use_runtime: bool = Field(
        default=False, description="only CAMBRICON_VISIBLE_DEVICES (Cambricon's runtime)"
    )
    cnmon_path: str | None = Field(default=None, description="host cnmon, mounted read-only at the same path")
    enable_console: bool = False
    mount_rpmsg: bool = Field(default=False, alias="mountRPMsg", description="mount /dev/cambricon/ (RPMsg)")
    disable_health_check: bool = False
    library: str = Field(default="libcndev.so", description="libcndev to load (a name or a path)")
    env: EnvTemplates = Field(
        default_factory=dict, description="extra env: {ids}, {uuids}, {indexes}, {count}"
    )

    @field_validator("cnmon_path")
    @classmethod
    def _cnmon_absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"cnmonPath {value!r} must be an absolute path")
        return value


@dataclass(frozen=True, slots=True)
class Slot:
    """What one allocatable ID stands for: an MLU, or one env-share copy of it."""

    index: int
    copy: int | None = None


# A stand-in for libcndev plugs in here: it answers the library and the machine (a fake tree) it reports.
SEAM: Seam[[], tuple[Any, Host]] = Seam("cndev")


@register_backend("cambricon", CambriconConfig)
class CambriconBackend(Backend):
    def __init__(self, config: CambriconConfig, library: Any = None, host: Host | None = None) -> None:
        self.config = config
        fake = SEAM.stand_in() if library is None else None
        if fake is not None:
            library, host = fake
            log.warning("using a fake libcndev", root=str(host.root))
        self.host = host or config.host
        self._placement = PlacementReader(self.host)
        self._library = library
        self.cndev: Cndev | None = None
        self._init_error: str | None = None
        self._init_reason = "cndev-unavailable"
        self._lock = threading.Lock()  # discover() runs in worker threads; cndev calls one at a time
        self._cards: dict[int, Card] = {}
        self._slots: dict[str, Slot] = {}
        self._compute_mode = True
        self._reported: dict[int, str | None] | None = None
        self._sample_errors: set[str] = set()
        env_off = os.environ.get("DP_DISABLE_HEALTHCHECKS", "").lower() == "all"
        self._health_checks = not (config.disable_health_check or env_off)

    # ------------------------------------------------------------------ cndev lifecycle
    def _start(self) -> Cndev | None:
        """cndev, initialized; None (and the reason kept) while it cannot start. Retried every discovery."""
        if self.cndev is not None:
            return self.cndev
        try:
            library = self._library if self._library is not None else load_library(self.config.library)
            cndev = Cndev(library)
            cndev.init()
        except OSError as exc:
            self._fail(
                f"cannot load {self.config.library}: {exc} (is the Cambricon driver installed?)",
                "no-libcndev",
            )
            return None
        except CndevError as exc:
            self._fail(f"cndev did not start: {exc}", exc.reason)
            return None
        self._library, self.cndev, self._init_error = library, cndev, None
        log.info("cndev started", library=self.config.library)
        return cndev

    def _fail(self, message: str, reason: str) -> None:
        if message != self._init_error:
            log.error(message + "; every MLU is reported Unhealthy until it starts")
        self._init_error, self._init_reason = message, reason

    # ------------------------------------------------------------------ telemetry
    def sample(self) -> TelemetrySample:
        """cndev's figures for the MLUs cndev named (utilization, memory, power, chip/board/memory temperatures,
        each process's MLU memory); an MLU whose calls fail is reported without figures, logged once."""
        devices: list[DeviceUsage] = []
        processes: list[ProcessUsage] = []
        with self._lock:
            if self.cndev is None:
                raise BackendError(f"cndev is not started: {self._init_error or 'not yet'}")
            telemetry = Telemetry(self.cndev.lib)
            for index, card in sorted(self._cards.items()):
                try:
                    use = telemetry.usage(telemetry.handle(index))
                except CndevError as exc:
                    if str(exc) not in self._sample_errors:
                        self._sample_errors.add(str(exc))
                        log.warning("telemetry: an MLU's figures cannot be read", mlu=index, error=str(exc))
                    devices.append(
                        DeviceUsage(uuid=card.uuid, index=index, model=card.model, vendor="cambricon")
                    )
                    continue
                temperatures = dict(use.temperatures)
                devices.append(
                    DeviceUsage(
                        uuid=card.uuid,
                        index=index,
                        model=card.model,
                        vendor="cambricon",
                        compute_utilization=use.utilization,
                        memory_used_bytes=None if use.memory_used_mib is None else use.memory_used_mib * _MIB,
                        memory_total_bytes=None
                        if use.memory_total_mib is None
                        else use.memory_total_mib * _MIB,
                        power_watts=use.power_watts,
                        temperature_celsius=temperatures.pop("chip", None),
                        temperatures_celsius=temperatures,
                    )
                )
                processes += [
                    ProcessUsage(uuid=card.uuid, pid=pid, memory_used_bytes=size)
                    for pid, size in use.processes
                ]
        return TelemetrySample(tuple(devices), tuple(processes))

    def close(self) -> None:
        with self._lock:
            if self.cndev is not None:
                with contextlib.suppress(CndevError):
                    self.cndev.release()
                self.cndev = None

    # ------------------------------------------------------------------ discovery
    def _nodes_present(self) -> set[int]:
        return {int(m.group(1)) for name in self.host.listdir("/dev") if (m := _DEV.match(name))}

    def _read(self) -> list[tuple[int, Card | None, str | None]]:
        """(index, card if known, reason if unhealthy) for every MLU cndev or /dev knows."""
        nodes = self._nodes_present()
        cndev = self._start()
        count: int | None = None
        reason_all: str | None = None if cndev else self._init_reason
        if cndev is not None:
            try:
                count = cndev.device_count()
            except CndevError as exc:
                reason_all = exc.reason
                self._fail(f"cndev cannot count MLUs: {exc}", exc.reason)
                self.cndev = None  # initialize again next time: the driver may have been reloaded
        listed = set(range(count or 0))
        for gone in set(self._cards) - listed - nodes:
            del self._cards[gone]
        out: list[tuple[int, Card | None, str | None]] = []
        for index in sorted(listed | nodes):
            reason = reason_all
            if index not in nodes:
                reason = "no-device-node"
            elif count is not None and index not in listed:
                reason = "not-in-cndev"
            if cndev is not None and index in listed:
                try:
                    handle = cndev.handle(index)
                    if index not in self._cards:
                        self._cards[index] = cndev.card(index, handle)
                    if self._health_checks:
                        reason = self._health(cndev, handle) or reason
                except CndevError as exc:
                    reason = exc.reason
                    log.debug("cndev call failed", mlu=index, error=str(exc))
            out.append((index, self._cards.get(index), reason))
        return out

    def _health(self, cndev: Cndev, handle: int) -> str | None:
        try:
            return cndev.health(handle, self._compute_mode).reason
        except CndevError as exc:
            if exc.call != "cndevGetComputeMode":
                raise
            self._compute_mode = False  # as the plugin does: stop asking once it fails
            log.warning("compute mode unreadable; ignoring it from now on", error=str(exc))
            return cndev.health(handle, False).reason

    def discover(self) -> list[Device]:
        with self._lock:
            read = self._read()
        devices: list[Device] = []
        slots: dict[str, Slot] = {}
        for index, card, reason in read:
            base = (
                card.uuid if card is not None else f"cambricon_dev{index}"
            )  # unhealthy until cndev names it
            if card is None and reason is None:
                reason = self._init_reason
            copies = self.config.virtualization_num if self.config.mode == "env-share" else 0
            ids = [f"{base}{SHARE_SEPARATOR}{n}" for n in range(1, copies + 1)] or [base]
            for n, device_id in enumerate(ids, start=1):
                slots[device_id] = Slot(index, n if copies else None)
                devices.append(self._device(device_id, index, card, reason, n if copies else None))
        self._log_changes(read)
        self._slots = slots
        return devices

    def _device(
        self, device_id: str, index: int, card: Card | None, reason: str | None, copy: int | None
    ) -> Device:
        extra: dict[str, str | int | bool] = {"slot": index, "path": f"/dev/cambricon_dev{index}"}
        if card is not None:
            extra.update(serialNumber=card.serial, motherboardSerialNumber=card.motherboard)
        if copy is not None:
            extra.update(copy=copy, copies=self.config.virtualization_num)
        return Device(
            id=device_id,
            health=Health.UNHEALTHY if reason else Health.HEALTHY,
            health_reason=reason,
            numa_nodes=(card.numa_node,) if card is not None and card.numa_node is not None else (),
            model=card.model if card else None,
            uuid=card.uuid if card else None,
            index=index,
            memory_mib=card.memory_mib if card else None,
            cores=card.cores if card else None,
            pci_bus_id=card.pci_bus_id if card else None,
            pcie_root=self._placement.pcie_root(card.pci_bus_id) if card else None,
            extra=extra,
        )

    def _log_changes(self, read: list[tuple[int, Card | None, str | None]]) -> None:
        now = {index: reason for index, _, reason in read}
        before = self._reported or {}
        for index, reason in now.items():
            if before.get(index) == reason:
                continue
            if reason:
                log.warning("MLU unhealthy", mlu=index, reason=reason)
            elif index in before:
                log.info("MLU healthy again", mlu=index)
        if not now and self._reported != now:
            log.warning("no MLUs: no /dev/cambricon_dev* and cndev lists none")
        self._reported = now

    async def watch(self) -> AsyncGenerator[list[Device]]:
        """Device nodes appearing or going wake it at once; cndev's health answers are polled."""
        async for devices in host_changes(
            self.discover, lambda: ["/dev"], self.host, self.config.poll_seconds
        ):
            yield devices

    # ------------------------------------------------------------------ allocation
    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        try:
            slots = [self._slots[d.id] for d in devices]
        except KeyError as exc:
            raise BackendError(f"not an MLU of this resource: {exc.args[0]}") from None
        indexes = sorted({s.index for s in slots})
        edits = ContainerEdits(env=render_env(self.config.env, devices))
        if self.config.use_runtime:
            edits.env[VISIBLE_DEVICES_ENV] = ",".join(map(str, indexes))
            return edits
        if self.config.mount_rpmsg:
            edits.mounts.append(Mount(RPMSG_DIR, str(self.host.path(RPMSG_DIR))))
        if self.config.cnmon_path:
            edits.mounts.append(
                Mount(self.config.cnmon_path, str(self.host.path(self.config.cnmon_path)), True)
            )
        paths = list(GLOBAL_NODES)
        for n in indexes:
            per_mlu = [*PER_MLU_NODES, *([CONSOLE_NODE] if self.config.enable_console else [])]
            paths += [p.format(n=n) for p in per_mlu] + [f"/dev/cambricon_dev{n}"]
        edits.device_nodes = [
            DeviceNode(p, str(self.host.path(p)), "rw") for p in paths if self.host.exists(p)
        ]
        return edits

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        """env-share: one copy from each of the MLUs with the most free copies (the plugin's rule); else NUMA-packed."""
        if self.config.mode != "env-share":
            return numa_packed(available, must_include, size)
        chosen = list(dict.fromkeys(d.id for d in must_include))
        used = {self._slots[i].index for i in chosen if i in self._slots}
        free: dict[int, list[str]] = {}
        for d in available:
            slot = self._slots.get(d.id)
            if slot is not None and d.id not in chosen:
                free.setdefault(slot.index, []).append(d.id)
        for index in sorted(free, key=lambda i: (i in used, -len(free[i]), i)):
            if len(chosen) >= size:
                break
            chosen.append(free[index][0])
        for ids in free.values():  # more copies than MLUs: fill from the emptiest again
            chosen += [i for i in ids if i not in chosen][: max(0, size - len(chosen))]
        return chosen[:size]

    # ------------------------------------------------------------------ labels
    def node_labels(self) -> dict[str, str]:
        """The plugin's ``--node-label`` labels: Model, DriverVersion, MCUVersion (of the first MLU)."""
        with self._lock:
            cndev = self._start()
            if cndev is None:
                return {}
            try:
                handle = cndev.handle(0)
                card = self._cards.get(0) or cndev.card(0, handle)
                mcu, driver = cndev.versions(handle)
            except CndevError as exc:
                log.warning("no MLU labels", error=str(exc))
                return {}
        return {"Model": card.model, "DriverVersion": driver, "MCUVersion": mcu}

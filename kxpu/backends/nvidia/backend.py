"""NVIDIA GPUs through NVML: whole GPUs, MIG devices, time-sliced or MPS replicas, health, labels, telemetry.

Discovery runs once, when the backend is built (a MIG layout change needs a reload, as
with NVIDIA's plugin); health changes arrive from the NVML event thread and are pushed
through ``watch()`` at once. What a container gets follows NVIDIA's device list strategies,
so existing NVIDIA container runtimes and hooks keep working unchanged.

With MPS (``sharing.mps`` replicas, or ``mps.enabled`` for fractional sharing) the backend runs one
MPS control daemon per GPU (``mps.py``) and gives each container that GPU's pipe directory and the
server's /dev/shm; replicas are capped by the daemon's defaults, fractional grants by each
container's own limits (``allocate_shares``). A dead daemon makes its GPU's devices unhealthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, replace

from kxpu.atomicfile import write_atomically
from kxpu.backends.host import Host
from kxpu.backends.nvidia import discovery, dynamic_mig, mps, topology
from kxpu.backends.nvidia.config import GpuRef, NvidiaConfig
from kxpu.backends.nvidia.discovery import MIB, GpuInfo, Inventory, MigInfo
from kxpu.backends.nvidia.health import DEFAULT_WAIT_MS, HealthKey, HealthMonitor, XidPolicy
from kxpu.backends.nvidia.labels import gpu_labels, write_features_file
from kxpu.backends.nvidia.mps import MpsDaemon, MpsError, MpsLimits, MpsManager
from kxpu.backends.nvidia.nvml import NvmlSource, default_source, describe, is_code
from kxpu.backends.nvidia.sharing import pick_replicas
from kxpu.backends.nvidia.telemetry import GpuSampler
from kxpu.backends.pci import PlacementReader
from kxpu.backends.registry import register_backend
from kxpu.backends.wakeups import Wakeups
from kxpu.logs import get_logger
from kxpu.model import (
    GRANT_ANNOTATION,
    SUB_DEVICE_SEPARATOR,
    Backend,
    BackendError,
    ContainerEdits,
    CounterSet,
    Device,
    DeviceNode,
    DeviceShare,
    Grant,
    Health,
    Mount,
    TelemetrySample,
    encode_grants,
    numa_packed,
)

log = get_logger("kxpu.backends.nvidia")

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNTS_HOST_PATH = "/dev/null"
VOLUME_MOUNTS_CONTAINER_ROOT = "/var/run/nvidia-container-devices"
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
REPLICA_SEPARATOR = SUB_DEVICE_SEPARATOR


@dataclass(frozen=True, slots=True)
class Unit:
    """One allocatable device: a GPU or MIG device, or one time-slicing replica of it."""

    id: str
    visible: str  # the name NVIDIA's runtime understands: UUID or index, without the replica suffix
    gpu: GpuInfo
    mig: MigInfo | None = None
    replica: int | None = None
    replicas: int = 1

    @property
    def physical(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


def _matches(ref: GpuRef, gpu: GpuInfo, mig: MigInfo | None = None) -> bool:
    if isinstance(ref, int) or ref.isdigit():
        return int(ref) == gpu.index
    if ref == gpu.uuid:
        return True
    return mig is not None and ref in (mig.uuid, mig.index_id)


def _warn_missing(where: str, refs: Sequence[GpuRef], gpus: Sequence[GpuInfo]) -> None:
    """One warning line per GPU (or MIG device) a selection names that this node does not have: its
    settings would otherwise be silently ignored (a copied config, a node with fewer GPUs)."""
    present = ", ".join(str(g.index) for g in gpus) or "none"
    for ref in refs:
        if not any(_matches(ref, g, m) for g in gpus for m in (None, *g.migs)):
            log.warning(
                f"{where} names GPU {ref}, which this node does not have (GPUs present: {present}); "
                "its setting is ignored here"
            )


class NvidiaBackend(Backend):
    def __init__(
        self,
        config: NvidiaConfig,
        source: NvmlSource | None = None,
        environ: Mapping[str, str] | None = None,
        event_wait_ms: int = DEFAULT_WAIT_MS,
    ) -> None:
        self.config = config
        self.source = source or default_source()
        self.nvml = self.source.module
        self._environ = os.environ if environ is None else environ
        self._initialized = False
        self._closed = False
        self._nvml_lock = threading.Lock()  # sample() against close(): never query a shut-down NVML
        self.mps: MpsManager | None = None
        # MPS: None until start_mps() ran; "running", or "fallback" when onUnavailable let it go without
        self._mps_state: str | None = None
        self._mps_lock = threading.Lock()
        self._compute_modes: dict[str, int] = {}  # GPU → compute mode before kxpu set EXCLUSIVE_PROCESS
        self._wakeups = Wakeups()
        self.inventory = self._start_nvml()
        self._mig_maker = dynamic_mig.MigMaker(self.nvml, self.source.host_root)
        self._realized: dict[str, MigInfo] = {}  # placement ID → the MIG device made for it (dynamic MIG)
        try:
            self.units = self._build_units(self.inventory)
            self.placements = self._read_placements(self.inventory)
        except BaseException:
            self._shutdown_nvml()
            raise
        self._by_id = {u.id: u for u in self.units}
        self._placement_by_id = {p.id: p for p in self.placements}
        self._gpu_of = {u.id: u.physical for u in self.units}
        self._replicas_of = {u.physical: u.replicas for u in self.units}
        whole = not any(u.mig for u in self.units) and not config.replicated and not self.placements
        served = list(
            {
                **{u.gpu.uuid: u.gpu for u in self.units},
                **{p.gpu.uuid: p.gpu for p in self.placements},
            }.values()
        )
        self.topology = topology.measure(self.nvml, served) if whole and len(served) > 1 else None
        # Where each GPU sits, for claims that line devices up (matchAttribute): measured once, as NVLinks
        # and fabric membership change only with the hardware or a driver reload (a restart of kxpu).
        self._placement = PlacementReader(Host(self.source.host_root))
        self._link_domains = topology.link_domains(self.nvml, served) if len(served) > 1 else {}
        self._cliques = {g.uuid: c for g in served if (c := topology.fabric_clique(self.nvml, g))}
        self.monitor: HealthMonitor | None = None
        policy = XidPolicy.from_env(config.health.ignored_xids, self._environ)
        if policy.checks_off:
            log.info("health checks disabled by DP_DISABLE_HEALTHCHECKS")
        elif served and self._initialized:
            self.monitor = HealthMonitor(
                self.nvml, served, policy, config.health.recovery, self._wakeups.notify, wait_ms=event_wait_ms
            )
        self.sampler = GpuSampler(self.nvml, served, self.monitor)
        self._served = served
        self._mps_wanted = bool(config.mps_active and served)
        try:
            if self._mps_wanted:
                self._check_mps(served)
            if config.hami_core is not None and config.hami_core.preload:
                self._write_preload_file()
        except BaseException:
            self._shutdown_nvml()
            raise
        log.info(
            "NVIDIA devices discovered",
            gpus=len(self.inventory.gpus),
            devices=len(self.units),
            driver=self.inventory.driver_version,
            mig_strategy=config.mig_strategy,
            fake_nvml=self.source.fake,
        )

    # ------------------------------------------------------------------ NVML lifecycle
    def _start_nvml(self) -> Inventory:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
            self._initialized = True
            return discovery.discover(nvml, self.source.host_root)
        except nvml.NVMLError as exc:
            self._shutdown_nvml()
            message = f"NVML unavailable ({describe(exc)}): is the NVIDIA driver installed and a GPU present?"
            if self.config.fail_on_init_error:
                log.error(message)
                raise BackendError(f"{message} Set failOnInitError: false to run with zero GPUs.") from None
            log.warning(message + " Serving no GPUs (failOnInitError: false).")
            return Inventory(gpus=())

    def _shutdown_nvml(self) -> None:
        with self._nvml_lock:
            if self._initialized:
                self._initialized = False
                sampler = getattr(self, "sampler", None)  # none yet if the backend failed while being built
                if sampler is not None:
                    sampler.close()  # GPM samples are NVML's memory: freed before it shuts down
                with contextlib.suppress(Exception):
                    self.nvml.nvmlShutdown()

    # ------------------------------------------------------------------ MPS
    def _check_mps(self, served: Sequence[GpuInfo]) -> None:
        """What no fallback can fix, refused when the backend is built."""
        for gpu in served:
            if gpu.mig_enabled or any(u.mig for u in self.units if u.gpu.uuid == gpu.uuid):
                raise BackendError(
                    f"GPU {gpu.index} ({gpu.uuid}) is in MIG mode: MPS cannot share it. Disable MIG on it "
                    "(nvidia-smi -i N -mig 0), or serve it without MPS in another resource (devices: [...])"
                )
            replicas = max((u.replicas for u in self.units if u.gpu.uuid == gpu.uuid), default=1)
            most = mps.max_clients(gpu.compute_capability)
            if replicas > most:
                raise BackendError(
                    f"invalid MPS configuration: GPU {gpu.index} gets {replicas} replicas, but an MPS server "
                    f"takes at most {most} clients on compute capability "
                    + ".".join(map(str, gpu.compute_capability or ("?",)))
                )

    def start_mps(self) -> None:
        """Start the GPUs' MPS daemons (or the chosen fallback). ``watch()`` calls it before its first list,
        so listing devices (``kxpu devices``) never touches MPS or compute modes; until it has run the
        GPUs' devices are unhealthy (``mps-not-running``) and not allocated. Blocks: run it in a thread."""
        with self._mps_lock:
            if not self._mps_wanted or self._mps_state is not None or self._closed:
                return
            self._start_mps(self._served)

    def _start_mps(self, served: Sequence[GpuInfo]) -> None:
        try:
            self._prepare_mps(served)
            self._mps_state = "running"
        except MpsError as exc:
            self._restore_compute_modes()
            if self.config.mps.on_unavailable == "fail":
                raise BackendError(
                    f"MPS unavailable: {exc}. (Set mps.onUnavailable: time-slicing to serve the GPUs "
                    "without MPS: no memory or compute isolation.)"
                ) from None
            self.mps = None
            self._mps_state = "fallback"
            log.error(
                "MPS unavailable; serving the GPUs without it as mps.onUnavailable says: containers are "
                "NOT isolated from each other",
                error=str(exc),
                fallback=self.config.mps.on_unavailable,
            )

    def _prepare_mps(self, served: Sequence[GpuInfo]) -> None:
        cfg = self.config
        binary = mps.control_binary(cfg.nvidia_driver_root)
        if not os.access(binary, os.X_OK):
            raise MpsError(
                f"{binary} not found or not executable: MPS needs the driver's {mps.CONTROL_BINARY} "
                "under nvidiaDriverRoot"
            )
        mps.check_shm(cfg.mps.shm_dir or cfg.mps_root / "shm")
        self._set_compute_modes(served)
        environ = mps.daemon_environ(cfg.nvidia_driver_root, self._environ)
        daemons = []
        for gpu in served:
            replicas = max((u.replicas for u in self.units if u.gpu.uuid == gpu.uuid), default=1)
            limits = MpsLimits()
            if replicas > 1:  # NVIDIA's equal shares: memory / replicas, 100 / replicas
                limits = MpsLimits(
                    memory_mib=(gpu.memory_mib or 0) // replicas or None, thread_percentage=100 // replicas
                )
            daemons.append(
                MpsDaemon(
                    gpu.uuid,
                    cfg.mps_root,
                    binary,
                    limits,
                    {**environ, "CUDA_VISIBLE_DEVICES": gpu.uuid},
                    cfg.mps.start_timeout_seconds,
                )
            )
        manager = MpsManager(
            daemons, self._wakeups.notify, cfg.mps.check_interval_seconds, cfg.mps.stop_timeout_seconds
        )
        manager.start()
        self.mps = manager

    def _set_compute_modes(self, served: Sequence[GpuInfo]) -> None:
        """EXCLUSIVE_PROCESS: only the MPS server may hold a context, so a container that leaves MPS out
        cannot take the GPU past its limits (NVIDIA's plugin sets it with nvidia-smi; kxpu through NVML)."""
        nvml = self.nvml
        wanted = int(nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        names = {
            int(nvml.NVML_COMPUTEMODE_DEFAULT): "DEFAULT",
            int(nvml.NVML_COMPUTEMODE_PROHIBITED): "PROHIBITED",
            wanted: "EXCLUSIVE_PROCESS",
        }
        for gpu in served:
            try:
                mode = int(nvml.nvmlDeviceGetComputeMode(gpu.handle))
            except nvml.NVMLError as exc:
                raise MpsError(f"GPU {gpu.index}: cannot read its compute mode ({describe(exc)})") from None
            if mode == wanted:
                continue
            name = names.get(mode, str(mode))
            if not self.config.mps.set_compute_mode:
                raise MpsError(
                    f"GPU {gpu.index} is in compute mode {name}; MPS needs EXCLUSIVE_PROCESS, or a container "
                    f"could bypass the MPS server and its limits. Run nvidia-smi -i {gpu.index} -c "
                    "EXCLUSIVE_PROCESS, or let kxpu set it (mps.setComputeMode: true)"
                )
            try:
                nvml.nvmlDeviceSetComputeMode(gpu.handle, wanted)
            except nvml.NVMLError as exc:
                hint = " (kxpu must run as root)" if is_code(nvml, exc, "NVML_ERROR_NO_PERMISSION") else ""
                raise MpsError(
                    f"GPU {gpu.index}: cannot set compute mode EXCLUSIVE_PROCESS ({describe(exc)}){hint}"
                ) from None
            self._compute_modes[gpu.uuid] = mode
            log.info("compute mode set for MPS", gpu=gpu.index, was=name, now="EXCLUSIVE_PROCESS")

    def _restore_compute_modes(self, only: set[str] | None = None) -> None:
        by_uuid = {g.uuid: g for g in self.inventory.gpus}
        for uuid, mode in list(self._compute_modes.items()):
            if only is not None and uuid not in only:
                continue
            gpu = by_uuid.get(uuid)
            try:
                if gpu is not None and self._initialized:
                    self.nvml.nvmlDeviceSetComputeMode(gpu.handle, mode)
            except self.nvml.NVMLError as exc:
                log.warning("could not restore a GPU's compute mode", gpu=uuid, error=describe(exc))
            del self._compute_modes[uuid]

    def _write_preload_file(self) -> None:
        hami = self.config.hami_core
        assert hami is not None
        try:
            write_atomically(hami.preload_file, hami.container_path + "\n")
        except OSError as exc:
            raise BackendError(f"hamiCore: cannot write {hami.preload_file}: {exc.strerror}") from None

    # ------------------------------------------------------------------ which devices this resource serves
    def _selected(self, gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
        refs = self.config.devices
        if refs == "all":
            return list(gpus)
        chosen = [g for g in gpus if any(_matches(r, g) for r in refs)]
        _warn_missing("devices", refs, gpus)
        return chosen

    def _bases(self, gpus: list[GpuInfo]) -> list[tuple[GpuInfo, MigInfo | None]]:
        strategy = self.config.mig_strategy
        known = [g for g in gpus if g.error is None]
        mig_on = [g for g in known if g.mig_enabled]
        if strategy == "none":
            return [(g, None) for g in gpus]
        if strategy == "dynamic":  # GPUs in MIG mode are offered as placements (_read_placements)
            return [(g, None) for g in gpus if g not in mig_on]
        empty = [str(g.index) for g in mig_on if not g.migs]
        if empty:
            raise BackendError(
                f"invalid MIG configuration: GPU {', '.join(empty)} has MIG enabled but no MIG devices; "
                "create GPU and compute instances (nvidia-smi mig -cgi ... -C) or disable MIG"
            )
        if strategy == "single":
            if not mig_on:
                log.info("migStrategy single, but no GPU has MIG enabled: serving whole GPUs")
                return [(g, None) for g in gpus]
            if len(mig_on) != len(known):
                off = [str(g.index) for g in known if not g.mig_enabled]
                raise BackendError(
                    "migStrategy single needs every GPU configured the same way, but MIG is off on GPU "
                    f"{', '.join(off)} and on for the others; use migStrategy: mixed"
                )
            profiles = sorted({m.profile for g in mig_on for m in g.migs})
            if len(profiles) > 1:
                raise BackendError(
                    "migStrategy single needs one MIG device type on every GPU, found "
                    f"{', '.join(profiles)}; use migStrategy: mixed"
                )
            return [(g, m) for g in mig_on for m in g.migs]
        # mixed
        if self.config.mig_profile is None:
            return [(g, None) for g in gpus if not g.mig_enabled]
        chosen: list[tuple[GpuInfo, MigInfo | None]] = [
            (g, m) for g in mig_on for m in g.migs if m.profile == self.config.mig_profile
        ]
        if not chosen:
            found = sorted({m.profile for g in mig_on for m in g.migs})
            log.warning(
                "no MIG device has the configured profile",
                mig_profile=self.config.mig_profile,
                profiles_found=found,
            )
        return chosen

    def _build_units(self, inventory: Inventory) -> list[Unit]:
        by_index = self.config.device_id_strategy == "index"
        entries = self.config.sharing.replicas.resources
        key = "mps" if self.config.sharing.mps is not None else "timeSlicing"
        for n, entry in enumerate(entries):
            if entry.devices != "all":
                _warn_missing(f"sharing.{key}.resources[{n}].devices", entry.devices, inventory.gpus)
        units: list[Unit] = []
        for gpu, mig in self._bases(self._selected(inventory.gpus)):
            if mig is not None:
                visible = mig.index_id if by_index else mig.uuid
            else:
                visible = str(gpu.index) if by_index else gpu.uuid
            hits = [
                n
                for n, e in enumerate(entries)
                if e.devices == "all" or any(_matches(r, gpu, mig) for r in e.devices)
            ]
            if len(hits) > 1:
                raise BackendError(
                    f"{visible} is named by sharing.{key}.resources[{hits[0]}] and [{hits[1]}]; "
                    "name each GPU in one entry"
                )
            if not hits:
                units.append(Unit(visible, visible, gpu, mig))
                continue
            replicas = entries[hits[0]].replicas
            units += [
                Unit(f"{visible}{REPLICA_SEPARATOR}{n}", visible, gpu, mig, n, replicas)
                for n in range(replicas)
            ]
        return units

    def _read_placements(self, inventory: Inventory) -> list[dynamic_mig.Placement]:
        if self.config.mig_strategy != "dynamic":
            return []
        out: list[dynamic_mig.Placement] = []
        for gpu in self._selected(inventory.gpus):
            if gpu.error is not None or not gpu.mig_enabled:
                continue
            try:
                placements = dynamic_mig.read_placements(self.nvml, gpu)
            except self.nvml.NVMLError as exc:
                raise BackendError(
                    f"GPU {gpu.index} ({gpu.uuid}): cannot read its MIG profiles and placements ({describe(exc)})"
                ) from None
            if not placements:
                log.warning("GPU in MIG mode has no MIG profile placements", gpu=gpu.index)
            out += placements
        return out

    # ------------------------------------------------------------------ devices
    def _placement_fault(self, p: dynamic_mig.Placement, faults: Mapping[HealthKey, str]) -> str | None:
        if p.gpu.error:
            return "discovery-failed"
        if (p.gpu.uuid, None, None) in faults:
            return faults[(p.gpu.uuid, None, None)]
        mig = self._realized.get(p.id)
        for (gpu_uuid, gi, ci), reason in faults.items():
            if gpu_uuid == p.gpu.uuid and mig is not None and (mig.gi, mig.ci) == (gi, ci):
                return reason
        return None

    def _placement_devices(self, faults: Mapping[HealthKey, str]) -> list[Device]:
        out = []
        for p in self.placements:
            reason = self._placement_fault(p, faults)
            base = self._device(Unit(p.gpu.uuid, p.gpu.uuid, p.gpu), reason)
            out.append(dynamic_mig.placement_device(p, base))
        return out

    def _fault(self, unit: Unit, faults: Mapping[HealthKey, str]) -> str | None:
        if unit.gpu.error:
            return "discovery-failed"
        uuid = unit.gpu.uuid
        if self._mps_wanted and self._mps_state is None:
            return "mps-not-running"
        if self.mps is not None and uuid in self.mps.down():
            return "mps-daemon-down"
        if (uuid, None, None) in faults:
            return faults[(uuid, None, None)]
        for (gpu_uuid, gi, ci), reason in faults.items():
            if gpu_uuid != uuid:
                continue
            if unit.mig is None or (unit.mig.gi == gi and unit.mig.ci == ci):
                return reason
        return None

    def _device(self, unit: Unit, reason: str | None) -> Device:
        gpu, mig = unit.gpu, unit.mig
        extra: dict[str, str | int | bool] = {"migCapable": gpu.mig_capable}
        if (
            self.config.mig_strategy == "dynamic"
        ):  # as NVIDIA's DRA driver: a DeviceClass picks one or the other
            extra["type"] = "gpu"
        if gpu.compute_capability:
            extra["computeCapability"] = "{}.{}".format(*gpu.compute_capability)
        if gpu.minor is not None:
            extra["minor"] = gpu.minor
        if mig is not None:
            extra.update(
                migProfile=mig.profile,
                migIndex=mig.index_id,
                gpuInstance=mig.gi,
                computeInstance=mig.ci,
                giSlices=mig.gi_slices,
                ciSlices=mig.ci_slices,
                parentUuid=gpu.uuid,
            )
        if unit.replica is not None:
            extra.update(replica=unit.replica, replicas=unit.replicas, sharingStrategy=self._strategy)
        if gpu.uuid in self._cliques:
            extra["nvlinkClique"] = self._cliques[gpu.uuid]
        return Device(
            id=unit.id,
            health=Health.UNHEALTHY if reason else Health.HEALTHY,
            health_reason=reason,
            numa_nodes=(gpu.numa_node,) if gpu.numa_node is not None else (),
            model=gpu.name,
            uuid=unit.physical,
            index=gpu.index,
            memory_mib=mig.memory_mib if mig else gpu.memory_mib,
            pci_bus_id=gpu.pci_bus_id,
            pcie_root=self._placement.pcie_root(gpu.pci_bus_id),
            link_domain=self._link_domains.get(gpu.uuid),
            extra=extra,
        )

    def discover(self) -> list[Device]:
        faults = self.monitor.snapshot() if self.monitor else {}
        return [self._device(u, self._fault(u, faults)) for u in self.units] + self._placement_devices(faults)

    async def watch(self) -> AsyncGenerator[list[Device], None]:
        """First the full list once health events are being received, then a list on every health change."""
        with self._wakeups.subscribe() as changed:
            if self._mps_wanted:
                await asyncio.to_thread(self.start_mps)
            if self.monitor is not None and not self.monitor.running:
                await asyncio.to_thread(self.monitor.start)
            self._write_labels()
            yield self.discover()
            while True:
                await changed.wait()
                changed.clear()
                yield self.discover()

    # ------------------------------------------------------------------ allocation
    def _units(self, devices: Sequence[Device]) -> list[Unit]:
        units = []
        for d in devices:
            unit = self._by_id.get(d.id)
            if unit is None and d.id in self._placement_by_id:
                mig = self._realized.get(d.id)
                if mig is None:
                    raise BackendError(
                        f"{d.id}: its MIG device does not exist (it is created when a claim is prepared)"
                    )
                unit = Unit(d.id, mig.uuid, self._placement_by_id[d.id].gpu, mig)
            if unit is None:
                raise BackendError(f"not an NVIDIA device of this resource: {d.id}")
            units.append(unit)
        return units

    def _dev_prefix(self) -> str:
        """What host paths of device nodes start with: the driver root's when it holds /dev, else nothing (/)."""
        root = str(self.config.nvidia_driver_root).rstrip("/")
        return root if root and os.path.isdir(f"{root}/dev") else ""

    def _device_nodes(self, units: Sequence[Unit]) -> list[DeviceNode]:
        # Looked at on every Allocate (the UVM nodes appear once the driver loads nvidia-uvm), as text paths:
        # pathlib made this nine tenths of an NVIDIA Allocate's own time.
        prefix = self._dev_prefix()
        paths: list[str] = []
        for unit in units:
            if unit.gpu.minor is None:
                raise BackendError(f"{unit.id}: the GPU's minor number is unknown ({unit.gpu.error})")
            paths.append(f"/dev/nvidia{unit.gpu.minor}")
            if unit.mig is not None:
                paths += unit.mig.cap_paths
        paths += [f"/dev/{name}" for name in CONTROL_DEVICES if os.path.exists(f"{prefix}/dev/{name}")]
        return [DeviceNode(path, f"{prefix}{path}", "rw") for path in dict.fromkeys(paths)]

    @property
    def _strategy(self) -> str:
        return (
            "mps" if self.config.sharing.mps is not None and self._mps_state != "fallback" else "time-slicing"
        )

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        units = self._units(devices)
        ts = self.config.sharing.replicas
        if ts.fail_requests_greater_than_one and len(units) > 1 and any(u.replicas > 1 for u in units):
            raise BackendError(
                f"maximum request size for shared resources is 1, got {len(units)} (failRequestsGreaterThanOne)"
            )
        if self._mps_wanted and self._mps_state is None:
            raise BackendError("MPS is not running yet on this resource's GPUs")
        edits = self._visible_edits(units)
        if self.mps is not None:
            self._mps_edits(units, edits)
        if self.config.hami_core is not None:
            self._hami_core_edits(edits)
        return edits

    def allocate_shares(self, shares: Sequence[DeviceShare]) -> ContainerEdits:
        """Fractional sharing's grant, enforced by MPS when it runs: the container's own pinned-memory and
        active-thread limits (which can only lower the daemon's). Without MPS, plain ``allocate``."""
        edits = self.allocate([s.device for s in shares])
        if self.mps is not None and shares:
            share = shares[0]  # _mps_edits refused containers spanning GPUs; one grant per device
            edits.env[mps.PINNED_MEMORY_ENV] = f"0={share.memory_mib}M"
            if 0 < share.cores < 100:
                edits.env[mps.THREAD_PERCENTAGE_ENV] = str(share.cores)
        return edits

    def _mps_edits(self, units: Sequence[Unit], edits: ContainerEdits) -> None:
        assert self.mps is not None
        gpus = list(dict.fromkeys(u.gpu.uuid for u in units))
        if len(gpus) > 1:
            raise BackendError(
                f"under MPS a container talks to one GPU's MPS server, but this request spans {len(gpus)} GPUs "
                f"({', '.join(gpus)}): ask for one"
            )
        daemon = self.mps.daemon(gpus[0])
        if daemon is None:
            raise BackendError(f"GPU {gpus[0]} has no MPS daemon")
        shm = self.config.mps.shm_dir or self.config.mps_root / "shm"
        edits.env[mps.PIPE_ENV] = daemon.container_pipe_dir
        edits.mounts += [
            Mount(daemon.container_pipe_dir, str(daemon.pipe_dir)),
            Mount(mps.CONTAINER_SHM, str(shm)),
        ]
        replicas = units[0].replicas
        if replicas > 1:  # what the daemon's defaults cap each replica at: telemetry compares with it
            limits = daemon.limits
            edits.annotations[GRANT_ANNOTATION] = encode_grants(
                [
                    Grant(
                        gpus[0],
                        None if limits.memory_mib is None else limits.memory_mib * MIB,
                        None if limits.thread_percentage is None else limits.thread_percentage / 100,
                    )
                ]
            )

    def _hami_core_edits(self, edits: ContainerEdits) -> None:
        hami = self.config.hami_core
        assert hami is not None
        edits.mounts.append(Mount(hami.container_path, str(hami.library), read_only=True))
        if hami.preload:
            edits.mounts.append(Mount("/etc/ld.so.preload", str(hami.preload_file), read_only=True))
        if hami.lock_dir is not None:
            edits.mounts.append(Mount("/tmp/vgpulock", str(hami.lock_dir)))

    def _visible_edits(self, units: Sequence[Unit]) -> ContainerEdits:
        visible = list(dict.fromkeys(u.visible for u in units))
        strategies = self.config.device_list_strategy
        edits = ContainerEdits()
        if "envvar" in strategies:
            edits.env[VISIBLE_DEVICES_ENV] = ",".join(visible)
        if "volume-mounts" in strategies:
            edits.env[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_CONTAINER_ROOT
            edits.mounts += [
                Mount(f"{VOLUME_MOUNTS_CONTAINER_ROOT}/{v}", VOLUME_MOUNTS_HOST_PATH, read_only=True)
                for v in visible
            ]
        names = [f"{self.config.cdi_kind}={v}" for v in visible]
        if "cdi-cri" in strategies:
            edits.cdi_devices += names
        if "cdi-annotations" in strategies:
            token = hashlib.sha256(",".join(visible).encode()).hexdigest()[:16]
            edits.annotations[f"{self.config.cdi_annotation_prefix}kxpu-nvidia_{token}"] = ",".join(names)
        if self.config.pass_device_specs:
            edits.device_nodes += self._device_nodes(units)
        return edits

    # ------------------------------------------------------------------ dynamic MIG (Partitioner)
    def counter_sets(self) -> list[CounterSet]:
        by_gpu: dict[str, list[dynamic_mig.Placement]] = {}
        for p in self.placements:
            by_gpu.setdefault(p.gpu.uuid, []).append(p)
        return [dynamic_mig.counter_set(ps[0].gpu, ps) for ps in by_gpu.values()]

    def realize(self, devices: Sequence[Device]) -> list[tuple[Device, dict[str, str | int]]]:
        """Create the MIG device of each placement (GPU instance + compute instance); all or none. Blocks."""
        made: list[tuple[Device, dict[str, str | int]]] = []
        with self._nvml_lock:
            if not self._initialized:
                raise BackendError("NVML is not initialized (the backend is closed or has no driver)")
            try:
                for device in devices:
                    p = self._placement_by_id.get(device.id)
                    if p is None:
                        made.append((device, {}))
                        continue
                    mig, handle = self._mig_maker.create(p)
                    self._realized[p.id] = mig
                    extra = {**device.extra, "gpuInstance": mig.gi, "computeInstance": mig.ci}
                    made.append((replace(device, uuid=mig.uuid, extra=extra), handle))
            except BaseException:
                errors = self._destroy([h for _, h in made if h])
                if errors:
                    log.error("cannot destroy MIG devices made for a failed claim", errors="; ".join(errors))
                raise
        return made

    def release(self, handles: Sequence[Mapping[str, str | int]]) -> None:
        """Destroy the MIG devices ``realize`` made; one already gone is released. Blocks."""
        with self._nvml_lock:
            if not self._initialized:
                raise BackendError("NVML is not initialized (the backend is closed or has no driver)")
            errors = self._destroy([h for h in handles if h])
        if errors:
            raise BackendError("; ".join(errors))

    def reclaim(self, devices: Sequence[Device]) -> list[str]:
        """PartitionReclaimer: destroy the MIG instance at each placement, made by a realize whose process died
        before the DRA driver recorded it. Blocks."""
        destroyed: list[str] = []
        with self._nvml_lock:
            if not self._initialized:
                raise BackendError("NVML is not initialized (the backend is closed or has no driver)")
            for device in devices:
                p = self._placement_by_id.get(device.id)
                if p is None:
                    continue
                what = self._mig_maker.reclaim(p)
                if what is not None:
                    destroyed.append(what)
                    self._realized.pop(p.id, None)
        return destroyed

    def _destroy(self, handles: Sequence[Mapping[str, str | int]]) -> list[str]:
        by_uuid = {g.uuid: g for g in self.inventory.gpus}
        errors = []
        for handle in handles:
            try:
                gpu = by_uuid.get(str(handle.get("gpu")))
                if gpu is None:
                    raise BackendError(
                        f"MIG device {handle.get('uuid')}: GPU {handle.get('gpu')} is not on this node"
                    )
                self._mig_maker.destroy(gpu, handle)
            except (BackendError, KeyError, ValueError) as exc:
                errors.append(
                    str(exc) if isinstance(exc, BackendError) else f"bad MIG handle {dict(handle)}: {exc!r}"
                )
                continue
            for pid, mig in list(self._realized.items()):
                if mig.uuid == handle.get("uuid"):
                    del self._realized[pid]
        return errors

    # ------------------------------------------------------------------ telemetry
    def sample(self) -> TelemetrySample:
        """NVML's figures for the GPUs this resource serves (see ``telemetry.py``)."""
        with self._nvml_lock:
            if not self._initialized:
                raise BackendError("NVML is not initialized (the backend is closed or has no driver)")
            return self.sampler.sample()

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]:
        """Replicas: distributed/packed; whole GPUs: best interconnect (see topology); else NUMA-packed."""
        if self.config.replicated:
            return pick_replicas(
                [d.id for d in available],
                [d.id for d in must_include],
                size,
                self._gpu_of,
                self._replicas_of,
                self.config.shared_devices_allocation_policy,
            )
        topo = self.topology
        if topo is not None:
            uuid_of = {
                d.id: self._by_id[d.id].gpu.uuid for d in [*available, *must_include] if d.id in self._by_id
            }
            return topology.best_set(
                [d.id for d in available if d.id in uuid_of],
                [d.id for d in must_include if d.id in uuid_of],
                size,
                lambda a, b: topo.pair(uuid_of[a], uuid_of[b]),
            )
        return numa_packed(available, must_include, size)

    # ------------------------------------------------------------------ labels
    def node_labels(self) -> dict[str, str]:
        """GPU Feature Discovery-style labels for what this resource serves."""
        devices = self.discover()
        if self.placements:  # label the GPUs, not their possible partitions
            gpus = {p.gpu.uuid: p.gpu for p in self.placements}
            devices = [d for d in devices if not d.consumes] + [
                self._device(Unit(g.uuid, g.uuid, g), None) for g in gpus.values()
            ]
            devices.sort(key=lambda d: d.index if d.index is not None else -1)
        return gpu_labels(
            devices,
            driver_version=self.inventory.driver_version,
            cuda_driver_version=self.inventory.cuda_driver_version,
            mig_strategy=self.config.mig_strategy,
            mig_capable=any(g.mig_capable for g in self.inventory.gpus),
            renamed=self.config.renamed,
        )

    def _write_labels(self) -> None:
        path = self.config.labels.features_file
        if path is None:
            return
        try:
            write_features_file(path, self.node_labels())
        except OSError as exc:
            log.error("cannot write the NFD features file", path=str(path), error=str(exc))

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        path = self.config.labels.features_file
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # a directory put there, a read-only mount: say so, close the rest anyway
                log.error(
                    "cannot remove the NFD features file", path=str(path), error=exc.strerror or str(exc)
                )
        with self._mps_lock:  # not while start_mps() is under way in the watch's thread
            if self.mps is not None:
                exited = self.mps.stop()
                self._restore_compute_modes(
                    only=exited
                )  # a daemon still serving clients keeps its GPU's mode
        if self.monitor is not None:
            self.monitor.stop(on_exit=self._shutdown_nvml)
        else:
            self._shutdown_nvml()


register_backend("nvidia", NvidiaConfig)(NvidiaBackend)

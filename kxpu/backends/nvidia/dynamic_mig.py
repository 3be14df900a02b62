"""Dynamic MIG (``migStrategy: dynamic``): every placement of every MIG profile, made when a claim is prepared.

For each GPU in MIG mode the backend reads, from NVML, every GPU instance profile the GPU supports
(``nvmlDeviceGetGpuInstanceProfileInfo``) and each profile's possible placements
(``nvmlDeviceGetGpuInstancePossiblePlacements``), and offers one device per placement, named as NVIDIA's
DRA driver names them: ``gpu-<index>-mig-<profile>-<profile ID>-<start>`` (``gpu-0-mig-1g10gb-19-3``).

Each GPU has one counter set (``gpu-<index>-counter-set``): one counter per memory slice (``memory-slice-N``,
1 each) and the GPU's multiprocessors, copy engines, decoders, encoders, JPEG and OFA engines (the most any
profile has). A placement draws the memory slices it covers and its profile's engines, so the DRA scheduler
never allocates two placements that overlap, nor two ``+me`` profiles that would share the one OFA engine.

``realize`` makes the GPU instance at the placement and one compute instance over all of it
(``nvmlDeviceCreateGpuInstanceWithPlacement``, ``nvmlGpuInstanceCreateComputeInstance``) and returns the
device with its MIG device UUID; ``release`` destroys the compute instance, then the GPU instance. An
instance already gone is released; one whose ID now names another profile or placement is left alone.

``reclaim`` destroys the instance at a placement without a handle: what a daemon killed inside ``realize``
leaves (the GPU keeps its instances; the handle was never written down). The DRA driver asks it only for
placements it recorded, before creating them, that no prepared claim holds (``PartitionReclaimer``).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kxpu.backends.nvidia.discovery import GpuInfo, MigInfo, read_mig
from kxpu.backends.nvidia.nvml import Nvml, describe, is_code, text
from kxpu.logs import get_logger
from kxpu.model import BackendError, CounterSet, Device

log = get_logger("kxpu.backends.nvidia")

# The full compute instance of a GPU instance of N compute slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_PROFILE_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
_MAX_GPU_INSTANCE_ID = 32  # GPU instance IDs are small (0-14 on 8-slice GPUs)
_NOT_LABEL = re.compile(r"[^a-z0-9]+")
# Engines a placement draws from its GPU's counter set besides memory slices: counter → profile info field.
ENGINE_COUNTERS = {
    "multiprocessors": "multiprocessorCount",
    "copy-engines": "copyEngineCount",
    "decoders": "decoderCount",
    "encoders": "encoderCount",
    "jpeg-engines": "jpegCount",
    "ofa-engines": "ofaCount",
}


@dataclass(frozen=True, slots=True)
class GiProfile:
    """One GPU instance profile of one GPU, as NVML describes it."""

    index: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int
    name: str  # "1g.10gb", "1g.10gb+me"
    slices: int  # compute slices
    memory_mib: int
    engines: Mapping[str, int]  # ENGINE_COUNTERS' names → amount


@dataclass(frozen=True, slots=True)
class Placement:
    gpu: GpuInfo
    profile: GiProfile
    start: int  # first memory slice
    size: int  # memory slices

    @property
    def id(self) -> str:
        label = _NOT_LABEL.sub("-", self.profile.name.replace(".", "").lower()).strip("-")
        return f"gpu-{self.gpu.index}-mig-{label}-{self.profile.id}-{self.start}"

    @property
    def counter_set(self) -> str:
        return counter_set_name(self.gpu)

    def consumes(self) -> dict[str, int]:
        out = {f"memory-slice-{i}": 1 for i in range(self.start, self.start + self.size)}
        out.update({k: v for k, v in self.profile.engines.items() if v > 0})
        return out


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.index}-counter-set"


def _profile_name(nvml: Nvml, info: Any, index: int, gpu: GpuInfo) -> str:
    name = text(getattr(info, "name", b"") or b"").strip()
    if name:
        return name.removeprefix("MIG ").strip()
    # Drivers before the v2 structure: NVIDIA's naming from slices and memory (+me for the REV1 profile).
    from kxpu.backends.nvidia.discovery import MIB, mig_profile_name

    base = mig_profile_name(
        int(info.sliceCount), int(info.sliceCount), int(info.memorySizeMB), (gpu.memory_mib or 0) * MIB
    )
    return base + "+me" if index == getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1", -1) else base


def read_placements(nvml: Nvml, gpu: GpuInfo) -> list[Placement]:
    """Every placement of every GPU instance profile ``gpu`` supports (raises NVMLError on driver trouble)."""
    out: list[Placement] = []
    for index in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu.handle, index)
        except nvml.NVMLError as exc:
            if is_code(nvml, exc, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT"):
                continue  # a profile this GPU does not have
            raise
        profile = GiProfile(
            index=index,
            id=int(info.id),
            name=_profile_name(nvml, info, index, gpu),
            slices=int(info.sliceCount),
            memory_mib=int(info.memorySizeMB),
            engines={counter: int(getattr(info, field)) for counter, field in ENGINE_COUNTERS.items()},
        )
        count = ctypes.c_uint(0)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu.handle, profile.id, None, ctypes.byref(count))
        if count.value == 0:
            continue
        placements = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            gpu.handle, profile.id, placements, ctypes.byref(count)
        )
        out += [
            Placement(gpu, profile, int(placements[n].start), int(placements[n].size))
            for n in range(count.value)
        ]
    return out


def counter_set(gpu: GpuInfo, placements: list[Placement]) -> CounterSet:
    """What the GPU's placements draw from: every memory slice once, and the most of each engine any profile
    has (the whole-GPU profile's)."""
    counters: dict[str, int] = {}
    for p in placements:
        for i in range(p.start, p.start + p.size):
            counters[f"memory-slice-{i}"] = 1
        for name, amount in p.profile.engines.items():
            if amount > 0:
                counters[name] = max(counters.get(name, 0), amount)
    return CounterSet(counter_set_name(gpu), counters)


def placement_device(p: Placement, base: Device) -> Device:
    """The DRA device of a placement (``base``: its GPU's device, whose health and facts it shares)."""
    gpu = p.gpu
    return replace(
        base,
        id=p.id,
        uuid=None,
        memory_mib=p.profile.memory_mib,
        extra={
            **base.extra,
            "type": "mig",
            "migProfile": p.profile.name,
            "migProfileId": p.profile.id,
            "parentUuid": gpu.uuid,
            "parent": gpu.uuid,
            "profile": p.profile.name,
            "placement": p.start,
            "memorySlices": p.size,
            "giSlices": p.profile.slices,
            "multiprocessors": p.profile.engines.get("multiprocessors", 0),
        },
        consumes={p.counter_set: p.consumes()},
    )


class MigMaker:
    """Creates and destroys the GPU and compute instances of placements; every call blocks on NVML."""

    def __init__(self, nvml: Nvml, host_root: Path) -> None:
        self.nvml = nvml
        self.host_root = host_root

    def _fail(self, p: Placement, what: str, exc: BaseException) -> BackendError:
        hint = ""
        if is_code(self.nvml, exc, "NVML_ERROR_INSUFFICIENT_RESOURCES"):
            hint = (
                ": no room for it on the GPU, a MIG instance that exists already overlaps it or holds the "
                "engines it needs (one made outside kxpu? nvidia-smi mig -lgi lists them)"
            )
        elif is_code(self.nvml, exc, "NVML_ERROR_NO_PERMISSION"):
            hint = " (kxpu must run as root to create MIG instances)"
        return BackendError(
            f"{p.id}: cannot {what} on GPU {p.gpu.index} ({p.gpu.uuid}): {describe(exc)}{hint}"
        )

    def create(self, p: Placement) -> tuple[MigInfo, dict[str, str | int]]:
        nvml = self.nvml
        placement = nvml.c_nvmlGpuInstancePlacement_t(p.start, p.size)
        what = f"create GPU instance {p.profile.name} at memory slice {p.start}"
        adopted: tuple[Any, Any] | None = None
        try:
            # The C function takes the placement by pointer; the binding passes the argument through as is.
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                p.gpu.handle, p.profile.id, ctypes.byref(placement)
            )
        except nvml.NVMLError as exc:
            adopted = self._left_over(p) if is_code(nvml, exc, "NVML_ERROR_INSUFFICIENT_RESOURCES") else None
            if adopted is None:
                raise self._fail(p, what, exc) from None
            gi = adopted[0]
        ci = None
        try:
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
            ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, _CI_PROFILE_FOR_SLICES[p.profile.slices], nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
            what = f"create its compute instance (GPU instance {gi_id})"
            ci = adopted[1] if adopted is not None and adopted[1] is not None else None
            if ci is None:
                ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_profile.id))
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            what = f"find the MIG device of GPU instance {gi_id}, compute instance {ci_id}"
            mig = self.find(p.gpu, gi_id, ci_id)
            if mig is None:
                raise BackendError(
                    f"{p.id}: NVML lists no MIG device for GPU instance {gi_id}, compute instance {ci_id}"
                )
        except (nvml.NVMLError, BackendError, KeyError) as exc:
            self._undo(p, gi, ci)
            if isinstance(exc, BackendError):
                raise
            if isinstance(exc, KeyError):
                raise BackendError(
                    f"{p.id}: no compute instance profile spans {p.profile.slices} slices"
                ) from None
            raise self._fail(p, what, exc) from None
        handle: dict[str, str | int] = {
            "gpu": p.gpu.uuid,
            "gpuInstance": gi_id,
            "computeInstance": ci_id,
            "profileId": p.profile.id,
            "start": p.start,
            "uuid": mig.uuid,
        }
        log.info("MIG device created", device=p.id, uuid=mig.uuid, gi=gi_id, ci=ci_id)
        return mig, handle

    def _at(self, p: Placement) -> tuple[int, Any] | None:
        """The GPU instance of exactly this profile and placement, with its ID, if one exists."""
        nvml = self.nvml
        for gi_id in range(_MAX_GPU_INSTANCE_ID):
            try:
                gi = nvml.nvmlDeviceGetGpuInstanceById(p.gpu.handle, gi_id)
                info = nvml.nvmlGpuInstanceGetInfo(gi)
            except nvml.NVMLError:
                continue
            if int(info.profileId) == p.profile.id and int(info.placement.start) == p.start:
                return gi_id, gi
        return None

    def reclaim(self, p: Placement) -> str | None:
        """Destroy the GPU instance at ``p`` and its compute instances; what was destroyed, or None if there
        was none. Raises BackendError when NVML refuses (the instance stays; the next reconciliation retries)."""
        nvml = self.nvml
        found = self._at(p)
        if found is None:
            return None
        gi_id, gi = found
        try:
            for ci_id in range(p.profile.slices):
                try:
                    ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                except nvml.NVMLError as exc:
                    if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                        continue
                    raise
                nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError as exc:
            if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND"):
                return None
            raise BackendError(
                f"{p.id}: cannot destroy the left-over GPU instance {gi_id} on GPU {p.gpu.index}: {describe(exc)}"
            ) from None
        log.info("left-over MIG instance destroyed", device=p.id, gpu=p.gpu.index, gi=gi_id)
        return f"{p.id} (GPU {p.gpu.index}, GPU instance {gi_id})"

    def _left_over(self, p: Placement) -> tuple[Any, Any] | None:
        """A GPU instance of exactly this profile and placement that exists already, with no compute instance or
        one over all of it: what a restart between creating it and recording the claim leaves; taken over rather
        than refusing the claim for ever. None when there is none (something else holds the memory slices)."""
        nvml = self.nvml
        found = self._at(p)
        if found is None:
            return None
        gi_id, gi = found
        cis = []
        for ci_id in range(p.profile.slices):
            try:
                cis.append(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
            except nvml.NVMLError:
                continue
        full = _CI_PROFILE_FOR_SLICES.get(p.profile.slices)
        if not cis or (len(cis) == 1 and int(nvml.nvmlComputeInstanceGetInfo(cis[0]).profileId) == full):
            log.warning(
                "taking over a MIG instance left at this placement (kxpu restarted before recording its claim?)",
                device=p.id,
                gi=gi_id,
            )
            return gi, (cis[0] if cis else None)
        return None

    def _undo(self, p: Placement, gi: Any, ci: Any) -> None:
        for destroy, instance in (
            (self.nvml.nvmlComputeInstanceDestroy, ci),
            (self.nvml.nvmlGpuInstanceDestroy, gi),
        ):
            if instance is None:
                continue
            try:
                destroy(instance)
            except self.nvml.NVMLError as exc:
                log.error("cannot undo a half-made MIG device", device=p.id, error=describe(exc))

    def find(self, gpu: GpuInfo, gi_id: int, ci_id: int) -> MigInfo | None:
        nvml = self.nvml
        for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))):
            try:
                handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except nvml.NVMLError as exc:
                if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND", "NVML_ERROR_INVALID_ARGUMENT"):
                    continue
                raise
            if (
                int(nvml.nvmlDeviceGetGpuInstanceId(handle)) == gi_id
                and int(nvml.nvmlDeviceGetComputeInstanceId(handle)) == ci_id
            ):
                return read_mig(nvml, handle, slot, gpu, self.host_root)
        return None

    def destroy(self, gpu: GpuInfo, handle: Mapping[str, str | int]) -> None:
        """Destroy what ``create`` made; what is gone already counts as destroyed. Raises BackendError."""
        nvml = self.nvml
        gi_id, ci_id = int(handle["gpuInstance"]), int(handle["computeInstance"])
        name = f"MIG device {handle.get('uuid')} (GPU {gpu.index}, GPU instance {gi_id})"
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(gpu.handle, gi_id)
        except nvml.NVMLError as exc:
            if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND"):
                return
            raise BackendError(f"cannot look up {name}: {describe(exc)}") from None
        try:
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            if int(info.profileId) != int(handle["profileId"]) or int(info.placement.start) != int(
                handle["start"]
            ):
                log.warning("a MIG GPU instance ID now names another instance; leaving it", device=name)
                return
            try:
                ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
            except nvml.NVMLError as exc:
                if not is_code(nvml, exc, "NVML_ERROR_NOT_FOUND"):
                    raise
            else:
                mig = self.find(gpu, gi_id, ci_id)
                if mig is not None and handle.get("uuid") and mig.uuid != handle["uuid"]:
                    log.warning(
                        "a MIG device was made again in place of kxpu's; leaving it",
                        device=name,
                        now=mig.uuid,
                    )
                    return
                nvml.nvmlComputeInstanceDestroy(ci)
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError as exc:
            if is_code(nvml, exc, "NVML_ERROR_NOT_FOUND"):
                return
            hint = (
                " (other compute instances or processes still use it)"
                if is_code(nvml, exc, "NVML_ERROR_IN_USE")
                else ""
            )
            raise BackendError(f"cannot destroy {name}: {describe(exc)}{hint}") from None
        log.info("MIG device destroyed", uuid=handle.get("uuid"), gpu=gpu.index, gi=gi_id, ci=ci_id)

"""The ``nvidia:`` config section. Keys keep NVIDIA's device-plugin names where they mean the same thing.

One kxpu resource is one socket and one resource name, so a section describes exactly
one resource: ``migStrategy: mixed`` plus ``migProfile: 1g.10gb`` serves that MIG profile;
without ``migProfile`` it serves the GPUs whose MIG mode is off (NVIDIA's ``nvidia.com/gpu``
under ``mixed``). ``devices`` picks which GPUs the resource serves, so several resources
can split one node's GPUs (for instance with different time-slicing replicas).

``sharing.mps`` takes the same keys as ``sharing.timeSlicing`` (NVIDIA's ``ReplicatedResources``),
with ``failRequestsGreaterThanOne`` true unless set, as NVIDIA's plugin does for MPS; ``mpsRoot`` is
NVIDIA's flag. kxpu's own MPS settings (the daemon's supervision, fractional enforcement without
replicas, what to do when MPS cannot start) are under ``mps``; see ``docs/mps.md``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from kxpu.backends.recovery import HealthRecovery
from kxpu.backends.registry import BackendConfig, set_while_off

# NVIDIA's application-error Xids: the job failed, the GPU is fine.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)

DeviceListStrategy = Literal["envvar", "volume-mounts", "cdi-cri", "cdi-annotations"]
GpuRef = int | str  # a GPU index, a GPU UUID, a MIG UUID or a MIG index "<gpu>:<mig>"

_MIG_PROFILE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+[a-z0-9]+)?$")
_CDI_KIND = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
SHARED_SUFFIX = ".shared"


def _check_refs(value: Literal["all"] | list[GpuRef]) -> Literal["all"] | list[GpuRef]:
    if value == "all":
        return value
    if not value:
        raise ValueError("give 'all' or at least one GPU index or UUID")
    for ref in value:
        if isinstance(ref, int) and ref < 0:
            raise ValueError(f"GPU index {ref} must be >= 0")
    return value


GpuSelection = Annotated[Literal["all"] | list[GpuRef], AfterValidator(_check_refs)]


class TimeSlicingResource(BackendConfig):
    """Replicas for some GPUs: several entries give different GPUs different replica counts."""

    name: str | None = Field(default=None, description="NVIDIA compatibility: must be this resource's name")
    rename: str | None = None
    replicas: int = Field(ge=2, le=1024)
    devices: GpuSelection = "all"


class TimeSlicing(BackendConfig):
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    resources: list[TimeSlicingResource] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_all(self) -> TimeSlicing:
        if len(self.resources) > 1 and any(r.devices == "all" for r in self.resources):
            raise ValueError("a resources entry with devices: all must be the only one")
        renames = {r.rename for r in self.resources if r.rename}
        if len(renames) > 1:
            raise ValueError(f"entries rename this resource differently: {', '.join(sorted(renames))}")
        return self


class MpsSharing(TimeSlicing):
    """NVIDIA's ``sharing.mps``: equal replicas whose memory and compute the MPS server caps."""

    fail_requests_greater_than_one: bool = True
    resources: list[TimeSlicingResource] = Field(min_length=1)


class Sharing(BackendConfig):
    time_slicing: TimeSlicing = Field(default_factory=TimeSlicing)
    mps: MpsSharing | None = None

    @model_validator(mode="after")
    def _one_strategy(self) -> Sharing:
        if self.mps is not None and self.time_slicing.resources:
            raise ValueError("set either timeSlicing or mps replicas, not both: a GPU is shared one way")
        return self

    @property
    def replicas(self) -> TimeSlicing:
        """The replicated resources in force (MPS's when set, as NVIDIA's plugin reads them)."""
        return self.mps if self.mps is not None else self.time_slicing


class MpsConfig(BackendConfig):
    """kxpu's MPS settings. MPS runs when ``sharing.mps`` has replicas or ``enabled`` is true (fractional
    sharing: each container's limits come from its grant instead of equal replicas)."""

    enabled: bool = False
    set_compute_mode: bool = Field(
        default=True, description="set EXCLUSIVE_PROCESS while MPS runs and restore the mode after"
    )
    on_unavailable: Literal["fail", "time-slicing"] = Field(
        default="fail", description="when MPS cannot start: refuse, or serve the GPUs without MPS"
    )
    shm_dir: Path | None = Field(
        default=None, description="host directory that is the MPS server's /dev/shm; default <mpsRoot>/shm"
    )
    start_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    check_interval_seconds: float = Field(default=1.0, gt=0, le=60)
    stop_timeout_seconds: float = Field(default=5.0, ge=0, le=300)

    @field_validator("shm_dir")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"shmDir {value} must be an absolute path")
        return value


class HamiCoreConfig(BackendConfig):
    """Mount a host's HAMi-core library into every container and preload it (it then enforces the
    ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` / ``CUDA_DEVICE_SM_LIMIT`` that fractional sharing sets)."""

    library: Path = Field(description="HAMi-core's libvgpu.so on the host")
    container_path: str = "/usr/local/vgpu/libvgpu.so"
    preload: bool = True
    preload_file: Path = Path("/run/kxpu/hami-core/ld.so.preload")
    lock_dir: Path | None = Path("/tmp/vgpulock")

    @field_validator("library", "preload_file", "lock_dir")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"{value} must be an absolute path")
        return value

    @field_validator("container_path")
    @classmethod
    def _container_absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"containerPath {value} must be an absolute path")
        return value


class HealthConfig(BackendConfig):
    ignored_xids: list[int] = Field(default_factory=lambda: list(DEFAULT_IGNORED_XIDS), alias="ignoredXids")
    recovery: HealthRecovery = Field(default_factory=HealthRecovery)


class LabelsConfig(BackendConfig):
    features_file: Path | None = Field(
        default=None, description="Node Feature Discovery local source file, e.g. .../features.d/kxpu-gpu"
    )

    @field_validator("features_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"featuresFile {value} must be an absolute path")
        return value


class NvidiaConfig(BackendConfig):
    # dynamic: each GPU in MIG mode is offered as every placement of every MIG profile it supports, with shared
    # counters so that the DRA scheduler never allocates two that overlap; a claim's partition is created when
    # it is prepared and destroyed when it is unprepared (DRA only; see dynamic_mig.py).
    mig_strategy: Literal["none", "single", "mixed", "dynamic"] = "none"
    mig_profile: str | None = None
    device_id_strategy: Literal["uuid", "index"] = Field(default="uuid", alias="deviceIDStrategy")
    device_list_strategy: list[DeviceListStrategy] = Field(
        default_factory=lambda: list[DeviceListStrategy](["envvar"])
    )
    pass_device_specs: bool = False
    nvidia_driver_root: Path = Path("/")
    mps_root: Path = Field(default=Path("/run/kxpu/mps"), alias="mpsRoot")
    mps: MpsConfig = Field(default_factory=MpsConfig)
    hami_core: HamiCoreConfig | None = Field(default=None, alias="hamiCore")
    fail_on_init_error: bool = True
    devices: GpuSelection = "all"
    shared_devices_allocation_policy: Literal["distributed", "packed"] = "distributed"
    sharing: Sharing = Field(default_factory=Sharing)
    health: HealthConfig = Field(default_factory=HealthConfig)
    labels: LabelsConfig = Field(default_factory=LabelsConfig)
    cdi_kind: str = Field(default="nvidia.com/gpu", alias="cdiKind")
    cdi_annotation_prefix: str = Field(default="cdi.k8s.io/", alias="cdiAnnotationPrefix")

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("device_list_strategy")
    @classmethod
    def _non_empty(cls, value: list[DeviceListStrategy]) -> list[DeviceListStrategy]:
        if not value:
            raise ValueError("name at least one device list strategy")
        return list(dict.fromkeys(value))

    @field_validator("mig_profile")
    @classmethod
    def _profile(cls, value: str | None) -> str | None:
        if value is not None and not _MIG_PROFILE.match(value):
            raise ValueError(f"{value!r} is not a MIG profile name like 1g.10gb or 1c.2g.20gb")
        return value

    @field_validator("nvidia_driver_root")
    @classmethod
    def _root(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"nvidiaDriverRoot {value} must be an absolute path")
        return value

    @field_validator("mps_root")
    @classmethod
    def _mps_root(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"mpsRoot {value} must be an absolute path")
        return value

    @field_validator("cdi_kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if not _CDI_KIND.match(value):
            raise ValueError(f"cdiKind {value!r} must look like vendor.com/class")
        return value

    @field_validator("cdi_annotation_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        if not value.endswith("/"):
            raise ValueError(f"cdiAnnotationPrefix {value!r} must end with '/'")
        return value

    @model_validator(mode="after")
    def _mig(self) -> NvidiaConfig:
        if self.mig_profile is not None and self.mig_strategy != "mixed":
            raise ValueError(
                "migProfile selects a MIG profile under migStrategy: mixed; set migStrategy: mixed"
            )
        if self.shared_devices_allocation_policy == "packed" and not self.replicated:
            raise ValueError(
                "sharedDevicesAllocationPolicy packed places replicas, and no sharing.timeSlicing or sharing.mps "
                "resources make any: add replicas, or drop the key"
            )
        unused = [] if self.mps_active else set_while_off(self.mps)
        if unused:
            raise ValueError(
                f"mps: {', '.join(unused)} set, but MPS is off: set mps.enabled: true or give sharing.mps "
                "replicas (or mps.enabled: false to keep MPS off)"
            )
        if self.mps_active and self.mig_strategy == "mixed":
            raise ValueError("MPS cannot share MIG devices: migStrategy mixed is not supported with MPS")
        if self.mig_strategy == "dynamic" and (self.mps_active or self.replicated):
            raise ValueError(
                "migStrategy dynamic partitions GPUs into MIG devices, one per claim: it cannot be combined with "
                "sharing.timeSlicing, sharing.mps or mps.enabled"
            )
        return self

    def dra_only(self) -> str | None:
        return (
            "nvidia.migStrategy dynamic offers overlapping MIG partitions"
            if self.mig_strategy == "dynamic"
            else None
        )

    @property
    def mps_active(self) -> bool:
        return self.sharing.mps is not None or self.mps.enabled

    @property
    def replicated(self) -> bool:
        return bool(self.sharing.replicas.resources)

    @property
    def renamed(self) -> bool:
        ts = self.sharing.replicas
        return self.replicated and (ts.rename_by_default or any(r.rename for r in ts.resources))

    def resource_name(self, configured: str) -> str:
        """Apply NVIDIA's replica renames: ``rename`` wins, then ``renameByDefault`` → ``<name>.shared``."""
        ts = self.sharing.replicas
        key = "mps" if self.sharing.mps is not None else "timeSlicing"
        for entry in ts.resources:
            if entry.name is not None and entry.name != configured:
                raise ValueError(
                    f"sharing.{key}.resources names {entry.name!r}, but this section serves {configured!r}; "
                    "each kxpu resource has its own nvidia section, so drop 'name' or make it match"
                )
        for entry in ts.resources:
            if entry.rename:
                return entry.rename
        if ts.resources and ts.rename_by_default:
            return configured + SHARED_SUFFIX
        return configured

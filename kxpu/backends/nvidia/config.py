"""The ``nvidia:`` config section. Keys keep NVIDIA's device-plugin names where they mean the same thing.

One kxpu resource is one socket and one resource name, so a section describes exactly
one resource: ``migStrategy: mixed`` plus ``migProfile: 1g.10gb`` serves that MIG profile;
without ``migProfile`` it serves the GPUs whose MIG mode is off (NVIDIA's ``nvidia.com/gpu``
under ``mixed``). ``devices`` picks which GPUs the resource serves, so several resources
can split one node's GPUs (for instance with different time-slicing replicas).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from kxpu.backends.registry import BackendConfig

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


class Sharing(BackendConfig):
    time_slicing: TimeSlicing = Field(default_factory=TimeSlicing)


class HealthRecovery(BackendConfig):
    enabled: bool = False
    quiet_period_seconds: float = Field(default=300.0, gt=0)


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
    mig_strategy: Literal["none", "single", "mixed"] = "none"
    mig_profile: str | None = None
    device_id_strategy: Literal["uuid", "index"] = Field(default="uuid", alias="deviceIDStrategy")
    device_list_strategy: list[DeviceListStrategy] = Field(
        default_factory=lambda: list[DeviceListStrategy](["envvar"])
    )
    pass_device_specs: bool = False
    nvidia_driver_root: Path = Path("/")
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
        return self

    @property
    def replicated(self) -> bool:
        return bool(self.sharing.time_slicing.resources)

    @property
    def renamed(self) -> bool:
        ts = self.sharing.time_slicing
        return self.replicated and (ts.rename_by_default or any(r.rename for r in ts.resources))

    def resource_name(self, configured: str) -> str:
        """Apply NVIDIA's time-slicing renames: ``rename`` wins, then ``renameByDefault`` → ``<name>.shared``."""
        ts = self.sharing.time_slicing
        for entry in ts.resources:
            if entry.name is not None and entry.name != configured:
                raise ValueError(
                    f"sharing.timeSlicing.resources names {entry.name!r}, but this section serves {configured!r}; "
                    "each kxpu resource has its own nvidia section, so drop 'name' or make it match"
                )
        for entry in ts.resources:
            if entry.rename:
                return entry.rename
        if ts.resources and ts.rename_by_default:
            return configured + SHARED_SUFFIX
        return configured

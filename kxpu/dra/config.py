"""``dra:`` on a resource: how its devices are served through Dynamic Resource Allocation, and the driver
name it derives (the model kxpu/config.py composes; it imports nothing else of kxpu.dra)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kxpu.model import FaultClass
from kxpu.model.faults import Effect
from kxpu.sockets import MAX_SOCKET_PATH

DEFAULT_KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_PLUGINS_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_CDI_SPEC_DIR = Path("/var/run/cdi")
DRIVER_NAME_MAX = 63
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")


def check_driver_name(name: str) -> str:
    """The API server's rule for ``spec.driver`` (and the kubelet's plugin name)."""
    if len(name) > DRIVER_NAME_MAX or not _DNS_SUBDOMAIN.match(name):
        raise ValueError(
            f"DRA driver name {name!r} must be a lowercase DNS subdomain of at most {DRIVER_NAME_MAX} "
            "characters, ending in a domain the vendor owns (e.g. npu.example.com)"
        )
    return name


def default_driver_name(resource: str) -> str:
    """``example.com/npu`` → ``npu.example.com``, ``nvidia.com/gpu`` → ``gpu.nvidia.com`` (NVIDIA's own
    DRA driver name): the resource's name part becomes the first DNS label of its domain."""
    domain, _, short = resource.partition("/")
    label = _NOT_LABEL.sub("-", short.lower()).strip("-")
    name = f"{label}.{domain}" if label else domain
    try:
        return check_driver_name(name)
    except ValueError:
        raise ValueError(
            f"no DRA driver name can be derived from {resource!r} ({name!r} is not a DNS subdomain of at most "
            f"{DRIVER_NAME_MAX} characters): set dra.driverName"
        ) from None


# A DaemonSet rolled with maxSurge runs two pods of the driver on a node at once: each serves sockets of its own
# (named after its pod UID, the downward API's metadata.uid), the kubelet registers both and calls the newest
# (the seamless-upgrade protocol of the kubelet's plugin manager, Kubernetes 1.33+). Without an instance the
# sockets have the fixed names and a second process stands by.
_INSTANCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


def check_instance(instance: str) -> str:
    """A pod UID (or any short name) that can go into socket names."""
    if not _INSTANCE.fullmatch(instance):
        raise ValueError(
            f"instance {instance!r} (POD_UID) cannot name a socket: use the pod's UID (downward API metadata.uid), "
            "letters, digits and '-', at most 64 characters"
        )
    return instance


def dra_socket(plugins_dir: Path, driver: str, instance: str | None = None) -> Path:
    return plugins_dir / driver / ("dra.sock" if instance is None else f"dra-{instance}.sock")


def registration_socket(registry_dir: Path, driver: str, instance: str | None = None) -> Path:
    return registry_dir / (f"{driver}-reg.sock" if instance is None else f"{driver}-{instance}-reg.sock")


def driver_sockets(plugins_dir: Path, driver: str) -> list[Path]:
    """The DRA service sockets of every instance of ``driver`` (the fixed name and the per-pod ones)."""
    directory = plugins_dir / driver
    return [directory / "dra.sock", *sorted(directory.glob("dra-*.sock"))]


def check_dra_socket_paths(
    plugins_dir: Path, registry_dir: Path, driver: str, instance: str | None = None
) -> None:
    """Refuse at load what bind() would refuse at serve time."""
    for path in (
        dra_socket(plugins_dir, driver, instance),
        registration_socket(registry_dir, driver, instance),
    ):
        size = len(str(path).encode())
        if size > MAX_SOCKET_PATH:
            raise ValueError(
                f"socket path {path} for DRA driver {driver} is {size} bytes; unix sockets allow {MAX_SOCKET_PATH}: "
                "use shorter kubeletPluginsDir/pluginsRegistryDir or dra.driverName"
            )


class DraSharesConfig(BaseModel):
    """``dra.shares``: each device may be allocated to several claims, each consuming part of its memory and
    compute (DRA consumable capacity). A claim names its amounts in ``capacity.requests`` (``memory``,
    ``cores`` in percent); one that names none gets the whole device. Each container gets the same
    in-container limits kxpu's extender path gives (HAMi-core's variables by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    memory_step_mib: int = Field(
        default=256, ge=1, alias="memoryStepMiB", description="requests are rounded up to multiples of this"
    )
    min_memory_mib: int = Field(default=256, ge=0, alias="minMemoryMiB")
    memory_scaling: float = Field(default=1.0, gt=0, le=100, description="publish physical memory times this")
    core_scaling: float = Field(default=1.0, gt=0, le=100, description="publish 100 percent times this")
    memory_limit_env: str = "CUDA_DEVICE_MEMORY_LIMIT_{i}"
    core_limit_env: str = "CUDA_DEVICE_SM_LIMIT"
    env: dict[str, str] = Field(default_factory=dict, description="more env for containers holding a share")

    @field_validator("memory_limit_env")
    @classmethod
    def _indexed(cls, value: str) -> str:
        if "{i}" not in value:
            raise ValueError("memoryLimitEnv needs {i} (the device's index in the container's request)")
        return value

    @model_validator(mode="after")
    def _min_on_the_step(self) -> DraSharesConfig:
        # The API server wants (default - min) % step == 0 for a capacity's request policy
        # (validateRequestPolicyRangeStep); the default is a multiple of the step, so min must be too, or
        # every ResourceSlice of the driver is refused.
        if self.min_memory_mib % self.memory_step_mib:
            raise ValueError(
                f"minMemoryMiB {self.min_memory_mib} must be a multiple of memoryStepMiB {self.memory_step_mib} "
                "(the API server refuses a request policy whose default is not a whole number of steps from min)"
            )
        return self


class DraTaintsConfig(BaseModel):
    """``dra.taints``: the effect of the taint each class of fault puts on a device in the ResourceSlice
    (``kxpu.dra.taints``; docs/dra.md, "Device faults"). ``NoSchedule``: no new claim gets the device, running
    pods stay. ``NoExecute``: the pods using it are evicted too. ``None``: informational, the device stays
    allocatable."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    device_lost: Effect = Field(default="NoSchedule", description="kxpu.io/device-lost: gone from the bus")
    ecc_fatal: Effect = Field(default="NoSchedule", description="kxpu.io/ecc-fatal: uncorrectable ECC/RAS")
    unmonitored: Effect = Field(default="NoSchedule", description="kxpu.io/unmonitored: health source down")
    driver_error: Effect = Field(
        default="NoSchedule", description="kxpu.io/driver-error: driver/library error"
    )
    other: Effect = Field(default="NoSchedule", description="kxpu.io/unhealthy: any other reason")

    def effects(self) -> dict[FaultClass, Effect]:
        """The effect per fault class, for ``kxpu.dra.taints.TaintPolicy``."""
        return {
            FaultClass.DEVICE_LOST: self.device_lost,
            FaultClass.ECC_FATAL: self.ecc_fatal,
            FaultClass.UNMONITORED: self.unmonitored,
            FaultClass.DRIVER_ERROR: self.driver_error,
            FaultClass.OTHER: self.other,
        }


class DraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    driver_name: str | None = Field(
        default=None,
        description="default: the resource name turned around (example.com/npu → npu.example.com)",
    )
    node_name: str | None = Field(default=None, description="default: $NODE_NAME; the pool's name")
    cdi_spec_dir: Path = DEFAULT_CDI_SPEC_DIR
    unhealthy: Literal["taint", "withdraw"] = Field(
        default="taint",
        description="taint unhealthy devices (per fault class, see taints) or leave them out of the "
        "ResourceSlice (all but those whose effect is None); taints fall back to withdrawal where the API "
        "server drops them",
    )
    taints: DraTaintsConfig = Field(
        default_factory=DraTaintsConfig, description="the taint effect per fault class"
    )
    shares: DraSharesConfig | None = Field(
        default=None, description="consumable capacity: several claims per device"
    )
    claim_cache: bool = Field(
        default=True,
        description="keep this node's allocated claims from a watch (list and watch on resourceclaims), so "
        "prepare needs no GET; false: a GET per prepare, get alone suffices",
    )

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, value: str | None) -> str | None:
        return None if value is None else check_driver_name(value)

    @field_validator("cdi_spec_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"cdiSpecDir {value} must be an absolute path")
        return value

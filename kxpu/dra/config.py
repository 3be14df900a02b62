"""``dra:`` on a resource: how its devices are served through Dynamic Resource Allocation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from kxpu.dra.names import check_driver_name
from kxpu.sockets import MAX_SOCKET_PATH

DEFAULT_KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_PLUGINS_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_CDI_SPEC_DIR = Path("/var/run/cdi")


def dra_socket(plugins_dir: Path, driver: str) -> Path:
    return plugins_dir / driver / "dra.sock"


def registration_socket(registry_dir: Path, driver: str) -> Path:
    return registry_dir / f"{driver}-reg.sock"


def check_dra_socket_paths(plugins_dir: Path, registry_dir: Path, driver: str) -> None:
    """Refuse at load what bind() would refuse at serve time."""
    for path in (dra_socket(plugins_dir, driver), registration_socket(registry_dir, driver)):
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
        description="taint unhealthy devices (NoSchedule) or leave them out of the ResourceSlice; taints fall "
        "back to withdrawal where the API server drops them",
    )
    shares: DraSharesConfig | None = Field(
        default=None, description="consumable capacity: several claims per device"
    )
    claim_cache: bool = Field(
        default=True,
        description="keep this node's allocated claims from a watch (list and watch on resourceclaims), so "
        "prepare needs no GET; false: a GET per prepare, get alone suffices",
    )

    claim_status: bool = Field(
        default=True,
        description="after prepare, write each device's conditions and data (ID, UUID, model, memory, share, "
        "partition, health) into the claim's status.devices, removed at unprepare; in the background, best "
        "effort (needs resourceclaims/status patch and associated-node:patch on resourceclaims/driver)",
    )
    device_metadata: bool = Field(
        default=False,
        description="KEP-5304: mount each request's devices and their attributes into the container as "
        "/var/run/kubernetes.io/dra-device-attributes/…/<driver>-metadata.json (opt-in, as upstream)",
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

"""``dra:`` on a resource: how its devices are served through Dynamic Resource Allocation."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from kxpu.dra.names import check_driver_name

DEFAULT_KUBELET_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_PLUGINS_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_CDI_SPEC_DIR = Path("/var/run/cdi")


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

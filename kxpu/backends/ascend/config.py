"""The ``ascend:`` config section. Keys take the names Huawei's and HAMi's plugins use where they mean the same.

One section serves one resource. Its devices are every NPU DCMI lists (or those whose chip
name is in ``chipNames``, e.g. ``[910B3]`` for HAMi's per-chip ``huawei.com/Ascend910B3``),
with IDs ``<prefix>-<physical ID>`` as Huawei's plugin names them (``Ascend910-0``); the
prefix defaults to the name part of the resource (``huawei.com/Ascend910`` → ``Ascend910``).
"""

from __future__ import annotations

import re

from pydantic import Field, PrivateAttr, field_validator, model_validator

from kxpu.backends.ascend.dcmi import DEFAULT_LIBRARY_PATHS
from kxpu.backends.host import HostBackendConfig
from kxpu.backends.registry import BackendConfig

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# What HAMi's ascend plugin mounts for its soft-slicing mode, and what an Ascend container needs
# from the driver when no Ascend Docker Runtime adds it (only paths present on the host are used).
DEFAULT_DRIVER_MOUNTS = (
    "/usr/local/Ascend/driver/lib64/driver",
    "/usr/local/Ascend/driver/version.info",
    "/usr/local/bin/npu-smi",
    "/etc/ascend_install.info",
)


class VnpuTemplate(BackendConfig):
    """One vNPU template of HAMi's ``vnpus`` config (``vir05_1c_16g``: 5 AI cores, 1 AI CPU, 16 GiB)."""

    name: str = Field(pattern=r"^vir[0-9A-Za-z_]+$")
    memory: int = Field(ge=1, description="MiB")
    ai_core: int = Field(ge=1, alias="aiCore")
    ai_cpu: int = Field(default=0, ge=0, alias="aiCPU")


def _templates(*rows: tuple[str, int, int, int]) -> tuple[VnpuTemplate, ...]:
    return tuple(VnpuTemplate(name=n, memory=m, ai_core=c, ai_cpu=p) for n, m, c, p in rows)


# HAMi's defaults (charts/hami device-configmap ``vnpus``), by DCMI chip name.
HAMI_TEMPLATES: dict[str, tuple[VnpuTemplate, ...]] = {
    "910A": _templates(
        ("vir02", 2184, 2, 0), ("vir04", 4369, 4, 0), ("vir08", 8738, 8, 0), ("vir16", 17476, 16, 0)
    ),
    "910B2": _templates(
        ("vir03_1c_8g", 8192, 3, 1), ("vir06_1c_16g", 16384, 6, 1), ("vir12_3c_32g", 32768, 12, 3)
    ),
    "910B3": _templates(("vir05_1c_16g", 16384, 5, 1), ("vir10_3c_32g", 32768, 10, 3)),
    "910B4": _templates(("vir05_1c_8g", 8192, 5, 1), ("vir10_3c_16g", 16384, 10, 3)),
    "910B4-1": _templates(("vir05_1c_16g", 16384, 5, 1), ("vir10_3c_32g", 32768, 10, 3)),
    "310P3": _templates(("vir01", 3072, 1, 1), ("vir02", 6144, 2, 2), ("vir04", 12288, 4, 4)),
}


class HealthConfig(BackendConfig):
    healthy_states: list[int] = Field(
        default_factory=lambda: [0], description="dcmi_get_device_health values counted healthy (0 = OK)"
    )


class AscendConfig(HostBackendConfig):
    use_ascend_docker: bool = Field(
        default=True,
        description="Ascend Docker Runtime adds nodes and driver files from ASCEND_VISIBLE_DEVICES "
        "(Huawei's -useAscendDocker); false: kxpu returns device nodes and driver mounts itself",
    )
    chip_names: list[str] = Field(default_factory=list, description="serve only these DCMI chip names")
    device_id_prefix: str | None = Field(default=None, alias="deviceIDPrefix")
    runtime_options: str = Field(default="", description="ASCEND_RUNTIME_OPTIONS (e.g. NODRV)")
    dcmi_library: list[str] = Field(default_factory=lambda: list(DEFAULT_LIBRARY_PATHS))
    driver_mounts: list[str] = Field(default_factory=lambda: list(DEFAULT_DRIVER_MOUNTS))
    vnpu_templates: list[VnpuTemplate] | None = Field(
        default=None, description="vNPU templates for sharing; default: HAMi's for the chip"
    )
    health: HealthConfig = Field(default_factory=HealthConfig)
    _resource: str | None = PrivateAttr(default=None)

    @field_validator("dcmi_library", "driver_mounts")
    @classmethod
    def _absolute_paths(cls, value: list[str]) -> list[str]:
        for path in value:
            if not path.startswith("/"):
                raise ValueError(f"{path!r} must be an absolute path")
        return value

    @field_validator("device_id_prefix")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        if value is not None and not _PREFIX.match(value):
            raise ValueError(f"deviceIDPrefix {value!r} must be letters, digits, '_', '.', '-'")
        return value

    @model_validator(mode="after")
    def _library(self) -> AscendConfig:
        if not self.dcmi_library:
            raise ValueError("dcmiLibrary needs at least one path")
        return self

    def resource_name(self, configured: str) -> str:
        self._resource = configured  # the default ID prefix is the resource's own name
        return configured

    @property
    def id_prefix(self) -> str:
        if self.device_id_prefix:
            return self.device_id_prefix
        if self._resource:
            return self._resource.rpartition("/")[2]
        return "Ascend"

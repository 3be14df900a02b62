"""``cdi:`` on a resource (write a CDI spec for its devices and allocate by CDI device name) and the CDI rule for
a kind: the model kxpu/config.py composes; it imports nothing else of kxpu.cdi."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

DEFAULT_CDI_SPEC_DIR = Path("/var/run/cdi")
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


def validate_kind(kind: str) -> str:
    vendor, sep, cls = kind.partition("/")
    if not sep or not vendor or not cls:
        raise ValueError(f"CDI kind {kind!r} must be vendor/class, e.g. example.com/npu")
    for part, what in ((vendor, "vendor"), (cls, "class")):
        if not _VENDOR_OR_CLASS.match(part):
            raise ValueError(
                f"CDI kind {kind!r}: the {what} {part!r} must start with a letter, end with a letter or digit, "
                "and hold only letters, digits, '_', '-' and '.'"
            )
    return kind


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class CdiConfig(_Model):
    """``cdi:`` on a resource: write a CDI spec for its devices and allocate by CDI device name."""

    enabled: bool = False
    spec_dir: Path = DEFAULT_CDI_SPEC_DIR
    kind: str | None = Field(default=None, description="vendor/class; default: the resource name")
    annotations: bool = False

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str | None) -> str | None:
        return None if value is None else validate_kind(value)

    @field_validator("spec_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError(f"specDir {value} must be an absolute path")
        return value

"""The ``mounts:`` list that several backends accept."""

from __future__ import annotations

from pydantic import field_validator

from kxpu.backends.registry import BackendConfig
from kxpu.model import Mount


class MountConfig(BackendConfig):
    host_path: str
    container_path: str
    read_only: bool = True

    @field_validator("host_path", "container_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    def to_mount(self) -> Mount:
        return Mount(container_path=self.container_path, host_path=self.host_path, read_only=self.read_only)

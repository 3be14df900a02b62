"""The ``gaudi:`` config section. Habana's plugin has no config file; kxpu adds only what kxpu adds
(health recovery, the host root), so ``gaudi: {}`` serves as Habana's plugin does."""

from __future__ import annotations

from pydantic import Field

from kxpu.backends.host import HostBackendConfig
from kxpu.backends.recovery import HealthRecovery
from kxpu.backends.registry import BackendConfig


class HealthConfig(BackendConfig):
    recovery: HealthRecovery = Field(default_factory=HealthRecovery)
    event_wait_ms: int = Field(default=5000, ge=10, le=60000, alias="eventWaitMs")


class GaudiConfig(HostBackendConfig):
    health: HealthConfig = Field(default_factory=HealthConfig)

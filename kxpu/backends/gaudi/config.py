"""The ``gaudi:`` config section. Habana's plugin has no config file; kxpu adds only what kxpu adds
(health recovery, the host root), so ``gaudi: {}`` serves as Habana's plugin does."""

from __future__ import annotations

from pydantic import Field, model_validator

from kxpu.backends.host import HostBackendConfig
from kxpu.backends.registry import BackendConfig, refuse_set_while_off


class HealthRecovery(BackendConfig):
    enabled: bool = False
    quiet_period_seconds: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _not_ignored(self) -> HealthRecovery:
        refuse_set_while_off(self, "health recovery")
        return self


class HealthConfig(BackendConfig):
    recovery: HealthRecovery = Field(default_factory=HealthRecovery)
    event_wait_ms: int = Field(default=5000, ge=10, le=60000, alias="eventWaitMs")


class GaudiConfig(HostBackendConfig):
    health: HealthConfig = Field(default_factory=HealthConfig)

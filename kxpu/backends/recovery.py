"""``health.recovery``: a device marked unhealthy by a health event counts as healthy again after a quiet period.

One model for every backend whose health comes from events (NVIDIA's Xids, Gaudi's HLML), so the section
reads and is checked the same in each; the backend's health watcher decides what "quiet" means.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from kxpu.backends.registry import BackendConfig, refuse_set_while_off


class HealthRecovery(BackendConfig):
    enabled: bool = False
    quiet_period_seconds: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _not_ignored(self) -> HealthRecovery:
        refuse_set_while_off(self, "health recovery")
        return self

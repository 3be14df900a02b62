"""kxpu's opaque per-claim configuration: what a DeviceClass or ResourceClaim may pass to a kxpu driver.

It arrives in ``spec.devices.config[].opaque.parameters`` with ``driver`` set to the kxpu driver's
name, and is validated strictly (unknown fields, wrong types and a wrong ``apiVersion``/``kind`` are
refused with the field named), because a typo silently ignored is a workload silently misconfigured::

    opaque:
      driver: npu.example.com
      parameters:
        apiVersion: kxpu.io/v1alpha1
        kind: DeviceConfig
        env: {NPU_LOG_LEVEL: debug}     # extra environment for the containers using these devices
        sharing: {strategy: MPS}        # how a share is enforced: TimeSlicing (default) or MPS
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

API_VERSION = "kxpu.io/v1alpha1"
KIND = "DeviceConfig"
# POSIX portable names; '=' and NUL would corrupt the container's environment.
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SharingConfig(BaseModel):
    """How a share of a device (consumable capacity) is enforced in the container, with NVIDIA's names.
    A share's containers always get HAMi-core's limit variables (cooperative); on top of them:

    - ``TimeSlicing``: nothing more (the backend's plain ``allocate``);
    - ``MPS``: the backend's own enforcement of the grant (``ShareAllocator.allocate_shares``: for nvidia the
      MPS client limits, which hold only while its ``sharing.mps`` daemon runs; Ascend's vNPU template).
      Refused for a backend without one.

    Unset: the backend's own enforcement where it has one, else TimeSlicing. A claim that wants a device to
    itself names no capacity amounts: the scheduler then consumes the published defaults, which are the
    whole device (its memory rounded down to the step), and the claim gets no limits."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    strategy: Literal["TimeSlicing", "MPS"]


class DeviceConfig(BaseModel):
    """The parameters, after merging class and claim configs (both fields optional for merging)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    api_version: Literal["kxpu.io/v1alpha1"] = Field(default="kxpu.io/v1alpha1", alias="apiVersion")
    kind: Literal["DeviceConfig"] = "DeviceConfig"
    env: dict[str, str] = Field(default_factory=dict)
    sharing: SharingConfig | None = None

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _ENV_NAME.match(name):
                raise ValueError(
                    f"env name {name!r} must be letters, digits and '_', not starting with a digit"
                )
            if "\x00" in text:
                raise ValueError(f"env {name}: the value holds a NUL byte")
        return value

    def merged_with(self, later: DeviceConfig) -> DeviceConfig:
        """``later`` applied over this one (a claim's config over its class's)."""
        return DeviceConfig(env={**self.env, **later.env}, sharing=later.sharing or self.sharing)


def parse_device_config(parameters: Any) -> DeviceConfig:
    """Validate ``parameters`` (a JSON object, or its text); raise ValueError / ValidationError naming the
    problem. ``apiVersion`` and ``kind`` are required here, so an object meant for another driver or an
    older schema is not mistaken for ours."""
    if isinstance(parameters, str | bytes):
        try:
            parameters = json.loads(parameters)
        except ValueError as exc:
            raise ValueError(f"parameters are not JSON: {exc}") from None
    if not isinstance(parameters, Mapping):
        raise ValueError(f"parameters must be an object with apiVersion {API_VERSION} and kind {KIND}")
    missing = [key for key in ("apiVersion", "kind") if key not in parameters]
    if missing:
        raise ValueError(f"parameters need {' and '.join(missing)} ({API_VERSION}, {KIND})")
    try:
        return DeviceConfig.model_validate(dict(parameters))
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'parameters'}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors(include_url=False)
        )
        raise ValueError(details) from None

"""Device taints for faults (KEP-5055): one taint key per fault class, each with the effect ``dra.taints`` gives it.

An unhealthy device stays in the ResourceSlice with a taint whose key names the kind of fault
(``kxpu.model.faults``) and whose value is the backend's reason:

| fault class | taint key |
|---|---|
| device-lost | ``kxpu.io/device-lost`` |
| ecc-fatal | ``kxpu.io/ecc-fatal`` |
| unmonitored | ``kxpu.io/unmonitored`` |
| driver-error | ``kxpu.io/driver-error`` |
| other | ``kxpu.io/unhealthy`` |

The effect decides what Kubernetes does: ``NoSchedule`` (the scheduler allocates the device to no new
claim that does not tolerate it; running pods stay), ``NoExecute`` (also: the device taint eviction
controller deletes the pods using it) or ``None`` (informational: the device stays allocatable and kxpu
prepares it). The taint goes when the backend reports the device healthy again. kxpu never writes or
reads DeviceTaintRules: an admin's rule taints devices beside kxpu's, and kxpu lifting its own taint leaves
the rule in force.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kxpu.model import Device, FaultClass, fault_class
from kxpu.model.faults import Effect

_LABEL_VALUE_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

TAINT_KEYS: Mapping[FaultClass, str] = {
    FaultClass.DEVICE_LOST: "kxpu.io/device-lost",
    FaultClass.ECC_FATAL: "kxpu.io/ecc-fatal",
    FaultClass.UNMONITORED: "kxpu.io/unmonitored",
    FaultClass.DRIVER_ERROR: "kxpu.io/driver-error",
    FaultClass.OTHER: "kxpu.io/unhealthy",
}


@dataclass(frozen=True, slots=True)
class TaintPolicy:
    """The effect per fault class (a class not named gets ``NoSchedule``, what kxpu did before classes)."""

    effects: Mapping[FaultClass, Effect] = field(default_factory=dict)

    def effect(self, cls: FaultClass) -> Effect:
        return self.effects.get(cls, "NoSchedule")

    def fault_taint(self, device: Device) -> dict[str, str] | None:
        """The taint an unhealthy device carries (key, value, effect); None for a healthy one."""
        if device.healthy:
            return None
        cls = fault_class(device.health_reason)
        return {
            "key": TAINT_KEYS[cls],
            "value": taint_value(device.health_reason),
            "effect": self.effect(cls),
        }

    def schedulable(self, device: Device) -> bool:
        """Whether the scheduler may allocate the device to any claim (healthy, or its fault only informs)."""
        taint = self.fault_taint(device)
        return taint is None or taint["effect"] == "None"


def taint_value(reason: str | None) -> str:
    """A label value (at most 63 of letters, digits, ``-_.``, alphanumeric at both ends)."""
    cleaned = _LABEL_VALUE_UNSAFE.sub("-", reason or "unknown")[:63].strip("-_.")
    return cleaned or "unknown"


def tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, str]) -> bool:
    """Whether one of a request's ``tolerations`` (as its allocation result copies them) tolerates ``taint``:
    the API's rules for device tolerations (an empty key with ``Exists`` matches every key, an empty effect
    every effect; ``Equal``, the default, also compares the value)."""
    for toleration in tolerations:
        effect = toleration.get("effect") or ""
        if effect and effect != taint["effect"]:
            continue
        key = toleration.get("key") or ""
        operator = toleration.get("operator") or "Equal"
        if key and key != taint["key"]:
            continue
        if operator == "Exists" or (
            key and operator == "Equal" and (toleration.get("value") or "") == taint["value"]
        ):
            return True
    return False

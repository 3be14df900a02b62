"""What a device's health reason means: one fault class per kind of failure, the same for every vendor.

Backends report why a device is unhealthy as a short code (``Device.health_reason``: ``xid-79``,
``ras-uncorrectable-umc``, ``cndev-unavailable`` …). Consumers that act on faults (the DRA driver taints a
device per class, each class with its own effect) need the kind of failure, not the vendor's code; this
table is the one place that reads the codes, so a backend adding a code adds it here.

| class | meaning | codes |
|---|---|---|
| ``device-lost`` | the device is gone from the bus or its node is missing | ``gpu-lost``, ``aip-lost``, Xid 79, ``no-device-node``, … |
| ``ecc-fatal`` | uncorrectable memory (ECC/RAS) errors: data in it can no longer be trusted | ``ecc-*``, ``ras-uncorrectable-*``, ``*-uncorrectable-error``, Xid 48/64/94/95 |
| ``unmonitored`` | the health source itself is down: kxpu cannot vouch for the device | ``nvml-events-unavailable``, ``*-unavailable``, … |
| ``driver-error`` | the driver or management library reports an error for the device | other Xids, ``nvml-probe-failed``, ``cndev-*``, ``dcmi*``, … |
| ``other`` | any other reason (a state file, an unknown code) | |
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Literal

# What a device taint does to claims (resource.k8s.io/v1 DeviceTaint.effect).
Effect = Literal["NoSchedule", "NoExecute", "None"]


class FaultClass(StrEnum):
    DEVICE_LOST = "device-lost"
    ECC_FATAL = "ecc-fatal"
    UNMONITORED = "unmonitored"
    DRIVER_ERROR = "driver-error"
    OTHER = "other"


# First match wins: a lost device's later probe failures stay "lost"; ECC before the generic Xid rule.
_RULES: tuple[tuple[FaultClass, re.Pattern[str]], ...] = (
    (
        FaultClass.DEVICE_LOST,
        re.compile(
            r"gpu-lost|aip-lost|xid-79|no-device-node|device-node-missing|no-drm-device|no-kfd-node|not-in-cndev"
        ),
    ),
    (
        FaultClass.ECC_FATAL,
        re.compile(r"ecc-.+|ras-uncorrectable-.+|.+-uncorrectable-error|xid-(48|64|94|95)"),
    ),
    (
        FaultClass.UNMONITORED,
        re.compile(
            r"nvml-events-unavailable|nvml-event-wait-failed|health-thread-crashed|amdsmi-unavailable"
            r"|cndev-unavailable|dcmi-unavailable|HLML unavailable.*",
            re.S,
        ),
    ),
    (
        FaultClass.DRIVER_ERROR,
        re.compile(
            r"xid-\d+|nvml-.+|cndev-.+|dcmi.+|hlml-.+|bad-sysfs|sysfs-unreadable|core-count-unknown"
            r"|device-state-invalid|no-.+",
            re.S,
        ),
    ),
)


def fault_class(reason: str | None) -> FaultClass:
    """The class of an unhealthy device's reason (``other`` when the code is unknown or missing)."""
    if reason:
        for cls, pattern in _RULES:
            if pattern.fullmatch(reason):
                return cls
    return FaultClass.OTHER

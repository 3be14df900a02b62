"""Reading a ResourceClaim's allocation: which of this driver's devices on this node it holds, and with
what per-claim configuration. Pure functions over the claim as the API returns it (a dict).

The claim is input from the API server, which the scheduler wrote; kxpu still checks everything it
relies on, because preparing a device the scheduler did not allocate to this node and driver would
hand a container hardware it must not have. Every refusal is a ``ClaimError`` whose message is what
the kubelet shows in the pod's events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kxpu.dra.opaque import DeviceConfig, parse_device_config


class ClaimError(Exception):
    """This claim cannot be prepared here; the message says why and is returned to the kubelet."""


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    request: str  # as the allocation names it (``gpu`` or ``gpu/a100``)
    pool: str
    device: str  # the DRA device name
    share_id: str | None = None
    admin_access: bool = False
    consumed: Mapping[str, str] = field(default_factory=dict)
    # The request's device tolerations as the allocation copied them (kxpu.dra.taints.tolerates reads them).
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimAllocation:
    namespace: str
    name: str
    uid: str
    devices: tuple[AllocatedDevice, ...]
    # Per request (as the allocation names it): the merged opaque configuration for this driver.
    configs: Mapping[str, DeviceConfig]

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


# Checked against ``(dict, Mapping)`` and ``(list, Sequence)``: a claim is JSON, and an abstract class's
# isinstance costs a few times a concrete one's, a dozen times a prepare.
def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, (dict, Mapping)):
            return None
        obj = obj.get(key)
    return obj


def allocation_for(claim: Mapping[str, Any], uid: str, driver: str, pool: str) -> ClaimAllocation:
    """This driver's share of ``claim`` on the node whose pool is ``pool``; ClaimError when there is none,
    when the claim is not the one the kubelet asked for, or when any of this driver's devices lives in
    another pool (never half-prepare a claim the scheduler placed elsewhere)."""
    namespace = str(_get(claim, "metadata", "namespace") or "")
    name = str(_get(claim, "metadata", "name") or "")
    ref = f"{namespace}/{name}"
    actual_uid = _get(claim, "metadata", "uid")
    if actual_uid != uid:
        raise ClaimError(
            f"ResourceClaim {ref} has UID {actual_uid}, not {uid} as the kubelet asked: it was deleted and "
            "created again"
        )
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, (dict, Mapping)):
        raise ClaimError(f"ResourceClaim {ref} is not allocated")
    results = _get(allocation, "devices", "results") or []
    if not isinstance(results, (list, Sequence)):
        raise ClaimError(f"ResourceClaim {ref}: status.allocation.devices.results is not a list")
    mine: list[AllocatedDevice] = []
    for n, result in enumerate(results):
        if not isinstance(result, (dict, Mapping)) or result.get("driver") != driver:
            continue
        where = f"ResourceClaim {ref}: status.allocation.devices.results[{n}]"
        request, device, result_pool = result.get("request"), result.get("device"), result.get("pool")
        if not (isinstance(request, str) and request and isinstance(device, str) and device):
            raise ClaimError(f"{where} has no request or device name")
        if result_pool != pool:
            raise ClaimError(
                f"{where} allocates device {device} of driver {driver} from pool {result_pool!r}, which is not "
                f"this node's ({pool}); refusing to prepare it here"
            )
        consumed = result.get("consumedCapacity") or {}
        tolerations = result.get("tolerations") or []
        mine.append(
            AllocatedDevice(
                request=request,
                pool=result_pool,
                device=device,
                share_id=result.get("shareID") or None,
                admin_access=bool(result.get("adminAccess")),
                consumed={str(k): str(v) for k, v in consumed.items()}
                if isinstance(consumed, (dict, Mapping))
                else {},
                tolerations=tuple(t for t in tolerations if isinstance(t, (dict, Mapping)))
                if isinstance(tolerations, (list, Sequence))
                else (),
            )
        )
    if not mine:
        raise ClaimError(f"ResourceClaim {ref} allocates no device of driver {driver}")
    configs = _configs(allocation, driver, ref, {d.request for d in mine})
    return ClaimAllocation(namespace, name, uid, tuple(mine), configs)


# A request no config names: one object for all (frozen; merged_with makes a new one).
_NO_CONFIG = DeviceConfig()


def _configs(
    allocation: Mapping[str, Any], driver: str, ref: str, requests: set[str]
) -> dict[str, DeviceConfig]:
    """Merge this driver's opaque configs per request. The API lists the class's configs first, then the
    claim's, so later entries override earlier ones (``env`` key by key); an entry without ``requests``
    applies to every request (a request also matches its parent's name: ``gpu`` configures ``gpu/a100``)."""
    entries = _get(allocation, "devices", "config") or []
    merged: dict[str, DeviceConfig] = dict.fromkeys(requests, _NO_CONFIG)
    for n, entry in enumerate(entries if isinstance(entries, (list, Sequence)) else []):
        opaque = _get(entry, "opaque")
        if not isinstance(opaque, (dict, Mapping)) or opaque.get("driver") != driver:
            continue
        source = _get(entry, "source") or "FromClaim"
        try:
            config = parse_device_config(opaque.get("parameters"))
        except (ValueError, ValidationError) as exc:
            raise ClaimError(
                f"ResourceClaim {ref}: opaque config {n} ({source}) for driver {driver} is invalid: {exc}"
            ) from None
        targets = _get(entry, "requests") or []
        for request in requests:
            parent = request.split("/", 1)[0]
            if not targets or request in targets or parent in targets:
                merged[request] = merged[request].merged_with(config)
    return merged

"""The node inventory annotation: what the node daemon publishes, what the scheduler reads.

One annotation per resource family, ``kxpu.io/devices.<domain>_<name>`` (e.g.
``kxpu.io/devices.nvidia.com_gpu``), holding versioned JSON::

    {"version": "v1", "resource": "nvidia.com/gpu", "publishedAt": 1700000000.0,
     "devices": [{"id": "gpu-0", "uuid": "GPU-…", "model": "NVIDIA A100", "index": 0,
                  "memoryMiB": 40960, "memoryCapacityMiB": 40960, "coreCapacity": 100,
                  "splitCount": 10, "numa": 0, "healthy": true, "cores": 108}]}

Decoding is strict: a node annotation is input from outside the scheduler, so unknown
versions, unknown or missing keys, wrong types, impossible numbers and duplicate IDs are
refused with an error naming the field (the node is then treated as having no devices of
that family), never half-read.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kxpu.sharing.model import NodeInventory, SharedDevice

VERSION = "v1"
ANNOTATION_PREFIX = "kxpu.io/devices."
# Set by the node daemon on nodes that publish an inventory: the extender watches only those nodes.
SHARING_NODE_LABEL = "kxpu.io/sharing"
_MAX_NAME = 63


class InventoryError(ValueError):
    """The annotation is not a valid inventory."""


def annotation_key(resource: str) -> str:
    """The annotation holding ``resource``'s inventory (a hash when the name would be too long)."""
    suffix = resource.replace("/", "_")
    name = "devices." + suffix
    if len(name) > _MAX_NAME:
        name = "devices." + hashlib.sha256(resource.encode()).hexdigest()[:32]
    return "kxpu.io/" + name


def encode(inventory: NodeInventory) -> str:
    devices = []
    for d in inventory.devices:
        item: dict[str, Any] = {
            "id": d.id,
            "uuid": d.uuid,
            "model": d.model,
            "index": d.index,
            "memoryMiB": d.memory_mib,
            "memoryCapacityMiB": d.memory_capacity_mib,
            "coreCapacity": d.core_capacity,
            "splitCount": d.split_count,
            "numa": d.numa,
            "healthy": d.healthy,
        }
        if d.cores is not None:
            item["cores"] = d.cores
        devices.append(item)
    doc = {
        "version": VERSION,
        "resource": inventory.resource,
        "publishedAt": inventory.published_at,
        "devices": devices,
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


_DEVICE_KEYS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    # key: (type, required)
    "id": (str, True),
    "uuid": (str, True),
    "model": (str, True),
    "index": (int, True),
    "memoryMiB": (int, True),
    "memoryCapacityMiB": (int, True),
    "coreCapacity": (int, True),
    "splitCount": (int, True),
    "numa": ((int, type(None)), True),
    "healthy": (bool, True),
    "cores": ((int, type(None)), False),
}


def _check_type(value: Any, kind: type | tuple[type, ...], where: str) -> None:
    # bool is an int in Python; never accept one for the other.
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise InventoryError(f"{where}: expected {_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise InventoryError(f"{where}: expected {_names(kinds)}, got {type(value).__name__}")


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _device(item: Any, n: int) -> SharedDevice:
    where = f"devices[{n}]"
    if not isinstance(item, dict):
        raise InventoryError(f"{where}: expected an object")
    unknown = sorted(set(item) - set(_DEVICE_KEYS))
    if unknown:
        raise InventoryError(f"{where}: unknown keys {', '.join(unknown)}")
    for key, (kind, required) in _DEVICE_KEYS.items():
        if key not in item:
            if required:
                raise InventoryError(f"{where}.{key}: missing")
            continue
        _check_type(item[key], kind, f"{where}.{key}")
    if not item["id"] or not item["uuid"]:
        raise InventoryError(f"{where}: id and uuid must not be empty")
    for key in ("index", "memoryMiB", "memoryCapacityMiB", "coreCapacity"):
        if item[key] < 0:
            raise InventoryError(f"{where}.{key}: must not be negative")
    if item["splitCount"] < 1:
        raise InventoryError(f"{where}.splitCount: must be at least 1")
    if item["numa"] is not None and item["numa"] < 0:
        raise InventoryError(f"{where}.numa: must not be negative")
    cores = item.get("cores")
    if cores is not None and cores < 0:
        raise InventoryError(f"{where}.cores: must not be negative")
    return SharedDevice(
        id=item["id"],
        uuid=item["uuid"],
        model=item["model"],
        memory_mib=item["memoryMiB"],
        memory_capacity_mib=item["memoryCapacityMiB"],
        core_capacity=item["coreCapacity"],
        split_count=item["splitCount"],
        numa=item["numa"],
        healthy=item["healthy"],
        index=item["index"],
        cores=cores,
    )


def decode(text: str, resource: str | None = None) -> NodeInventory:
    """Parse and validate an inventory annotation; ``resource``, if given, must match."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InventoryError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InventoryError("expected a JSON object")
    version = doc.get("version")
    if version != VERSION:
        raise InventoryError(f"version {version!r} is not supported (this scheduler reads {VERSION!r})")
    unknown = sorted(set(doc) - {"version", "resource", "publishedAt", "devices"})
    if unknown:
        raise InventoryError(f"unknown keys {', '.join(unknown)}")
    if not isinstance(doc.get("resource"), str):
        raise InventoryError("resource: expected a string")
    if resource is not None and doc["resource"] != resource:
        raise InventoryError(f"resource: {doc['resource']!r}, expected {resource!r}")
    published = doc.get("publishedAt")
    if isinstance(published, bool) or not isinstance(published, int | float) or not math.isfinite(published):
        raise InventoryError("publishedAt: expected a number of seconds")
    items = doc.get("devices")
    if not isinstance(items, list):
        raise InventoryError("devices: expected a list")
    devices = tuple(_device(item, n) for n, item in enumerate(items))
    ids = [d.id for d in devices]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise InventoryError(f"devices: duplicate ids {', '.join(duplicates)}")
    return NodeInventory(doc["resource"], devices, float(published))

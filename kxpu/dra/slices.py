"""ResourceSlice content from kxpu devices: pure functions, no API calls (``publisher.py`` writes them).

One pool per node and driver, named after the node. Each kxpu ``Device`` becomes one DRA device
with typed attributes the scheduler's CEL selectors read, and capacities:

| attribute / capacity | from |
|---|---|
| ``id`` (string) | the kxpu device ID, as the device plugin would name it |
| ``model``, ``uuid`` (string), ``index`` (int) | the backend's ``Device`` |
| ``resource.kubernetes.io/numaNode`` (int), ``resource.kubernetes.io/pciBusID`` (string, ``0000:07:00.0``), ``resource.kubernetes.io/pcieRoot`` (string, ``pci0000:00``) | standard names (``k8s.io/dynamic-resource-allocation/deviceattribute``) |
| ``linkDomain`` (string) | devices joined by NVLink / xGMI / HCCS share it (``matchAttribute``) |
| each ``Device.extra`` key, camelCased (int, bool, string; a ``…Version`` that is semver → version) | vendor facts |
| capacity ``memory`` (bytes, written in Mi), ``cores`` | ``memory_mib``, ``cores`` |

An unhealthy device is either **tainted** (a key per fault class, the effect ``dra.taints`` gives that
class, the value its reason: ``kxpu.dra.taints``; it stays visible with the reason) or **withdrawn** from
the slice (for API servers without device taints; a fault whose effect is ``None`` keeps the device
published, untainted). A pool is split into slices
of at most 128 devices, 64 when taints may be used (the API's limit for slices using them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kxpu.dra.names import device_name
from kxpu.dra.taints import TaintPolicy
from kxpu.logs import get_logger
from kxpu.model import MAX_NUMA_NODE, CounterSet, Device, pci_address

log = get_logger("kxpu.dra.slices")

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64  # also with counters: the API's limit for "advanced" devices
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_VALUE = 64
MAX_IDENTIFIER = 32
DEFAULT_TAINTS = TaintPolicy()  # every fault NoSchedule
# Still held by a pod that got it through the device plugin (a node moving from the device plugin to DRA).
HELD_TAINT_KEY = "kxpu.io/held-by-device-plugin"
INT64_MAX = 2**63 - 1
# Kubernetes' standard attributes (k8s.io/dynamic-resource-allocation/deviceattribute).
NUMA_NODE = "resource.kubernetes.io/numaNode"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

Unhealthy = Literal["taint", "withdraw"]

_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """Consumable capacity (``dra.shares``): devices allow several allocations, each consuming memory (MiB,
    in steps) and cores (percent); a request naming no amount takes the whole device."""

    memory_step_mib: int = 256
    min_memory_mib: int = 256
    memory_scaling: float = 1.0
    core_scaling: float = 1.0

    def memory_capacity_mib(self, device: Device) -> int | None:
        return None if device.memory_mib is None else int(device.memory_mib * self.memory_scaling)

    def core_capacity(self) -> int:
        return int(100 * self.core_scaling)

    def memory_default_mib(self, device: Device) -> int | None:
        """The memory a claim naming no amount consumes (the scheduler fills ``consumedCapacity`` with it): the
        whole capacity rounded down to the step (the API wants the default a multiple of it); None when the
        device's memory is not published as consumable."""
        memory = self.memory_capacity_mib(device)
        step = self.memory_step_mib
        if memory is None or memory < max(step, self.min_memory_mib + step):
            return None
        return memory // step * step


@dataclass(frozen=True, slots=True)
class PoolContent:
    """What one node's pool holds at one generation: the slice specs, in order."""

    driver: str
    node: str
    generation: int
    slices: tuple[dict[str, Any], ...]


def camel(key: str) -> str:
    """``compute_capability`` → ``computeCapability`` (the convention of DRA drivers' attributes)."""
    head, *rest = key.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def as_version(text: str) -> str | None:
    """A semantic version for the API's ``version`` type, if ``text`` is one once tidied:
    ``580.159.04`` → ``580.159.4``, ``2.31`` → ``2.31.0``; else None (published as a string)."""
    core, sep, rest = text.strip().partition("-")
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    parts = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    candidate = ".".join(parts) + (sep + rest if sep else "")
    return candidate if _SEMVER.match(candidate) else None


def attribute_value(key: str, value: str | int | bool) -> dict[str, Any] | None:
    """The typed JSON of one attribute, or None when the API would refuse the value."""
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value} if -INT64_MAX - 1 <= value <= INT64_MAX else None
    text = str(value)
    if key.lower().endswith("version"):
        version = as_version(text)
        if version is not None and len(version) <= MAX_STRING_VALUE:
            return {"version": version}
    return {"string": text} if len(text) <= MAX_STRING_VALUE else None


def device_attributes(device: Device) -> dict[str, dict[str, Any]]:
    attrs: dict[str, dict[str, Any]] = {"id": {"string": device.id}}
    if device.model:
        attrs["model"] = {"string": device.model[:MAX_STRING_VALUE]}
    if device.uuid:
        attrs["uuid"] = {"string": device.uuid[:MAX_STRING_VALUE]}
    if device.index is not None:
        attrs["index"] = {"int": device.index}
    if device.numa_nodes and 0 <= device.numa_nodes[0] <= MAX_NUMA_NODE:
        attrs[NUMA_NODE] = {"int": device.numa_nodes[0]}
    bus_id = pci_address(device.pci_bus_id)  # NVML's 8-digit domain is not the standard form
    if bus_id:
        attrs[PCI_BUS_ID] = {"string": bus_id}
    if device.pcie_root and _PCIE_ROOT.match(device.pcie_root):
        attrs[PCIE_ROOT] = {"string": device.pcie_root}
    if device.link_domain and len(device.link_domain) <= MAX_STRING_VALUE:
        attrs["linkDomain"] = {"string": device.link_domain}
    for key in sorted(device.extra):
        name = camel(key)
        if name in attrs or not _C_IDENTIFIER.match(name) or len(name) > MAX_IDENTIFIER:
            continue
        value = attribute_value(name, device.extra[key])
        if value is not None:
            attrs[name] = value
    return attrs


_BINARY_SUFFIXES = (("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def binary_quantity(num_bytes: int) -> str:
    """A byte count in the canonical form the API server stores (``16384Mi`` comes back as ``16Gi``), so
    that what kxpu publishes compares equal to what it reads back."""
    for suffix, size in _BINARY_SUFFIXES:
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{suffix}"
    return str(num_bytes)


def device_capacity(device: Device) -> dict[str, dict[str, str]]:
    capacity: dict[str, dict[str, str]] = {}
    if device.memory_mib is not None:
        capacity["memory"] = {"value": binary_quantity(device.memory_mib * 2**20)}
    if device.cores is not None:
        capacity["cores"] = {"value": str(device.cores)}
    return capacity


def shared_capacity(device: Device, policy: SharePolicy) -> dict[str, dict[str, Any]]:
    """Capacities with request policies: the default is the whole (a claim that names no amount is exclusive),
    requests are rounded up to the step (the API wants the default a multiple of it)."""
    capacity: dict[str, dict[str, Any]] = {}
    memory = policy.memory_capacity_mib(device)
    step = policy.memory_step_mib
    whole = policy.memory_default_mib(device)
    if memory is not None and whole is not None:
        capacity["memory"] = {
            "value": binary_quantity(memory * 2**20),
            "requestPolicy": {
                "default": binary_quantity(whole * 2**20),
                "validRange": {
                    "min": binary_quantity(policy.min_memory_mib * 2**20) if policy.min_memory_mib else "0",
                    "step": binary_quantity(step * 2**20),
                },
            },
        }
    cores = policy.core_capacity()
    # min 0: a share may take no compute (best-effort time-sharing, no SM limit), as the extender path's
    # gpucores default; a request below min would be raised to it and limit the container to 1 %
    capacity["cores"] = {
        "value": str(cores),
        "requestPolicy": {"default": str(cores), "validRange": {"min": "0", "max": str(cores), "step": "1"}},
    }
    return capacity


def device_entry(
    device: Device,
    unhealthy: Unhealthy,
    shares: SharePolicy | None = None,
    held: bool = False,
    taints: TaintPolicy = DEFAULT_TAINTS,
) -> dict[str, Any]:
    capacity = device_capacity(device) if shares is None else shared_capacity(device, shares)
    attrs = device_attributes(device)
    room = MAX_ATTRIBUTES_AND_CAPACITIES - len(capacity)
    if len(attrs) > room:
        dropped = list(attrs)[room:]
        log.warning(
            "device has more facts than a ResourceSlice holds; dropping some",
            device=device.id,
            dropped=dropped,
        )
        attrs = dict(list(attrs.items())[:room])
    entry: dict[str, Any] = {"name": device_name(device.id), "attributes": attrs}
    if capacity:
        entry["capacity"] = capacity
    if shares is not None:
        entry["allowMultipleAllocations"] = True
    if device.consumes:  # backends name counter sets and counters freely; the API wants DNS labels
        entry["consumesCounters"] = [
            {
                "counterSet": device_name(name),
                "counters": {device_name(c): {"value": str(v)} for c, v in sorted(counters.items())},
            }
            for name, counters in sorted(device.consumes.items())
        ]
    published = []
    fault = taints.fault_taint(device) if unhealthy == "taint" else None
    if fault is not None:
        published.append(fault)
    if held:
        published.append({"key": HELD_TAINT_KEY, "value": "true", "effect": "NoSchedule"})
    if published:
        entry["taints"] = published
    return entry


def pool_content(
    driver: str,
    node: str,
    devices: Sequence[Device],
    generation: int,
    unhealthy: Unhealthy,
    shares: SharePolicy | None = None,
    held: frozenset[str] = frozenset(),
    counter_sets: Sequence[CounterSet] = (),
    taints: TaintPolicy = DEFAULT_TAINTS,
) -> PoolContent:
    """The pool's slices at ``generation``: devices in the backend's order (the allocator's first-fit
    order), withdrawn ones left out. A pool with no device still has one empty slice, so consumers see
    the pool (and that it is empty) rather than nothing."""
    # Withdrawal leaves out what taints would keep from new claims: devices with a fault whose effect is not None
    # and devices device-plugin pods still hold.
    entries = [
        device_entry(d, unhealthy, shares, d.id in held, taints)
        for d in devices
        if unhealthy == "taint" or (taints.schedulable(d) and d.id not in held)
    ]
    advanced = unhealthy == "taint" or bool(counter_sets)
    size = MAX_DEVICES_PER_SLICE_WITH_TAINTS if advanced else MAX_DEVICES_PER_SLICE
    chunks: list[dict[str, Any]] = [
        {"devices": entries[i : i + size]} for i in range(0, len(entries), size)
    ] or [{"devices": []}]
    # Counter sets live in slices of their own (a slice holds devices or counters, not both).
    sets = [
        {
            "name": device_name(c.name),
            "counters": {device_name(k): {"value": str(v)} for k, v in sorted(c.counters.items())},
        }
        for c in counter_sets
    ]
    chunks += [
        {"sharedCounters": sets[i : i + MAX_COUNTER_SETS_PER_SLICE]}
        for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
    ]
    slices = tuple(
        {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)},
            **chunk,
        }
        for chunk in chunks
    )
    return PoolContent(driver, node, generation, slices)


def comparable(device: Mapping[str, Any]) -> dict[str, Any]:
    """A device as kxpu writes it, from a device as kxpu wrote it or as the API server returns it (which adds
    each taint's ``timeAdded``)."""
    out = {
        key: device[key]
        for key in ("name", "attributes", "capacity", "allowMultipleAllocations", "consumesCounters")
        if device.get(key)
    }
    taints = [{k: t[k] for k in ("key", "value", "effect") if k in t} for t in device.get("taints") or []]
    if taints:
        out["taints"] = taints
    return out


def same_devices(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> bool:
    """Whether two slice spec lists publish the same devices and counters (ignoring the pool's generation)."""

    def content(specs: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [
            ([comparable(d) for d in s.get("devices") or []], s.get("sharedCounters") or []) for s in specs
        ]

    return content(a) == content(b)

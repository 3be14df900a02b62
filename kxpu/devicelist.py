"""What ``kxpu devices`` prints: a table as kubectl prints one, or a stable JSON/YAML document.

The table has a header and aligned columns, one row per device of every resource, ``<none>`` where a
value is unknown, and the health reason beside an unhealthy device (what the daemon's ``/status`` and
``kxpu status`` call it). ``-o wide`` adds the identifying columns and the node labels the backends
would publish. The document (``-o json|yaml``) is the interface scripts use and is documented in the
README: a mapping from resource name to ``{backend, devices, labels?, error?}``; every device has
``id``, ``health``, ``reason`` (null while healthy) and ``numa_nodes``, and the facts its backend knows
(``model``, ``uuid``, ``index``, ``memory_mib``, ``cores``, ``pci_bus_id``, ``extra``); unknown ones are
left out, never null.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kxpu.model import Device

NONE = "<none>"
OUTPUTS = ("table", "wide", "json", "yaml")


@dataclass
class Listing:
    """Discovery's answer per resource, in config order."""

    backends: dict[str, str] = field(default_factory=dict)  # resource → backend key
    devices: dict[str, list[Device]] = field(default_factory=dict)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def device_to_json(device: Device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": device.id,
        "health": device.health.value,
        "reason": None if device.healthy else (device.health_reason or "unknown"),
        "numa_nodes": list(device.numa_nodes),
    }
    for key in ("model", "uuid", "index", "memory_mib", "cores", "pci_bus_id", "pcie_root", "link_domain"):
        value = getattr(device, key)
        if value is not None:
            out[key] = value
    if device.extra:
        out["extra"] = dict(device.extra)
    return out


def document(listing: Listing) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name, backend in listing.backends.items():
        entry: dict[str, Any] = {
            "backend": backend,
            "devices": [device_to_json(d) for d in listing.devices.get(name, [])],
        }
        if name in listing.labels:
            entry["labels"] = dict(sorted(listing.labels[name].items()))
        if name in listing.errors:
            entry["error"] = listing.errors[name]
        doc[name] = entry
    return doc


def _text(value: object) -> str:
    return NONE if value is None or value == "" else str(value)


def table(rows: Sequence[Sequence[str]]) -> str:
    """Columns as kubectl aligns them: left-aligned, three spaces apart, no trailing blanks."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _row(resource: str, d: Device, wide: bool) -> list[str]:
    row = [
        resource,
        d.id,
        d.health.value,
        NONE if d.healthy else (d.health_reason or "unknown"),
        _text(d.model),
        NONE if d.memory_mib is None else f"{d.memory_mib}Mi",
        ",".join(map(str, d.numa_nodes)) or NONE,
    ]
    if wide:
        extra = ",".join(f"{k}={v}" for k, v in sorted(d.extra.items()))
        row += [_text(d.index), _text(d.uuid), _text(d.pci_bus_id), _text(d.cores), extra or NONE]
    return row


HEADER = ["RESOURCE", "DEVICE", "HEALTH", "REASON", "MODEL", "MEMORY", "NUMA"]
WIDE_HEADER = [*HEADER, "INDEX", "UUID", "PCI-BUS-ID", "CORES", "EXTRA"]


def render(listing: Listing, output: str) -> str:
    """The text for stdout (errors go to stderr, see ``error_lines``); empty when nothing was found."""
    if output == "json":
        return json.dumps(document(listing), indent=2)
    if output == "yaml":
        return yaml.safe_dump(document(listing), sort_keys=False, default_flow_style=False).rstrip("\n")
    wide = output == "wide"
    rows = [_row(name, d, wide) for name in listing.backends for d in listing.devices.get(name, [])]
    parts = [table([WIDE_HEADER if wide else HEADER, *rows])] if rows else []
    if wide:
        labels = [
            [name, key, value]
            for name, found in listing.labels.items()
            for key, value in sorted(found.items())
        ]
        if labels:
            parts.append(table([["RESOURCE", "NODE LABEL", "VALUE"], *labels]))
    return "\n\n".join(parts)


def error_lines(errors: Mapping[str, str]) -> list[str]:
    return [f"kxpu: error: {name}: {error}" for name, error in errors.items()]

"""CDI (Container Device Interface) specs: names, validation, the minimum version, and atomic files.

The rules are the CDI specification's (cncf-tags/container-device-interface): a kind is
``vendor/class``, both starting with a letter and ending with a letter or digit, made of
letters, digits, ``_``, ``-`` and ``.``; a device name starts and ends with a letter or
digit and may also hold ``:``. The ``cdiVersion`` written is the lowest the content needs
(0.3.0 for plain env/devices/mounts, 0.5.0 once a device node has a ``hostPath`` or a name
starts with a digit, 0.6.0 for a ``.`` in the class or annotations), so runtimes with an
older CDI library (containerd 1.7, CRI-O) still load it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kxpu.atomicfile import write_atomically
from kxpu.cdi.config import validate_kind
from kxpu.model import ContainerEdits

KNOWN_VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0")
ANNOTATION_PREFIX = "cdi.k8s.io/"
MAX_ANNOTATION_NAME = 63

_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_ANNOTATION_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")

Spec = dict[str, Any]


def is_device_name(name: str) -> bool:
    return bool(_DEVICE_NAME.match(name))


def qualified_name(kind: str, name: str) -> str:
    return f"{kind}={name}"


def annotation_key(plugin: str, device: str) -> str:
    """``cdi.k8s.io/<plugin>_<device>``, made name-safe and at most 63 characters after the prefix."""
    name = _UNSAFE.sub("_", f"{plugin}_{device}").strip("_.-")
    if len(name) > MAX_ANNOTATION_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = name[: MAX_ANNOTATION_NAME - 11].rstrip("_.-") + "_" + digest
    return ANNOTATION_PREFIX + name


def spec_file_name(kind: str) -> str:
    vendor, _, cls = kind.partition("/")
    return f"kxpu-{vendor}-{cls}.json"


def edits_to_cdi(edits: ContainerEdits) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits.env:
        out["env"] = [f"{key}={value}" for key, value in edits.env.items()]
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            entry: dict[str, Any] = {"path": node.container_path}
            if node.host_path != node.container_path:
                entry["hostPath"] = node.host_path
            entry["permissions"] = node.permissions
            nodes.append(entry)
        out["deviceNodes"] = nodes
    if edits.mounts:
        out["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["ro" if m.read_only else "rw", "bind"],
            }
            for m in edits.mounts
        ]
    return out


def minimum_version(spec: Mapping[str, Any]) -> str:
    version = "0.3.0"
    cls = str(spec.get("kind", "")).partition("/")[2]
    devices = spec.get("devices", [])
    edits = [spec.get("containerEdits") or {}, *[d.get("containerEdits") or {} for d in devices]]
    if any("hostPath" in n for e in edits for n in e.get("deviceNodes", [])) or any(
        d.get("name", "x")[:1].isdigit() for d in devices
    ):
        version = "0.5.0"
    if "." in cls or spec.get("annotations") or any(d.get("annotations") for d in devices):
        version = "0.6.0"
    return version


def build_spec(kind: str, devices: Sequence[tuple[str, ContainerEdits]]) -> Spec:
    """One ``devices[]`` entry per (name, edits); the version is the lowest that fits the content."""
    spec: Spec = {
        "cdiVersion": "",
        "kind": kind,
        "devices": [{"name": name, "containerEdits": edits_to_cdi(edits)} for name, edits in devices],
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


_EDIT_FIELDS = frozenset(
    {"env", "deviceNodes", "mounts", "hooks", "intelRdt", "additionalGids", "netDevices"}
)


def _check_edits(edits: Mapping[str, Any], where: str, device: bool) -> list[str]:
    errors: list[str] = []
    for key in edits:
        if key not in _EDIT_FIELDS:
            errors.append(f"{where}: unknown containerEdits field {key!r}")
    if device and not any(edits.get(k) for k in ("env", "deviceNodes", "mounts", "hooks")):
        errors.append(f"{where}: a device's containerEdits must not be empty")
    for env in edits.get("env", []):
        if not isinstance(env, str) or env.find("=") <= 0:
            errors.append(f"{where}: env entry {env!r} is not K=V")
    for node in edits.get("deviceNodes", []):
        if not node.get("path"):
            errors.append(f"{where}: device node without a path")
        perms = node.get("permissions", "")
        if perms and set(perms) - set("rwm"):
            errors.append(f"{where}: device node permissions {perms!r} are not a mix of r, w, m")
    for mount in edits.get("mounts", []):
        if not mount.get("hostPath") or not mount.get("containerPath"):
            errors.append(f"{where}: a mount needs hostPath and containerPath")
    return errors


def validate_spec(spec: Mapping[str, Any]) -> list[str]:
    """Every way ``spec`` breaks the CDI rules a runtime enforces when it loads it (empty: valid)."""
    errors: list[str] = []
    version = spec.get("cdiVersion")
    if version not in KNOWN_VERSIONS:
        errors.append(f"cdiVersion {version!r} is not a released CDI version")
    elif tuple(map(int, str(version).split("."))) < tuple(map(int, minimum_version(spec).split("."))):
        errors.append(f"cdiVersion {version} is older than the content needs ({minimum_version(spec)})")
    return errors + _content_errors(spec)


def _content_errors(spec: Mapping[str, Any]) -> list[str]:
    """``validate_spec`` but for the version (``build_spec`` sets the lowest that fits: checking it again costs a
    DRA prepare more than the rest of the check)."""
    errors: list[str] = []
    try:
        validate_kind(str(spec.get("kind", "")))
    except ValueError as exc:
        errors.append(str(exc))
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        errors.append("a spec needs at least one device")
        devices = []
    seen: set[str] = set()
    for n, device in enumerate(devices):
        name = device.get("name", "")
        where = f"devices[{n}] ({name})"
        if not is_device_name(name):
            errors.append(f"{where}: {name!r} is not a valid CDI device name")
        if name in seen:
            errors.append(f"{where}: device name repeated")
        seen.add(name)
        errors += _check_edits(device.get("containerEdits") or {}, where, device=True)
    if spec.get("containerEdits"):
        errors += _check_edits(spec["containerEdits"], "containerEdits", device=False)
    for key in set(spec) - {"cdiVersion", "kind", "devices", "containerEdits", "annotations"}:
        errors.append(f"unknown top-level field {key!r}")
    return errors


def write_spec(spec_dir: Path, spec: Spec) -> Path:
    """Write atomically (temp file in the same directory, then rename): runtimes never read half a spec."""
    path = spec_dir / spec_file_name(spec["kind"])
    write_atomically(path, json.dumps(spec, indent=2) + "\n")
    return path


class InvalidSpec(ValueError):
    """The spec breaks the CDI rules (the message names each way, ``; ``-joined): nothing was written."""


def write_device_spec(path: Path | str, kind: str, devices: Sequence[tuple[str, ContainerEdits]]) -> None:
    """Build the spec of ``devices``, check it and write it atomically at ``path`` (a DRA claim's own file):
    InvalidSpec before writing a spec a runtime would refuse, OSError when it cannot be written. Compact: json's
    C encoder serves only calls without indent (the indenting one is pure Python)."""
    spec = build_spec(kind, devices)
    errors = _content_errors(spec)
    if errors:
        raise InvalidSpec("; ".join(errors))
    write_atomically(path, json.dumps(spec, separators=(",", ":")) + "\n")

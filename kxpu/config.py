"""The config file: typed models, validated once at load, passed down.

Each resource names exactly one backend by its key; that section is validated by the
backend's own model from the registry. Errors name the field (``resources[1].simulated.count``)
and say what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

import kxpu.backends  # noqa: F401  (registers the built-in backends)
from kxpu.backends.registry import BackendConfig, known_keys, lookup, refuse_set_while_off
from kxpu.cdi.config import CdiConfig, validate_kind
from kxpu.dra.config import (
    DEFAULT_KUBELET_PLUGINS_DIR,
    DEFAULT_PLUGINS_REGISTRY_DIR,
    DraConfig,
    check_dra_socket_paths,
    default_driver_name,
)
from kxpu.logs import one_line
from kxpu.sharing.config import SharingConfig

# How a second daemon takes a device-plugin resource over (Config.device_plugin_handover says how each works).
Handover = Literal["standby", "alongside"]

DEFAULT_DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
KUBELET_CHECKPOINT = "kubelet_internal_checkpoint"

# The kubelet's rules for an extended resource name (v1helper.IsExtendedResourceName):
# "domain/name", not in the kubernetes.io domains, not "requests.*", and "requests.<name>"
# must be a qualified name.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def check_extended_resource_name(name: str) -> str:
    if "/" not in name:
        raise ValueError(
            f"{name!r} is not an extended resource name: it needs a domain, e.g. example.com/npu"
        )
    if "kubernetes.io/" in name:
        raise ValueError(f"{name!r} is in a kubernetes.io domain, which is reserved for native resources")
    if name.startswith("requests."):
        raise ValueError(f"{name!r} must not start with 'requests.'")
    prefix, _, short = ("requests." + name).partition("/")
    if "/" in short:
        raise ValueError(f"{name!r} has more than one '/'")
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        raise ValueError(f"the domain of {name!r} must be a lowercase DNS subdomain")
    if len(short) > 63 or not _QUALIFIED_NAME_PART.match(short):
        raise ValueError(
            f"the name part of {name!r} must be at most 63 characters of letters, digits, '-', '_', '.', "
            "starting and ending with a letter or digit"
        )
    return name


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class ResourceConfig(_Model):
    name: str
    backend: str = Field(description="the backend key that appeared in the file")
    backend_config: BackendConfig
    cdi: CdiConfig = Field(default_factory=CdiConfig)
    sharing: SharingConfig | None = Field(
        default=None, description="fractional sharing (kxpu.sharing.config)"
    )
    serve: Literal["devicePlugin", "dra"] = Field(
        default="devicePlugin",
        description="how the kubelet gets the devices: the Device Plugin API, or Dynamic Resource Allocation",
    )
    dra: DraConfig = Field(default_factory=DraConfig)

    @property
    def dra_unserved(self) -> bool:
        """A ``dra:`` section on a resource not served through DRA: it only applies to draining the claims
        left from when it was (``kxpu.dra.leftover``), so it is kept, but almost always means a forgotten
        ``serve: dra``, which ``kxpu plugin`` and ``kxpu devices`` warn about."""
        return self.serve != "dra" and "dra" in self.model_fields_set

    @property
    def cdi_kind(self) -> str:
        return self.cdi.kind or self.name

    @property
    def dra_driver(self) -> str:
        """The DRA driver name (also the kubelet plugin's name and every ResourceSlice's ``spec.driver``)."""
        return self.dra.driver_name or default_driver_name(self.name)

    @model_validator(mode="after")
    def _serving(self) -> ResourceConfig:
        if self.serve != "dra":
            why = self.backend_config.dra_only()
            if why is not None:
                raise ValueError(f"{why}: only DRA can serve that (set serve: dra)")
            return self
        if self.cdi.enabled:
            raise ValueError(
                "cdi: applies to the device plugin's Allocate answer; a resource served through DRA always gets "
                "per-claim CDI specs (set dra.cdiSpecDir instead)"
            )
        if self.sharing is not None:
            raise ValueError(
                "sharing: is fractional sharing through the scheduler extender, which needs serve: devicePlugin"
            )
        self.dra_driver  # noqa: B018  (raises ValueError naming the fix when no driver name can be derived)
        return self

    @model_validator(mode="after")
    def _cdi_kind(self) -> ResourceConfig:
        if self.cdi.enabled and self.cdi.kind is None:
            try:
                validate_kind(self.name)
            except ValueError as exc:
                raise ValueError(
                    f"cdi.kind: the resource name is not a usable CDI kind ({exc}); set cdi.kind"
                ) from None
        return self

    @field_validator("name")
    @classmethod
    def _extended_resource_name(cls, value: str) -> str:
        return check_extended_resource_name(value)

    @model_validator(mode="before")
    @classmethod
    def _pick_backend(cls, data: Any) -> Any:
        """Turn ``{name, <backendKey>: {...}}`` into ``{name, backend, backend_config}``."""
        if not isinstance(data, dict) or "backend" in data:
            return data
        own = {"name", "cdi", "sharing", "serve", "dra"}
        candidates = [k for k in data if k not in own]
        unknown = [k for k in candidates if lookup(k) is None]
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))}; a resource takes 'name' and exactly one "
                f"backend key out of: {', '.join(known_keys())}"
            )
        if len(candidates) != 1:
            found = ", ".join(candidates) or "none"
            raise ValueError(f"a resource needs exactly one backend key (found: {found})")
        key = candidates[0]
        spec = lookup(key)
        assert spec is not None
        section = data[key] if data[key] is not None else {}
        rest = {k: v for k, v in data.items() if k != key}
        try:
            parsed = spec.config_model.model_validate(section)
        except ValidationError as exc:
            raise _SectionErrors(_error_lines(exc, prefix=key)) from None
        if isinstance(rest.get("name"), str):
            try:
                rest["name"] = parsed.resource_name(rest["name"])
            except ValueError as exc:
                raise _SectionErrors([(key, str(exc))]) from None
        return {**rest, "backend": key, "backend_config": parsed}


class TelemetryConfig(_Model):
    """``telemetry:``: sample backends that can measure their devices, and say which pod uses what.

    Processes are tied to pods through ``<hostRoot>/proc/<pid>/cgroup`` (the host's PID namespace: run
    the daemon with hostPID, or mount the host's / at hostRoot), the kubelet's device checkpoint in the
    device-plugin directory and its PodResources API. See docs/telemetry.md."""

    enabled: bool = False
    interval_seconds: float = Field(default=10.0, ge=0.1, le=3600)
    host_root: Path = Path("/")
    kubelet_checkpoint: Path | None = Field(
        default=None, description="default: <devicePluginDir>/kubelet_internal_checkpoint"
    )
    events: bool = Field(
        default=False, description="a Warning event on a pod whose container exceeds its grant (API access)"
    )

    @field_validator("host_root", "kubelet_checkpoint")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"{value} must be an absolute path")
        return value

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        # before 2026-11 the kubelet's dra_manager_state gave DRA claims their pod UIDs; reservedFor does now
        if isinstance(data, dict) and ("kubeletDraCheckpoint" in data or "kubelet_dra_checkpoint" in data):
            raise ValueError(
                "kubeletDraCheckpoint is no longer read (a DRA claim's pods come from its status.reservedFor): "
                "remove it"
            )
        return data

    @model_validator(mode="after")
    def _not_ignored(self) -> TelemetryConfig:
        refuse_set_while_off(self, "telemetry")
        return self


class Config(_Model):
    version: Literal["v1"]
    device_plugin_dir: Path = DEFAULT_DEVICE_PLUGIN_DIR
    kubelet_plugins_dir: Path = Field(
        default=DEFAULT_KUBELET_PLUGINS_DIR, description="DRA: <dir>/<driver>/dra.sock and its checkpoint"
    )
    plugins_registry_dir: Path = Field(
        default=DEFAULT_PLUGINS_REGISTRY_DIR, description="DRA: where the kubelet finds registration sockets"
    )
    pod_resources_socket: Path = Field(
        default=DEFAULT_POD_RESOURCES_SOCKET,
        description="the kubelet's PodResources API: who holds which device (telemetry; DRA during a migration)",
    )
    device_plugin_handover: Handover = Field(
        default="standby",
        description=(
            "how a second daemon (a rolling update's new pod) takes a device-plugin resource over: standby waits "
            "for the serving one's socket to go (any kubelet; the kubelet counts the devices unhealthy for the "
            "milliseconds between); alongside serves a socket of its own and registers beside it (kubelet 1.37+ "
            "keeps both, so the devices never drop)"
        ),
    )
    resources: list[ResourceConfig] = Field(min_length=1)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @property
    def kubelet_checkpoint(self) -> Path:
        return self.telemetry.kubelet_checkpoint or self.device_plugin_dir / KUBELET_CHECKPOINT

    @field_validator("resources")
    @classmethod
    def _unique_names(cls, value: list[ResourceConfig]) -> list[ResourceConfig]:
        names = [r.name for r in value]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"resource names must be unique; repeated: {', '.join(duplicates)}")
        kinds = [r.cdi_kind for r in value if r.cdi.enabled]
        shared = sorted({k for k in kinds if kinds.count(k) > 1})
        if shared:  # each would overwrite the other's spec file
            raise ValueError(f"CDI kinds must be unique across resources; repeated: {', '.join(shared)}")
        drivers = [r.dra_driver for r in value if r.serve == "dra"]
        twice = sorted({d for d in drivers if drivers.count(d) > 1})
        if twice:  # one kubelet plugin, one pool per node and driver
            raise ValueError(
                f"DRA driver names must be unique across resources; repeated: {', '.join(twice)}"
            )
        return value

    @model_validator(mode="after")
    def _dra_socket_paths(self) -> Config:
        for resource in self.resources:
            if resource.serve == "dra":
                check_dra_socket_paths(
                    self.kubelet_plugins_dir, self.plugins_registry_dir, resource.dra_driver
                )
        return self


class ConfigError(Exception):
    """The config file cannot be used; the message names the file and every bad field, on one line (what
    the file holds, a key with a newline, is escaped)."""

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


def _format_location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out


class _SectionErrors(ValueError):
    """A backend section's errors, kept structured so their locations join the outer ones."""

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{where}: {msg}" for where, msg in lines))
        self.lines = lines


def _error_lines(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False):
        loc = _format_location(tuple(p for p in err["loc"] if p not in ("function-before", "function-after")))
        where = ".".join(p for p in (prefix, loc) if p)
        nested = err.get("ctx", {}).get("error")
        if isinstance(nested, _SectionErrors):
            lines += [(f"{where}.{sub}" if where else sub, msg) for sub, msg in nested.lines]
        else:
            lines.append((where, err["msg"].removeprefix("Value error, ")))
    return lines


# Enough to say what is wrong without burying it: a 10,000-entry list of bad values is one mistake.
MAX_ERRORS_SHOWN = 10
# A config file lists resources; megabytes of it are a mistake (or an attack on the node daemon).
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def _format_errors(exc: ValidationError) -> str:
    lines = [f"{where}: {msg}" if where else msg for where, msg in _error_lines(exc)]
    if len(lines) > MAX_ERRORS_SHOWN:
        lines = [*lines[:MAX_ERRORS_SHOWN], f"and {len(lines) - MAX_ERRORS_SHOWN} more errors"]
    return "; ".join(lines)


def _nul_location(data: Any) -> str | None:
    """Where a string holds a NUL character: no path, env value or name can carry one to a container.

    Raises ConfigError for a container that contains itself (a YAML alias such as ``&a [*a]``). Each
    container is walked once, however many aliases share it (a "billion laughs" file shares a lot)."""
    done: set[int] = set()
    path: set[int] = set()  # the containers being walked: meeting one again is a cycle

    def walk(value: Any, where: str) -> str | None:
        if isinstance(value, str):
            return (where or "(top level)") if "\x00" in value else None
        if not isinstance(value, dict | list) or id(value) in done:
            return None
        if id(value) in path:
            raise ConfigError(f"{where or '(top level)'}: a YAML alias that contains itself")
        path.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            here = f"{where}[{key}]" if isinstance(value, list) else (f"{where}.{key}" if where else str(key))
            if isinstance(key, str) and "\x00" in key:
                return here
            found = walk(item, here)
            if found:
                return found
        path.discard(id(value))
        done.add(id(value))
        return None

    return walk(data, "")


def parse_config(data: Any, source: str = "<config>") -> Config:
    try:
        nul = _nul_location(data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a kxpu config") from None
    if nul is not None:
        raise ConfigError(f"{source}: {nul}: contains a NUL character")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_format_errors(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a kxpu config") from None


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """One line that names the file, the line and the problem (PyYAML's own text names '<unicode string>'
    and spans several lines with carets)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = (
            f" ({exc.context} at line {exc.context_mark.line + 1})"
            if exc.context and exc.context_mark
            else ""
        )
        return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {exc.problem}{context}"
    return f"{path}: not valid YAML: {' '.join(str(exc).split())}"


def load_config(path: Path, device_plugin_dir: Path | None = None) -> Config:
    """Read and validate ``path``; a flag or env var value for the directory wins over the file.

    Every way a file can be unusable ends in ConfigError with one line naming the file."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a kxpu config")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): not a kxpu config") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(path, exc)) from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a kxpu config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping with 'version' and 'resources'")
    config = parse_config(data, str(path))
    if device_plugin_dir is not None:
        config = config.model_copy(update={"device_plugin_dir": device_plugin_dir})
    return config

"""Backends by config key: built-ins register on import, third parties through entry points.

A config resource names its backend by one key (``simulated:``, ``generic:``, …); the
registry maps that key to the backend's pydantic config model and its class, so the
config layer can validate a section it knows nothing about and the daemon can build a
backend without knowing any vendor.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from kxpu.logs import error_text, get_logger
from kxpu.model import Backend

log = get_logger("kxpu.backends.registry")

ENTRY_POINT_GROUP = "kxpu.backends"


class BackendConfig(BaseModel):
    """Base for a backend's config section: camelCase keys in YAML, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    def resource_name(self, configured: str) -> str:
        """The name the section's devices are advertised under; a backend may derive it from the
        configured one (NVIDIA's time-slicing ``renameByDefault`` → ``<name>.shared``) or refuse it
        with ValueError."""
        return configured

    def dra_only(self) -> str | None:
        """Why this section can only be served through DRA (None: either way); refused at load otherwise."""
        return None


def set_while_off(section: BaseModel, switch: str = "enabled") -> list[str]:
    """The keys a file sets in a feature that is off by default and not switched on (its ``switch`` not
    given): they would be accepted and ignored, which nobody writing them means. ``switch: false`` given
    explicitly keeps them off on purpose."""
    if switch in section.model_fields_set or getattr(section, switch):
        return []
    fields = type(section).model_fields
    return sorted(fields[name].alias or name for name in section.model_fields_set)


def refuse_set_while_off(section: BaseModel, what: str, switch: str = "enabled") -> None:
    """ValueError naming the keys ``set_while_off`` finds, and the two ways out."""
    keys = set_while_off(section, switch)
    if keys:
        raise ValueError(
            f"{', '.join(keys)} set, but {what} is off: set {switch}: true to use "
            f"{'them' if len(keys) > 1 else 'it'} (or {switch}: false to keep {what} off)"
        )


@dataclass(frozen=True, slots=True)
class BackendSpec:
    key: str
    config_model: type[BackendConfig]
    factory: Callable[[Any], Backend]


_registry: dict[str, BackendSpec] = {}
_entry_points_loaded = False

B = TypeVar("B", bound=type[Backend])


def register_backend(key: str, config_model: type[BackendConfig]) -> Callable[[B], B]:
    """Class decorator: make a backend available under ``key`` in config files.

    The class is constructed with one argument, its validated config section.
    """

    def decorate(cls: B) -> B:
        existing = _registry.get(key)
        if existing is not None and existing.factory is not cls:
            raise ValueError(f"backend key {key!r} is already registered by {existing.factory!r}")
        _registry[key] = BackendSpec(key, config_model, cls)
        return cls

    return decorate


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()  # importing the module registers its backends
        except Exception as exc:  # one broken package must not take every resource down with a traceback
            log.error(
                "cannot load a backend package; its backends are unavailable",
                entry_point=f"{ep.name} = {ep.value}",
                error=error_text(exc),
            )


def import_backend_module(module: str) -> None:
    """Import a module that registers backends (``kxpu plugin --import mypkg.backend``)."""
    importlib.import_module(module)


# Built-in backends, imported only when a config names them (their config models, vendor libraries):
# every node daemon pays for what it loads.
_LAZY_BUILTINS = {
    "simulated": "kxpu.backends.simulated",
    "generic": "kxpu.backends.generic",
    "nvidia": "kxpu.backends.nvidia",
    "neuron": "kxpu.backends.neuron",
    "cambricon": "kxpu.backends.cambricon",
    "ascend": "kxpu.backends.ascend",
    "gaudi": "kxpu.backends.gaudi",
    "amd": "kxpu.backends.amd",
    "hygon": "kxpu.backends.amd",
}


def lookup(key: str) -> BackendSpec | None:
    if key not in _registry and key in _LAZY_BUILTINS:
        importlib.import_module(_LAZY_BUILTINS[key])
    if key not in _registry:
        _load_entry_points()
    return _registry.get(key)


def known_keys() -> list[str]:
    _load_entry_points()
    return sorted(set(_registry) | set(_LAZY_BUILTINS))


def build_backend(key: str, section: BackendConfig) -> Backend:
    spec = lookup(key)
    if spec is None:
        raise LookupError(f"no backend registered under {key!r}")
    return spec.factory(section)

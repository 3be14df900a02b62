"""CDI (Container Device Interface) output for any backend: spec files and qualified device names.

The names below load on first use (PEP 562), so that ``kxpu.cdi.config`` (what the daemon's config composes)
loads without the Backend wrapper and the spec writer.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kxpu.cdi.backend import CdiBackend, with_cdi
    from kxpu.cdi.config import validate_kind
    from kxpu.cdi.spec import annotation_key, build_spec, qualified_name, validate_spec, write_spec

_EXPORTS = {
    "CdiBackend": "kxpu.cdi.backend",
    "with_cdi": "kxpu.cdi.backend",
    "validate_kind": "kxpu.cdi.config",
    "annotation_key": "kxpu.cdi.spec",
    "build_spec": "kxpu.cdi.spec",
    "qualified_name": "kxpu.cdi.spec",
    "validate_spec": "kxpu.cdi.spec",
    "write_spec": "kxpu.cdi.spec",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kxpu.cdi' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CdiBackend",
    "annotation_key",
    "build_spec",
    "qualified_name",
    "validate_kind",
    "validate_spec",
    "with_cdi",
    "write_spec",
]

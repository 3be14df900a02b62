"""Which HLML module the backend talks to (Habana's ``pyhlml`` or the fake), and helpers around its errors.

``pyhlml`` (PyPI ``habana-pyhlml``) mirrors NVML: ``hlmlInit`` loads ``libhlml.so`` (so importing
it needs no driver), calls return bytes for strings and raise ``HLMLError`` subclasses carrying
``HLML_RETURN`` codes. Constants come from ``pyhlml.pyhlml_types_generated``; the fake
takes them from the same module, so they cannot drift; it plugs into ``SEAM``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kxpu.backends.fakes import Seam

Hlml = Any  # pyhlml is untyped


@dataclass(frozen=True, slots=True)
class HlmlSource:
    module: Hlml
    types: Any  # pyhlml.pyhlml_types_generated: HLML_RETURN, HLML_DEFINES
    host_root: Path
    fake: bool = False


# A stand-in for pyhlml plugs in here; it is given ``hostRoot`` (where it may write its machine).
SEAM: Seam[[Path], HlmlSource] = Seam("HLML")


def default_source(host_root: Path) -> HlmlSource:
    """The stand-in plugged into ``SEAM`` if it names a machine, else pyhlml."""
    fake = SEAM.stand_in(host_root)
    if fake is not None:
        return fake
    with warnings.catch_warnings():  # pyhlml.main imports its own deprecated hlml_types module
        warnings.simplefilter("ignore", DeprecationWarning)
        import pyhlml
        import pyhlml.pyhlml_types_generated as types
    return HlmlSource(pyhlml, types, host_root)


def error_code(hlml: Hlml, exc: BaseException) -> int | None:
    if isinstance(exc, hlml.HLMLError):
        value = getattr(exc, "value", None)
        return int(value) if isinstance(value, int) else None
    return None


def is_code(source: HlmlSource, exc: BaseException, name: str) -> bool:
    return error_code(source.module, exc) == int(getattr(source.types.HLML_RETURN, name))


def text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def handle_key(handle: Any) -> int | None:
    """An HLML device handle (``c_void_p``) or an event's ``device`` field (an int) as one comparable value."""
    value = getattr(handle, "value", handle)
    return value if isinstance(value, int) else None

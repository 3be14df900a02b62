"""Which NVML module the backend talks to, and small helpers around its errors.

The backend never imports ``pynvml`` at module level: it is handed a module-like object (the real binding,
or a stand-in plugged into ``SEAM``: a test's fake, or the one a daemon started with ``--import`` of a fake
module plays, named by ``KXPU_FAKE_NVML=<profile>``), so the real backend code runs over a fake machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kxpu.backends.fakes import Seam

# nvml is deliberately untyped here: nvidia-ml-py ships no type information.
Nvml = Any


@dataclass(frozen=True, slots=True)
class NvmlSource:
    module: Nvml
    host_root: Path  # where /proc and /sys are read from ("/" except over a fake machine)
    fake: bool = False


# A stand-in for pynvml (and the machine it reports) plugs in here.
SEAM: Seam[[], NvmlSource] = Seam("NVML")


def default_source() -> NvmlSource:
    """The stand-in plugged into ``SEAM`` if it names a machine, else the real binding."""
    fake = SEAM.stand_in()
    if fake is not None:
        return fake
    import pynvml

    return NvmlSource(pynvml, Path("/"))


def error_code(nvml: Nvml, exc: BaseException) -> int | None:
    """The NVML_ERROR_* code of an NVMLError from ``nvml``, else None."""
    if isinstance(exc, nvml.NVMLError):
        value = getattr(exc, "value", None)
        return value if isinstance(value, int) else None
    return None


def is_code(nvml: Nvml, exc: BaseException, *names: str) -> bool:
    code = error_code(nvml, exc)
    return code is not None and any(code == getattr(nvml, name, None) for name in names)


def text(value: str | bytes) -> str:
    """NVML strings: nvidia-ml-py decodes them, older bindings return bytes."""
    return value.decode() if isinstance(value, bytes) else value


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

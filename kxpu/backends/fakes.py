"""Fake machines: the seam a stand-in for a vendor library plugs into, and the variables that name one.

A backend gets its vendor library (NVML, HLML, DCMI, cndev) or its host tree (amdgpu, Neuron sysfs) from its
``Seam`` before it falls back to the host's. Nothing under ``kxpu/`` outside ``kxpu/testing/`` imports a fake:
a fake module plugs itself into its seam when it is imported, by a test, or by a daemon whose command line
names it (``kxpu plugin --import kxpu.testing.fake_nvml``), so an operator always sees it. With a fake plugged
in, its ``KXPU_FAKE_*`` variable says which machine it plays (a profile, or a fake tree's path).

The variables live in one table so that a misspelt one (``KXPU_FAKE_NVIDIA`` for ``KXPU_FAKE_NVML``) is refused
on one line instead of silently ignored, and so is one set while no fake is plugged in (it would do nothing:
the daemon would read the real host). The names follow the vendor library each fake stands in for, not the
config key. A test checks the table against every ``KXPU_FAKE_*`` name kxpu reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, ParamSpec, TypeVar

PREFIX = "KXPU_FAKE_"

# name → what it fakes, for the error line and the docs
FAKE_ENVS: dict[str, str] = {
    "KXPU_FAKE_NVML": "nvidia: a fake NVML profile",
    "KXPU_FAKE_NVML_CONTROL": "nvidia: the fake NVML's control socket",
    "KXPU_FAKE_AMD": "amd and hygon: a profile or a fake tree's path",
    "KXPU_FAKE_DCMI": "ascend: a fake DCMI profile",
    "KXPU_FAKE_HLML": "gaudi: a fake HLML profile",
    "KXPU_FAKE_HLML_CONTROL": "gaudi: the fake HLML's control socket",
    "KXPU_FAKE_CAMBRICON": "cambricon: a profile or a fake tree's path",
    "KXPU_FAKE_NEURON": "neuron: a profile or a fake tree's path",
    "KXPU_FAKE_MPS_FAIL": "the fake MPS control daemon: a fault to inject",
    "KXPU_FAKE_MPS_FAIL_FILE": "the fake MPS control daemon: a file naming a fault to inject",
}

# the variable that names a fake machine → the library of the seam its fake plugs into
FAKE_MACHINES: dict[str, str] = {
    "KXPU_FAKE_NVML": "NVML",
    "KXPU_FAKE_AMD": "amdgpu",
    "KXPU_FAKE_DCMI": "DCMI",
    "KXPU_FAKE_HLML": "HLML",
    "KXPU_FAKE_CAMBRICON": "cndev",
    "KXPU_FAKE_NEURON": "Neuron",
}

P = ParamSpec("P")
T = TypeVar("T")

_plugged: set[str] = set()  # the libraries whose seam has a stand-in


class Seam(Generic[P, T]):
    """Where a stand-in for one vendor library plugs in. ``stand_in`` is what the backend uses instead of the
    host's library: the plugged-in provider's answer (None when it names no machine), or None."""

    def __init__(self, library: str) -> None:
        self.library = library
        self._provider: Callable[P, T | None] | None = None

    def plug(self, provider: Callable[P, T | None]) -> None:
        self._provider = provider
        _plugged.add(self.library)

    def stand_in(self, *args: P.args, **kwargs: P.kwargs) -> T | None:
        return None if self._provider is None else self._provider(*args, **kwargs)


def check_fake_envs(environ: Mapping[str, str]) -> None:
    """ValueError on one line for a ``KXPU_FAKE_*`` variable kxpu does not read, naming those it does, or for
    one that names a machine while no fake for it is plugged in (call this after the ``--import`` modules)."""
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in FAKE_ENVS)
    if unknown:
        machines = [k for k, v in FAKE_ENVS.items() if "profile" in v]
        others = [k for k in FAKE_ENVS if k not in machines]
        named = ", ".join(f"{k} ({FAKE_ENVS[k].partition(':')[0]})" for k in machines)
        raise ValueError(
            f"{', '.join(unknown)}: no such kxpu variable; a fake machine is named by {named} "
            f"(also read: {', '.join(others)}); unset it or use one of those"
        )
    for name, library in FAKE_MACHINES.items():
        if environ.get(name) and library not in _plugged:
            raise ValueError(
                f"{name} is set, but no fake {library} is plugged in: kxpu plays a fake machine only when its "
                f"command line imports the fake (--import, see docs/troubleshooting.md); add that, or unset {name}"
            )

"""The fake module behind each ``KXPU_FAKE_*`` variable, for harnesses that start kxpu as a process.

kxpu plays a fake machine only when its command line imports the fake (``kxpu.backends.fakes``), so a
harness that sets a variable also passes ``--import`` for its module: ``DaemonProcess``, the e2e suite's
daemons, the hack/ checks.
"""

from __future__ import annotations

from collections.abc import Mapping

FAKE_MODULES: dict[str, str] = {
    "KXPU_FAKE_NVML": "kxpu.testing.fake_nvml",
    "KXPU_FAKE_AMD": "kxpu.testing.fake_amd",
    "KXPU_FAKE_DCMI": "kxpu.testing.fake_dcmi",
    "KXPU_FAKE_HLML": "kxpu.testing.fake_hlml",
    "KXPU_FAKE_CAMBRICON": "kxpu.testing.fake_cambricon",
    "KXPU_FAKE_NEURON": "kxpu.testing.fake_neuron",
}


def import_args(env: Mapping[str, str]) -> list[str]:
    """``--import <module>`` for each fake machine ``env`` names, to add to a kxpu command line."""
    return [arg for name, module in FAKE_MODULES.items() if env.get(name) for arg in ("--import", module)]

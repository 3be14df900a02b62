"""The environment variables that point a built-in backend at a fake machine instead of the host's devices
(``kxpu devices`` and the daemon without hardware, the tests, the demo).

They live in one table so that a misspelt one (``KXPU_FAKE_NVIDIA`` for ``KXPU_FAKE_NVML``) is refused
on one line instead of silently ignored: the daemon would then read the real host and find nothing. The
names follow the vendor library each fake stands in for, not the config key. A test checks the table
against every ``KXPU_FAKE_*`` name kxpu reads.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def check_fake_envs(environ: Mapping[str, str]) -> None:
    """ValueError on one line for a ``KXPU_FAKE_*`` variable kxpu does not read, naming those it does."""
    unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in FAKE_ENVS)
    if unknown:
        machines = [k for k, v in FAKE_ENVS.items() if "profile" in v]
        others = [k for k in FAKE_ENVS if k not in machines]
        named = ", ".join(f"{k} ({FAKE_ENVS[k].partition(':')[0]})" for k in machines)
        raise ValueError(
            f"{', '.join(unknown)}: no such kxpu variable; a fake machine is named by {named} "
            f"(also read: {', '.join(others)}); unset it or use one of those"
        )

"""KXPU_FAKE_* variables: the table kxpu checks is the set it reads, a misspelt one is one line, exit 2, and one
takes effect only when the command line imports the fake (an env var alone never makes kxpu serve a fake)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kxpu.backends.fakes import FAKE_ENVS, FAKE_MACHINES
from kxpu.testing.fakes import FAKE_MODULES, import_args

ROOT = Path(__file__).resolve().parent.parent


def test_the_table_is_every_fake_variable_kxpu_reads() -> None:
    read = set()
    for path in (ROOT / "kxpu").rglob("*.py"):
        if path.name != "fakes.py":
            read |= set(re.findall(r"KXPU_FAKE_[A-Z_]*[A-Z]", path.read_text()))
    assert read == set(FAKE_ENVS)


def test_a_misspelt_fake_variable_is_one_line_naming_the_real_ones() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    result = subprocess.run(
        [sys.executable, "-m", "kxpu", "devices", "--config", str(ROOT / "examples/config.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "KXPU_FAKE_NVIDIA": "a100-8x"},
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "kxpu: error: KXPU_FAKE_NVIDIA: no such kxpu variable; a fake machine is named by KXPU_FAKE_NVML (nvidia), "
        "KXPU_FAKE_AMD (amd and hygon), KXPU_FAKE_DCMI (ascend), KXPU_FAKE_HLML (gaudi), KXPU_FAKE_CAMBRICON "
        "(cambricon), KXPU_FAKE_NEURON (neuron) (also read: KXPU_FAKE_NVML_CONTROL, KXPU_FAKE_HLML_CONTROL, "
        "KXPU_FAKE_MPS_FAIL, KXPU_FAKE_MPS_FAIL_FILE); unset it or use one of those\n"
    )


@pytest.mark.parametrize(
    ("name", "example", "resource", "library"),
    [
        ("KXPU_FAKE_NVML", "nvidia-mps.yaml", "nvidia.com/gpu", "NVML"),
        ("KXPU_FAKE_AMD", "hygon.yaml", "hygon.com/dcunum", "AMD"),
        ("KXPU_FAKE_DCMI", "ascend.yaml", "huawei.com/Ascend910", "DCMI"),
        ("KXPU_FAKE_HLML", "gaudi.yaml", "habana.ai/gaudi", "HLML"),
        ("KXPU_FAKE_CAMBRICON", "cambricon.yaml", "cambricon.com/mlu", "Cambricon"),
        ("KXPU_FAKE_NEURON", "neuron.yaml", "aws.amazon.com/neuron", "Neuron"),
    ],
)
def test_an_unknown_profile_is_one_line_naming_the_known_ones(
    name: str, example: str, resource: str, library: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "kxpu", "devices", "--config", str(ROOT / "examples" / example)),
            *import_args({name: "no-such-profile"}),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, name: "no-such-profile"},
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("kxpu: error:")]
    assert errors and all(f"unknown fake {library} profile 'no-such-profile'; known: " in e for e in errors)
    assert errors[0].startswith(
        f"kxpu: error: {resource}: ValueError: unknown fake {library} profile 'no-such-profile'; known: "
    )


def test_every_fake_machine_variable_has_its_fake_module() -> None:
    assert set(FAKE_MODULES) == set(FAKE_MACHINES)


@pytest.mark.parametrize(
    ("name", "example", "library"),
    [("KXPU_FAKE_NVML", "nvidia-mps.yaml", "NVML"), ("KXPU_FAKE_AMD", "amd.yaml", "amdgpu")],
)
def test_a_fake_variable_alone_serves_no_fake_machine(name: str, example: str, library: str) -> None:
    """An env var on a DaemonSet must not turn a production daemon into fake hardware: the fake plays only
    when the command line (what an operator reads) imports it; the variable alone is refused on one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    profile = {"KXPU_FAKE_NVML": "a100-8x", "KXPU_FAKE_AMD": "mi300x-8x-cpx"}[name]
    command = [sys.executable, "-m", "kxpu", "devices", "--config", str(ROOT / "examples" / example)]
    alone = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**env, name: profile})
    assert alone.returncode == 2
    assert alone.stdout == ""
    assert alone.stderr == (
        f"kxpu: error: {name} is set, but no fake {library} is plugged in: kxpu plays a fake machine only when "
        f"its command line imports the fake (--import, see docs/troubleshooting.md); add that, or unset {name}\n"
    )
    imported = subprocess.run(
        [*command, "--import", FAKE_MODULES[name]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, name: profile},
    )
    assert imported.returncode == 0, imported.stderr
    assert len(imported.stdout.strip().splitlines()) > 8  # the fake machine's devices, listed

"""KXPU_FAKE_* variables: the table kxpu checks is the set it reads, and a misspelt one is one line, exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kxpu.backends.fakes import FAKE_ENVS

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
        [sys.executable, "-m", "kxpu", "devices", "--config", str(ROOT / "examples" / example)],
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

"""KXPU_FAKE_* variables: the table kxpu checks is the set it reads, and a misspelt one is one line, exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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

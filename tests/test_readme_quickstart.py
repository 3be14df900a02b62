"""The README's quick starts parse into the blocks e2e/test_quickstart.py runs verbatim: every mode, three blocks
each, valid bash, naming only files that exist under deploy/ and examples/. (The cluster run is the e2e test.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from e2e import quickstart

REPO = Path(__file__).resolve().parents[1]


def test_every_mode_is_marked_with_install_try_and_clean_up() -> None:
    found = quickstart.load()
    assert tuple(found) == quickstart.MODES
    for qs in found.values():
        assert "helm install kxpu deploy/helm/kxpu" in qs.install, qs.mode
        assert "helm uninstall kxpu" in qs.clean_up, qs.mode


@pytest.mark.parametrize("mode", quickstart.MODES)
def test_blocks_are_bash_and_name_existing_files(mode: str) -> None:
    qs = quickstart.load()[mode]
    for block in (qs.install, qs.try_, qs.clean_up):
        proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert proc.returncode == 0, f"{mode}: {proc.stderr}"
    files = qs.files()
    assert files, mode
    for name in files:
        path = REPO / name
        assert path.exists(), f"README quick start {mode} names {name}, which does not exist"
        if path.suffix == ".yaml":
            assert list(yaml.safe_load_all(path.read_text())), name


def test_a_mode_with_a_missing_block_is_refused_by_name() -> None:
    text = "<!-- quickstart:dra -->\n```sh\nhelm install\n```\n```sh\nkubectl apply\n```\n<!-- /quickstart:dra -->\n"
    with pytest.raises(ValueError, match=r"quick start 'dra': 2 ```sh blocks, expected 3"):
        quickstart.parse(text)

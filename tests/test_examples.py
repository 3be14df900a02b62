"""Every kxpu config under examples/ loads (the README and docs point users at them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kxpu.config import parse_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _configs() -> list[Path]:
    found = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        if len(docs) == 1 and isinstance(docs[0], dict) and {"version", "resources"} <= docs[0].keys():
            found.append(path)
    return found


@pytest.mark.parametrize("path", _configs(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_config_loads(path: Path) -> None:
    config = parse_config(yaml.safe_load(path.read_text()))
    assert config.resources


def test_the_examples_are_found() -> None:
    names = {str(p.relative_to(EXAMPLES)) for p in _configs()}
    assert {"dra/config.yaml", "dra/shares-config.yaml", "amd.yaml"} <= names, names

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


# Where each kind of file under examples/ is checked; a file of no known kind fails below, so a new example
# cannot go unchecked.
KUBE_MANIFEST = (
    "Kubernetes objects: e2e/test_examples.py applies them (dry-run=server; the quick starts for real)"
)
CHECKED_BY = {
    "kxpu node config": "test_example_config_loads",
    "sharing control plane": "tests/test_sharing_node.py (load_control_plane_config)",
    "KubeSchedulerConfiguration": "e2e/sharing_support.py runs kube-scheduler with it",
    "Helm values": "deploy/tests/test_examples_values.py renders the chart with them",
    "Kubernetes objects": KUBE_MANIFEST,
}


def example_kind(path: Path) -> str | None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if len(docs) == 1 and {"version", "resources"} <= docs[0].keys():
        return "kxpu node config"
    if len(docs) == 1 and {"version", "families"} <= docs[0].keys():
        return "sharing control plane"
    if len(docs) == 1 and docs[0].get("kind") == "KubeSchedulerConfiguration":
        return "KubeSchedulerConfiguration"
    if len(docs) == 1 and "config" in docs[0] and "apiVersion" not in docs[0]:
        return "Helm values"
    if docs and all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs):
        return "Kubernetes objects"
    return None


def test_every_example_is_of_a_checked_kind() -> None:
    unknown = [
        str(p.relative_to(EXAMPLES)) for p in sorted(EXAMPLES.rglob("*.y*ml")) if example_kind(p) is None
    ]
    assert not unknown, f"examples no test checks (add a kind to CHECKED_BY and its test): {unknown}"
    kinds = {example_kind(p) for p in EXAMPLES.rglob("*.yaml")}
    assert kinds == set(CHECKED_BY), kinds

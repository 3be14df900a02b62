"""Render the Helm chart with the helm that hack/helm/build.sh built, and parse what it prints."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "kxpu"
OVERRIDES = Path(__file__).parent / "values-overrides.yaml"


def helm_binary() -> Path | None:
    """$KXPU_HELM, else the cached build for the pinned version (`make helm` builds it)."""
    if os.environ.get("KXPU_HELM"):
        return Path(os.environ["KXPU_HELM"])
    out = subprocess.run(
        ["bash", str(REPO / "hack" / "helm" / "build.sh"), "path"], check=True, capture_output=True, text=True
    )
    path = Path(out.stdout.strip())
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def helm() -> Path:
    path = helm_binary()
    if path is None:
        pytest.skip(
            "helm is not built: run `make helm-check` (hack/helm/build.sh builds it from its Go module)"
        )
    return path


class Rendered:
    """The objects `helm template` printed, with lookups by kind and name."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [d for d in self.kinds(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, (
            f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
        )
        return found[0]


def template(helm: Path, *args: str, release: str = "kxpu", namespace: str = "kxpu-system") -> Rendered:
    proc = subprocess.run(
        [str(helm), "template", release, str(CHART), "--namespace", namespace, *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"helm template failed: {proc.stderr}"
    return Rendered([d for d in yaml.safe_load_all(proc.stdout) if d])


def template_error(helm: Path, *args: str) -> str:
    """helm template's error message for values the chart must refuse."""
    proc = subprocess.run([str(helm), "template", "kxpu", str(CHART), *args], capture_output=True, text=True)
    assert proc.returncode != 0, f"helm template accepted {args}"
    return proc.stderr


def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def override_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(OVERRIDES.read_text())
    return values

"""Every Helm values file under examples/ renders the chart, and every DeviceClass an example claims from ships
with the chart (rendered with one of those values files) or with the examples themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.tests.conftest import REPO, template

EXAMPLES = REPO / "examples"
# The webhook's certificate is the user's (README quick start: a Secret and its CA); any value renders.
TLS = ("--set", "webhook.tls.secretName=kxpu-webhook-tls", "--set", "webhook.tls.caBundle=Q0E=")


def values_files() -> list[Path]:
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if len(docs) == 1 and "config" in docs[0] and "apiVersion" not in docs[0]:
            out.append(path)
    return out


def docs_of(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_values_files_are_found() -> None:
    names = {str(p.relative_to(EXAMPLES)) for p in values_files()}
    assert {
        "dra/chart-values.yaml",
        "dra/shares-chart-values.yaml",
        "quickstart/sharing-values.yaml",
    } <= names


@pytest.mark.parametrize("path", values_files(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_values_render(helm: Path, path: Path) -> None:
    r = template(helm, "-f", str(path), *TLS)
    assert r.kinds("DaemonSet")
    (cm,) = [d for d in r.kinds("ConfigMap") if d["metadata"]["name"] == "kxpu-config"]
    rendered = yaml.safe_load(cm["data"]["config.yaml"])["resources"]
    given = yaml.safe_load(path.read_text())["config"]["resources"]
    # the chart fills in (sharing: the signing keys), never drops or renames
    assert [(r["name"], r.get("serve"), r.get("simulated")) for r in rendered] == [
        (r["name"], r.get("serve"), r.get("simulated")) for r in given
    ]


def test_every_device_class_an_example_claims_ships(helm: Path) -> None:
    shipped = {
        d["metadata"]["name"]
        for path in EXAMPLES.rglob("*.yaml")
        for d in docs_of(path)
        if isinstance(d, dict) and d.get("kind") == "DeviceClass"
    }
    for path in values_files():
        shipped |= {d["metadata"]["name"] for d in template(helm, "-f", str(path), *TLS).kinds("DeviceClass")}
    claimed: dict[str, set[str]] = {}
    for path in EXAMPLES.rglob("*.yaml"):
        for name in _device_class_names(path.read_text()):
            claimed.setdefault(name, set()).add(str(path.relative_to(EXAMPLES)))
    assert claimed, "no example claims a DeviceClass: the scan is broken"
    missing = {name: files for name, files in claimed.items() if name not in shipped}
    assert not missing, (
        f"DeviceClasses claimed by examples that neither the chart nor an example ships: {missing}"
    )


def _device_class_names(text: str) -> set[str]:
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "deviceClassName" and isinstance(value, str):
                    found.add(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for doc in yaml.safe_load_all(text):
        walk(doc)
    return found

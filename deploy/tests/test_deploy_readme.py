"""deploy/README.md agrees with the chart: every value it names (`sharing.signing.scheme`, `webhook.tls.caBundle`,
...) is one values.yaml has, or one the chart refuses by name (a removed value), and the image it says the chart
defaults to is the one the chart renders."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from deploy.tests.conftest import CHART, REPO, template, template_error

DOC = (REPO / "deploy" / "README.md").read_text()
NOT_VALUES = {"config.yaml"}  # the ConfigMap's key, named beside the value `config`


def named_values(values: dict[str, Any]) -> set[str]:
    tops = "|".join(sorted(map(re.escape, values), key=len, reverse=True))
    return set(re.findall(rf"`((?:{tops})(?:\.[A-Za-z0-9]+)+)(?:[:=][^`]*)?`", DOC)) - NOT_VALUES


def resolves(values: dict[str, Any], path: str) -> bool:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_value_deploy_readme_names_exists_or_is_refused(helm: Path) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    named = named_values(values)
    assert len(named) > 15, named  # the scan finds them
    for path in sorted(p for p in named if not resolves(values, p)):
        error = template_error(helm, "--set", f"{path}=true")
        assert path in error, (
            f"deploy/README.md names {path}, which values.yaml lacks and the chart does not refuse"
        )


def test_the_default_image_deploy_readme_states_is_rendered(helm: Path) -> None:
    (stated,) = set(re.findall(r"The chart's default image is `([^`]+)`", DOC))
    rendered = template(helm).one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert stated.replace("<appVersion>", version) == rendered

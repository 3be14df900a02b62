"""``{placeholder}`` templates in backend configs (env values, container paths), checked at load time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from string import Formatter
from typing import Annotated

from pydantic import AfterValidator

from kxpu.model import Device

# What an env template may name, for the devices one container gets.
DEVICE_LIST_FIELDS = ("ids", "uuids", "indexes", "count")


def check_template(template: str, allowed: Sequence[str]) -> str:
    """Raise ValueError naming the bad placeholder, so config errors point at the culprit."""
    try:
        fields = [name for _, name, _, _ in Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"bad template {template!r}: {exc}") from exc
    for name in fields:
        if name not in allowed:
            raise ValueError(
                f"template {template!r} uses {{{name}}}; allowed: {', '.join('{' + a + '}' for a in allowed)}"
            )
    return template


def check_env_templates(env: dict[str, str]) -> dict[str, str]:
    for value in env.values():
        check_template(value, DEVICE_LIST_FIELDS)
    return env


# A config field of env var templates, checked when the config is loaded.
EnvTemplates = Annotated[dict[str, str], AfterValidator(check_env_templates)]


def device_list_values(devices: Sequence[Device]) -> dict[str, str]:
    return {
        "ids": ",".join(d.id for d in devices),
        "uuids": ",".join(d.uuid or d.id for d in devices),
        "indexes": ",".join(str(d.index) for d in devices if d.index is not None),
        "count": str(len(devices)),
    }


def render_env(env: Mapping[str, str], devices: Sequence[Device]) -> dict[str, str]:
    values = device_list_values(devices)
    return {key: template.format_map(values) for key, template in env.items()}

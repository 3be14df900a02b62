"""``{placeholder}`` templates in backend configs (env values, container paths), checked at load time.

Everything that could fail when a container is allocated fails here instead, naming the culprit: an
unknown placeholder, a conversion or format spec (``{ids!x}``, ``{count:d}``: every Allocate would fail
with a Python format error), an env var name the container runtime would mangle (``A=B``).
"""

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
    if "\x00" in template:
        raise ValueError(f"template {template!r} contains a NUL character")
    try:
        fields = [
            (name, spec, conv) for _, name, spec, conv in Formatter().parse(template) if name is not None
        ]
    except ValueError as exc:
        raise ValueError(f"bad template {template!r}: {exc}") from exc
    for name, spec, conversion in fields:
        if name not in allowed:
            raise ValueError(
                f"template {template!r} uses {{{name}}}; allowed: {', '.join('{' + a + '}' for a in allowed)}"
            )
        if spec or conversion:
            written = (
                "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            )
            raise ValueError(
                f"template {template!r}: {written} has a conversion or format spec; placeholders are plain "
                f"text, write {{{name}}}"
            )
    return template


def check_env_name(name: str) -> str:
    """The Kubernetes rule for container env var names (relaxed validation): a ``=`` in the name would
    reach the container as part of the value (``A=B=x``)."""
    if not name or any(not (" " <= c <= "~") or c == "=" for c in name):
        raise ValueError(
            f"env var name {name!r} must be non-empty and consist only of printable ASCII characters other "
            "than '='"
        )
    return name


def check_env_templates(env: dict[str, str]) -> dict[str, str]:
    for name, value in env.items():
        check_env_name(name)
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

"""The e2e harness's own parsing, without a cluster: what it reads from node status must be read right."""

from __future__ import annotations

import pytest

from e2e.kube import parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("4", 4),
        ("1k", 1000),
        ("1500", 1500),
        ("2k", 2000),
        ("1M", 1_000_000),
        ("2Ki", 2048),
        ("1Mi", 1024**2),
        ("1e3", 1000),
        ("12E2", 1200),
        ("1.5k", 1500),
        ("3000m", 3),
        ("+7", 7),
    ],
)
def test_quantities_as_the_api_server_writes_them(text: str, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "k", "1kk", "1.5", "500m", "1 k", "0x10", "1K"])
def test_what_is_not_a_whole_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)

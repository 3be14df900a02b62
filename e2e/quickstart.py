"""The README's quick starts as the e2e suite runs them: the fenced shell blocks between
``<!-- quickstart:<mode> -->`` and ``<!-- /quickstart:<mode> -->``, verbatim.

Each mode has three blocks, run in order: install, try, clean up. The suite runs them in a directory holding
only ``deploy/`` and ``examples/`` of the repository (what the blocks may name), with ``kubectl`` and ``helm`` on
``PATH`` and ``KUBECONFIG`` set, as a user's shell would have them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MODES = ("device-plugin", "dra", "sharing-extender", "sharing-dra")
STEPS = ("install", "try", "clean up")
# What a block may name in the repository: the chart and the examples (the run directory holds only these).
REPO_PATHS = ("deploy/", "examples/")

_SECTION = re.compile(r"<!-- quickstart:([a-z-]+) -->\n(.*?)<!-- /quickstart:\1 -->", re.S)
_FENCE = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class QuickStart:
    mode: str
    install: str
    try_: str
    clean_up: str

    def files(self) -> list[str]:
        """The repository paths the blocks name (``examples/...``, ``deploy/helm/...``; ``deploy/<name>`` alone is
        kubectl's Deployment shorthand)."""
        text = "\n".join((self.install, self.try_, self.clean_up))
        return sorted(
            set(re.findall(r"(?<![\w/.-])((?:deploy/(?:helm|manifests)|examples)(?:/[\w.-]+)+)", text))
        )


def parse(text: str) -> dict[str, QuickStart]:
    """Every marked mode's blocks; a mode without exactly three blocks is an error naming it."""
    found: dict[str, QuickStart] = {}
    for match in _SECTION.finditer(text):
        mode, body = match.group(1), match.group(2)
        blocks = _FENCE.findall(body)
        if len(blocks) != len(STEPS):
            raise ValueError(
                f"README quick start {mode!r}: {len(blocks)} ```sh blocks, expected {len(STEPS)} ({', '.join(STEPS)})"
            )
        if mode in found:
            raise ValueError(f"README quick start {mode!r} is marked twice")
        found[mode] = QuickStart(mode, *blocks)
    return found


def load(readme: Path = README) -> dict[str, QuickStart]:
    return parse(readme.read_text())

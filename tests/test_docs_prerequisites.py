"""Each vendor backend's doc says what a node needs first (driver, device nodes, library, runtime, chart values),
and names only host paths and libraries the shipped code actually uses.

A backend's doc is the page under docs/ whose title names it (``# … (the `nvidia` backend)``,
``… on the `generic` backend``). Every built-in backend but ``simulated`` must have one, with a
``## Prerequisites`` section, and the README links each. In that section every backticked name that looks like a
host path (``/dev/…``, ``/sys/…``) or a shared library (``lib….so[.N]``) must occur in the code that runs on the
node: kxpu's product code (not ``kxpu/testing``: the fakes would vouch for anything), the vendor bindings the
backends import (``pynvml`` and ``pyhlml`` load ``libnvidia-ml.so.1`` and ``libhlml.so`` themselves), or the
example configs (the ``generic`` backend's paths are config). A placeholder in the doc (``/dev/davinci<N>``,
``renderD*``) matches the code's f-string field (``f"/dev/davinci{p}"``) or any name part.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

from kxpu.backends import registry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BINDINGS = ("pynvml", "pyhlml")  # vendor Python bindings the backends import; they dlopen the vendor library
NO_DOC = {"simulated"}  # no hardware, so nothing to install

_PATHLIKE = re.compile(r"^(?:/[\w.:<>*{}-]+(?:/[\w.:<>*{}-]*)*|[\w.+-]*lib[\w.+-]*\.so(?:\.\d+)*)$")
_PLACEHOLDER = re.compile(r"<[^>]*>|\*|\{[^}]*\}")
_CODE_FIELD = r"(?:\{[^}\n]*\}|<[^>\n]*>|[\w.:-]*)"  # what a placeholder stands for in code or config


def _builtin_keys() -> list[str]:
    keys = []
    for key in registry.known_keys():
        spec = registry.lookup(key)
        if spec is not None and spec.factory.__module__.startswith("kxpu.backends."):
            keys.append(key)
    return sorted(keys)


def _doc_for(key: str) -> Path | None:
    for path in sorted(DOCS.glob("*.md")):
        title = path.read_text().partition("\n")[0]
        if title.startswith("# ") and re.search(rf"`{re.escape(key)}`.*backends?\b", title):
            return path
    return None


def _section(text: str, heading: str) -> str | None:
    match = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    return match.group(1) if match else None


def _named_paths(section: str) -> list[str]:
    return sorted({token for token in re.findall(r"`([^`\n]+)`", section) if _PATHLIKE.match(token)})


@cache
def _corpus() -> str:
    files = [p for p in (ROOT / "kxpu").rglob("*.py") if "testing" not in p.relative_to(ROOT / "kxpu").parts]
    files += sorted((ROOT / "examples").glob("*.yaml"))
    for module in BINDINGS:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{module} is not installed (make dev)"
        files += sorted(Path(spec.origin).parent.glob("*.py"))
    return "\n".join(p.read_text() for p in files)


def _pattern(token: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(token)
    return re.compile(_CODE_FIELD.join(re.escape(p) for p in parts))


DOCUMENTED = [(key, _doc_for(key)) for key in _builtin_keys() if key not in NO_DOC]


@pytest.mark.parametrize(("key", "doc"), DOCUMENTED, ids=[k for k, _ in DOCUMENTED])
def test_every_vendor_backend_has_its_prerequisites(key: str, doc: Path | None) -> None:
    assert doc is not None, f"backend {key!r} has no doc under docs/ whose title names it (`{key}` backend)"
    section = _section(doc.read_text(), "## Prerequisites")
    assert section is not None, f"{doc.relative_to(ROOT)} has no '## Prerequisites' section"
    for needed in ("Kubernetes 1.34", "CDI", "Chart values", "What has run on"):
        assert needed in section, f"{doc.relative_to(ROOT)}: Prerequisites says nothing of {needed!r}"
    link = f"{doc.relative_to(ROOT)}#prerequisites"
    assert link in (ROOT / "README.md").read_text(), f"README.md does not link {link}"


@pytest.mark.parametrize(("key", "doc"), DOCUMENTED, ids=[k for k, _ in DOCUMENTED])
def test_prerequisites_name_only_paths_the_code_uses(key: str, doc: Path | None) -> None:
    assert doc is not None
    section = _section(doc.read_text(), "## Prerequisites") or ""
    named = _named_paths(section)
    assert named, f"{doc.relative_to(ROOT)}: Prerequisites names no device node, sysfs path or library"
    unknown = [token for token in named if not _pattern(token).search(_corpus())]
    assert not unknown, f"{doc.relative_to(ROOT)} names paths no shipped code or example uses: {unknown}"


def test_the_path_check_catches_an_invented_node() -> None:
    corpus = _corpus()
    assert _pattern("/dev/davinci<N>").search(corpus)  # f"/dev/davinci{p}"
    assert _pattern("/dev/dri/renderD*").search(corpus)
    assert _pattern("libnvidia-ml.so.1").search(corpus)  # in pynvml, not in kxpu
    assert not _pattern("/dev/davinci_nonexistent<N>").search(corpus)
    assert not _pattern("libdcmi2.so").search(corpus)
    assert _named_paths(
        "`/dev/kfd`, `libcndev.so`, `NVIDIA_VISIBLE_DEVICES=all`, `plugin.hostPaths.cdi`"
    ) == [
        "/dev/kfd",
        "libcndev.so",
    ]

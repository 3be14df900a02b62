"""The README's architecture block is the tree as it stands: every module and folder it names exists, every package
under kxpu/ is named, and where the block lists a folder's modules it lists all of them.

The block (the fenced one under ``## Architecture``) has one entry per line that starts in the first column
(``kxpu/dra/            the DRA node server …``) with its continuation lines. A bare name is read in the entry's
folder, then in any folder below it (``sharing/ (informer.py …`` in kxpu/kube's entry); a name with a folder
also relative to kxpu/ or the repository root (``kube/dra.py``, ``kxpu/kube/sharing/``). A module counts as
named only as ``name.py``: a bare word (``snapshot``, ``taints``) is too often plain English to vouch for one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kxpu"
README = (ROOT / "README.md").read_text()

_FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")
_FOLDER = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+)(?![\w.])")
# Packages described by one phrase, not module by module: the generated wire API and the vendor backends.
_LISTED_AS_A_WHOLE = ("kxpu/api/", "kxpu/backends/")


@dataclass(frozen=True)
class Entry:
    head: str
    folder: Path
    text: str


def _block() -> str:
    section = README.split("\n## Architecture\n", 1)[1]
    match = re.search(r"^```\n(.*?)^```", section, re.M | re.S)
    assert match, "README.md: no fenced block under ## Architecture"
    return match.group(1)


def _entries() -> list[Entry]:
    entries: list[Entry] = []
    for line in _block().splitlines():
        if line and not line[0].isspace():
            head = line.split()[0].rstrip(",")
            folder = ROOT / head if head.endswith("/") else (ROOT / head).parent
            entries.append(Entry(head, folder, line))
        elif entries:
            last = entries[-1]
            entries[-1] = Entry(last.head, last.folder, last.text + "\n" + line)
    return entries


def _resolve(name: str, entry: Entry) -> Path | None:
    """A bare name is the entry's own (its folder or one below); a name with a folder may be anyone's."""
    if "/" in name:
        candidates = [entry.folder / name, PACKAGE / name, ROOT / name]
    else:
        below = sorted(p for p in entry.folder.rglob(name) if "__pycache__" not in p.parts)
        candidates = [entry.folder / name, *below[:1]]
    return next((c for c in candidates if c.exists()), None)


def _named() -> tuple[set[Path], list[str]]:
    """Every file and folder the block names, resolved; and the names that resolve to nothing."""
    found: set[Path] = set()
    missing: list[str] = []
    for entry in _entries():
        names = _FILE.findall(entry.text) + _FOLDER.findall(entry.text)
        for name in names:
            path = _resolve(name.rstrip("/"), entry)
            if path is None:
                missing.append(f"{name} (in the {entry.head} entry)")
            else:
                found.add(path.resolve())
    return found, missing


def _packages() -> list[Path]:
    return sorted(
        p.parent
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE and not p.parent.relative_to(PACKAGE).as_posix().startswith("api/")
    )


def _module_lists() -> list[Path]:
    """The folders whose modules the block lists."""
    lists = [PACKAGE]  # kxpu's own modules are named across the entries' heads
    for entry in _entries():
        if entry.head.endswith("/") and not entry.head.startswith(_LISTED_AS_A_WHOLE):
            lists.append(entry.folder)
    # A subfolder whose modules an entry names (kxpu/kube/sharing/) is held to listing all of them.
    found, _ = _named()
    for package in _packages():
        if package not in lists and any(p.parent == package.resolve() for p in found):
            lists.append(package)
    return lists


def test_every_module_and_folder_the_block_names_exists() -> None:
    _, missing = _named()
    assert not missing, f"README.md's architecture block names what the tree does not have: {missing}"


def test_every_package_under_kxpu_is_named() -> None:
    found, _ = _named()
    heads = {(ROOT / e.head).resolve() for e in _entries()}
    unnamed = [p.relative_to(ROOT).as_posix() + "/" for p in _packages() if p.resolve() not in found | heads]
    assert not unnamed, f"README.md's architecture block does not name these packages: {unnamed}"


def test_a_folder_whose_modules_are_listed_lists_them_all() -> None:
    found, _ = _named()
    unlisted = []
    for folder in _module_lists():
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py" and module.resolve() not in found:
                unlisted.append(module.relative_to(ROOT).as_posix())
    assert not unlisted, f"README.md's architecture block lists these folders' modules but not: {unlisted}"


def test_the_check_reads_names_as_meant() -> None:
    entry = Entry("kxpu/kube/", PACKAGE / "kube", "")
    assert _resolve("informer.py", entry) == PACKAGE / "kube" / "sharing" / "informer.py"
    assert _resolve("backoff.py", Entry("kxpu/daemon/", PACKAGE / "daemon", "")) is None  # kxpu/backoff.py
    assert _resolve("kube/dra.py", Entry("kxpu/dra/", PACKAGE / "dra", "")) == PACKAGE / "kube" / "dra.py"
    assert _resolve("daemon/backoff.py", Entry("kxpu/", PACKAGE, "")) is None
    assert _resolve("gone.py", entry) is None
    text = "plugin.py (sockets), v1/v1beta1, kxpu.io/v1alpha1, /metrics /healthz, sharing/ (x), start/stop"
    assert _FILE.findall(text) == ["plugin.py"]
    assert _FOLDER.findall(text) == ["sharing/"]

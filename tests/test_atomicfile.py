"""Files kxpu writes (CDI specs, the DRA checkpoint, NFD feature files, the HAMi preload file) get their final
mode on the open descriptor, exactly, whatever the umask, and never by a chmod of a path."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kxpu.atomicfile import write_atomically
from kxpu.cdi.spec import write_spec


@pytest.fixture
def umask() -> Iterator[Any]:
    before = os.umask(0o022)
    os.umask(before)

    def set_umask(value: int) -> None:
        os.umask(value)

    yield set_umask
    os.umask(before)


@pytest.mark.parametrize("mask", [0o077, 0o022, 0o000])
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o644])
def test_the_file_has_exactly_its_mode(tmp_path: Path, umask: Any, mask: int, mode: int) -> None:
    umask(mask)
    path = tmp_path / "f.json"
    write_atomically(path, "x", mode=mode)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    write_atomically(path, "y", mode=mode, durable=True)  # replacing keeps it
    assert stat.S_IMODE(path.stat().st_mode) == mode and path.read_text() == "y"


def test_no_mode_is_ever_changed_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chmod by path follows whatever the name is by then (a symlink someone put there): refuse them all."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"chmod by path: {args}")

    monkeypatch.setattr(os, "chmod", refuse)
    monkeypatch.setattr(Path, "chmod", refuse)
    seen: list[tuple[int, str]] = []
    replace = os.replace

    def watching_replace(src: Any, dst: Any) -> None:
        seen.append((stat.S_IMODE(os.stat(src).st_mode), Path(src).read_text()))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watching_replace)
    path = tmp_path / "checkpoint.json"
    write_atomically(path, "secret", mode=0o600, durable=True)
    assert seen == [(0o600, "secret")]  # in place with its mode and content before it takes the name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fchmod", full)
    with pytest.raises(OSError, match="No space"):
        write_atomically(tmp_path / "f", "x")
    assert list(tmp_path.iterdir()) == []


def test_cdi_specs_are_world_readable_whatever_the_umask(tmp_path: Path, umask: Any) -> None:
    """Container runtimes and `nvidia-ctk cdi list` read them; nothing in them is secret."""
    umask(0o077)
    path = write_spec(tmp_path, {"cdiVersion": "0.6.0", "kind": "example.com/npu", "devices": []})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644

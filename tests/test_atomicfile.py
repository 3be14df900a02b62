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


def test_the_status_returned_is_the_written_files(tmp_path: Path) -> None:
    """The DRA checkpoint keeps it to tell a file another process wrote from its own, without a stat by path."""
    path = tmp_path / "checkpoint.json"
    for text in ("first", "second, longer"):
        written = write_atomically(path, text, mode=0o600, durable=True)
        now = path.stat()
        assert (written.st_ino, written.st_mtime_ns, written.st_size, written.st_mode) == (
            now.st_ino,
            now.st_mtime_ns,
            now.st_size,
            now.st_mode,
        )


def test_a_forked_child_names_its_temp_files_after_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process ID in temp names is asked once, and again in a forked child: parent and child never pick
    the same temp name for the same file."""
    renamed: list[str] = []
    replace = os.replace

    def watching_replace(src: Any, dst: Any) -> None:
        renamed.append(os.path.basename(src))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", watching_replace)
    write_atomically(tmp_path / "f", "parent")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        write_atomically(tmp_path / "f", "child")
        os.write(write, renamed[-1].encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        in_child = pipe.read()
    assert os.waitpid(child, 0)[1] == 0
    assert renamed[0].startswith(f".f.{os.getpid()}-"), renamed
    assert in_child.startswith(f".f.{child}-"), in_child
    assert (tmp_path / "f").read_text() == "child"

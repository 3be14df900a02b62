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


def test_a_file_replaced_on_every_call_reuses_two_inodes(tmp_path: Path, umask: Any) -> None:
    """The DRA checkpoint is replaced on every prepare and unprepare: making and freeing an inode each time costs
    more CPU than the write (inode allocation, the discard of freed blocks). replace_durably writes in turn over
    the inode the last replace retired; content, mode and the old-or-new guarantee stay those of a rename."""
    from kxpu.atomicfile import replace_durably

    umask(0o022)
    path = tmp_path / "checkpoint.json"
    inodes = set()
    for n in range(6):
        text = "x" * (100 - 7 * n) + str(n)  # shrinking: a shorter write leaves no tail of the longer one
        replace_durably(path, text)
        assert path.read_text() == text and stat.S_IMODE(path.stat().st_mode) == 0o600
        inodes.add(path.stat().st_ino)
    assert len(inodes) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.json.spares", "checkpoint.json"]
    assert [p.name for p in (tmp_path / ".checkpoint.json.spares").iterdir()] == ["spare"]


def test_a_replace_interrupted_anywhere_is_finished_by_the_next(tmp_path: Path) -> None:
    """A crash between the steps of replace_durably leaves a retired link, or a spare that is the live file's
    second name, or no spare: the next replace never writes over the live file's bytes and ends clean."""
    from kxpu.atomicfile import replace_durably

    path = tmp_path / "checkpoint.json"
    spare, retired = (
        tmp_path / ".checkpoint.json.spares" / "spare",
        tmp_path / ".checkpoint.json.spares" / "retired",
    )
    replace_durably(path, "one")
    replace_durably(path, "two")
    os.link(path, retired)  # crashed after keeping the live inode aside, before the rename
    replace_durably(path, "three")
    assert path.read_text() == "three" and not retired.exists() and spare.read_text() == "two"
    spare.unlink()
    os.link(path, spare)  # the spare is the live file under a second name (a crash between the renames)
    live = path.stat().st_ino
    replace_durably(path, "four")
    assert path.read_text() == "four" and path.stat().st_ino != live
    spare.unlink()
    spare.symlink_to(tmp_path / "elsewhere")  # not ours to write through
    replace_durably(path, "five")
    assert path.read_text() == "five" and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.json.spares", "checkpoint.json"]
    assert [p.name for p in spare.parent.iterdir()] == ["spare"]


def test_a_spare_this_process_did_not_settle_is_flushed_before_it_is_written_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a crash (or the other process of a rolling update) the spare may be the file's name on disk still,
    its renames not flushed: written over in place, a power loss then would leave the file half written. The
    directory is flushed before such a spare is touched; a spare this process settled itself is not."""
    from kxpu import atomicfile

    path = tmp_path / "checkpoint.json"
    atomicfile.replace_durably(path, "one")
    atomicfile.replace_durably(path, "two")
    steps: list[str] = []
    fsync, pwrite = os.fsync, os.pwrite

    def flush(fd: int) -> None:
        steps.append("flush " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def write(fd: int, data: bytes, offset: int) -> int:
        steps.append("write " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "fsync", flush)
    monkeypatch.setattr(os, "pwrite", write)
    atomicfile.replace_durably(path, "three")
    assert steps == ["write spare", f"flush {tmp_path.name}"]  # settled by this process
    steps.clear()
    atomicfile._settled.clear()  # a new process
    atomicfile.replace_durably(path, "four")
    assert steps == [f"flush {tmp_path.name}", "write spare", f"flush {tmp_path.name}"]
    assert path.read_text() == "four"

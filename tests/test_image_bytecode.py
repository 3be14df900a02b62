"""The image's Python modules start from bytecode, never compiled at each start.

The daemon's venv is read-only to it and PYTHONDONTWRITEBYTECODE is set: a .pyc that does not match its source
is compiled again on every start and never saved. A timestamp .pyc matches only while its source keeps the
mtime it recorded, which a layer's tar rounds to the second; an unchecked-hash .pyc always matches. Reads the
archive `make image` (hack/image/build.sh) wrote; skipped, saying so, when there is none.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARCHIVE = Path(os.environ.get("KXPU_IMAGE_ARCHIVE", REPO / "out" / "kxpu-image.tar"))
VENV = "opt/kxpu/"


def _layers(archive: tarfile.TarFile) -> list[tarfile.TarFile]:
    def blob(digest: str) -> bytes:
        member = archive.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
        assert member is not None
        return member.read()

    index = json.loads(archive.extractfile("index.json").read())  # type: ignore[union-attr]
    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    return [tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) for layer in manifest["layers"]]


@pytest.mark.skipif(not ARCHIVE.is_file(), reason=f"no image archive at {ARCHIVE}: run `make image`")
def test_every_module_of_the_venv_has_bytecode_valid_for_it() -> None:
    with tarfile.open(ARCHIVE) as archive:
        members = {m.name: (layer, m) for layer in _layers(archive) for m in layer.getmembers()}
    sources = [n for n in members if n.startswith(VENV) and n.endswith(".py")]
    assert any(n.endswith("/kxpu/cli.py") for n in sources), "no kxpu in the image's venv"
    stale, missing = [], []
    for name in sources:
        directory, base = name.rsplit("/", 1)
        pyc = f"{directory}/__pycache__/{base[:-3]}.cpython-311.pyc"
        if pyc not in members:
            missing.append(name)
            continue
        layer, member = members[pyc]
        head = layer.extractfile(member).read(16)  # type: ignore[union-attr]
        (flags,) = struct.unpack("<I", head[4:8])
        if flags & 1:  # hash-based: unchecked (flags 1) is valid whatever the source's mtime
            if flags & 2:
                stale.append(f"{name} (checked hash: read and hashed at every start)")
            continue
        mtime, size = struct.unpack("<II", head[8:16])
        source = members[name][1]
        if (mtime, size) != (int(source.mtime) & 0xFFFFFFFF, source.size & 0xFFFFFFFF):
            stale.append(f"{name} (records mtime {mtime}, the image has {source.mtime})")
    assert not missing, f"{len(missing)} modules without bytecode, e.g. {missing[:3]}"
    assert not stale, f"{len(stale)} of {len(sources)} modules compiled at every start, e.g. {stale[:3]}"

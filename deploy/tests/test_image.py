"""The two image builds stay the same image: one lock, one venv path, user and entry point.

Building needs root, mmdebstrap and the network (`make image`); these checks are static and fast.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from deploy.tests.conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
BUILD_SH = (REPO / "hack" / "image" / "build.sh").read_text()


def final_stage() -> str:
    return DOCKERFILE.rsplit("\nFROM ", 1)[1]


def test_lock_matches_pyproject() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "image" / "lock.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_same_user_entrypoint_and_path() -> None:
    stage = final_stage()
    user = re.search(r"^USER (\S+)$", stage, re.M)
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", stage, re.M)
    path = re.search(r"ENV PATH=(\S+)", stage)
    assert user and entrypoint and path
    assert re.search(rf"^UID_GID={re.escape(user.group(1))}\b", BUILD_SH, re.M)
    (exe,) = json.loads(entrypoint.group(1))
    venv = re.search(r"^VENV=(\S+)$", BUILD_SH, re.M)
    assert venv and exe == f"{venv.group(1)}/bin/kxpu"
    assert '--config.entrypoint "$VENV/bin/kxpu"' in BUILD_SH
    assert f'--config.env "PATH=$VENV/bin:{path.group(1).split(":", 1)[1]}"' in BUILD_SH


def test_both_install_the_hash_pinned_lock() -> None:
    assert "--require-hashes -r /tmp/lock/requirements.txt" in DOCKERFILE
    assert "--require-hashes -r /tmp/wheels/requirements.txt" in BUILD_SH
    assert "--require-hashes -r /tmp/lock/installer.txt" in DOCKERFILE


def test_dockerignore_lets_the_copied_files_through() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = {
        src for line in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M) for src in line.split()
    }
    assert copied <= allowed, copied - allowed

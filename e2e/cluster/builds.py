"""Which binaries the cluster runs (``hack/cluster/build.sh``'s cache, or ``KXPU_K8S_BIN``) and where each
mode keeps its state."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from e2e.cluster.layout import REPO

BUILD_SCRIPT = REPO / "hack" / "cluster" / "build.sh"
K8S_BIN_ENV = "KXPU_K8S_BIN"  # a directory of Kubernetes binaries instead of build.sh's cache


def build_paths() -> tuple[Path, Path, str]:
    """The cached binary directories and the Kubernetes release (``KXPU_K8S_RELEASE``, default the newest
    tested), as build.sh computes them."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "paths"], check=True, capture_output=True, text=True
    ).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Path(values["K8S_BIN"]), Path(values["CONTAINERD_BIN"]), values["K8S_RELEASE"]


def state_dir(control_plane_only: bool) -> Path:
    if control_plane_only:
        return Path(os.environ.get("KXPU_E2E_CP_STATE", "/var/lib/kxpu-e2e-cp"))
    return Path(os.environ.get("KXPU_E2E_STATE", "/var/lib/kxpu-e2e"))

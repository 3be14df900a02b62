"""What every part of the harness stands on: ``ClusterError``, the log line, polling with a deadline, and
``ClusterBase``: one cluster instance's paths and the commands run against it (kubectl, ctr), whether or
not it is up. The other modules add to it what they own (credentials.py, components.py, node.py,
control_plane.py); core.py's ``Cluster`` joins them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from e2e.cluster.builds import K8S_BIN_ENV, build_paths, state_dir
from e2e.cluster.layout import COMPONENTS, CONTROL_PLANE, OPTIONAL_CONTROL_PLANE


class ClusterError(RuntimeError):
    """The cluster could not be brought up or torn down; the message names the log to read."""


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} cluster: {msg}", file=sys.stderr, flush=True)


def wait_for(
    what: str, check: Callable[[], bool], timeout: float, hint: str = "", interval: float = 0.25
) -> None:
    """Poll ``check`` until it is true; raise with ``what`` and ``hint`` (e.g. a log path) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # a component still starting answers with errors; keep polling
            pass
        if time.monotonic() > deadline:
            raise ClusterError(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f"; see {hint}" if hint else "")
            )
        time.sleep(interval)


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"{argv[0]} {argv[1]} failed: {proc.stderr.strip()}")


def tail_file(path: Path, lines: int = 60) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<{path}: {exc}>"


@dataclasses.dataclass(frozen=True)
class ClusterBase:
    """Paths of one cluster instance; every method is safe to call whether or not it is up."""

    state: Path
    k8s_bin: Path
    containerd_bin: Path
    control_plane_only: bool = False
    release: str = ""  # the Kubernetes minor release, e.g. "1.37" (KXPU_K8S_RELEASE)

    @classmethod
    def default(cls, control_plane_only: bool = False) -> Self:
        """The normal cluster, or the control-plane-only one (its own state directory, the same ports)."""
        k8s_bin, containerd_bin, release = build_paths()
        if os.environ.get(K8S_BIN_ENV):
            k8s_bin = Path(os.environ[K8S_BIN_ENV]).resolve()
        return cls(state_dir(control_plane_only), k8s_bin, containerd_bin, control_plane_only, release)

    @property
    def release_tuple(self) -> tuple[int, int]:
        """(1, 37) for "1.37"; (0, 0) when unknown."""
        try:
            major, minor = self.release.split(".")[:2]
            return int(major), int(minor)
        except ValueError:
            return (0, 0)

    def sibling(self) -> Self:
        """The other mode's cluster on this host (same binaries): it uses the same ports as this one."""
        other = not self.control_plane_only
        return dataclasses.replace(self, state=state_dir(other), control_plane_only=other)

    @property
    def components(self) -> tuple[str, ...]:
        """What this mode runs, in start order."""
        if not self.control_plane_only:
            return COMPONENTS
        return tuple(c for c in CONTROL_PLANE if c not in OPTIONAL_CONTROL_PLANE or self._binary(c).is_file())

    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (system:masters) for kubectl and the tests."""
        return self.state / "admin.kubeconfig"

    @property
    def kubectl_bin(self) -> Path:
        return self.k8s_bin / "kubectl"

    @property
    def containerd_sock(self) -> Path:
        return self.state / "containerd" / "containerd.sock"

    def log_file(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def _pid_file(self, component: str) -> Path:
        return self.state / "pids" / f"{component}.pid"

    def _binary(self, component: str) -> Path:
        return (self.containerd_bin if component == "containerd" else self.k8s_bin) / component

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        """Run kubectl against this cluster and return stdout; raise with stderr when ``check`` fails."""
        proc = subprocess.run(
            [str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def kubectl_json(self, *args: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl(*args, "-o", "json"))
        return out

    def ctr(self, *args: str, check: bool = True) -> str:
        proc = subprocess.run(
            [str(self.containerd_bin / "ctr"), "--address", str(self.containerd_sock), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def pid(self, component: str) -> int | None:
        """PID of a running component this harness started, or None; its executable must be the one recorded at
        start (no PID reuse), whichever release's binary that was."""
        try:
            recorded = self._pid_file(component).read_text().split(maxsplit=1)
            pid = int(recorded[0])
            binary = recorded[1].strip() if len(recorded) > 1 else str(self._binary(component))
            exe = os.readlink(f"/proc/{pid}/exe")
        except (OSError, ValueError, IndexError):
            return None
        # A binary replaced in the cache while running shows as "<path> (deleted)"; it is still ours.
        return pid if exe.removesuffix(" (deleted)") == binary else None

    def running(self) -> dict[str, int | None]:
        return {c: self.pid(c) for c in self.components}

    def tail(self, component: str, lines: int = 60) -> str:
        """Last lines of a component log (for failure reports)."""
        return tail_file(self.log_file(component), lines)

    def _already_up(self, ready: Callable[[], bool], what: str) -> bool:
        """Whether an earlier ``up`` left this cluster running and ready; stale state is torn down."""
        if not self.state.exists():
            return False
        if all(self.running().values()) and ready():
            log(f"{what} (state {self.state})")
            return True
        log(f"stale state in {self.state}; tearing it down first")
        self.down()
        return False

    def _refuse_if_sibling_up(self) -> None:
        """The two modes share ports: start neither while the other runs."""
        other = self.sibling()
        up = [c for c, pid in other.running().items() if pid]
        if up:
            mode = "normal" if self.control_plane_only else "control-plane-only"
            flag = "" if self.control_plane_only else " --control-plane-only"
            raise ClusterError(
                f"the {mode} e2e cluster is running ({', '.join(up)}; state {other.state}) on the same ports; "
                f"stop it first with: python3 -m e2e.cluster down{flag}"
            )

    def down(self) -> None:
        """Stop what up started and remove the state (``Cluster.down``, core.py)."""
        raise NotImplementedError

"""Fixtures for the real-cluster scenarios: one cluster per session, one kxpu daemon and pod set per test.

The cluster is brought up once (or reused when ``make cluster-up`` already started it, in which case it is left
running) and torn down at the end. Every test gets an ``E2E`` context that starts kxpu daemons from configs and
creates pods, and on teardown deletes its pods and stops its daemons. A failed test's report carries the tails
of the kubelet, containerd and kxpu logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from e2e import kube
from e2e.cluster import COMPONENTS, NODE_NAME, REPO, Cluster, ClusterError, exclusive, tail_file
from kxpu.testing.fakes import import_args

_CLUSTER: Cluster | None = None
_CONTEXT_KEY = pytest.StashKey["E2E"]()
SCENARIO_TIMEOUT = 300  # seconds per test; the cluster start is budgeted to the first test
LOCK_WAIT = float(os.environ.get("KXPU_E2E_LOCK_WAIT", "900"))  # for another e2e session to finish


# The device-plugin core: also run on the oldest supported Kubernetes release (`make e2e` runs `-m core` there).
CORE_SCENARIOS = frozenset({"test_simulated.py", "test_restarts.py", "test_generic.py", "test_cdi.py"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip everything without root; give each scenario a longer pytest-timeout than unit tests get; mark the
    device-plugin core scenarios ``core``."""
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        if Path(str(item.fspath)).name in CORE_SCENARIOS:
            item.add_marker(pytest.mark.core)
        if os.geteuid() != 0:
            item.add_marker(
                pytest.mark.skip(reason="e2e needs root: it runs a kubelet, containerd and mounts")
            )
        if config.pluginmanager.hasplugin("timeout"):
            item.add_marker(pytest.mark.timeout(SCENARIO_TIMEOUT))


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    global _CLUSTER
    if os.geteuid() != 0:
        pytest.skip("e2e needs root")
    try:
        c = Cluster.default()
    except (subprocess.CalledProcessError, KeyError) as exc:
        pytest.skip(f"cannot locate the cluster binaries (hack/cluster/build.sh paths): {exc}")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(exclusive(LOCK_WAIT, "pytest e2e session"))
        except ClusterError as exc:
            pytest.fail(str(exc), pytrace=False)
        reuse = c.state.exists() and all(c.running().values())
        if not reuse:
            try:
                c.up()
            except ClusterError as exc:
                tails = "\n".join(f"--- {name} ---\n{c.tail(name, 30)}" for name in COMPONENTS)
                c.down()  # the logs are in the message; leave nothing running
                pytest.fail(f"cluster did not come up: {exc}\n{tails}", pytrace=False)
        _CLUSTER = c
        yield c
        if not reuse and os.environ.get("KXPU_E2E_KEEP") != "1":
            c.down()


def kxpu_binary() -> Path:
    """The daemon under test: $KXPU_BIN, else the project venv's entry point."""
    found = os.environ.get("KXPU_BIN") or str(REPO / ".venv" / "bin" / "kxpu")
    path = Path(found)
    if not path.exists():
        alt = shutil.which("kxpu")
        if alt is None:
            pytest.skip(f"kxpu not installed at {path} (run make dev) and not on PATH")
        path = Path(alt)
    return path


class Kxpu:
    """One ``kxpu plugin`` process on the host, with its config and log file."""

    def __init__(
        self,
        binary: Path,
        config: Path,
        log: Path,
        resources: list[str],
        imports: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.binary, self.config, self.log, self.resources = binary, config, log, resources
        self.imports = list(imports)  # backend modules of this repository (tests.flaky_backend)
        self.env = env  # more environment (NODE_NAME and KUBECONFIG for DRA, fakes' settings)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [str(self.binary), "plugin", "--config", str(self.config), "--log-level", "debug"]
        env = None if self.env is None else {**os.environ, **self.env}
        args += import_args(
            env or os.environ
        )  # the fake machine a KXPU_FAKE_* variable names plays when imported
        for module in self.imports:
            args += ["--import", module]
            env = {
                **(env or os.environ),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            }
        with self.log.open("ab") as out:
            out.write(f"--- start {time.strftime('%H:%M:%S')}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def send(self, sig: signal.Signals) -> None:
        assert self.proc is not None, "not started"
        self.proc.send_signal(sig)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> int | None:
        """Signal the daemon and wait for it to exit; escalate to SIGKILL after ``timeout``."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                return proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                raise AssertionError(f"kxpu ignored {sig.name} for {timeout:.0f}s and was killed") from None
        return proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class E2E:
    """Per-test resources; cleaned up in reverse: pods first (their devices go free), then daemons."""

    def __init__(self, cluster: Cluster, tmp: Path, name: str) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.label = re.sub(r"[^a-z0-9-]", "-", name.lower())[:50].strip("-")
        self.daemons: list[Kxpu] = []
        self.pods: list[kube.PodSpec] = []
        self.logs: dict[str, Path] = {}  # more logs for a failed test's report (e.g. control-plane processes)
        self.cleanups: list[Callable[[], object]] = []  # after pods and daemons, last added first

    def kxpu(
        self,
        resources: list[dict[str, Any]],
        start: bool = True,
        env: dict[str, str] | None = None,
        imports: Sequence[str] = (),
        **top: Any,
    ) -> Kxpu:
        """Write a kxpu config (JSON is YAML; ``top``: more top-level keys) and start a daemon for it. A
        resource served through DRA gets the node's name and the cluster's admin kubeconfig, as the chart's
        DaemonSet gets its node name and service account."""
        n = len(self.daemons)
        config = self.tmp / f"kxpu-{n}.yaml"
        config.write_text(json.dumps({"version": "v1", "resources": resources, **top}, indent=2) + "\n")
        names = [str(r["name"]) for r in resources if r.get("serve") != "dra"]
        if any(r.get("serve") == "dra" for r in resources):
            env = {"NODE_NAME": NODE_NAME, "KUBECONFIG": str(self.cluster.kubeconfig), **(env or {})}
        daemon = Kxpu(kxpu_binary(), config, self.tmp / f"kxpu-{n}.log", names, imports, env)
        self.daemons.append(daemon)
        if start:
            daemon.start()
        return daemon

    def pod(self, name: str, script: str, limits: dict[str, int]) -> kube.PodSpec:
        spec = kube.PodSpec(
            name=f"{self.label[:30]}-{name}", script=script, limits=limits, labels={"kxpu-e2e": self.label}
        )
        self.pods.append(spec)
        kube.create_pod(self.cluster, spec)
        return spec

    def close(self) -> None:
        errors = []
        if self.pods:
            try:
                kube.delete_pods(self.cluster, f"kxpu-e2e={self.label}")
            except Exception as exc:
                errors.append(f"deleting pods: {exc}")
        for daemon in reversed(self.daemons):
            try:
                daemon.stop()
            except Exception as exc:
                errors.append(f"stopping kxpu: {exc}")
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception as exc:
                errors.append(f"cleaning up: {exc}")
        # Leave no healthy devices behind: the next scenario's wait for allocatable must see its own daemon
        # register, not this one's stale node status.
        for resource in sorted({r for d in self.daemons for r in d.resources}):
            try:
                kube.wait_resource(self.cluster, resource, allocatable=0, timeout=30)
            except Exception as exc:
                errors.append(f"after stopping kxpu: {exc}")
        if errors:
            raise AssertionError("; ".join(errors))


@pytest.fixture
def e2e(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[E2E]:
    ctx = E2E(cluster, tmp_path, request.node.name)
    request.node.stash[_CONTEXT_KEY] = ctx
    yield ctx
    ctx.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach the component logs to a failed scenario's report."""
    report: pytest.TestReport = yield
    if report.failed and _CLUSTER is not None:
        ctx = item.stash.get(_CONTEXT_KEY, None)
        for daemon in ctx.daemons if ctx else []:
            report.sections.append((f"kxpu log {daemon.log}", tail_file(daemon.log, 80)))
        for name, path in ctx.logs.items() if ctx else []:
            report.sections.append((f"{name} log {path}", tail_file(path, 80)))
        for component in ("kubelet", "containerd", "kube-scheduler"):
            text = _relevant(tail_file(_CLUSTER.log_file(component), 400), 60)
            report.sections.append((f"{component} log {_CLUSTER.log_file(component)}", text))
    return report


def _relevant(text: str, lines: int) -> str:
    """Prefer the lines that mention devices or errors; fall back to the plain tail."""
    keep = [ln for ln in text.splitlines() if re.search(r"device|plugin|cdi|error|fail|E\d{4} ", ln, re.I)]
    return "\n".join((keep or text.splitlines())[-lines:])

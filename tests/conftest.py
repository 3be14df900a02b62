from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, settings

from kxpu.testing import KubeletStandIn
from kxpu.testing.process import DaemonProcess

TESTS = Path(__file__).parent

# Hypothesis profiles. "ci" (the default, what `make test` runs) bounds every fuzz and property test
# that does not set its own example count, so that the fuzzing stays within about a minute on a 2-core
# machine; "thorough" is for hunting: HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/test_fuzz_*.py
settings.register_profile(
    "ci",
    max_examples=100,  # hypothesis's own default: the property tests keep their strength
    deadline=None,  # a loaded CI machine is slow now and then; time is bounded by the example count
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: keep the base short, not pytest's long tmp_path.
    path = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin_dir(workdir: Path) -> Path:
    path = workdir / "dp"
    path.mkdir()
    return path


@pytest.fixture
async def kubelet(plugin_dir: Path) -> AsyncIterator[KubeletStandIn]:
    standin = KubeletStandIn(plugin_dir)
    await standin.start()
    yield standin
    await standin.stop()


@pytest.fixture
def write_config(workdir: Path, plugin_dir: Path) -> Callable[..., Path]:
    def write(resources: list[dict[str, Any]], name: str = "config.yaml", **top: Any) -> Path:
        path = workdir / name
        doc = {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            # Never the host's: a DRA checkpoint there (an e2e run's) would be drained by these daemons.
            "kubeletPluginsDir": str(workdir / "kubelet-plugins"),
            "pluginsRegistryDir": str(workdir / "plugins-registry"),
            "resources": resources,
            **top,
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    return write


@pytest.fixture
async def daemons(workdir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Callable[..., Any]]:
    """Start daemons as separate processes; stop them afterwards and show their logs if the test failed."""
    started: list[DaemonProcess] = []

    async def start(config: Path, *extra: str, **kwargs: Any) -> DaemonProcess:
        daemon = DaemonProcess(config, workdir / f"daemon-{len(started)}.log", extra_args=extra, **kwargs)
        await daemon.start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        with contextlib.suppress(TimeoutError):
            await daemon.stop(timeout=10)
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for daemon in started:
            print(f"--- {daemon.log_path.name} ---\n{daemon.log_text()}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report

"""What a starting node daemon loads: only what its configured backends and serving paths use.

Every module a process imports costs its start (exec → registered with the kubelet) and its memory for as long
as it runs, so ``kxpu plugin`` loads a vendor backend, the Kubernetes client, the DRA driver, fractional sharing
and telemetry only when the config uses them. Read from the daemon itself: ``kxpu plugin`` runs as a separate
process against the kubelet stand-in with ``PYTHONPROFILEIMPORTTIME`` set, and the test reads every module it
imported, until it registered and stopped, from that report on its stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kxpu.testing import KubeletStandIn
from kxpu.testing.dra import DraKubeletStandIn
from kxpu.testing.process import DaemonProcess
from tests.waiting import wait_until

# Never loaded by a daemon whose config does not use them (the feature's own config model aside: the config
# file composes every feature's model).
VENDORS = [
    f"kxpu.backends.{v}" for v in ("nvidia", "amd", "ascend", "gaudi", "neuron", "cambricon", "generic")
]
ALWAYS_UNUSED = [
    *VENDORS,
    "kxpu.testing",  # fakes plug in from outside, and only when the environment names one
    "kxpu.sharing.",  # the cluster side; kxpu.sharing.config is the one module a node daemon loads
    "kxpu.daemon.telemetry",  # telemetry is off in these configs
    "aiohttp",
]
DEVICE_PLUGIN_UNUSED = [
    *ALWAYS_UNUSED,
    "kxpu.dra.",  # no DRA resource, no DRA checkpoint on the node: kxpu.dra.config only
    "kxpu.api.dra",
    "kxpu.api.pluginregistration",
    "kxpu.daemon.holders",  # what pods hold: read by telemetry and by a DRA driver before it publishes
    "kxpu.api.podresources",
    "kxpu.kube",  # no API server needed (--http-auth none)
    "lightkube",
    "httpx",
]
ALLOWED = {"kxpu.sharing.config", "kxpu.dra.config"}

BENCH = Path(__file__).resolve().parent.parent / "bench"
_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", re.M)


def _config(base: Path, dra: bool, resource: dict[str, Any] | None = None, **extra: Any) -> Path:
    """The daemon's config: 8 simulated devices (or ``resource``) served one way, with ``extra`` top-level keys."""
    resource = resource or {"name": "example.com/npu", "simulated": {"count": 8, "model": "sim"}}
    if dra:
        resource |= {"serve": "dra", "dra": {"nodeName": "node-a", "cdiSpecDir": str(base / "cdi")}}
    config = base / "config.json"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "devicePluginDir": str(base / "dp"),
                "kubeletPluginsDir": str(base / "plugins"),
                "pluginsRegistryDir": str(base / "registry"),
                "podResourcesSocket": str(base / "pod-resources.sock"),
                "resources": [resource],
                **extra,
            }
        )
    )
    for d in ("dp", "plugins", "registry"):
        (base / d).mkdir(exist_ok=True)
    return config


def _loaded(log: Path) -> set[str]:
    return set(_IMPORTED.findall(log.read_text()))


def _unexpected(modules: set[str], unused: list[str]) -> list[str]:
    """``unused`` names a module with its submodules, or, ending in a dot, only a package's submodules."""

    def matches(module: str, name: str) -> bool:
        return (
            module.startswith(name) if name.endswith(".") else module == name or module.startswith(name + ".")
        )

    return sorted(m for m in modules - ALLOWED if any(matches(m, u) for u in unused))


@contextlib.asynccontextmanager
async def _registered(
    workdir: Path, config: Path, resource: str, dra: bool, **env: str
) -> AsyncIterator[DaemonProcess]:
    """A daemon reporting its imports (``PYTHONPROFILEIMPORTTIME``), registered with a kubelet stand-in of its
    path; both stopped on the way out (the test stops the daemon itself to check its exit status)."""
    kubelet: KubeletStandIn | DraKubeletStandIn = (
        DraKubeletStandIn(workdir / "registry") if dra else KubeletStandIn(workdir / "dp")
    )
    await kubelet.start()
    env = {"PYTHONPROFILEIMPORTTIME": "1", "KUBECONFIG": "/nonexistent", **env}
    daemon = DaemonProcess(config, workdir / "daemon.log", env=env)
    await daemon.start()
    try:
        await kubelet.wait_registered(resource, timeout=60)
        yield daemon
    finally:
        await daemon.stop()
        await kubelet.stop()


async def test_a_device_plugin_node_loads_no_dra_kubernetes_vendor_or_sharing_code(workdir: Path) -> None:
    config, log = _config(workdir, dra=False), workdir / "daemon.log"
    async with _registered(workdir, config, "example.com/npu", dra=False) as daemon:
        assert await daemon.stop() == 0
    modules = _loaded(log)
    # The report is read. (A module imported by name, importlib.import_module, is not in it, only what it imports:
    # the simulated backend, loaded for its config key, shows through its partitions.)
    assert "kxpu.daemon.servicer" in modules and "kxpu.backends.partitions" in modules
    assert _unexpected(modules, DEVICE_PLUGIN_UNUSED) == []


async def test_a_dra_node_loads_no_vendor_sharing_or_telemetry_code(workdir: Path) -> None:
    config, log = _config(workdir, dra=True), workdir / "daemon.log"
    async with _registered(workdir, config, "npu.example.com", dra=True, NODE_NAME="node-a") as daemon:
        assert await daemon.stop() == 0
    modules = _loaded(log)
    assert "kxpu.dra.plugin" in modules  # the report is read
    assert _unexpected(modules, ALWAYS_UNUSED) == []


# Loaded only once the kubelet has the node's devices: registration does not need them.
AFTER_REGISTRATION = ["prometheus_client", "h11", "kxpu.daemon.http"]
_LIGHTKUBE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*lightkube$", re.M)


def _first_line(log: str, pattern: str) -> int:
    match = re.search(pattern, log, re.M)
    assert match, pattern
    return log.count("\n", 0, match.start())


def _import_line(log: str, module: str) -> int:
    return _first_line(log, rf"^import time:\s+\d+ \|\s+\d+ \|\s*{re.escape(module)}$")


async def _metrics(daemon: DaemonProcess) -> str:
    """/metrics, waited for: the HTTP server is up a moment after the registration (and the port is refused
    until the starting process has taken it)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            answer = await daemon.http_get("/metrics")
        except OSError as exc:  # refused: the process has not reached its listen() yet
            answer = (0, str(exc))
        if answer[0] == 200:
            return answer[1]
        assert asyncio.get_running_loop().time() < deadline, answer
        await asyncio.sleep(0.01)


def _value(metrics: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", metrics, re.M)
    assert match, series
    return float(match.group(1))


async def test_a_device_plugin_registers_before_it_loads_metrics_and_http_and_loses_no_metric(
    workdir: Path,
) -> None:
    config, log = _config(workdir, dra=False), workdir / "daemon.log"
    async with _registered(workdir, config, "example.com/npu", dra=False) as daemon:
        metrics = await _metrics(daemon)
        assert (await daemon.http_get("/readyz"))[0] in (200, 503)  # the probes are served as well
        assert await daemon.stop() == 0
    text = log.read_text()
    registered = _first_line(text, r"event=\"registered with the kubelet\"")
    assert all(_import_line(text, m) > registered for m in AFTER_REGISTRATION), text
    # What the metrics were given before prometheus-client loaded (discovery, the registration) is exported.
    resource = 'resource="example.com/npu"'
    assert _value(metrics, f"kxpu_registrations_total{{{resource}}}") == 1
    assert _value(metrics, f"kxpu_resource_registered{{{resource}}}") == 1
    assert _value(metrics, f'kxpu_resource_devices{{{resource},state="capacity"}}') == 8
    assert len(re.findall(r"^kxpu_device_health\{.*\} 1\.0$", metrics, re.M)) == 8


async def test_a_dra_driver_registers_before_it_loads_the_api_client_metrics_and_http(workdir: Path) -> None:
    config, log = _config(workdir, dra=True), workdir / "daemon.log"
    async with _registered(workdir, config, "npu.example.com", dra=True, NODE_NAME="node-a") as daemon:
        metrics = await _metrics(daemon)
        # The API side starts after the registration all the same (and fails: there is no API server here).
        await wait_until(lambda: _LIGHTKUBE.search(daemon.log_text()) is not None, what="lightkube loaded")
        assert await daemon.stop() == 0
    text = log.read_text()
    registered = _first_line(text, r"component=kxpu\.dra\.plugin event=\"registered with the kubelet\"")
    assert all(_import_line(text, m) > registered for m in [*AFTER_REGISTRATION, "lightkube"]), text
    assert _value(metrics, 'kxpu_dra_registered{driver="npu.example.com"}') == 1


async def test_a_node_of_one_vendor_loads_no_other_backend_nor_the_simulated_one(workdir: Path) -> None:
    """An NVIDIA node with telemetry on (over the fake NVML, which plays the machine in the daemon): neither the
    simulated backend (with its partitions, env templates and mounts) nor another vendor's is loaded."""
    nvidia = {"name": "nvidia.com/gpu", "nvidia": {}}
    config = _config(workdir, dra=False, resource=nvidia, telemetry={"enabled": True})
    log = workdir / "daemon.log"
    async with _registered(workdir, config, "nvidia.com/gpu", dra=False, KXPU_FAKE_NVML="a100-8x") as daemon:
        await _metrics(daemon)  # telemetry has started (after the registration)
        assert await daemon.stop() == 0
    modules = _loaded(log)
    assert (
        "kxpu.backends.nvidia.backend" in modules and "kxpu.daemon.telemetry" in modules
    )  # the report is read
    others = [v for v in VENDORS if v != "kxpu.backends.nvidia"]
    # (the simulated module itself would not be in the report, imported by name: what it imports would)
    simulated = [f"kxpu.backends.{m}" for m in ("simulated", "partitions", "templates", "mounts")]
    assert _unexpected(modules, [*others, *simulated]) == []


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
async def test_without_a_kubelet_the_probes_and_metrics_still_come_up(workdir: Path, dra: bool) -> None:
    """The HTTP server waits for the registration only so long: with no kubelet at all (a DRA driver then never
    registers) /healthz, /readyz and /metrics answer all the same."""
    config = _config(workdir, dra=dra)
    env = {"KUBECONFIG": "/nonexistent", "NODE_NAME": "node-a"}
    daemon = DaemonProcess(config, workdir / "daemon.log", env=env)
    await daemon.start()
    try:
        metrics = await _metrics(daemon)
        assert (await daemon.http_get("/healthz"))[0] == 200
        status, body = await daemon.http_get("/readyz")
        assert status == 503 and json.loads(body)["resources"]["example.com/npu"] != "registered"
        assert ("kxpu_dra_registered" if dra else "kxpu_resource_devices") in metrics
        assert await daemon.stop() == 0
    finally:
        await daemon.stop()


async def test_a_node_draining_an_old_dra_driver_still_registers_before_it_loads_metrics(
    workdir: Path,
) -> None:
    # Claims still prepared by a driver this config no longer serves through DRA (kxpu.dra.leftover): the daemon
    # serves that driver for unprepare only, and that must not pull the metrics library before the registration.
    config, log = _config(workdir, dra=False), workdir / "daemon.log"
    old = workdir / "plugins" / "old.example.com"
    old.mkdir(parents=True)
    (old / "checkpoint.json").write_text(
        json.dumps({"version": "v1", "driver": "old.example.com", "claims": {"uid-1": {}}})
    )
    async with _registered(workdir, config, "example.com/npu", dra=False, NODE_NAME="node-a") as daemon:
        await _metrics(daemon)
        assert await daemon.stop() == 0
    text = log.read_text()
    assert "kxpu.dra.leftover" in _loaded(log)  # the draining driver is served
    registered = _first_line(text, r"component=kxpu\.daemon\.\w+ event=\"registered with the kubelet\"")
    assert all(_import_line(text, m) > registered for m in AFTER_REGISTRATION), text


def _libraries(report: str, before: int | None = None) -> set[str]:
    """The third-party packages (top-level names, neither the standard library nor kxpu) a process imported, in
    its import report, up to line ``before``."""
    text = report if before is None else "\n".join(report.splitlines()[:before])
    tops = {m.split(".")[0] for m in _IMPORTED.findall(text)}
    # The report also names what was only tried (a library's optional extras, not installed) and what site
    # loads (private names): neither is a library the process holds.
    tops = {t for t in tops if not t.startswith("_") and importlib.util.find_spec(t) is not None}
    return tops - set(sys.stdlib_module_names) - {"kxpu", "kept_libraries"}


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
async def test_the_benchs_library_floor_loads_what_a_starting_daemon_loads(workdir: Path, dra: bool) -> None:
    """bench/bench_startup.py's ``--libs-floor`` contenders stand for the libraries kxpu cannot start without:
    the bare registrar with ``bench/kept_libraries.py`` must load exactly the third-party packages a starting
    daemon has loaded when it registers, no fewer (the floor would flatter kxpu) and no more (it would blame the
    libraries for kxpu's own choices)."""
    resource = "npu.example.com" if dra else "example.com/npu"
    config, log = _config(workdir, dra=dra), workdir / "daemon.log"
    async with _registered(workdir, config, resource, dra=dra, NODE_NAME="node-a") as daemon:
        assert await daemon.stop() == 0
    text = log.read_text()
    component = r"kxpu\.dra\.plugin" if dra else r"kxpu\.daemon\.\w+"
    registered = _first_line(text, rf"component={component} event=\"registered with the kubelet\"")
    daemon_libraries = _libraries(text, before=registered)
    assert {"pydantic", "grpc", "google"} <= daemon_libraries  # the report is read

    floor = workdir / "floor"
    kubelet: KubeletStandIn | DraKubeletStandIn = (
        DraKubeletStandIn(floor / "registry") if dra else KubeletStandIn(floor / "dp")
    )
    for d in ("dp", "plugins", "registry"):
        (floor / d).mkdir(parents=True)
    script = BENCH / ("bare_dra_registrar.py" if dra else "bare_dp_registrar.py")
    args = (
        [resource, str(floor / "registry"), str(floor / "plugins")]
        if dra
        else [resource, str(floor / "dp"), "4"]
    )
    env = {
        **os.environ,
        "PYTHONPROFILEIMPORTTIME": "1",
        "BARE_WITH_LIBS": "1",
        "PYTHONPATH": str(BENCH.parent),
    }
    await kubelet.start()
    try:
        with (floor / "log").open("wb") as out:
            bare = await asyncio.create_subprocess_exec(
                sys.executable, str(script), *args, stdout=out, stderr=out, env=env, cwd=floor
            )
        try:
            await kubelet.wait_registered(resource, timeout=60)
        finally:
            bare.terminate()
            assert await asyncio.wait_for(bare.wait(), 20) == 0
    finally:
        await kubelet.stop()
    assert _libraries((floor / "log").read_text()) == daemon_libraries

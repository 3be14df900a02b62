"""The daemon's probes and metrics, its optional capabilities, and its flag/env overrides."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kxpu.testing import KubeletStandIn
from kxpu.testing.process import DaemonProcess
from tests.test_daemon import NPU, simulated
from tests.waiting import wait_ready, wait_until

ROOT = Path(__file__).parent.parent
# the simulated backend's UUIDs for sim-npu-0 .. sim-npu-3 (derived from the IDs)
SIM_UUID = [
    "SIM-3bd74612-cf16-5259-9032-5a9dfd37f4c5",
    "SIM-ede3e944-43a6-5f22-bba3-3b7eb1232693",
    "SIM-0502c331-629a-5891-b0ee-b54a842b45e9",
    "SIM-7ca6f1c9-1058-5d62-9775-46ff50f58f6b",
]


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format, or None if absent."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if found == labels:
            return float(match.group(3))
    return None


async def test_readyz_follows_registration_and_metrics_follow_devices(
    plugin_dir: Path, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    state = workdir / "state.json"
    daemon: DaemonProcess = await daemons(write_config([simulated(stateFile=str(state))]))
    await wait_until(lambda: "waiting for the kubelet" in daemon.log_text(), what="the daemon to start")
    status, body = await daemon.http_get("/readyz")
    assert status == 503 and json.loads(body)["resources"] == {NPU: "waiting-for-kubelet"}
    assert (await daemon.http_get("/healthz"))[0] == 200

    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    try:
        await kubelet.wait_registered(NPU)
        assert await wait_ready(daemon) == {"ready": True, "resources": {NPU: "registered"}}

        state.write_text(json.dumps({"sim-npu-3": "Unhealthy"}))
        await kubelet.wait_devices(NPU, lambda d: d["sim-npu-3"] == "Unhealthy")
        with pytest.raises(grpc.aio.AioRpcError):
            await kubelet.allocate(NPU, ["sim-npu-3"])
        await kubelet.allocate(NPU, ["sim-npu-0"])

        text = (await daemon.http_get("/metrics"))[1]
        assert metric(text, "kxpu_resource_devices", resource=NPU, state="capacity") == 4
        assert metric(text, "kxpu_resource_devices", resource=NPU, state="allocatable") == 3
        assert metric(text, "kxpu_device_health", resource=NPU, device="sim-npu-3", uuid=SIM_UUID[3]) == 0
        assert metric(text, "kxpu_device_health", resource=NPU, device="sim-npu-0", uuid=SIM_UUID[0]) == 1
        assert metric(text, "kxpu_health_events_total", resource=NPU, cause="state-file") == 1
        assert metric(text, "kxpu_allocate_errors_total", resource=NPU, code="FAILED_PRECONDITION") == 1
        assert metric(text, "kxpu_allocate_duration_seconds_count", resource=NPU) == 2
        assert metric(text, "kxpu_registrations_total", resource=NPU) == 1
        assert metric(text, "kxpu_resource_registered", resource=NPU) == 1

        await kubelet.restart()
        await kubelet.wait_registered(NPU, times=2)
        text = (await daemon.http_get("/metrics"))[1]
        assert metric(text, "kxpu_kubelet_restarts_total") == 1
        assert metric(text, "kxpu_registrations_total", resource=NPU) == 2
        assert (await daemon.http_get("/nope"))[0] == 404
    finally:
        await kubelet.stop()


async def test_pre_start_is_advertised_and_run(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    record = workdir / "prestarted"
    config = write_config([{"name": "example.com/ps", "prestart": {"record": str(record)}}])
    await daemons(config, "--import", "tests.flaky_backend", env={"PYTHONPATH": str(ROOT)})
    view = await kubelet.wait_registered("example.com/ps")
    assert view.options.pre_start_required
    assert not view.options.get_preferred_allocation_available  # not implemented by this backend
    await kubelet.pre_start("example.com/ps", ["ps-1", "ps-0"])
    assert record.read_text() == "ps-1,ps-0\n"
    # Not offered, but a kubelet that asks anyway still gets a valid answer.
    assert sorted(await kubelet.preferred("example.com/ps", ["ps-0", "ps-1"], [], 1)) in (["ps-0"], ["ps-1"])


async def test_env_var_overrides_the_file(
    workdir: Path, write_config: Callable[..., Path], daemons: Callable[..., Any]
) -> None:
    other = workdir / "other-dir"
    kubelet = KubeletStandIn(other)
    await kubelet.start()
    try:
        await daemons(write_config([simulated()]), env={"KXPU_DEVICE_PLUGIN_DIR": str(other)})
        await kubelet.wait_registered(NPU)
    finally:
        await kubelet.stop()


def test_devices_command_prints_discovery(write_config: Callable[..., Path]) -> None:
    config = write_config([simulated(count=2, memoryMiB=1024, numaNodes=[0, 1])])
    result = subprocess.run(
        [sys.executable, "-m", "kxpu", "devices", "--config", str(config), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    doc = json.loads(result.stdout)
    devices = doc[NPU]["devices"]
    assert doc[NPU]["backend"] == "simulated"
    assert [(d["id"], d["health"], d["numa_nodes"], d["memory_mib"]) for d in devices] == [
        ("sim-npu-0", "Healthy", [0], 1024),
        ("sim-npu-1", "Healthy", [1], 1024),
    ]
    table = subprocess.run(
        [sys.executable, "-m", "kxpu", "devices", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert table.splitlines()[2].split() == [
        "example.com/npu",
        "sim-npu-1",
        "Healthy",
        "<none>",
        "sim-npu",
        "1024Mi",
        "1",
    ]


def _series(text: str, name: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r'(\w+)="([^"]*)"', line.partition(" ")[0]))
        for line in text.splitlines()
        if line.startswith(name + "{")
    ]


async def test_health_and_telemetry_series_join_on_resource_and_uuid(
    plugin_dir: Path, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    """`kxpu_device_health` (per kubelet device ID) and the telemetry series (per physical device) share the
    labels a PromQL join needs: `kxpu_device_health * on (resource, uuid) group_left (model) kxpu_device_info`
    finds, for every device the kubelet sees, the figures of the device behind it."""
    (workdir / "host" / "proc").mkdir(parents=True)
    config = write_config(
        [simulated(memoryMiB=1024)],
        telemetry={"enabled": True, "intervalSeconds": 0.1, "hostRoot": str(workdir / "host")},
    )
    daemon: DaemonProcess = await daemons(config)
    kubelet = KubeletStandIn(plugin_dir)
    await kubelet.start()
    try:
        await kubelet.wait_registered(NPU)

        deadline = asyncio.get_running_loop().time() + 10
        while True:  # the first telemetry tick follows registration
            text = (await daemon.http_get("/metrics"))[1]
            if _series(text, "kxpu_device_info") and _series(text, "kxpu_device_health"):
                break
            assert asyncio.get_running_loop().time() < deadline, "no telemetry series after 10 s"
            await asyncio.sleep(0.05)
    finally:
        await kubelet.stop()
    health = _series(text, "kxpu_device_health")
    info = {(s["resource"], s["uuid"]): s for s in _series(text, "kxpu_device_info")}
    assert len(health) == 4 and len(info) == 4
    for series in health:
        assert series["device"].startswith("sim-npu-") and series["uuid"].startswith("SIM-")
        assert info[(series["resource"], series["uuid"])]["model"] == "sim-npu"
    for name in ("kxpu_device_memory_total_bytes", "kxpu_device_compute_utilization_ratio"):
        assert {(s["resource"], s["uuid"]) for s in _series(text, name)} == set(info), name

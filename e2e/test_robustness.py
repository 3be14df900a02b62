"""What an unlucky or hostile node does to kxpu, against the real kubelet: a backend failing while a stop or a
reload arrives, a regular file matching a device glob, 1,000 devices under a name too long for a plain socket
name. Each asserts what Kubernetes reports (node status, pods, the container's view) and kxpu's exit."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time
from pathlib import Path
from typing import Any

from e2e import kube
from e2e.cluster import DEVICE_PLUGIN_DIR
from e2e.configs import NPU, simulated
from e2e.conftest import E2E, Kxpu

BROKEN = "example.com/broken"
TEST_BACKENDS = ["tests.flaky_backend"]  # the repository's test backends (the `breaking` one here)


def _breaking(tmp: Path) -> dict[str, Any]:
    """A backend that serves two devices, then fails while serving once ``tmp/break`` exists (and again on
    every retry), appending a line to ``tmp/failures`` each time it fails."""
    return {"name": BROKEN, "breaking": {"breakWhen": str(tmp / "break"), "marker": str(tmp / "failures")}}


def _failures(tmp: Path) -> int:
    try:
        return (tmp / "failures").read_text().count("failing")
    except FileNotFoundError:
        return 0


def _break_while_serving(tmp: Path) -> None:
    """Make the backend fail while the kubelet's ListAndWatch stream is open and return at once: the
    resource is being torn down (its server waits out the open stream), the moment a stop used to hang."""
    before = _failures(tmp)
    (tmp / "break").touch()
    kube.wait_until("the backend to fail", lambda: _failures(tmp) > before, timeout=30, interval=0.02)


def _after_stopping(daemon: Kxpu) -> str:
    text = daemon.log_text()
    return text[text.rindex("event=stopping") :] if "event=stopping" in text else ""


def test_sigterm_while_a_failing_resource_is_torn_down(e2e: E2E, tmp_path: Path) -> None:
    """A DaemonSet update never waits for its grace period: SIGTERM during a failing resource's teardown
    exits at once (it hung, registering again after 'stopping', until SIGKILL)."""
    daemon = e2e.kxpu([simulated(), _breaking(tmp_path)], imports=TEST_BACKENDS)
    for attempt in range(2):
        kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=60)
        kube.wait_resource(e2e.cluster, BROKEN, allocatable=2, capacity=2, timeout=60)
        _break_while_serving(tmp_path)
        started = time.monotonic()
        assert daemon.stop(signal.SIGTERM, timeout=10) == 0, f"attempt {attempt}: kxpu did not exit 0"
        assert time.monotonic() - started < 5, "stopping took longer than a resource's grace"
        after = _after_stopping(daemon)
        assert "event=stopped" in after and "registered with the kubelet" not in after, after[-3000:]
        leftover = sorted(p.name for p in DEVICE_PLUGIN_DIR.glob("kxpu-*.sock"))
        assert not leftover, f"sockets left behind: {leftover}"
        kube.wait_resource(e2e.cluster, BROKEN, allocatable=0, timeout=60)
        (tmp_path / "break").unlink()
        daemon.start()


def test_sighup_removing_a_failing_resource_completes(e2e: E2E, tmp_path: Path) -> None:
    """A reload always finishes: removing a resource whose backend is failing removes its socket and its
    devices from the node, and later reloads are applied (the reload never finished, nor did any after)."""
    daemon = e2e.kxpu([simulated(), _breaking(tmp_path)], imports=TEST_BACKENDS)
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=60)
    kube.wait_resource(e2e.cluster, BROKEN, allocatable=2, capacity=2, timeout=60)
    _break_while_serving(tmp_path)
    daemon.config.write_text(json.dumps({"version": "v1", "resources": [simulated()]}))
    daemon.send(signal.SIGHUP)
    kube.wait_until(
        "the reload to finish", lambda: "config reloaded" in daemon.log_text(), timeout=10, interval=0.1
    )
    kube.wait_until(
        "the removed resource's socket to go",
        lambda: not [p for p in DEVICE_PLUGIN_DIR.glob("kxpu-*broken*.sock")],
        timeout=10,
        interval=0.1,
    )
    kube.wait_resource(e2e.cluster, BROKEN, allocatable=0, timeout=60)

    later = simulated(name="example.com/later", count=1)
    daemon.resources.append(later["name"])  # so that the scenario's clean-up waits for it to go too
    daemon.config.write_text(json.dumps({"version": "v1", "resources": [simulated(), later]}))
    daemon.send(signal.SIGHUP)
    kube.wait_resource(e2e.cluster, "example.com/later", allocatable=1, capacity=1, timeout=60)
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=60)
    pod = e2e.pod(
        "after-reloads", 'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"; echo end-of-report', {NPU: 1}
    )
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    assert daemon.stop(signal.SIGTERM, timeout=10) == 0


def test_a_regular_file_matching_the_glob_is_not_a_device(e2e: E2E, tmp_path: Path) -> None:
    """Only device nodes are advertised: a regular file or FIFO that matches the glob used to become a device,
    and the pod that got it failed in containerd with "not a device node"."""
    fpga = "example.com/fpga"
    devdir = tmp_path / "dev"
    devdir.mkdir()
    os.mknod(devdir / "fpga0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (devdir / "fpga1").write_text("a regular file, not a device\n")
    os.mkfifo(devdir / "fpga2")
    group = {
        "paths": [str(devdir / "fpga*")],
        "containerPath": "/dev/fpga_accel/{name}",
        "env": {"F": "{ids}"},
    }
    daemon = e2e.kxpu([{"name": fpga, "generic": {"groups": [group]}}])
    kube.wait_resource(e2e.cluster, fpga, allocatable=1, capacity=1, timeout=60)
    script = 'echo "F=$F"; stat -c "node %n %F %t:%T" /dev/fpga_accel/*; echo end-of-report'
    pod = e2e.pod("only-nodes", script, {fpga: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    assert "F=fpga0" in log and "node /dev/fpga_accel/fpga0 character special file 1:3" in log, log
    warnings = [ln for ln in daemon.log_text().splitlines() if "not a device node" in ln]
    assert any("fpga1" in w and "a regular file" in w for w in warnings), warnings
    assert any("fpga2" in w and "a FIFO" in w for w in warnings), warnings


def test_a_thousand_devices_under_a_long_resource_name(e2e: E2E) -> None:
    """1,000 devices (the node reports "1k") under a name whose plain socket name would pass the unix limit:
    the resource gets a hashed socket name, registers, and a pod gets a device."""
    name = "robustness." + "d" * 40 + ".example.com/" + "long-name-" + "n" * 40
    assert len(str(DEVICE_PLUGIN_DIR)) + 1 + len("kxpu-.sock") + len(name) > 107
    e2e.kxpu([simulated(name=name, count=1000)])
    kube.wait_resource(e2e.cluster, name, allocatable=1000, capacity=1000, timeout=90)
    capacity = e2e.cluster.kubectl_json("get", "node")["items"][0]["status"]["capacity"][name]
    assert capacity == "1k", capacity
    sockets = [p.name for p in DEVICE_PLUGIN_DIR.glob("kxpu-long-name-*.sock")]
    assert len(sockets) == 1 and "_" not in sockets[0], sockets
    pod = e2e.pod(
        "long-name", 'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"; echo end-of-report', {name: 2}
    )
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    match = re.search(r"^SIM_VISIBLE_DEVICES=(sim-npu-\d+),(sim-npu-\d+)$", log, re.M)
    assert match and match.group(1) != match.group(2), log

"""Scenarios 5-6: the kubelet and kxpu restart under running pods."""

from __future__ import annotations

import re
import signal
import urllib.request
from datetime import UTC, datetime

from e2e import kube
from e2e.cluster import DEVICE_PLUGIN_DIR
from e2e.configs import NPU, sim_ids, simulated
from e2e.conftest import E2E

REPORT = 'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"\necho end-of-report'


def _running_pod(e2e: E2E, name: str, count: int = 1) -> tuple[str, tuple[str, int], set[str]]:
    """Create a pod asking for ``count`` devices; return its name, container identity and the IDs it got."""
    spec = e2e.pod(name, REPORT, {NPU: count})
    pod = kube.wait_pod_phase(e2e.cluster, spec.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, spec.name, "end-of-report")
    match = re.search(r"^SIM_VISIBLE_DEVICES=(.*)$", log, re.M)
    assert match, log
    ids = set(match.group(1).split(","))
    assert len(ids) == count and ids <= sim_ids(), log
    return spec.name, kube.container_state(pod), ids


def _assert_untouched(e2e: E2E, pods: dict[str, tuple[str, int]]) -> None:
    """Running pods keep their container (same ID, no restarts) across the restart."""
    for name, before in pods.items():
        pod = kube.get_pod(e2e.cluster, name)
        assert pod["status"]["phase"] == "Running", kube.describe(pod)
        assert kube.container_state(pod) == before, f"{name} was restarted: {kube.describe(pod)}"


def _assert_no_device_shared(e2e: E2E, names: list[str], seen: dict[str, set[str]]) -> None:
    """Per the kubelet's checkpoint (and the containers' env), no device went to two pods."""
    granted = kube.devices_by_pod(e2e.cluster, NPU, names)
    assert set(granted) == set(names), f"checkpoint lacks pods: {granted}"
    flat = [d for ids in granted.values() for d in ids]
    assert len(flat) == len(set(flat)), f"a device was handed to two pods: {granted}"
    for name in names:
        assert set(granted[name]) == seen[name], f"{name}: checkpoint {granted[name]} vs env {seen[name]}"


def _kubelet_healthy() -> bool:
    with urllib.request.urlopen("http://127.0.0.1:10248/healthz", timeout=2) as resp:
        return bool(resp.read() == b"ok")


def test_kubelet_restart(e2e: E2E) -> None:
    """5. After a kubelet restart kxpu registers again; running pods stay; a new pod is admitted."""
    e2e.kxpu([simulated()])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    first, first_state, first_ids = _running_pod(e2e, "before")

    e2e.cluster.stop_kubelet()
    restarted = datetime.now(UTC).replace(microsecond=0)
    try:
        e2e.cluster.start_kubelet()
        kube.wait_until("kubelet /healthz", _kubelet_healthy, timeout=60)
        # Node status written by the new kubelet (the old Ready condition and allocatable are stale).
        kube.wait_until(
            "a node status heartbeat from the restarted kubelet",
            lambda: kube.node_ready(e2e.cluster) and kube.node_heartbeat(e2e.cluster) >= restarted,
            timeout=60,
        )
    finally:
        if e2e.cluster.pid("kubelet") is None:
            e2e.cluster.start_kubelet()

    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=60)
    # Admission calls Allocate on a registered endpoint: a Running pod proves the re-registration.
    second, _, second_ids = _running_pod(e2e, "after")
    _assert_untouched(e2e, {first: first_state})
    _assert_no_device_shared(e2e, [first, second], {first: first_ids, second: second_ids})


def test_kxpu_restart_and_kill(e2e: E2E) -> None:
    """6. kxpu stopped by SIGTERM, then killed by SIGKILL, and started again each time."""
    before = set(DEVICE_PLUGIN_DIR.iterdir())
    daemon = e2e.kxpu([simulated()])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    sockets = kube.wait_until(
        "kxpu's socket in the device-plugin directory", lambda: set(DEVICE_PLUGIN_DIR.iterdir()) - before
    )
    a, a_state, a_ids = _running_pod(e2e, "a")

    # SIGTERM: a clean exit that removes kxpu's sockets; the kubelet then sees the devices go unhealthy.
    assert daemon.stop(signal.SIGTERM) == 0, "kxpu did not exit 0 on SIGTERM"
    leftover = {p for p in sockets if p.exists()}
    assert not leftover, f"kxpu left sockets behind after SIGTERM: {sorted(map(str, leftover))}"
    kube.wait_resource(e2e.cluster, NPU, allocatable=0, timeout=60)
    daemon.start()
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    b, b_state, b_ids = _running_pod(e2e, "b")
    _assert_untouched(e2e, {a: a_state})

    # SIGKILL: no cleanup at all; the stale socket is kxpu's to cope with on the next start.
    daemon.stop(signal.SIGKILL)
    kube.wait_resource(e2e.cluster, NPU, allocatable=0, timeout=60)
    daemon.start()
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    c, _, c_ids = _running_pod(e2e, "c")
    _assert_untouched(e2e, {a: a_state, b: b_state})
    _assert_no_device_shared(e2e, [a, b, c], {a: a_ids, b: b_ids, c: c_ids})


def test_a_rolling_update_alongside(e2e: E2E) -> None:
    """Two daemons as a DaemonSet rolled with surge runs them, with devicePluginHandover alongside, on the real kubelet:
    each serves a socket of its own and registers it. A 1.37 kubelet keeps both, so when the old one stops the
    resource never loses its last plugin (the kubelet's own log says so); an older kubelet disconnects the newer one
    then, and kxpu registers it again at once. Either way the running pod keeps its device and a new pod gets one."""
    old = e2e.kxpu([simulated()], devicePluginHandover="alongside")
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    a, a_state, a_ids = _running_pod(e2e, "a")
    kubelet_log = e2e.cluster.log_file("kubelet")
    log_from = kubelet_log.stat().st_size
    (old_socket,) = _alongside_sockets()

    # A pod of its own has its own network namespace; on the host the second daemon takes another port.
    new = e2e.kxpu(
        [simulated()], env={"KXPU_HTTP_ADDRESS": "127.0.0.1:5979"}, devicePluginHandover="alongside"
    )
    kube.wait_until("the new daemon registered", lambda: "registered with the kubelet" in new.log_text(), 60)
    served = _alongside_sockets()
    assert len(served) == 2 and old_socket in served, served  # one socket each, side by side
    assert old.stop(signal.SIGTERM) == 0

    def kubelet_lines() -> list[str]:
        with kubelet_log.open("rb") as log:
            log.seek(log_from)
            return log.read().decode(errors="replace").splitlines()

    if e2e.cluster.release_tuple >= (1, 37):
        kube.wait_until(
            "the kubelet to let go of the old daemon's socket",
            lambda: any("Deregistered client" in line and NPU in line for line in kubelet_lines()),
            30,
        )
        lost = [
            line for line in kubelet_lines() if "Last device plugin for this resource disconnected" in line
        ]
        assert not lost, lost
        assert "the kubelet let go of this plugin" not in new.log_text()
    else:
        kube.wait_until(
            "kxpu to register again after the kubelet dropped it",
            lambda: "the kubelet let go of this plugin; registering again" in new.log_text(),
            30,
        )
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=30)
    (left,) = _alongside_sockets()
    assert left != old_socket  # the old daemon removed its socket; the new one serves its own
    b, _, b_ids = _running_pod(e2e, "b")
    _assert_untouched(e2e, {a: a_state})
    _assert_no_device_shared(e2e, [a, b], {a: a_ids, b: b_ids})


def _alongside_sockets() -> list[str]:
    return sorted(p.name for p in DEVICE_PLUGIN_DIR.glob("kxpu-example.com_npu@*.sock"))

"""Scenarios 1-4: a simulated resource through the real kubelet, scheduler and containerd."""

from __future__ import annotations

import json
import re
from pathlib import Path

from e2e import kube
from e2e.cluster import NODE_NAME
from e2e.configs import NPU, sim_ids, simulated
from e2e.conftest import E2E


def test_registration_sets_capacity_and_allocatable(e2e: E2E) -> None:
    """1. The kubelet accepts kxpu's registration and the node advertises every simulated device."""
    e2e.kxpu([simulated()])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)


def test_pod_gets_devices_env_and_mounts(e2e: E2E, tmp_path: Path) -> None:
    """2. kube-scheduler places a pod asking for 2; its container sees what Allocate returned."""
    share = tmp_path / "share"
    share.mkdir()
    (share / "marker").write_text("kxpu-e2e-mount-ok\n")
    e2e.kxpu([simulated(mount_dir=share)])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)

    pod = e2e.pod(
        "two",
        """
echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"
echo "SIM_DEVICE_COUNT=$SIM_DEVICE_COUNT"
echo "marker=$(cat /sim/marker)"
grep ' /sim ' /proc/mounts | sed 's/^/mount: /'
if touch /sim/probe 2>/dev/null; then echo "sim=writable"; else echo "sim=readonly"; fi
echo "end-of-report"
""",
        {NPU: 2},
    )
    running = kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    assert running["spec"]["nodeName"] == NODE_NAME
    scheduled = [e for e in kube.events_for(e2e.cluster, pod.name) if e["reason"] == "Scheduled"]
    assert scheduled, "no Scheduled event: the pod was not placed by kube-scheduler"
    assert scheduled[0].get("reportingComponent") == "default-scheduler" or (
        scheduled[0].get("source", {}).get("component") == "default-scheduler"
    )

    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    env_ids = _env_ids(log, "SIM_VISIBLE_DEVICES")
    assert len(env_ids) == 2 and env_ids <= sim_ids(), log
    assert "SIM_DEVICE_COUNT=2" in log, log
    assert "marker=kxpu-e2e-mount-ok" in log, log
    mount_line = next((ln for ln in log.splitlines() if ln.startswith("mount: ")), "")
    assert re.search(r"\sro[,\s]", mount_line), f"/sim is not mounted read-only: {mount_line!r}\n{log}"
    assert "sim=readonly" in log, log
    # The kubelet's own record agrees with what the container was told.
    granted = kube.devices_by_pod(e2e.cluster, NPU, [pod.name])
    assert set(granted.get(pod.name, ())) == env_ids


def test_request_above_allocatable_stays_pending(e2e: E2E) -> None:
    """3. A pod asking for more than the node has is not scheduled, and the scheduler says why."""
    e2e.kxpu([simulated()])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)
    pod = e2e.pod("five", "echo should-not-run", {NPU: 5})

    def failed_scheduling() -> str | None:
        for event in kube.events_for(e2e.cluster, pod.name):
            if event["reason"] == "FailedScheduling":
                return str(event["message"])
        return None

    message = kube.wait_until("a FailedScheduling event", failed_scheduling, timeout=60)
    assert f"Insufficient {NPU}" in message, message
    status = kube.get_pod(e2e.cluster, pod.name)["status"]
    assert status["phase"] == "Pending"
    assert not kube.get_pod(e2e.cluster, pod.name)["spec"].get("nodeName")


def test_health_changes_move_allocatable(e2e: E2E, tmp_path: Path) -> None:
    """4. An Unhealthy device leaves allocatable (capacity stays); Healthy again restores it; Absent leaves both."""
    state = tmp_path / "sim-npu.json"
    state.write_text("{}")
    e2e.kxpu([simulated(state_file=state)])
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4)

    state.write_text(json.dumps({"sim-npu-1": "Unhealthy"}))
    kube.wait_resource(e2e.cluster, NPU, allocatable=3, capacity=4, timeout=30)

    state.write_text(json.dumps({"sim-npu-1": "Healthy"}))
    kube.wait_resource(e2e.cluster, NPU, allocatable=4, capacity=4, timeout=30)

    state.write_text(json.dumps({"sim-npu-3": "Absent"}))
    kube.wait_resource(e2e.cluster, NPU, allocatable=3, capacity=3, timeout=30)


def _env_ids(log: str, var: str) -> set[str]:
    match = re.search(rf"^{var}=(.*)$", log, re.M)
    assert match, f"{var} not in the container's environment:\n{log}"
    return {i for i in match.group(1).split(",") if i}

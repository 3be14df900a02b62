"""The `ascend` backend on the real cluster, over a fake DCMI machine whose /dev/davinci<N> and management
nodes are real char devices (mknod in a fake root): the kubelet advertises eight 910B NPUs; a pod asking
for two gets exactly their /dev/davinci<phy>, the management nodes and the driver files HAMi's plugin
mounts, with ASCEND_VISIBLE_DEVICES naming the physical IDs the kubelet checkpointed for it and
ASCEND_RT_VISIBLE_DEVICES numbering them 0,1 inside the container; a card that drops off the bus
(DCMI answers -8012) leaves allocatable and comes back when it recovers (HAMi ascend-device-plugin#129)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kube
from e2e.conftest import E2E
from kxpu.testing.fake_dcmi import DAVINCI_MAJOR, FAKE_DCMI_ENV, MANAGEMENT_NODES, FakeDcmi

NPU = "huawei.com/Ascend910"
SCRIPT = r"""
echo "ASCEND_VISIBLE_DEVICES=${ASCEND_VISIBLE_DEVICES-unset}"
echo "ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES-unset}"
for d in /dev/davinci* /dev/devmm_svm /dev/hisi_hdc; do [ -e "$d" ] && echo "node $(stat -c '%n %F %t:%T' "$d")"; done
echo "driver $(cat /usr/local/Ascend/driver/version.info)"
[ -x /usr/local/bin/npu-smi ] && echo "npu-smi present"
echo end-of-report
"""


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDcmi]:
    fake = FakeDcmi("910b-8x", tmp_path / "host")
    monkeypatch.setenv(FAKE_DCMI_ENV, "910b-8x")  # the daemon's DCMI answers about this same machine
    yield fake
    fake.cleanup()


def nodes_seen(log: str) -> dict[str, str]:
    return dict(re.findall(r"^node (/dev/\S+) character special file (\S+)$", log, re.M))


def test_npus_reach_pods_with_their_nodes_and_both_visible_variables(e2e: E2E, machine: FakeDcmi) -> None:
    section = {"hostRoot": str(machine.root), "useAscendDocker": False, "pollSeconds": 0.5}
    e2e.kxpu([{"name": NPU, "ascend": section}])
    kube.wait_resource(e2e.cluster, NPU, allocatable=8, capacity=8)

    pod = e2e.pod("two-npus", SCRIPT, {NPU: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    granted = sorted(
        int(i.removeprefix("Ascend910-")) for i in kube.devices_by_pod(e2e.cluster, NPU, [pod.name])[pod.name]
    )
    assert len(granted) == 2, granted
    assert f"ASCEND_VISIBLE_DEVICES={granted[0]},{granted[1]}" in log, log
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1" in log, log
    expected = {f"/dev/davinci{p}": f"{DAVINCI_MAJOR:x}:{p:x}" for p in granted}
    expected |= {path: f"{major:x}:{minor:x}" for path, (major, minor) in MANAGEMENT_NODES.items()}
    assert nodes_seen(log) == expected, log
    assert "driver Version=24.1.rc2" in log and "npu-smi present" in log, log

    free = next(p for p in range(8) if p not in granted)
    machine.drop(free)  # DCMI now answers -8012 for it: only the poll sees it
    kube.wait_resource(e2e.cluster, NPU, allocatable=7, capacity=8)
    machine.recover(free)
    kube.wait_resource(e2e.cluster, NPU, allocatable=8, capacity=8)

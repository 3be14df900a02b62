"""The `cambricon` backend on the real cluster, over the fake libcndev (KXPU_FAKE_CAMBRICON) and a fake root
whose /dev/cambricon_* are real char devices: the kubelet advertises the MLUs under the plugin's IDs
(MLU-<uuid>), a pod asking for two sees exactly the nodes Cambricon's plugin gives (cambricon_ctl, then
cambricon_ipcm<N> and cambricon_dev<N> of its MLUs, the ones the kubelet checkpointed) and no visible-devices
variable; a health flip in cndev takes an MLU out of allocatable and its recovery puts it back."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kube
from e2e.conftest import E2E
from kxpu.testing.fake_cambricon import FAKE_MAJOR, FakeCambricon

MLU = "cambricon.com/mlu"
SCRIPT = r"""
echo "CAMBRICON_VISIBLE_DEVICES=${CAMBRICON_VISIBLE_DEVICES-unset} MLU_VISIBLE_DEVICES=${MLU_VISIBLE_DEVICES-unset}"
for d in /dev/cambricon*; do [ -e "$d" ] && echo "node $(stat -c '%n %F %t:%T' "$d")"; done
echo end-of-report
"""


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCambricon]:
    fake = FakeCambricon("mlu370-x8-4x", tmp_path / "host")
    monkeypatch.setenv(
        "KXPU_FAKE_CAMBRICON", str(fake.root)
    )  # the daemons this test starts load the fake cndev
    yield fake
    fake.cleanup()


def test_mlus_reach_pods_with_the_plugins_nodes(e2e: E2E, machine: FakeCambricon) -> None:
    e2e.kxpu([{"name": MLU, "cambricon": {"pollSeconds": 0.5}}])
    kube.wait_resource(e2e.cluster, MLU, allocatable=4, capacity=4)

    pod = e2e.pod("two-mlus", SCRIPT, {MLU: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    granted = kube.devices_by_pod(e2e.cluster, MLU, [pod.name])[pod.name]
    slots = sorted(i for i in range(4) if machine.uuid(i) in granted)
    assert len(slots) == 2, granted
    expected = {"/dev/cambricon_ctl": f"{FAKE_MAJOR:x}:{250:x}"}
    for n in slots:  # restore() numbers a card's nodes n*16 (cambricon_dev) and n*16+1 (cambricon_ipcm)
        expected[f"/dev/cambricon_dev{n}"] = f"{FAKE_MAJOR:x}:{n * 16:x}"
        expected[f"/dev/cambricon_ipcm{n}"] = f"{FAKE_MAJOR:x}:{n * 16 + 1:x}"
    assert dict(re.findall(r"^node (/dev/\S+) character special file (\S+)$", log, re.M)) == expected, log
    assert "CAMBRICON_VISIBLE_DEVICES=unset MLU_VISIBLE_DEVICES=unset" in log, log

    free = next(i for i in range(4) if i not in slots)
    machine.set_health(free, False)
    kube.wait_resource(e2e.cluster, MLU, allocatable=3, capacity=4)
    machine.set_health(free, True)
    kube.wait_resource(e2e.cluster, MLU, allocatable=4, capacity=4)

"""The `gaudi` backend on the real cluster, over a fake HLML machine whose /dev/accel nodes are real char
devices (mknod in a fake root): the kubelet advertises eight Gaudi2 named by serial number; a pod asking
for two gets exactly their accel and accel_controlD nodes and Habana's four variables for the devices the
kubelet checkpointed for it; an HLML critical event takes one device out of allocatable."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kube
from e2e.conftest import E2E
from kxpu.testing.fake_hlml import ACCEL_MAJOR, FAKE_HLML_CONTROL_ENV, FAKE_HLML_ENV, FakeHlml, send_control

GAUDI = "habana.ai/gaudi"
SCRIPT = r"""
for v in HABANA_VISIBLE_DEVICES HL_VISIBLE_DEVICES HL_VISIBLE_DEVICES_UUID HABANA_VISIBLE_MODULES; do
  eval "echo $v=\${$v-unset}"
done
for d in /dev/accel/*; do [ -e "$d" ] && echo "node $(stat -c '%n %F %t:%T' "$d")"; done
echo end-of-report
"""


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeHlml, Path]]:
    fake = FakeHlml("gaudi2-8x", tmp_path / "host")
    control = tmp_path / "hlml.sock"
    monkeypatch.setenv(FAKE_HLML_ENV, "gaudi2-8x")  # the daemon's HLML answers about this same machine
    monkeypatch.setenv(FAKE_HLML_CONTROL_ENV, str(control))
    yield fake, control
    fake.cleanup()


def test_gaudi_reach_pods_with_habanas_nodes_and_env(e2e: E2E, machine: tuple[FakeHlml, Path]) -> None:
    fake, control = machine
    e2e.kxpu([{"name": GAUDI, "gaudi": {"hostRoot": str(fake.root), "health": {"eventWaitMs": 200}}}])
    kube.wait_resource(e2e.cluster, GAUDI, allocatable=8, capacity=8)

    pod = e2e.pod("two-gaudi", SCRIPT, {GAUDI: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    serials = list(kube.devices_by_pod(e2e.cluster, GAUDI, [pod.name])[pod.name])
    by_serial = {a.serial: a for a in fake.aips}
    aips = [by_serial[s] for s in serials]
    assert len(aips) == 2, serials
    env = dict(re.findall(r"^(H\w+)=(.*)$", log, re.M))
    minors = [str(a.minor) for a in aips]
    assert sorted(env["HABANA_VISIBLE_DEVICES"].split(",")) == sorted(minors), log
    assert env == {  # one order for all four lists, as Habana's plugin builds them
        "HABANA_VISIBLE_DEVICES": env["HABANA_VISIBLE_DEVICES"],
        "HL_VISIBLE_DEVICES": ",".join(
            f"/dev/accel/accel{m}" for m in env["HABANA_VISIBLE_DEVICES"].split(",")
        ),
        "HL_VISIBLE_DEVICES_UUID": ",".join(
            next(a.serial for a in aips if str(a.minor) == m)
            for m in env["HABANA_VISIBLE_DEVICES"].split(",")
        ),
        "HABANA_VISIBLE_MODULES": ",".join(
            str(next(a.module_id for a in aips if str(a.minor) == m))
            for m in env["HABANA_VISIBLE_DEVICES"].split(",")
        ),
    }, log
    nodes = dict(re.findall(r"^node (/dev/\S+) character special file (\S+)$", log, re.M))
    expected = {f"/dev/accel/accel{a.minor}": f"{ACCEL_MAJOR:x}:{a.minor:x}" for a in aips}
    expected |= {f"/dev/accel/accel_controlD{a.minor}": f"{ACCEL_MAJOR:x}:{64 + a.minor:x}" for a in aips}
    assert nodes == expected, log

    free = next(i for i, a in enumerate(fake.aips) if a.serial not in serials)
    send_control(control, op="critical", index=free)
    kube.wait_resource(e2e.cluster, GAUDI, allocatable=7, capacity=8)

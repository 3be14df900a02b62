"""The `neuron` backend on the real cluster, over a fake Neuron machine whose /dev/neuron<N> are real char
devices (mknod in a fake root): the kubelet advertises NeuronCores and devices; a pod asking for two
NeuronCores gets NEURON_RT_VISIBLE_CORES naming a contiguous pair the kubelet checkpointed for it and
exactly the device node carrying them; a whole-device pod gets its nodes and no core variable; an
uncorrectable ECC count (a value change sysfs announces to nobody) takes a device's cores out."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import kube
from e2e.conftest import E2E
from kxpu.testing.fake_neuron import FAKE_MAJOR, FakeNeuron

CORE = "aws.amazon.com/neuroncore"
DEVICE = "aws.amazon.com/neuron"
SCRIPT = r"""
echo "NEURON_RT_VISIBLE_CORES=${NEURON_RT_VISIBLE_CORES-unset}"
for d in /dev/neuron*; do [ -e "$d" ] && echo "node $(stat -c '%n %F %t:%T' "$d")"; done
echo end-of-report
"""


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[FakeNeuron]:
    fake = FakeNeuron("trn1-32xl", tmp_path / "host")
    yield fake
    fake.cleanup()


def nodes_seen(log: str) -> dict[str, str]:
    return dict(re.findall(r"^node (/dev/\S+) character special file (\S+)$", log, re.M))


def test_neuroncores_reach_pods_contiguous_with_their_device(e2e: E2E, machine: FakeNeuron) -> None:
    e2e.kxpu([{"name": CORE, "neuron": {"unit": "core", "hostRoot": str(machine.root), "pollSeconds": 0.5}}])
    kube.wait_resource(e2e.cluster, CORE, allocatable=32, capacity=32)

    pod = e2e.pod("two-cores", SCRIPT, {CORE: 2})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    granted = sorted(
        int(i.removeprefix("neuroncore"))
        for i in kube.devices_by_pod(e2e.cluster, CORE, [pod.name])[pod.name]
    )
    assert len(granted) == 2 and granted[1] == granted[0] + 1 and granted[0] % 2 == 0, (
        granted
    )  # one device's pair
    assert f"NEURON_RT_VISIBLE_CORES={granted[0]}-{granted[1]}" in log, log
    device = granted[0] // 2
    assert nodes_seen(log) == {f"/dev/neuron{device}": f"{FAKE_MAJOR:x}:{device:x}"}, log

    other = (device + 1) % 16
    machine.set_ecc(other, "mem", 1)  # no inotify event: only the poll sees it
    kube.wait_resource(e2e.cluster, CORE, allocatable=30, capacity=32)


def test_whole_devices_reach_pods_without_core_env(e2e: E2E, machine: FakeNeuron) -> None:
    e2e.kxpu([{"name": DEVICE, "neuron": {"hostRoot": str(machine.root)}}])
    kube.wait_resource(e2e.cluster, DEVICE, allocatable=16, capacity=16)
    pod = e2e.pod("four-devices", SCRIPT, {DEVICE: 4})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    granted = sorted(
        int(i.removeprefix("neuron")) for i in kube.devices_by_pod(e2e.cluster, DEVICE, [pod.name])[pod.name]
    )
    assert granted == list(range(granted[0], granted[0] + 4)) and granted[0] % 4 == 0, (
        granted
    )  # an aligned group
    assert "NEURON_RT_VISIBLE_CORES=unset" in log, log
    assert nodes_seen(log) == {f"/dev/neuron{i}": f"{FAKE_MAJOR:x}:{i:x}" for i in granted}, log
    machine.lose(granted[0] - 1 if granted[0] else 15)  # hot-unplug of a free device
    kube.wait_resource(e2e.cluster, DEVICE, allocatable=15, capacity=15)

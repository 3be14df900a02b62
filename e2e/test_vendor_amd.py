"""The `amd` and `hygon` backends on the real cluster, over fake amdgpu trees whose /dev/kfd and /dev/dri/* are
real char devices (mknod): the kubelet advertises an MI300X node's 64 CPX partitions; a pod asking for one sees
exactly /dev/kfd and its partition's card and render nodes with the right major:minor, and no env; a repartition
to SPX takes the node to 8 GPUs and a RAS error takes one out of allocatable, with the same daemon process.
Then a Hygon DCU shared by two pods through kxpu's extender under HAMi's names (dcunum/dcumem/dcucores)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import kube
from e2e.cluster import Cluster
from e2e.conftest import E2E
from e2e.sharing_support import NS, Sharing, running_chain
from kxpu.testing.fake_amd import DRI_MAJOR, KFD_MAJOR, FakeAmd

GPU = "amd.com/gpu"
DCU, DCUMEM, DCUCORES = "hygon.com/dcunum", "hygon.com/dcumem", "hygon.com/dcucores"
SCRIPT = r"""
env | grep -E '^(HIP_|ROCR_|HSA_|GPU_DEVICE_ORDINAL|CUDA_)' | sed 's/^/env /'
for d in /dev/kfd /dev/mkfd /dev/dri/*; do [ -e "$d" ] && echo "node $(stat -c '%n %F %t:%T' "$d")"; done
echo end-of-report
"""


@pytest.fixture
def mi300x(tmp_path: Path) -> Iterator[FakeAmd]:
    fake = FakeAmd("mi300x-8x-cpx", tmp_path / "host")
    yield fake
    fake.cleanup()


def test_cpx_partitions_reach_pods_and_repartitioning_needs_no_restart(e2e: E2E, mi300x: FakeAmd) -> None:
    daemon = e2e.kxpu([{"name": GPU, "amd": {"hostRoot": str(mi300x.root), "pollSeconds": 0.5}}])
    kube.wait_resource(e2e.cluster, GPU, allocatable=64, capacity=64)

    pod = e2e.pod("one-partition", SCRIPT, {GPU: 1})
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    (granted,) = kube.devices_by_pod(e2e.cluster, GPU, [pod.name])[pod.name]
    card, render = _minors(mi300x, granted)
    expected = {
        "/dev/kfd": f"{KFD_MAJOR:x}:0",
        f"/dev/dri/card{card}": f"{DRI_MAJOR:x}:{card:x}",
        f"/dev/dri/renderD{render}": f"{DRI_MAJOR:x}:{render:x}",
    }
    assert dict(re.findall(r"^node (/dev/\S+) character special file (\S+)$", log, re.M)) == expected, log
    assert not re.search(r"^env ", log, re.M), log  # AMD's plugin sets no variable; neither does kxpu

    e2e.cluster.kubectl("delete", "pod", pod.name, "--wait=true", "--timeout=60s", timeout=90)
    mi300x.repartition("spx_nps1")
    kube.wait_resource(e2e.cluster, GPU, allocatable=8, capacity=8)
    mi300x.set_ras(3, "umc", 1)
    kube.wait_resource(e2e.cluster, GPU, allocatable=7, capacity=8)
    assert daemon.alive() and daemon.log_text().count("--- start") == 1  # one daemon process throughout


def _minors(fake: FakeAmd, device_id: str) -> tuple[int, int]:
    for g in range(8):
        if device_id == fake.bdf(g):
            return fake.card(g), fake.render(g)
        for k in range(1, 8):
            if device_id == f"amdgpu_xcp_{fake.xcp(g, k)}":
                return fake.card(g, k), fake.render(g, k)
    raise AssertionError(f"{device_id} is not a device of the fake")


@pytest.fixture(scope="module")
def dcu_chain(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Sharing, FakeAmd]]:
    work = tmp_path_factory.mktemp("hygon")
    fake = FakeAmd("hygon-dcu-8x", work / "host")
    resource = {
        "name": DCU,
        "hygon": {"hostRoot": str(fake.root), "pollSeconds": 1},
        "sharing": {"splitCount": 4, "publishIntervalSeconds": 5},
    }
    family = {"resource": DCU, "memory": DCUMEM, "cores": DCUCORES}
    try:
        with running_chain(cluster, work, resource=resource, family=family, slots=8 * 4) as sharing:
            yield sharing, fake
    finally:
        fake.cleanup()


def test_a_hygon_dcu_shared_by_two_pods_through_the_extender(
    e2e: E2E, dcu_chain: tuple[Sharing, FakeAmd]
) -> None:
    sharing, fake = dcu_chain
    e2e.logs.update(sharing.logs)
    sharing.wait_node_ready()
    limits = {DCU: 1, DCUMEM: 8192, DCUCORES: 40}
    sharing.create(sharing.pod("dcu-a", limits), sharing.pod("dcu-b", limits))
    try:
        pods = _wait_running(sharing, ["dcu-a", "dcu-b"])
        grants = {}
        for name, pod in pods.items():
            (container,) = sharing.assignment(pod).containers
            assert container.resource == DCU
            (grant,) = container.devices
            assert (grant.memory_mib, grant.cores) == (8192, 40)
            grants[name] = grant.device
            env = sharing.reported(name)
            assert (
                env.get("CUDA_DEVICE_MEMORY_LIMIT_0") == "8192m" and env.get("CUDA_DEVICE_SM_LIMIT") == "40"
            )
        # binpack: both on one DCU, 2 x 8192 MiB of its 32 GiB
        assert grants["dcu-a"] == grants["dcu-b"] and grants["dcu-a"] in {
            f"DCU-{fake.serial(g)}" for g in range(8)
        }
    finally:
        sharing.delete_pods()


def _wait_running(sharing: Sharing, names: list[str], timeout: float = 90) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}

    def probe() -> bool:
        for pod in sharing.pods(NS):
            name = pod["metadata"]["name"]
            if name in names:
                found[name] = pod
                phase = pod.get("status", {}).get("phase")
                assert phase not in ("Failed", "Succeeded"), f"{name} ended: {kube.describe(pod)}"
        return all(found.get(n, {}).get("status", {}).get("phase") == "Running" for n in names)

    kube.wait_until(f"pods {names} running", probe, timeout)
    return found

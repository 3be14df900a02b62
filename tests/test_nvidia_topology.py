"""Topology-aware choice of whole GPUs: NVLink first, then PCIe proximity, then NUMA."""

from __future__ import annotations

from kxpu.backends.nvidia.topology import best_set
from tests.nvidia_support import make


def test_nvlink_counts_decide_first() -> None:
    backend, fake = make("v100-4x-nvlink", deviceIDStrategy="index")
    topo = backend.topology
    assert topo is not None
    uuid = [g.uuid for g in fake.gpus]
    assert topo.pair(uuid[0], uuid[1])[0] == 2
    assert topo.pair(uuid[0], uuid[2])[0] == 1
    assert topo.pair(uuid[0], uuid[3])[0] == 0
    devices = backend.discover()
    # 1 and 2 have no link between them; each pairs best with its two-link partner.
    assert backend.preferred_allocation(devices[1:3] + devices[3:], [], 2) == ["2", "3"]
    assert backend.preferred_allocation(devices, [devices[1]], 2) == ["1", "0"]
    backend.close()


def test_nvswitch_links_connect_every_gpu_so_pcie_and_numa_decide() -> None:
    backend, fake = make("a100-8x", deviceIDStrategy="index")
    topo = backend.topology
    assert topo is not None
    a, b, c = fake.gpus[0].uuid, fake.gpus[1].uuid, fake.gpus[4].uuid
    assert topo.pair(a, b)[0] == topo.pair(a, c)[0] == 12  # every GPU reaches every switch twice
    devices = backend.discover()
    by_index = {d.id: d for d in devices}
    # GPUs 2 and 3 share a PCIe switch: with 0 taken, a pair comes from the same switch.
    available = [by_index[i] for i in ("1", "2", "3", "5")]
    assert sorted(backend.preferred_allocation(available, [], 2)) == ["2", "3"]
    # Four GPUs stay in one NUMA node when they can.
    four = backend.preferred_allocation([by_index[i] for i in ("3", "4", "5", "6", "7")], [], 4)
    assert sorted(four) == ["4", "5", "6", "7"]
    # must_include is always part of the answer, and the size is honoured.
    answer = backend.preferred_allocation(devices, [by_index["6"]], 2)
    assert answer == ["6", "7"]
    backend.close()


def test_greedy_path_for_large_choices_still_honours_must_include_and_size() -> None:
    ids = [f"g{i}" for i in range(40)]

    def pair(a: str, b: str) -> tuple[int, int, int]:
        same_block = int(a[1:]) // 8 == int(b[1:]) // 8
        return (4 if same_block else 0, 0, 0)

    chosen = best_set(ids, ["g17"], 8, pair)
    assert len(chosen) == 8 and chosen[0] == "g17"
    assert all(16 <= int(c[1:]) < 24 for c in chosen)  # the whole NVLink block of g17


def test_replicated_or_mig_resources_measure_no_topology() -> None:
    backend, _ = make("a100-8x", sharing={"timeSlicing": {"resources": [{"replicas": 2}]}})
    assert backend.topology is None
    backend.close()

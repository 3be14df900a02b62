"""Time-slicing replicas: IDs, per-GPU counts, distributed/packed choice, renames and request limits."""

from __future__ import annotations

from collections import Counter

import pytest

from kxpu.backends.nvidia.sharing import pick_replicas
from kxpu.config import ConfigError, parse_config
from kxpu.model import BackendError
from kxpu.testing.fake_nvml import FakeNvml
from tests.nvidia_support import make


def _shared(replicas: int = 4, **entry: object) -> dict[str, object]:
    return {"timeSlicing": {"resources": [{"replicas": replicas, **entry}]}}


def test_replicas_get_uuid_colon_colon_n_ids_and_share_the_gpu_in_the_env() -> None:
    backend, fake = make("a100-8x", sharing=_shared(10))
    devices = backend.discover()
    assert len(devices) == 80
    uuid0 = fake.gpus[0].uuid
    assert [d.id for d in devices[:3]] == [f"{uuid0}::0", f"{uuid0}::1", f"{uuid0}::2"]
    assert devices[0].extra["replicas"] == 10 and devices[0].uuid == uuid0
    edits = backend.allocate([devices[0], devices[1], devices[10]])
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": f"{uuid0},{fake.gpus[1].uuid}"}
    backend.close()


def test_per_gpu_replica_counts_and_unshared_gpus_in_one_resource() -> None:
    fake = FakeNvml("a100-8x")
    backend, _ = make(
        fake,
        devices=[0, 1, 2],
        sharing={
            "timeSlicing": {
                "resources": [
                    {"replicas": 2, "devices": [0]},
                    {"replicas": 5, "devices": [fake.gpus[1].uuid]},
                ]
            }
        },
    )
    per_gpu = Counter(d.uuid for d in backend.discover())
    assert per_gpu == {fake.gpus[0].uuid: 2, fake.gpus[1].uuid: 5, fake.gpus[2].uuid: 1}
    assert fake.gpus[2].uuid in {d.id for d in backend.discover()}  # unshared GPU keeps its plain ID
    backend.close()


def test_a_gpu_named_by_two_entries_is_refused() -> None:
    with pytest.raises(BackendError, match=r"resources\[0\] and \[1\]"):
        make(
            "a100-8x",
            sharing={
                "timeSlicing": {
                    "resources": [{"replicas": 2, "devices": [0, 1]}, {"replicas": 3, "devices": [1]}]
                }
            },
        )


def test_replicas_below_two_are_refused_like_nvidia() -> None:
    with pytest.raises(ConfigError, match="replicas"):
        parse_config(
            {"version": "v1", "resources": [{"name": "nvidia.com/gpu", "nvidia": {"sharing": _shared(1)}}]}
        )


def test_fail_requests_greater_than_one() -> None:
    backend, _ = make(
        "a100-8x",
        sharing={"timeSlicing": {"failRequestsGreaterThanOne": True, "resources": [{"replicas": 4}]}},
    )
    devices = backend.discover()
    backend.allocate(devices[:1])
    with pytest.raises(BackendError, match="maximum request size for shared resources is 1"):
        backend.allocate(devices[:2])
    backend.close()


def test_rename_by_default_advertises_the_shared_name_and_rename_wins() -> None:
    config = parse_config(
        {
            "version": "v1",
            "resources": [
                {
                    "name": "nvidia.com/gpu",
                    "nvidia": {
                        "sharing": {"timeSlicing": {"renameByDefault": True, "resources": [{"replicas": 2}]}}
                    },
                },
                {
                    "name": "nvidia.com/mig-1g.10gb",
                    "nvidia": {
                        "migStrategy": "mixed",
                        "migProfile": "1g.10gb",
                        "sharing": _shared(2, rename="nvidia.com/small"),
                    },
                },
                {
                    "name": "nvidia.com/whole",
                    "nvidia": {"sharing": {"timeSlicing": {"renameByDefault": True}}},
                },
            ],
        }
    )
    assert [r.name for r in config.resources] == [
        "nvidia.com/gpu.shared",
        "nvidia.com/small",
        "nvidia.com/whole",
    ]


def test_distributed_spreads_over_the_least_used_gpus() -> None:
    gpu_of = {f"g{g}::{r}": f"g{g}" for g in range(3) for r in range(4)}
    totals = dict.fromkeys(("g0", "g1", "g2"), 4)
    # g0 has 3 replicas in use, g1 one, g2 none.
    available = ["g0::3", "g1::1", "g1::2", "g1::3", "g2::0", "g2::1", "g2::2", "g2::3"]
    assert pick_replicas(available, [], 1, gpu_of, totals, "distributed") == ["g2::0"]
    chosen = pick_replicas(available, [], 3, gpu_of, totals, "distributed")
    assert Counter(gpu_of[c] for c in chosen) == {"g2": 2, "g1": 1}


def test_packed_fills_the_busiest_gpu_first() -> None:
    gpu_of = {f"g{g}::{r}": f"g{g}" for g in range(3) for r in range(4)}
    totals = dict.fromkeys(("g0", "g1", "g2"), 4)
    available = ["g0::3", "g1::1", "g1::2", "g1::3", "g2::0", "g2::1", "g2::2", "g2::3"]
    assert pick_replicas(available, [], 3, gpu_of, totals, "packed") == ["g0::3", "g1::1", "g1::2"]


def test_must_include_is_kept_and_counts_as_allocated() -> None:
    gpu_of = {f"g{g}::{r}": f"g{g}" for g in range(2) for r in range(2)}
    totals = {"g0": 2, "g1": 2}
    chosen = pick_replicas(["g0::0", "g0::1", "g1::0", "g1::1"], ["g0::0"], 2, gpu_of, totals, "distributed")
    assert chosen == ["g0::0", "g1::0"]


def test_backend_preferred_allocation_uses_the_configured_policy() -> None:
    for policy, expected_gpus in (("distributed", 2), ("packed", 1)):
        backend, _ = make("a100-8x", devices=[0, 1], sharing=_shared(4), sharedDevicesAllocationPolicy=policy)
        devices = backend.discover()
        # One replica of GPU 0 is already in use.
        available = [d for d in devices if d.id != devices[0].id]
        chosen = backend.preferred_allocation(available, [], 2)
        by_id = {d.id: d for d in devices}
        assert len({by_id[c].uuid for c in chosen}) == expected_gpus, policy
        backend.close()

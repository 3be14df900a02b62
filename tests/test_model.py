from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.model import (
    ContainerEdits,
    Device,
    DeviceNode,
    Health,
    InvalidDeviceError,
    Mount,
    capabilities_of,
    index_by_id,
    numa_packed,
)


@pytest.mark.parametrize("bad", ["", "-lead", "has space", "a/b", "x" * 64, "ünï"])
def test_device_ids_must_be_name_safe(bad: str) -> None:
    with pytest.raises(InvalidDeviceError):
        Device(id=bad)


def test_device_accepts_share_ids_and_coerces_health() -> None:
    device = Device(id="GPU-1234::7", health="Unhealthy")  # type: ignore[arg-type]
    assert device.health is Health.UNHEALTHY and not device.healthy
    assert device.with_health(Health.HEALTHY).healthy
    assert Device(id="x" * 63).id


def test_duplicate_ids_are_refused() -> None:
    with pytest.raises(InvalidDeviceError, match="duplicate"):
        index_by_id([Device(id="a"), Device(id="a")])


def test_edits_merge_keeps_first_value_like_the_kubelet() -> None:
    a = ContainerEdits(
        env={"X": "1"}, mounts=[Mount("/m", "/a")], device_nodes=[DeviceNode("/dev/x", "/dev/a")]
    )
    b = ContainerEdits(
        env={"X": "2", "Y": "3"},
        mounts=[Mount("/m", "/b"), Mount("/n", "/b")],
        device_nodes=[DeviceNode("/dev/x", "/dev/b")],
    )
    merged = a.merge(b)
    assert merged.env == {"X": "1", "Y": "3"}
    assert [m.host_path for m in merged.mounts] == ["/a", "/b"]
    assert [d.host_path for d in merged.device_nodes] == ["/dev/a"]


def test_device_node_permissions_are_checked() -> None:
    with pytest.raises(ValueError):
        DeviceNode("/dev/x", "/dev/x", "rx")


def test_capabilities_follow_what_the_backend_implements() -> None:
    caps = capabilities_of(SimulatedBackend(SimulatedConfig(count=1)))
    assert caps.watch and caps.preferred_allocation and not caps.pre_start


numa_devices = st.lists(st.integers(0, 3), min_size=1, max_size=16).map(
    lambda nodes: [Device(id=f"d{i}", numa_nodes=(n,)) for i, n in enumerate(nodes)]
)


@given(numa_devices, st.data())
def test_numa_packed_honours_the_request(devices: list[Device], data: st.DataObject) -> None:
    size = data.draw(st.integers(1, len(devices)))
    must = data.draw(st.lists(st.sampled_from(devices), unique=True, max_size=size))
    available = [d for d in devices if d not in must]
    chosen = numa_packed(available, must, size)
    assert len(chosen) == size == len(set(chosen))
    assert {d.id for d in must} <= set(chosen)
    assert set(chosen) <= {d.id for d in devices}
    if not must:
        # When one NUMA node can hold the whole request, the choice stays on one node.
        per_node = Counter(d.numa_nodes for d in devices)
        nodes_used = {next(d.numa_nodes for d in devices if d.id == i) for i in chosen}
        if max(per_node.values()) >= size:
            assert len(nodes_used) == 1

"""DRA names and ResourceSlice content: pure functions held to the API server's rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kxpu.dra.config import check_driver_name, default_driver_name
from kxpu.dra.names import device_name, is_dns_label
from kxpu.dra.slices import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    as_version,
    attribute_value,
    device_entry,
    pool_content,
)
from kxpu.dra.taints import taint_value
from kxpu.model import Device, Health


def test_driver_names() -> None:
    assert default_driver_name("example.com/npu") == "npu.example.com"
    assert default_driver_name("nvidia.com/gpu") == "gpu.nvidia.com"  # NVIDIA's own DRA driver name
    assert default_driver_name("huawei.com/Ascend910") == "ascend910.huawei.com"
    assert default_driver_name("amd.com/cpx_nps4") == "cpx-nps4.amd.com"
    with pytest.raises(ValueError, match=r"set dra\.driverName"):
        default_driver_name("a" * 60 + ".com/" + "b" * 20)
    with pytest.raises(ValueError, match="lowercase DNS subdomain"):
        check_driver_name("Npu.Example.com")


def test_device_names_are_labels_and_keep_label_ids() -> None:
    assert device_name("sim-npu-0") == "sim-npu-0"
    gpu = device_name("GPU-4f3c2a1b-0000-1111-2222-333344445555")
    assert is_dns_label(gpu) and gpu.startswith("gpu-4f3c2a1b")
    assert device_name("0000:19:00.0") != device_name("0000-19-00-0")  # cleaned forms do not collide
    assert device_name("Ascend910-0") != device_name("ascend910-0")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=63))
def test_any_id_maps_to_a_label_deterministically(device_id: str) -> None:
    name = device_name(device_id)
    assert is_dns_label(name)
    assert device_name(device_id) == name


def test_versions_and_attribute_types() -> None:
    assert as_version("580.159.04") == "580.159.4"
    assert as_version("2.31") == "2.31.0"
    assert as_version("1.2.3-rc.1") == "1.2.3-rc.1"
    assert as_version("v1") is None and as_version("banana") is None
    assert attribute_value("driverVersion", "580.159.04") == {"version": "580.159.4"}
    assert attribute_value("productName", "NVIDIA A100") == {"string": "NVIDIA A100"}
    assert attribute_value("count", 2**63) is None  # past int64: the API would refuse it
    assert attribute_value("mig", True) == {"bool": True}
    assert attribute_value("long", "x" * 65) is None


def test_device_entry_attributes_capacity_and_taint() -> None:
    device = Device(
        id="GPU-abc",
        model="A100",
        uuid="GPU-abc",
        index=3,
        memory_mib=40960,
        cores=108,
        numa_nodes=(1,),
        pci_bus_id="0000:19:00.0",
        extra={"compute_capability": "8.0", "driver_version": "580.159.04", "mig_capable": True},
        health=Health.UNHEALTHY,
        health_reason="xid-79",
    )
    entry = device_entry(device, "taint")
    assert entry["attributes"]["model"] == {"string": "A100"}
    assert entry["attributes"]["index"] == {"int": 3}
    assert entry["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert entry["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:19:00.0"}
    assert entry["attributes"]["driverVersion"] == {"version": "580.159.4"}
    assert entry["attributes"]["computeCapability"] == {"string": "8.0"}
    assert entry["attributes"]["migCapable"] == {"bool": True}
    assert entry["capacity"] == {"memory": {"value": "40Gi"}, "cores": {"value": "108"}}
    assert entry["taints"] == [{"key": "kxpu.io/device-lost", "value": "xid-79", "effect": "NoSchedule"}]
    assert "taints" not in device_entry(device.with_health(Health.HEALTHY), "taint")


def test_attributes_are_capped_at_the_api_limit() -> None:
    device = Device(id="d0", memory_mib=1, cores=1, extra={f"fact_{i}": i for i in range(40)})
    entry = device_entry(device, "taint")
    assert len(entry["attributes"]) + len(entry["capacity"]) == MAX_ATTRIBUTES_AND_CAPACITIES


def test_quantities_are_written_as_the_api_server_stores_them() -> None:
    from kxpu.dra.slices import binary_quantity

    assert binary_quantity(16384 * 2**20) == "16Gi"
    assert binary_quantity(1536 * 2**20) == "1536Mi"
    assert binary_quantity(81920 * 2**20) == "80Gi"
    assert binary_quantity(3 * 2**40) == "3Ti"


def test_taint_values_are_label_values() -> None:
    assert taint_value("xid-79") == "xid-79"
    assert taint_value("state file: Unhealthy!") == "state-file-Unhealthy"
    assert taint_value(None) == "unknown"
    assert len(taint_value("x" * 100)) == 63


def test_pools_split_at_the_device_limit_and_withdraw() -> None:
    devices = [Device(id=f"d{i}") for i in range(130)]
    plain = pool_content("npu.example.com", "node-a", devices, 4, "withdraw")
    assert [len(s["devices"]) for s in plain.slices] == [128, 2]
    assert all(
        s["pool"] == {"name": "node-a", "generation": 4, "resourceSliceCount": 2} for s in plain.slices
    )
    tainted = pool_content("npu.example.com", "node-a", devices, 4, "taint")
    assert [len(s["devices"]) for s in tainted.slices] == [64, 64, 2]
    sick = [devices[0].with_health(Health.UNHEALTHY, "x"), *devices[1:3]]
    assert [d["name"] for d in pool_content("drv.x", "n", sick, 1, "withdraw").slices[0]["devices"]] == [
        "d1",
        "d2",
    ]
    empty = pool_content("drv.x", "n", [], 1, "taint")
    assert len(empty.slices) == 1 and empty.slices[0]["devices"] == []


def test_slice_names_are_unique_per_node_and_driver() -> None:
    from kxpu.dra.config import _DNS_SUBDOMAIN
    from kxpu.dra.publisher import MAX_NAME, slice_name

    # Joined with "-", node a-b with driver c.io and node a with driver b-c.io read the same: the hash differs.
    assert slice_name("a-b", "c.io", 0) != slice_name("a", "b-c.io", 0)
    assert slice_name("a-b", "c.io", 0) == slice_name("a-b", "c.io", 0)
    long_node = "n" * 250
    names = {slice_name(long_node, d, i) for d in ("x.io", "y.io") for i in range(12)}
    assert len(names) == 24
    assert all(len(n) <= MAX_NAME and _DNS_SUBDOMAIN.match(n) for n in names)

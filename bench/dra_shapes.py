"""The same 8 whole devices per node, published in different shapes (``bench_dra.py``'s scheduling arms).

Each shape isolates one factor of what a DRA driver publishes, so that the scheduler's cost of that factor
can be read off one run against ``kxpu`` (kxpu's publisher as a simulated node runs it):

| shape | what changes against ``kxpu`` |
|---|---|
| ``dp`` | no DRA at all: the extended resource ``example.com/npu: 8`` (the device plugin's path) |
| ``example`` | kubernetes-sigs/dra-example-driver's devices (v0.2.1, as ``bench_dra_vs_go.py`` builds it): ``gpu-<i>`` with ``index``, ``uuid``, ``model``, ``driverVersion`` (a version) and capacity ``memory`` 80Gi, one slice per pool, written as the resourceslice controller writes it |
| ``rich`` | what kxpu's NVIDIA backend gives a GPU, with two driver versions and ``cores`` more: 13 attributes and 2 capacities, against 3 and 1 |
| ``slices2`` | the pool in two slices of 4 devices (what a pool with counters has: devices and counters apart) |
| ``counters`` | each device draws its 7 slice counters from a counter set of its own (kxpu's partitions' whole device), the sets in a second slice |
| ``counters2`` | the same with the example driver's 2 counters (``memory``, ``compute``) per set |
| ``shares`` | consumable capacity (``dra.shares``): ``allowMultipleAllocations`` and request policies; a claim that names no amount takes the whole device |
| ``cel`` | kxpu's devices, a DeviceClass selector that also reads an attribute and compares a capacity |
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from kxpu.dra.publisher import SlicePublisher, slice_name
from kxpu.dra.slices import SharePolicy, pool_content
from kxpu.kube.dra import DraKube
from kxpu.model import CounterSet, Device

DEVICES_PER_NODE = 8
PARTITION_SLICES = 7  # kxpu's partitions: a device of 7 slices, one counter each

Publish = Callable[[DraKube, str, str], Awaitable[None]]


def bench_devices() -> list[Device]:
    """What a simulated kxpu node gives: ``id``, ``model``, ``index``, ``memory``."""
    return [
        Device(id=f"npu-{i}", model="bench-npu", memory_mib=16384, index=i) for i in range(DEVICES_PER_NODE)
    ]


def rich_devices(node: str) -> list[Device]:
    """What kxpu's NVIDIA backend gives an H100 with NVLink (``backends/nvidia/backend.py``'s ``_device``), with two
    version attributes (typed ``version``, the costliest to evaluate) and ``cores`` more."""
    return [
        Device(
            id=f"npu-{i}",
            model="NVIDIA H100 80GB HBM3",
            uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{i}')}",
            index=i,
            memory_mib=81559,
            cores=132,
            numa_nodes=(i // 4,),
            pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
            pcie_root=f"pci0000:{0x10 * (i // 2):02x}",
            link_domain="nvl-0",
            extra={
                "migCapable": True,
                "computeCapability": "9.0",
                "minor": i,
                "driverVersion": "580.95.05",
                "cudaDriverVersion": "13.0",
            },
        )
        for i in range(DEVICES_PER_NODE)
    ]


def with_counters(devices: list[Device], counters: list[str]) -> tuple[list[Device], list[CounterSet]]:
    """Each device draws all of its own counter set (as a partitioned device's whole does)."""
    sets = [CounterSet(d.id, dict.fromkeys(counters, 1)) for d in devices]
    return [replace(d, consumes={d.id: dict.fromkeys(counters, 1)}) for d in devices], sets


async def publish_kxpu(kube: DraKube, driver: str, node: str) -> None:
    await SlicePublisher(kube, driver, node, "taint").publish(bench_devices())


async def publish_rich(kube: DraKube, driver: str, node: str) -> None:
    await SlicePublisher(kube, driver, node, "taint").publish(rich_devices(node))


async def publish_counters(kube: DraKube, driver: str, node: str) -> None:
    devices, sets = with_counters(bench_devices(), [f"s{i}" for i in range(PARTITION_SLICES)])
    await SlicePublisher(kube, driver, node, "taint").publish(devices, counter_sets=sets)


async def publish_counters2(kube: DraKube, driver: str, node: str) -> None:
    devices, sets = with_counters(bench_devices(), ["memory", "compute"])
    await SlicePublisher(kube, driver, node, "taint").publish(devices, counter_sets=sets)


async def publish_shares(kube: DraKube, driver: str, node: str) -> None:
    await SlicePublisher(kube, driver, node, "taint", shares=SharePolicy()).publish(bench_devices())


async def _create(kube: DraKube, driver: str, node: str, specs: list[dict[str, Any]]) -> None:
    """``specs`` as one pool's slices, owned by the Node (as kxpu's publisher and the resourceslice controller
    both write them)."""
    owner = {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node,
        "uid": await kube.node_uid(node),
        "controller": True,
    }
    for index, spec in enumerate(specs):
        spec["pool"]["resourceSliceCount"] = len(specs)
        await kube.create_slice(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": slice_name(node, driver, index), "ownerReferences": [owner]},
                "spec": spec,
            }
        )


async def publish_slices2(kube: DraKube, driver: str, node: str) -> None:
    (spec,) = pool_content(driver, node, bench_devices(), 1, "taint").slices
    half = DEVICES_PER_NODE // 2
    specs = [{**spec, "devices": spec["devices"][:half]}, {**spec, "devices": spec["devices"][half:]}]
    specs = [{**s, "pool": dict(s["pool"])} for s in specs]
    await _create(kube, driver, node, specs)


def example_devices(node: str) -> list[dict[str, Any]]:
    """dra-example-driver v0.2.1's ``enumerateAllPossibleDevices``: four attributes, one capacity (its UUIDs
    are seeded from the node's name too)."""
    return [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "index": {"int": i},
                "uuid": {"string": f"gpu-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{i}')}"},
                "model": {"string": "LATEST-GPU-MODEL"},
                "driverVersion": {"version": "1.0.0"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for i in range(DEVICES_PER_NODE)
    ]


async def publish_example(kube: DraKube, driver: str, node: str) -> None:
    spec = {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": 1},
        "devices": example_devices(node),
    }
    await _create(kube, driver, node, [spec])


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    publish: Publish | None  # None: the device plugin's extended resource
    selector: str = 'device.driver == "{driver}"'

    def driver(self) -> str:
        return f"{self.name}.bench.example.com"

    def expression(self) -> str:
        return self.selector.format(driver=self.driver())


SHAPES = {
    s.name: s
    for s in (
        Shape("dp", None),
        Shape("kxpu", publish_kxpu),
        Shape("example", publish_example),
        Shape("rich", publish_rich),
        Shape("slices2", publish_slices2),
        Shape("counters", publish_counters),
        Shape("counters2", publish_counters2),
        Shape("shares", publish_shares),
        Shape(
            "cel",
            publish_kxpu,
            'device.driver == "{driver}" && device.attributes["{driver}"].model == "bench-npu" && '
            'device.capacity["{driver}"].memory.compareTo(quantity("8Gi")) >= 0',
        ),
    )
}

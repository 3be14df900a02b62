"""Devices that line up: the standard PCI attributes and link domains every backend publishes for
``matchAttribute``, read from each vendor's fake machine exactly as from the host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kxpu.backends.host import Host
from kxpu.backends.pci import PcieRootError, PcieRoots, read_pcie_root
from kxpu.dra.slices import device_attributes
from kxpu.model import Device, pci_address
from kxpu.testing.fake_host import FakeHost

ROOT = "resource.kubernetes.io/pcieRoot"
BUS = "resource.kubernetes.io/pciBusID"
NUMA = "resource.kubernetes.io/numaNode"


@pytest.fixture
def fake() -> Iterator[FakeHost]:
    host = FakeHost()
    yield host
    host.cleanup()


def pci_function(fake: FakeHost, path: str) -> None:
    """A PCI function at ``/sys/devices/<path>`` with its ``/sys/bus/pci/devices`` link, as the kernel makes it."""
    fake.write_attribute(f"/sys/devices/{path}/numa_node", 0)
    fake.symlink(f"/sys/bus/pci/devices/{path.rsplit('/', 1)[-1]}", f"../../../devices/{path}")


def test_pci_addresses_take_the_standard_form() -> None:
    assert pci_address("00000000:07:00.0") == "0000:07:00.0"  # NVML
    assert pci_address("0000:3B:00.1") == "0000:3b:00.1"
    assert pci_address("0001:07:1f.7") == "0001:07:1f.7"
    for bad in ("", "07:00.0", "0000:07:00.8", "00010000:07:00.0", "0000:07:00.0\n0", "pci0000:00"):
        assert pci_address(bad) is None, bad


def test_the_root_is_the_first_directory_under_sys_devices(fake: FakeHost) -> None:
    pci_function(fake, "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:07:00.0")
    pci_function(fake, "pci0000:80/0000:80:01.0/0000:8a:00.0")
    host = Host(fake.root)
    assert read_pcie_root(host, "00000000:07:00.0") == "pci0000:00"
    assert read_pcie_root(host, "0000:8A:00.0") == "pci0000:80"


def test_garbage_sysfs_is_named(fake: FakeHost) -> None:
    host = Host(fake.root)
    fake.mkdir("/sys/bus/pci/devices/0000:01:00.0")  # a directory, not the kernel's link
    fake.symlink("/sys/bus/pci/devices/0000:02:00.0", "../../../devices/platform/0000:02:00.0")
    fake.symlink("/sys/bus/pci/devices/0000:03:00.0", "../../../devices/pci0000:00/0000:04:00.0")
    fake.symlink("/sys/bus/pci/devices/0000:05:00.0", "../../../devices/pcibanana/0000:05:00.0")
    cases = {
        "0000:01:00.0": "not a symlink",
        "0000:02:00.0": "not into /sys/devices/pci",
        "0000:03:00.0": "which is not 0000:03:00.0",
        "0000:05:00.0": "not into /sys/devices/pci",
        "0000:06:00.0": "does not exist",
        "GPU-1234": "not a PCI address",
    }
    for bus_id, message in cases.items():
        with pytest.raises(PcieRootError, match=message):
            read_pcie_root(host, bus_id)


def test_unknown_roots_are_left_out_with_one_warning(fake: FakeHost) -> None:
    fake.write_file("/sys/bus/pci/devices/0000:01:00.0", "garbage")
    roots = PcieRoots(Host(fake.root))
    with capture_logs() as logs:
        for _ in range(3):  # three rediscoveries
            assert roots.root("0000:01:00.0") is None
    assert [e["log_level"] for e in logs if "pcieRoot left out" in e["event"]] == ["warning"]
    fake.remove("/sys/bus/pci/devices/0000:01:00.0")
    pci_function(fake, "pci0000:00/0000:01:00.0")
    assert roots.root("0000:01:00.0") == "pci0000:00"


def test_standard_attributes_in_the_slice() -> None:
    device = Device(
        id="GPU-1",
        numa_nodes=(1,),
        pci_bus_id="00000000:07:00.0",
        pcie_root="pci0000:00",
        link_domain="nvlink-0000:07:00.0",
    )
    attrs = device_attributes(device)
    assert attrs[BUS] == {"string": "0000:07:00.0"}  # the standard form, not NVML's
    assert attrs[ROOT] == {"string": "pci0000:00"}
    assert attrs[NUMA] == {"int": 1}
    assert attrs["linkDomain"] == {"string": "nvlink-0000:07:00.0"}
    bare = device_attributes(Device(id="x", numa_nodes=(-1,), pci_bus_id="GPU-1", pcie_root="pci:garbage"))
    assert not {BUS, ROOT, NUMA, "linkDomain"} & set(bare)


def tree(fake: FakeHost) -> Path:
    return fake.root

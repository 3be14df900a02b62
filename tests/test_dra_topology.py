"""Devices that line up: the standard PCI attributes and link domains every backend publishes for
``matchAttribute``, read from each vendor's fake machine exactly as from the host."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from kxpu.backends.amd import AmdBackend, AmdConfig
from kxpu.backends.ascend.backend import AscendBackend
from kxpu.backends.ascend.config import AscendConfig
from kxpu.backends.ascend.dcmi import DcmiSource
from kxpu.backends.cambricon import CambriconBackend, CambriconConfig
from kxpu.backends.gaudi import GaudiBackend, GaudiConfig
from kxpu.backends.gaudi.hlml import HlmlSource
from kxpu.backends.generic import GenericBackend, GenericConfig
from kxpu.backends.host import Host
from kxpu.backends.links import link_groups
from kxpu.backends.neuron import NeuronBackend, NeuronConfig
from kxpu.backends.pci import PcieRootError, PlacementReader, read_pcie_root
from kxpu.config import parse_config
from kxpu.dra.slices import device_attributes
from kxpu.model import Device, pci_address
from kxpu.testing.fake_amd import FakeAmd
from kxpu.testing.fake_cambricon import FakeCambricon
from kxpu.testing.fake_dcmi import FakeDcmi
from kxpu.testing.fake_hlml import FakeHlml
from kxpu.testing.fake_host import FakeHost
from kxpu.testing.fake_neuron import FakeNeuron
from kxpu.testing.fake_nvml import FakeNvml
from tests.nvidia_support import make

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
    reader = PlacementReader(Host(fake.root))
    with capture_logs() as logs:
        for _ in range(3):  # three rediscoveries
            assert reader.pcie_root("0000:01:00.0") is None
    assert [e["log_level"] for e in logs if "pcieRoot unknown" in e["event"]] == ["warning"]
    fake.remove("/sys/bus/pci/devices/0000:01:00.0")
    pci_function(fake, "pci0000:00/0000:01:00.0")
    assert reader.pcie_root("0000:01:00.0") == "pci0000:00"


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


# ---------------------------------------------------------------------------------------------- AMD, Hygon
@pytest.fixture
def amd_machines() -> Iterator[Callable[[str], FakeAmd]]:
    made: list[FakeAmd] = []

    def make(profile: str) -> FakeAmd:
        made.append(FakeAmd(profile))
        return made[-1]

    yield make
    for machine in made:
        machine.cleanup()


def attrs_by_id(devices: list[Device]) -> dict[str, dict[str, Any]]:
    return {d.id: device_attributes(d) for d in devices}


def test_link_groups_are_transitive_and_named_by_the_first_member() -> None:
    """The grouping every vendor shares: the order given picks the name, a lone member is in none, and a
    link to itself or to a non-member (a switch, a device not served) joins nothing."""
    ordered = ["c", "a", "b", "d", "e"]
    groups = link_groups(ordered, iter([("a", "b"), ("b", "c"), ("d", "d"), ("e", "switch")]))
    assert groups == {"a": "c", "b": "c", "c": "c"}


def test_amd_xgmi_hives_are_link_domains(amd_machines: Callable[[str], FakeAmd]) -> None:
    fake = amd_machines("mi210-4x-xgmi")  # bridges join GPUs 0-1 and 2-3
    attrs = attrs_by_id(AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)})).discover())
    domains = [attrs[fake.bdf(g)]["linkDomain"]["string"] for g in range(4)]
    assert domains[0] == domains[1] != domains[2] == domains[3]
    assert domains[0] == f"xgmi-{fake.hive(0)}"
    assert {attrs[fake.bdf(g)][ROOT]["string"] for g in range(4)} == {"pci0000:00"}
    assert attrs[fake.bdf(2)][BUS] == {"string": fake.bdf(2)}


def test_amd_partitions_inherit_their_gpus_place(amd_machines: Callable[[str], FakeAmd]) -> None:
    fake = amd_machines("mi300x-8x-cpx")  # one hive of eight, eight partitions each
    devices = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)})).discover()
    assert len(devices) == 64
    assert {d.link_domain for d in devices} == {f"xgmi-{fake.hive(0)}"}
    assert {d.pcie_root for d in devices} == {"pci0000:00"}


def test_amd_garbage_hive_and_pci_link_are_left_out(amd_machines: Callable[[str], FakeAmd]) -> None:
    fake = amd_machines("mi210-4x-xgmi")
    fake.fake.set_attribute(f"/sys/devices/pci0000:00/{fake.bdf(0)}/xgmi_hive_info/xgmi_hive_id", "hive!")
    fake.fake.symlink(f"/sys/bus/pci/devices/{fake.bdf(3)}", "../../../devices/platform/nowhere")
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)}))
    with capture_logs() as logs:
        for _ in range(3):
            devices = {d.id: d for d in backend.discover()}
    # GPU 1 links to GPU 0's hive directory: both lose the domain; the GPUs stay healthy and served
    assert [devices[fake.bdf(g)].link_domain is None for g in range(4)] == [True, True, False, False]
    assert devices[fake.bdf(3)].pcie_root is None and devices[fake.bdf(2)].pcie_root == "pci0000:00"
    assert all(d.healthy for d in devices.values())
    warnings = [e for e in logs if e["log_level"] == "warning" and "left out" in e["event"]]
    assert len(warnings) == 3, warnings  # one per device and fact, not one per rediscovery
    assert any("expected an integer, found 'hive!'" in e["error"] for e in warnings)


# ---------------------------------------------------------------------------------------------- NVIDIA
def nvidia_attrs(profile: str | FakeNvml, **config: Any) -> dict[str, dict[str, Any]]:
    backend, _fake = make(profile, **config)
    try:
        return {d.id: device_attributes(d) for d in backend.discover()}
    finally:
        backend.close()


def test_nvlink_bridged_pairs_are_two_islands_on_two_roots() -> None:
    attrs = list(nvidia_attrs("a100-pcie-4x-bridged").values())  # bridges 0-1 and 2-3, one CPU per pair
    assert [a[BUS]["string"] for a in attrs] == [
        "0000:17:00.0",
        "0000:31:00.0",
        "0000:98:00.0",
        "0000:b1:00.0",
    ]
    assert [a["linkDomain"]["string"] for a in attrs] == ["nvlink-0000:17:00.0"] * 2 + [
        "nvlink-0000:98:00.0"
    ] * 2
    assert [a[ROOT]["string"] for a in attrs] == ["pci0000:00"] * 2 + ["pci0000:80"] * 2
    assert [a[NUMA]["int"] for a in attrs] == [0, 0, 1, 1]
    assert all("nvlinkClique" not in a for a in attrs)  # no fabric on PCIe cards


def test_nvswitch_gpus_share_one_island_and_the_fabric_clique() -> None:
    attrs = list(nvidia_attrs("gb200-4x").values())
    assert {a["linkDomain"]["string"] for a in attrs} == {"nvlink-0000:01:00.0"}
    assert {a["nvlinkClique"]["string"] for a in attrs} == {"5e7c1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b.32766"}
    assert len(nvidia_attrs("a100-8x")) == 8 and {
        a["linkDomain"]["string"] for a in nvidia_attrs("a100-8x").values()
    } == {"nvlink-0000:07:00.0"}


def test_a_gpu_without_nvlink_has_no_island_and_mig_devices_inherit_the_root() -> None:
    attrs = nvidia_attrs("h100-mig-single", migStrategy="single")  # MIG devices on two GPUs, no NVLink
    assert len(attrs) > 2 and all("linkDomain" not in a for a in attrs.values())
    by_parent = {(a["parentUuid"]["string"], a[ROOT]["string"], a[BUS]["string"]) for a in attrs.values()}
    assert {(root, bus) for _, root, bus in by_parent} == {
        ("pci0000:00", "0000:18:00.0"),
        ("pci0000:80", "0000:28:00.0"),
    }


def test_nvidia_fabric_not_registered_and_broken_links_are_left_out() -> None:
    fake = FakeNvml("gb200-4x")
    fake.gpus[1].fabric = None  # NOT_SUPPORTED
    (fake.host_root / "sys/bus/pci/devices/0000:41:00.0").unlink()
    (fake.host_root / "sys/bus/pci/devices/0000:41:00.0").symlink_to("../../../devices/virtual/x")
    with capture_logs() as logs:
        attrs = list(nvidia_attrs(fake).values())
    assert ["nvlinkClique" in a for a in attrs] == [True, False, True, True]
    assert [ROOT in a for a in attrs] == [True, False, True, True]
    assert [e["device"] for e in logs if "pcieRoot unknown" in e["event"]] == ["00000000:41:00.0"]


# ---------------------------------------------------------------------------------------------- Ascend
def ascend_devices(fake: FakeDcmi) -> list[Device]:
    config = AscendConfig.model_validate({"hostRoot": str(fake.root)})
    return AscendBackend(config, DcmiSource(fake.root, fake)).discover()


def test_ascend_hccs_rings_are_link_domains() -> None:
    fake = FakeDcmi("910-8x-rings")
    try:
        devices = ascend_devices(fake)
        assert [d.link_domain for d in devices] == ["hccs-0000:01:00.0"] * 4 + ["hccs-0000:02:00.0"] * 4
        assert [d.pcie_root for d in devices] == [
            f"pci0000:{b & 0xC0:02x}" for b in (0xC1, 1, 0x41, 0x81)
        ] * 2
    finally:
        fake.cleanup()


def test_ascend_mesh_is_one_domain_and_310p_cards_none() -> None:
    mesh, cards = FakeDcmi("910b-8x"), FakeDcmi("310p-4x")
    try:
        assert {d.link_domain for d in ascend_devices(mesh)} == {"hccs-0000:01:00.0"}
        devices = ascend_devices(cards)
        assert {d.link_domain for d in devices} == {None}
        assert {d.pcie_root for d in devices} == {"pci0000:3a"}
    finally:
        mesh.cleanup()
        cards.cleanup()


def test_ascend_topology_is_asked_once_and_a_dropped_chip_leaves_its_ring() -> None:
    fake = FakeDcmi("910-8x-rings")
    try:
        backend = AscendBackend(
            AscendConfig.model_validate({"hostRoot": str(fake.root)}), DcmiSource(fake.root, fake)
        )
        backend.discover()
        asked = fake.calls["dcmi_get_topo_info_by_device_id"]
        assert asked == 28  # every pair of eight, once
        backend.discover()
        assert fake.calls["dcmi_get_topo_info_by_device_id"] == asked  # polls do not ask again
        fake.drop(0)
        devices = {d.index: d for d in backend.discover()}
        assert devices[0].link_domain is None and not devices[0].healthy
        assert {devices[p].link_domain for p in (1, 2, 3)} == {"hccs-0000:01:00.0"}
    finally:
        fake.cleanup()


# ---------------------------------------------------------------------------------------------- the rest
def test_gaudi_roots_follow_the_cpus() -> None:
    fake = FakeHlml("gaudi2-8x")
    backend = GaudiBackend(
        GaudiConfig.model_validate({"hostRoot": str(fake.root)}),
        HlmlSource(fake, fake.types, fake.root, fake=True),
    )
    try:
        devices = backend.discover()
        assert [d.pcie_root for d in devices] == [
            f"pci0000:{n * 0x80:02x}" for n in (d.numa_nodes[0] for d in devices)
        ]
        assert {d.pcie_root for d in devices} == {"pci0000:00", "pci0000:80"}
        assert all(device_attributes(d)[BUS]["string"] == d.pci_bus_id for d in devices)
    finally:
        backend.close()
        fake.cleanup()


def test_cambricon_roots_follow_the_cpus() -> None:
    fake = FakeCambricon("mlu370-x8-4x")  # NUMA 0, 0, 1, 1
    try:
        config = CambriconConfig.model_validate({"hostRoot": str(fake.root)})
        devices = CambriconBackend(config, library=fake.library, host=Host(fake.root)).discover()
        assert [d.pcie_root for d in devices] == ["pci0000:00"] * 2 + ["pci0000:80"] * 2
    finally:
        fake.cleanup()


def test_neuron_pci_parents_and_neuronlink() -> None:
    fake = FakeNeuron("trn1-32xl-pci")  # a 4x4 torus of 16, half under each CPU
    old = FakeNeuron("inf1-6xl")  # no links, no PCI parent in the legacy layout
    try:
        devices = NeuronBackend(NeuronConfig.model_validate({"hostRoot": str(fake.root)})).discover()
        assert [d.pcie_root for d in devices] == ["pci0000:00"] * 8 + ["pci0000:80"] * 8
        assert [d.numa_nodes for d in devices] == [(0,)] * 8 + [(1,)] * 8
        assert {d.link_domain for d in devices} == {"neuronlink-0"}
        cores = NeuronBackend(
            NeuronConfig.model_validate({"hostRoot": str(fake.root), "unit": "core"})
        ).discover()
        assert (
            len(cores) == 32
            and cores[31].pcie_root == "pci0000:80"
            and cores[31].link_domain == "neuronlink-0"
        )
        bare = NeuronBackend(NeuronConfig.model_validate({"hostRoot": str(old.root)})).discover()
        assert {(d.pcie_root, d.link_domain) for d in bare} == {(None, None)}
    finally:
        fake.fake.cleanup()
        old.fake.cleanup()


# ---------------------------------------------------------------------------------------------- generic
def test_generic_nodes_with_a_pci_parent_carry_its_address_and_root(tmp_path: Path, fake: FakeHost) -> None:
    """A NIC's verbs node and a GPU render node (fake major:minor numbers) in a fake sysfs: each gets its
    PCI function and root complex; a node with no PCI parent gets neither."""
    for name, (major, minor) in {"uverbs0": (231, 192), "renderD128": (226, 128), "null": (1, 3)}.items():
        os.mknod(tmp_path / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    nic = "pci0000:80/0000:80:01.0/0000:81:00.0"
    pci_function(fake, nic)
    fake.symlink("/sys/dev/char/231:192", f"../../devices/{nic}/infiniband_verbs/uverbs0")
    fake.symlink(f"/sys/devices/{nic}/infiniband_verbs/uverbs0/device", "../..")
    fake.symlink("/sys/dev/char/226:128", "../../devices/pci0000:00/0000:00:02.0/0000:03:00.0/drm/renderD128")
    fake.symlink(
        "/sys/dev/char/1:3", "../../devices/virtual/mem/null"
    )  # 0000:03:00.0 has no bus link: root unknown
    config = GenericConfig.model_validate(
        {"groups": [{"paths": [str(tmp_path / "*")]}], "sysfsRoot": str(fake.root / "sys")}
    )
    with capture_logs() as logs:
        devices = {Path(str(d.extra["path"])).name: d for d in GenericBackend(config).discover()}
    assert (devices["uverbs0"].pci_bus_id, devices["uverbs0"].pcie_root) == ("0000:81:00.0", "pci0000:80")
    assert (devices["renderD128"].pci_bus_id, devices["renderD128"].pcie_root) == ("0000:03:00.0", None)
    assert (devices["null"].pci_bus_id, devices["null"].pcie_root) == (None, None)
    assert [e["device"] for e in logs if "pcieRoot unknown" in e["event"]] == ["0000:03:00.0"]
    attrs = device_attributes(devices["uverbs0"])
    assert attrs[ROOT] == {"string": "pci0000:80"} and attrs[BUS] == {"string": "0000:81:00.0"}
    assert attrs[NUMA] == {"int": 0}


def test_generic_sysfs_root_must_be_a_sys_directory() -> None:
    with pytest.raises(ValueError, match="must be an absolute path ending in /sys"):
        GenericConfig.model_validate({"groups": [{"paths": ["/dev/x"]}], "sysfsRoot": "/tmp/fake"})


# ---------------------------------------------------------------------------------------------- names, examples
_C_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "dra"


def valid_attribute(name: str, value: dict[str, Any]) -> bool:
    """The API server's rules for a device attribute (k8s.io/api/resource/v1: QualifiedName, one value,
    strings and versions at most 64 characters)."""
    domain, _, ident = name.rpartition("/")
    if domain and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain)):
        return False
    if len(ident) > 32 or not _C_ID.match(ident) or len(value) != 1:
        return False
    (kind, v), *_ = value.items()
    return kind in ("int", "bool") or (kind in ("string", "version") and len(str(v)) <= 64)


def test_every_placement_attribute_passes_the_api_servers_rules(
    amd_machines: Callable[[str], FakeAmd],
) -> None:
    published: list[dict[str, dict[str, Any]]] = []
    published += nvidia_attrs("gb200-4x").values()
    published += nvidia_attrs("a100-pcie-4x-bridged").values()
    published += attrs_by_id(
        AmdBackend(AmdConfig.model_validate({"hostRoot": str(amd_machines("mi300x-8x-spx").root)})).discover()
    ).values()
    dcmi = FakeDcmi("910-8x-rings")
    try:
        published += [device_attributes(d) for d in ascend_devices(dcmi)]
    finally:
        dcmi.cleanup()
    names = {name for attrs in published for name in attrs}
    assert {ROOT, BUS, NUMA, "linkDomain", "nvlinkClique"} <= names
    bad = [(n, v) for attrs in published for n, v in attrs.items() if not valid_attribute(n, v)]
    assert not bad, bad


def test_the_examples_align_on_attributes_kxpu_publishes() -> None:
    """examples/dra/topology.yaml names attributes by their qualified names; each one is one that the
    example's drivers publish (gpu.nvidia.com over the fake NVML, the generic NIC)."""
    config = parse_config(yaml.safe_load((EXAMPLES / "topology-config.yaml").read_text()))
    assert [r.name for r in config.resources] == ["nvidia.com/gpu", "example.com/nic"]
    gpu_attrs = next(iter(nvidia_attrs("a100-pcie-4x-bridged").values()))
    published = {f"gpu.nvidia.com/{n}" if "/" not in n else n for n in gpu_attrs}
    templates = [d for d in yaml.safe_load_all((EXAMPLES / "topology.yaml").read_text()) if d]
    constraints = [
        c
        for t in templates
        if t["kind"] == "ResourceClaimTemplate"
        for c in t["spec"]["spec"]["devices"]["constraints"]
    ]
    assert {c["matchAttribute"] for c in constraints} == {"gpu.nvidia.com/linkDomain", ROOT}
    assert {c["matchAttribute"] for c in constraints} <= published

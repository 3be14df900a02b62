"""examples/intel-gpu.yaml and examples/intel-fpga.yaml load, and the generic backend they configure finds
Intel's device nodes in a fake tree and hands them out at the paths Intel's plugins use."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from kxpu.backends.generic import GenericBackend, GenericConfig, device_name
from kxpu.config import ResourceConfig, load_config
from kxpu.testing.fake_host import FakeHost

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def fake() -> Iterator[FakeHost]:
    host = FakeHost()
    yield host
    host.cleanup()


def under(resource: ResourceConfig, root: Path) -> GenericBackend:
    """The example's generic section with its globs read under a fake root (container paths unchanged)."""
    section = resource.backend_config
    assert isinstance(section, GenericConfig)
    groups = [g.model_copy(update={"paths": [f"{root}{p}" for p in g.paths]}) for g in section.groups]
    return GenericBackend(section.model_copy(update={"groups": groups}))


def intel_af_name(interface_id: str, afu_id: str) -> str:
    """Intel's rule (pkg/fpga/devtypes.go GetAfuDevType), written here to check the example's name."""
    encoded = base64.urlsafe_b64encode(bytes.fromhex(interface_id + afu_id)).decode().rstrip("=")
    return f"af-{interface_id[:3]}.{afu_id[:3]}.{encoded}"


def test_intel_gpu_example_serves_render_nodes(fake: FakeHost) -> None:
    config = load_config(EXAMPLES / "intel-gpu.yaml")
    (resource,) = config.resources
    assert resource.name == "gpu.intel.com/i915"
    for n in range(2):  # two GPUs: a card node and a render node each, as the i915/xe drivers make them
        fake.device_node(f"/dev/dri/card{n}", 226, n)
        fake.device_node(f"/dev/dri/renderD{128 + n}", 226, 128 + n)
    backend = under(resource, fake.root)
    devices = backend.discover()
    # IDs are the path under /dev on a node (dri_renderD128); under the fake root, the file name
    assert [d.id for d in devices] == ["renderD128", "renderD129"]
    assert device_name("/dev/dri/renderD128") == "dri_renderD128"
    edits = backend.allocate(devices[1:])
    assert [(n.container_path, n.host_path, n.permissions) for n in edits.device_nodes] == [
        ("/dev/dri/renderD129", str(fake.path("/dev/dri/renderD129")), "rw")
    ]


def test_intel_fpga_example_serves_afu_ports_under_intels_name(fake: FakeHost) -> None:
    config = load_config(EXAMPLES / "intel-fpga.yaml")
    (resource,) = config.resources
    assert resource.name == "fpga.intel.com/" + intel_af_name(
        "69528db6eb31577a8c3668f9faa081f6", "d8424dc4a4a3c413f89e433683f9040b"
    )
    fake.device_node("/dev/dfl-port.0", 509, 0)
    fake.device_node("/dev/dfl-port.1", 509, 1)
    fake.device_node("/dev/dfl-fme.0", 510, 0)  # the FME is not a port: not served in af mode
    backend = under(resource, fake.root)
    devices = backend.discover()
    assert [d.id for d in devices] == ["dfl-port.0", "dfl-port.1"]
    edits = backend.allocate(devices[:1])
    assert [n.container_path for n in edits.device_nodes] == ["/dev/dfl-port.0"]

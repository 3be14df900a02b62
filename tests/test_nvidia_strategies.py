"""What a container gets under each of NVIDIA's device list strategies, and with passDeviceSpecs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kxpu.backends.nvidia import NvidiaConfig
from kxpu.cdi.spec import ANNOTATION_PREFIX
from kxpu.config import ConfigError, parse_config
from kxpu.model import DeviceNode, Mount
from tests.nvidia_support import make


def test_envvar_lists_the_allocated_gpus() -> None:
    backend, _ = make("a100-8x")
    devices = backend.discover()
    edits = backend.allocate([devices[2], devices[5]])
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": f"{devices[2].id},{devices[5].id}"}
    assert not edits.mounts and not edits.device_nodes and not edits.cdi_devices
    backend.close()


def test_volume_mounts_point_the_runtime_at_dev_null_entries() -> None:
    backend, _ = make("a100-8x", deviceIDStrategy="index", deviceListStrategy="volume-mounts")
    devices = backend.discover()
    edits = backend.allocate(devices[:2])
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert edits.mounts == [
        Mount("/var/run/nvidia-container-devices/0", "/dev/null", read_only=True),
        Mount("/var/run/nvidia-container-devices/1", "/dev/null", read_only=True),
    ]
    backend.close()


def test_cdi_cri_names_devices_of_the_configured_kind() -> None:
    backend, _ = make("a100-8x", deviceListStrategy=["cdi-cri"], cdiKind="nvidia.com/gpu")
    devices = backend.discover()
    edits = backend.allocate([devices[0]])
    assert edits.cdi_devices == [f"nvidia.com/gpu={devices[0].id}"]
    assert "NVIDIA_VISIBLE_DEVICES" not in edits.env
    backend.close()


def test_cdi_annotations_carry_the_same_names_under_the_cdi_prefix() -> None:
    backend, _ = make("a100-8x", deviceIDStrategy="index", deviceListStrategy=["cdi-annotations", "envvar"])
    edits = backend.allocate(backend.discover()[:2])
    assert len(edits.annotations) == 1
    key, value = next(iter(edits.annotations.items()))
    assert key.startswith(ANNOTATION_PREFIX + "kxpu-nvidia_")
    assert len(key) - len(ANNOTATION_PREFIX) <= 63
    assert value == "nvidia.com/gpu=0,nvidia.com/gpu=1"
    assert edits.env == {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    backend.close()


def _driver_root(tmp_path: Path, *present: str) -> Path:
    (tmp_path / "dev").mkdir()
    for name in present:
        (tmp_path / "dev" / name).touch()
    return tmp_path


def test_pass_device_specs_adds_gpu_and_present_control_nodes_under_the_driver_root(tmp_path: Path) -> None:
    root = _driver_root(tmp_path, "nvidiactl", "nvidia-uvm")  # no uvm-tools, no modeset
    backend, _ = make("a100-8x", passDeviceSpecs=True, nvidiaDriverRoot=str(root))
    devices = backend.discover()
    edits = backend.allocate([devices[3]])
    assert edits.device_nodes == [
        DeviceNode("/dev/nvidia3", f"{root}/dev/nvidia3", "rw"),
        DeviceNode("/dev/nvidiactl", f"{root}/dev/nvidiactl", "rw"),
        DeviceNode("/dev/nvidia-uvm", f"{root}/dev/nvidia-uvm", "rw"),
    ]
    assert edits.env["NVIDIA_VISIBLE_DEVICES"] == devices[3].id
    backend.close()


def test_driver_root_without_dev_takes_device_nodes_from_the_host(tmp_path: Path) -> None:
    backend, _ = make("a100-8x", passDeviceSpecs=True, nvidiaDriverRoot=str(tmp_path))
    nodes = backend.allocate(backend.discover()[:1]).device_nodes
    assert nodes[0] == DeviceNode("/dev/nvidia0", "/dev/nvidia0", "rw")
    backend.close()


def test_mig_device_specs_include_the_parent_and_its_capability_nodes(tmp_path: Path) -> None:
    root = _driver_root(tmp_path, "nvidiactl")
    backend, fake = make(
        "h100-mig-mixed",
        migStrategy="mixed",
        migProfile="3g.40gb",
        passDeviceSpecs=True,
        nvidiaDriverRoot=str(root),
    )
    [device] = backend.discover()
    mig = fake.gpus[0].migs[0]
    nodes = [n.container_path for n in backend.allocate([device]).device_nodes]
    assert nodes == [
        "/dev/nvidia0",
        f"/dev/nvidia-caps/nvidia-cap{mig.gi_cap_minor}",
        f"/dev/nvidia-caps/nvidia-cap{mig.ci_cap_minor}",
        "/dev/nvidiactl",
    ]
    backend.close()


def test_strategy_accepts_nvidias_single_string_form_and_refuses_unknown_ones() -> None:
    assert NvidiaConfig.model_validate({"deviceListStrategy": "envvar"}).device_list_strategy == ["envvar"]
    with pytest.raises(ConfigError, match=r"resources\[0\]\.nvidia\.deviceListStrategy"):
        parse_config(
            {
                "version": "v1",
                "resources": [{"name": "nvidia.com/gpu", "nvidia": {"deviceListStrategy": "magic"}}],
            }
        )


def test_nvidia_key_names_are_accepted_as_nvidia_spells_them() -> None:
    config = NvidiaConfig.model_validate(
        {
            "migStrategy": "mixed",
            "deviceIDStrategy": "index",
            "passDeviceSpecs": True,
            "nvidiaDriverRoot": "/run/nvidia/driver",
            "failOnInitError": False,
            "sharing": {"timeSlicing": {"failRequestsGreaterThanOne": True, "resources": [{"replicas": 3}]}},
        }
    )
    assert config.device_id_strategy == "index"
    assert config.nvidia_driver_root == Path("/run/nvidia/driver")
    assert config.sharing.time_slicing.resources[0].replicas == 3

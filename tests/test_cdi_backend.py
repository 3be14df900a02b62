"""The CDI wrapper: spec in step with discovery, qualified names in Allocate, capabilities carried over."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.cdi import with_cdi
from kxpu.cdi.spec import validate_spec
from kxpu.config import ConfigError, parse_config
from kxpu.model import Mount, NodeLabeller, PreferredAllocator, PreStarter, Watcher, capabilities_of
from kxpu.testing import KubeletStandIn
from tests.nvidia_support import make, next_list
from tests.waiting import wait_until

KIND = "example.com/npu"


def _simulated(tmp_path: Path, count: int = 3, **extra: Any) -> SimulatedBackend:
    config = {
        "count": count,
        "model": "npu",
        "env": {"KXPU_VISIBLE_DEVICES": "{ids}", "NPU_DRIVER": "v2"},
        "mounts": [{"hostPath": str(tmp_path), "containerPath": "/opt/npu"}],
        **extra,
    }
    return SimulatedBackend(SimulatedConfig.model_validate(config))


def _spec(spec_dir: Path) -> dict[str, Any]:
    [path] = spec_dir.glob("*.json")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_spec_has_one_valid_entry_per_device_with_device_independent_edits(tmp_path: Path) -> None:
    spec_dir = tmp_path / "cdi"
    backend = with_cdi(_simulated(tmp_path), KIND, KIND, spec_dir)
    devices = backend.discover()
    spec = _spec(spec_dir)
    assert validate_spec(spec) == []
    assert spec["kind"] == KIND and spec["cdiVersion"] == "0.3.0"
    assert [d["name"] for d in spec["devices"]] == ["npu-0", "npu-1", "npu-2"]
    edits = spec["devices"][1]["containerEdits"]
    # The device list differs per set, so only the constant env goes into the spec.
    assert edits["env"] == ["NPU_DRIVER=v2"]
    assert edits["mounts"] == [
        {"hostPath": str(tmp_path), "containerPath": "/opt/npu", "options": ["ro", "bind"]}
    ]
    response = backend.allocate(devices[:2])
    assert response.cdi_devices == [f"{KIND}=npu-0", f"{KIND}=npu-1"]
    assert response.env == {"KXPU_VISIBLE_DEVICES": "npu-0,npu-1", "NPU_DRIVER": "v2"}
    assert response.mounts == []  # the runtime gets them from the spec
    assert response.annotations == {}
    backend.close()
    assert _spec(spec_dir) == spec  # kept for containers restarting while the daemon is down


def test_annotations_name_the_devices_when_asked(tmp_path: Path) -> None:
    backend = with_cdi(_simulated(tmp_path), KIND, KIND, tmp_path / "cdi", annotations=True)
    devices = backend.discover()
    response = backend.allocate(devices[1:])
    assert response.annotations == {"cdi.k8s.io/kxpu_example.com_npu": f"{KIND}=npu-1,{KIND}=npu-2"}
    backend.close()


def test_devices_with_no_constant_edits_still_get_a_valid_entry(tmp_path: Path) -> None:
    inner = SimulatedBackend(SimulatedConfig.model_validate({"count": 2, "model": "npu"}))
    backend = with_cdi(inner, KIND, KIND, tmp_path)
    backend.discover()
    spec = _spec(tmp_path)
    assert validate_spec(spec) == []
    assert spec["devices"][0]["containerEdits"] == {"env": [f"KXPU_CDI_DEVICE_NPU_0={KIND}=npu-0"]}
    backend.close()


async def test_spec_follows_discovery_changes_and_disappears_with_the_last_device(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    spec_dir = tmp_path / "cdi"
    backend = with_cdi(_simulated(tmp_path, count=2, stateFile=str(state)), KIND, KIND, spec_dir)
    updates = backend.watch()
    await next_list(updates)
    assert [d["name"] for d in _spec(spec_dir)["devices"]] == ["npu-0", "npu-1"]
    state.write_text(json.dumps({"npu-1": "Absent"}))
    await next_list(updates, lambda ds: len(ds) == 1)
    assert [d["name"] for d in _spec(spec_dir)["devices"]] == ["npu-0"]
    state.write_text(json.dumps({"npu-0": "Absent", "npu-1": "Absent"}))
    await next_list(updates, lambda ds: not ds)
    assert not list(spec_dir.glob("*.json"))  # CDI refuses a spec without devices
    await updates.aclose()
    backend.close()


def test_capabilities_are_exactly_the_inner_backends(tmp_path: Path) -> None:
    wrapped = with_cdi(_simulated(tmp_path), KIND, KIND, tmp_path)
    assert isinstance(wrapped, PreferredAllocator) and isinstance(wrapped, Watcher)
    assert not isinstance(wrapped, PreStarter) and not isinstance(wrapped, NodeLabeller)
    gpu, _ = make("a100-8x")
    wrapped_gpu = with_cdi(gpu, "nvidia.com/gpu", "kxpu.nvidia.com/gpu", tmp_path)
    assert isinstance(wrapped_gpu, NodeLabeller)
    assert wrapped_gpu.node_labels()["nvidia.com/gpu.count"] == "8"
    assert capabilities_of(wrapped_gpu).preferred_allocation
    wrapped_gpu.close()


def test_nvidia_device_nodes_move_into_the_spec_and_env_stays_in_the_response(tmp_path: Path) -> None:
    root = tmp_path / "driver"
    (root / "dev").mkdir(parents=True)
    (root / "dev" / "nvidiactl").touch()
    gpu, _ = make("a100-8x", passDeviceSpecs=True, nvidiaDriverRoot=str(root), deviceIDStrategy="index")
    backend = with_cdi(gpu, "nvidia.com/gpu", "kxpu.nvidia.com/gpu", tmp_path / "cdi")
    devices = backend.discover()
    spec = _spec(tmp_path / "cdi")
    assert validate_spec(spec) == [] and spec["cdiVersion"] == "0.5.0"
    nodes = spec["devices"][2]["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/nvidia2", "/dev/nvidiactl"]
    response = backend.allocate(devices[2:4])
    assert response.cdi_devices == ["kxpu.nvidia.com/gpu=2", "kxpu.nvidia.com/gpu=3"]
    assert response.env == {"NVIDIA_VISIBLE_DEVICES": "2,3"}
    assert response.device_nodes == []
    backend.close()


def test_cdi_options_in_the_config() -> None:
    config = parse_config(
        {
            "version": "v1",
            "resources": [
                {"name": KIND, "simulated": {"count": 1}, "cdi": {"enabled": True}},
                {
                    "name": "example.com/x",
                    "simulated": {"count": 1},
                    "cdi": {
                        "enabled": True,
                        "kind": "vendor.io/thing",
                        "specDir": "/etc/cdi",
                        "annotations": True,
                    },
                },
            ],
        }
    )
    first, second = config.resources
    assert (first.cdi_kind, first.cdi.spec_dir, first.cdi.annotations) == (KIND, Path("/var/run/cdi"), False)
    assert (second.cdi_kind, str(second.cdi.spec_dir), second.cdi.annotations) == (
        "vendor.io/thing",
        "/etc/cdi",
        True,
    )
    with pytest.raises(ConfigError, match=r"cdi\.kind"):
        parse_config(
            {
                "version": "v1",
                "resources": [{"name": KIND, "simulated": {"count": 1}, "cdi": {"kind": "bad"}}],
            }
        )
    with pytest.raises(ConfigError, match="specDir"):
        parse_config(
            {
                "version": "v1",
                "resources": [{"name": KIND, "simulated": {"count": 1}, "cdi": {"specDir": "rel"}}],
            }
        )


async def test_daemon_serves_cdi_names_and_keeps_the_spec_over_a_restart(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    spec_dir = workdir / "cdi"
    config = write_config(
        [
            {
                "name": KIND,
                "simulated": {
                    "count": 2,
                    "model": "npu",
                    "mounts": [{"hostPath": str(workdir), "containerPath": "/opt/npu"}],
                },
                "cdi": {"enabled": True, "specDir": str(spec_dir)},
            }
        ]
    )
    daemon = await daemons(config)
    await kubelet.wait_registered(KIND)
    await wait_until(lambda: bool(list(spec_dir.glob("*.json"))), what="the CDI spec")
    assert validate_spec(_spec(spec_dir)) == []
    response = await kubelet.allocate(KIND, ["npu-1"])
    container = response.container_responses[0]
    assert [c.name for c in container.cdi_devices] == [f"{KIND}=npu-1"]
    assert dict(container.envs) == {"KXPU_VISIBLE_DEVICES": "npu-1"}
    assert list(container.mounts) == []
    written = _spec(spec_dir)
    assert await daemon.stop() == 0
    # Containers restarting while kxpu is down still resolve their checkpointed CDI names.
    assert _spec(spec_dir) == written


def test_mount_that_only_the_set_gets_stays_in_the_response(tmp_path: Path) -> None:
    class PairMount(SimulatedBackend):
        def allocate(self, devices):  # type: ignore[no-untyped-def]
            edits = super().allocate(devices)
            if len(devices) > 1:
                edits.mounts.append(Mount("/pair", "/host/pair"))
            return edits

    inner = PairMount(SimulatedConfig.model_validate({"count": 2, "model": "npu"}))
    backend = with_cdi(inner, KIND, KIND, tmp_path)
    devices = backend.discover()
    assert backend.allocate(devices).mounts == [Mount("/pair", "/host/pair")]
    backend.close()


def test_listing_devices_writes_no_spec(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kxpu.cli import main

    spec_dir = tmp_path / "cdi"
    config = tmp_path / "c.yaml"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "resources": [
                    {
                        "name": KIND,
                        "simulated": {"count": 1},
                        "cdi": {"enabled": True, "specDir": str(spec_dir)},
                    }
                ],
            }
        )
    )
    result = CliRunner().invoke(main, ["devices", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert not spec_dir.exists()

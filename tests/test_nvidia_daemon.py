"""The real daemon process running the NVIDIA backend over a fake machine (KXPU_FAKE_NVML)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from kxpu.cli import main
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_nvml import FakeNvml, send_control

GPU = "nvidia.com/gpu"


async def test_daemon_serves_fake_gpus_and_reports_an_injected_xid(
    kubelet: KubeletStandIn, write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    control = workdir / "nvml.sock"
    config = write_config([{"name": GPU, "nvidia": {"deviceIDStrategy": "index"}}])
    await daemons(config, env={"KXPU_FAKE_NVML": "a100-8x", "KXPU_FAKE_NVML_CONTROL": str(control)})
    view = await kubelet.wait_registered(GPU)
    assert view.devices == {str(i): "Healthy" for i in range(8)}
    assert view.options.get_preferred_allocation_available
    chosen = await kubelet.preferred(GPU, [str(i) for i in range(1, 8)], [], 2)
    assert sorted(chosen) == ["2", "3"]  # the pair behind one PCIe switch
    response = await kubelet.allocate(GPU, ["2", "3"])
    assert dict(response.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": "2,3"}
    send_control(control, op="xid", gpu=5, xid=79)
    devices = await kubelet.wait_devices(GPU, lambda d: d.get("5") == "Unhealthy")
    assert sum(h == "Healthy" for h in devices.values()) == 7


def _config(tmp_path: Path, nvidia: dict[str, Any]) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"version": "v1", "resources": [{"name": GPU, "nvidia": nvidia}]}))
    return path


def test_kxpu_devices_prints_gpus_and_labels(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("KXPU_FAKE_NVML", "v100-4x-nvlink")
    result = CliRunner().invoke(main, ["devices", "--config", str(_config(tmp_path, {})), "-o", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [d["id"] for d in doc[GPU]["devices"]] == [g.uuid for g in FakeNvml("v100-4x-nvlink").gpus]
    assert doc[GPU]["labels"]["nvidia.com/gpu.product"] == "Tesla-V100-SXM2-16GB"


def test_kxpu_devices_fails_without_a_driver(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("KXPU_FAKE_NVML", "no-driver")
    result = CliRunner().invoke(main, ["devices", "--config", str(_config(tmp_path, {}))])
    assert result.exit_code == 1
    assert "NVML unavailable" in result.output and "failOnInitError" in result.output
    relaxed = CliRunner().invoke(
        main, ["devices", "--config", str(_config(tmp_path, {"failOnInitError": False}))]
    )
    assert relaxed.exit_code == 0, relaxed.output


def test_fake_profile_name_typo_is_a_clear_error(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("KXPU_FAKE_NVML", "a100-9x")
    result = CliRunner().invoke(main, ["devices", "--config", str(_config(tmp_path, {}))])
    assert result.exit_code == 1
    assert "unknown fake NVML profile 'a100-9x'" in result.output


def test_gpu_check_script_passes_over_a_fake_machine() -> None:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(root / "hack" / "gpu-check"), "--fake", "a100-8x", "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KXPU_FAKE_NVML"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpu-check: everything matches" in result.stdout
    assert result.stdout.count("ok   Allocate") == 16  # env and device node, for each of 8 GPUs


def test_a_selection_naming_a_gpu_the_node_lacks_is_one_warning(tmp_path: Path, monkeypatch: Any) -> None:
    """Time-slicing for GPU 9 on an 8-GPU node would be silently ignored: one line says so, naming the GPUs."""
    monkeypatch.setenv("KXPU_FAKE_NVML", "a100-8x")
    section = {
        "sharing": {"timeSlicing": {"resources": [{"replicas": 2, "devices": [1, 9]}]}},
        "devices": [1, "GPU-nope"],
    }
    result = CliRunner().invoke(main, ["devices", "--config", str(_config(tmp_path, section)), "-o", "json"])
    assert result.exit_code == 0, result.output
    present = "(GPUs present: 0, 1, 2, 3, 4, 5, 6, 7); its setting is ignored here"
    warnings = [line for line in result.stderr.splitlines() if "level=warning" in line]
    assert len(warnings) == 2, result.stderr
    assert f'event="devices names GPU GPU-nope, which this node does not have {present}"' in result.stderr
    assert (
        f'event="sharing.timeSlicing.resources[0].devices names GPU 9, which this node does not have {present}"'
        in result.stderr
    )
    assert len(json.loads(result.stdout)[GPU]["devices"]) == 2  # GPU 1's two replicas

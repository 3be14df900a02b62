"""Start-up: a node daemon imports only what its configured backends and serving paths need.

Every import between exec and registration delays the kubelet seeing the node's devices; the heavy ones
(the Kubernetes client, the HTTP server of the cluster side, vendor backends, the status command's
gRPC client) must load only when a config uses them. Checked in a fresh interpreter, as ``kxpu plugin`` starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Modules ``kxpu plugin`` with a simulated device-plugin resource has no use for.
NOT_FOR_A_SIMULATED_DEVICE_PLUGIN = (
    "lightkube",
    "aiohttp",
    "kxpu.backends.generic",
    "kxpu.backends.nvidia",
    "kxpu.status",
    "kxpu.kube.dra",
    "kxpu.dra.plugin",
    "kxpu.kube.sharing",
    "kxpu.sharing.node",
)

PROBE = """
import json, sys
from pathlib import Path
from kxpu.cli import _build, _load
from kxpu.daemon import Daemon
config = _load(Path(sys.argv[1]), None, ())
backends = [_build(r) for r in config.resources]
print(json.dumps(sorted(sys.modules)))
"""


def test_a_simulated_device_plugin_node_loads_no_cluster_client_or_other_backend(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "devicePluginDir": str(tmp_path / "dp"),
                "resources": [{"name": "example.com/npu", "simulated": {"count": 2}}],
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(config)], check=True, capture_output=True, text=True, timeout=60
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "kxpu.daemon" in loaded  # the probe did load the serving path
    assert sorted(m for m in NOT_FOR_A_SIMULATED_DEVICE_PLUGIN if m in loaded) == []


def test_the_dra_driver_loads_the_kubernetes_client_only_on_its_first_api_call() -> None:
    probe = (
        "import json, sys, kxpu.cli, kxpu.kube.dra, kxpu.dra.plugin; print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "kxpu.dra.plugin" in loaded
    assert sorted(m for m in ("lightkube", "httpx", "kxpu.kube.client") if m in loaded) == []


def test_a_vendor_node_loads_no_simulated_backend(tmp_path: Path) -> None:
    """The simulated backend (with its partitions and env templates) loads for its config key, like every
    other built-in: an NVIDIA node (the fake NVML playing its machine) never has it in memory."""
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "version": "v1",
                "devicePluginDir": str(tmp_path / "dp"),
                "resources": [{"name": "nvidia.com/gpu", "nvidia": {}}],
            }
        )
    )
    probe = "import kxpu.testing.fake_nvml\n" + PROBE
    out = subprocess.run(
        [sys.executable, "-c", probe, str(config)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KXPU_FAKE_NVML": "a100-8x"},
    )
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "kxpu.backends.nvidia.backend" in loaded  # the probe did build the backend
    unused = ("kxpu.backends.simulated", "kxpu.backends.partitions", "kxpu.backends.templates")
    assert sorted(m for m in unused if m in loaded) == []

"""`kxpu devices` as kubectl prints: a header, aligned columns, the health reason, -o wide|json|yaml."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def devices(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kxpu", "devices", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(tmp_path: Path, unhealthy: dict[str, str], extra: str = "") -> Path:
    state = tmp_path / "state.json"
    state.write_text(json.dumps(unhealthy))
    config = tmp_path / "c.yaml"
    config.write_text(
        "version: v1\nresources:\n"
        "  - name: example.com/npu\n"
        f"    simulated: {{count: 3, model: sim-npu, memoryMiB: 16384, numaNodes: [0, 0, 1], stateFile: {state}}}\n"
        + extra
    )
    return config


def test_the_table_has_a_header_aligned_columns_and_the_reason(tmp_path: Path) -> None:
    result = devices(write(tmp_path, {"sim-npu-2": "Unhealthy"}))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == (
        "RESOURCE          DEVICE      HEALTH      REASON       MODEL     MEMORY    NUMA\n"
        "example.com/npu   sim-npu-0   Healthy     <none>       sim-npu   16384Mi   0\n"
        "example.com/npu   sim-npu-1   Healthy     <none>       sim-npu   16384Mi   0\n"
        "example.com/npu   sim-npu-2   Unhealthy   state-file   sim-npu   16384Mi   1\n"
    )


def test_wide_adds_identity_columns(tmp_path: Path) -> None:
    lines = devices(write(tmp_path, {}), "-o", "wide").stdout.splitlines()
    assert lines[0].split() == [
        *("RESOURCE", "DEVICE", "HEALTH", "REASON", "MODEL", "MEMORY", "NUMA"),
        *("INDEX", "UUID", "PCI-BUS-ID", "CORES", "EXTRA"),
    ]
    assert lines[1].split()[7:9] == ["0", "SIM-3bd74612-cf16-5259-9032-5a9dfd37f4c5"]
    starts = {line.index("SIM-") for line in lines[1:]}
    assert starts == {lines[0].index("UUID")}  # aligned under its header


def test_json_and_yaml_are_the_same_documented_document(tmp_path: Path) -> None:
    config = write(tmp_path, {"sim-npu-1": "Unhealthy"})
    doc = json.loads(devices(config, "-o", "json").stdout)
    assert yaml.safe_load(devices(config, "-o", "yaml").stdout) == doc
    assert list(doc) == ["example.com/npu"] and doc["example.com/npu"]["backend"] == "simulated"
    first, second = doc["example.com/npu"]["devices"][:2]
    assert first == {
        "id": "sim-npu-0",
        "health": "Healthy",
        "reason": None,
        "numa_nodes": [0],
        "model": "sim-npu",
        "uuid": "SIM-3bd74612-cf16-5259-9032-5a9dfd37f4c5",
        "index": 0,
        "memory_mib": 16384,
    }
    assert (second["health"], second["reason"]) == ("Unhealthy", "state-file")


def test_a_resource_that_fails_is_one_error_line_and_the_rest_still_print(tmp_path: Path) -> None:
    broken = "  - name: example.com/gpu\n    nvidia: {}\n"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "kxpu", "devices", "--config", str(write(tmp_path, {}, broken))),
            *("--import", "kxpu.testing.fake_nvml"),  # the machine KXPU_FAKE_NVML names: one without a driver
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KXPU_FAKE_NVML": "no-driver"},
    )
    assert result.returncode == 1
    assert result.stdout.splitlines()[0].startswith("RESOURCE ") and len(result.stdout.splitlines()) == 4
    errors = [line for line in result.stderr.splitlines() if line.startswith("kxpu: error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "kxpu: error: example.com/gpu: BackendError: NVML unavailable"
    )

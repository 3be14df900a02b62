"""bench/bench_nvidia_vs_go.py, the kit the lead runs once on a lent GPU machine, over the fake NVML here.

It must measure both contenders through the stand-in kubelet, say in one line why NVIDIA's plugin did not run
when it cannot, and always end in bounded time with its JSON written, also when it is killed mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_nvidia_vs_go.py"
PROFILE = "a100-8x"


def _fake_nvidia(tmp_path: Path, body: str | None = None) -> Path:
    """An executable that plays NVIDIA's binary (tests/fake_nvidia_device_plugin.py, or ``body``)."""
    script = tmp_path / "nvidia-device-plugin"
    plugin = ROOT / "tests" / "fake_nvidia_device_plugin.py"
    script.write_text(body or f'#!/bin/sh\nexec {sys.executable} {plugin} "$@"\n')
    script.chmod(0o755)
    return script


def _bench(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(BENCH), "--out", str(out), "--fake", PROFILE, "--allocations", "50", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KXPU_FAKE_")}
    return env | {"PYTHONPATH": str(ROOT)}  # the fake plugin imports kxpu's generated API


def test_both_contenders_measured_through_the_stand_in_kubelet(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    command = _bench(
        out, "--runs", "1", "--warmup", "0", "--nvidia-bin", str(_fake_nvidia(tmp_path)),
        "--plugin-dir", str(tmp_path / "dp"),
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert len(doc["expected_gpus"]) == 8
    runs = {r["contender"]: r for r in doc["runs"]}
    assert sorted(runs) == ["kxpu", "nvidia", "python-floor"]
    for run in runs.values():
        assert "error" not in run, run
        assert run["gpus"] == 8
        assert 0 < run["exec_to_registered_ms"] <= run["exec_to_listed_ms"]
        assert 0 < run["allocate_p50_ms"] <= run["allocate_p99_ms"]
        assert run["rss_settled_mb"] > 0
        assert run["exit_status"] == 0  # SIGTERM ends each cleanly
    assert (
        runs["kxpu"]["allocate_device_nodes"] == runs["nvidia"]["allocate_device_nodes"] == 1
    )  # /dev/nvidiaN
    assert runs["python-floor"]["allocate_device_nodes"] == 0  # the floor passes no device specs
    for other in ("nvidia", "python_floor"):
        ratios = doc["summary"][f"kxpu_over_{other}"]
        assert set(ratios) >= {
            "exec_to_registered_ms",
            "exec_to_listed_ms",
            "allocate_p50_ms",
            "rss_settled_mb",
        }
    assert "| kxpu / nvidia | kxpu / python-floor |" in done.stdout


def test_nvidia_that_cannot_start_is_one_line_then_dropped_and_a_kill_keeps_the_results(
    tmp_path: Path,
) -> None:
    out = tmp_path / "results.json"
    dead = _fake_nvidia(tmp_path, "#!/bin/sh\necho 'NVML: driver not loaded' >&2\nexit 1\n")
    command = _bench(out, "--runs", "50", "--nvidia-bin", str(dead), "--plugin-dir", str(tmp_path / "dp"))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        deadline = time.monotonic() + 40
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline and len(doc.get("runs", [])) < 6:
            time.sleep(0.1)  # polling a file another process rewrites
            if out.exists():
                doc = json.loads(out.read_text())
        assert len(doc.get("runs", [])) >= 6, doc
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, output
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["stopped"] == "interrupted (SIGTERM or SIGINT)"
    failed = [r for r in doc["runs"] if r["contender"] == "nvidia"]
    assert len(failed) == 2, failed  # not started again: kxpu has the time left
    assert doc["contenders"]["nvidia"]["dropped"] == "its first 2 runs failed"
    assert failed[0]["error"] == "RuntimeError: exited with status 1 before registering"
    assert "NVML: driver not loaded" in failed[0]["log_tail"]
    assert any("error" not in r for r in doc["runs"] if r["contender"] == "kxpu")


def test_without_a_usable_binary_nvidia_is_skipped_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    command = _bench(out, "--runs", "1", "--warmup", "0", "--nvidia-bin", str(tmp_path / "missing"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["contenders"]["nvidia"] == {"skipped": f"{tmp_path / 'missing'} is not an executable file"}
    assert [r["contender"] for r in doc["runs"]] == ["kxpu", "python-floor"]
    assert f"nvidia: skipped: {tmp_path / 'missing'} is not an executable file" in done.stdout

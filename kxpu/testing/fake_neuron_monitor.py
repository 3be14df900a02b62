"""A fake ``neuron-monitor`` (aws-neuronx-tools) over a fake Neuron tree (``kxpu.testing.fake_neuron``).

It is what ``FakeNeuron.install_monitor()`` (or a ``*-tools`` profile) puts at ``/opt/aws/neuron/bin/neuron-monitor``
in the tree, so the ``neuron`` backend finds it exactly where it finds AWS's, and runs as AWS's does: ``-c <config>``
(``period``, ``neuron_runtimes[].metrics[].type``, ``system_metrics[].type``; without ``-c`` every group every 5 s),
one JSON report per line on stdout, with the shape of AWS's user guide (``kxpu.backends.neuron.monitor`` names it):
``neuron_runtime_data`` (one entry per application with its ``pid``, tag and the requested runtime groups
``neuroncore_counters`` and ``memory_used``), ``system_data`` (``neuron_hw_counters``, whose uncorrected counts are
read from the tree's sysfs, as the driver keeps them), ``instance_info`` and ``neuron_hardware_info``. Only the global
period is honoured; groups kxpu does not ask for are left out.

What runs is in a state file in the tree (``STATE``), written by ``FakeNeuron.run_app``/``end_app``/
``set_ecc_corrected``/``monitor_fault`` and read before each report, so a test changes it while the monitor runs.
Faults: ``exit`` (one line on stderr, exit code 1, as when the driver cannot be opened) and ``garbage`` (lines that
are not JSON). It exits when its tree is removed or its reader goes away.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

STATE = "run/kxpu-fake-neuron-monitor.json"  # under the tree's root
STARTS = "run/kxpu-fake-neuron-monitor.starts"  # one line per start, for tests that count restarts
DEFAULT_PERIOD_S = 5.0
ALL_RUNTIME_GROUPS = ("neuroncore_counters", "memory_used", "neuron_runtime_vcpu_usage", "execution_stats")
ALL_SYSTEM_GROUPS = ("vcpu_usage", "memory_info", "neuron_hw_counters")
_PERIOD = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")
GIB = 1024**3


def read_state(root: Path | str) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads(Path(root, STATE).read_text())
    except FileNotFoundError:
        return None
    return state


def write_state(root: Path | str, state: dict[str, Any]) -> None:
    path = Path(root, STATE)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)  # the monitor never reads half a file


def starts(root: Path | str) -> list[int]:
    """The PIDs of the fake monitors started over this tree, oldest first."""
    try:
        return [int(line) for line in Path(root, STARTS).read_text().split()]
    except FileNotFoundError:
        return []


def parse_period(text: str) -> float:
    match = _PERIOD.match(text)
    if match is None:
        raise ValueError(f"period {text!r}: expected a duration such as 1s")
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def _sysfs_int(root: Path, path: str) -> int:
    try:
        return int(Path(root, path.lstrip("/")).read_text().strip())
    except (OSError, ValueError):
        return 0


def _devices(root: Path) -> list[int]:
    try:
        names = os.listdir(root / "sys/class/neuron_device")
    except FileNotFoundError:
        return []
    return sorted(int(n[6:]) for n in names if n.startswith("neuron") and n[6:].isdigit())


def report(
    root: Path, state: dict[str, Any], period: float, runtime: set[str], system: set[str]
) -> dict[str, Any]:
    devices = _devices(root)
    runtimes = []
    for app in state["apps"]:
        groups: dict[str, Any] = {}
        if "neuroncore_counters" in runtime:
            groups["neuroncore_counters"] = {
                "period": period,
                "neuroncores_in_use": {
                    core: {"neuroncore_utilization": data["utilization"], "flops": 0}
                    for core, data in app["cores"].items()
                },
                "error": "",
            }
        if "memory_used" in runtime:
            per_core = {core: dict(data["memory"]) for core, data in app["cores"].items()}
            groups["memory_used"] = {
                "period": period,
                "neuron_runtime_used_bytes": {
                    "host": 0,
                    "neuron_device": sum(sum(m.values()) for m in per_core.values()),
                    "usage_breakdown": {
                        "host": {"application_memory": 0, "constants": 0, "dma_buffers": 0, "tensors": 0},
                        "neuroncore_memory_usage": per_core,
                    },
                },
                "loaded_models": [],
                "error": "",
            }
        runtimes.append(
            {
                "pid": app["pid"],
                "address": "",
                "neuron_runtime_tag": app["tag"],
                "error": "",
                "report": groups,
            }
        )
    system_data: dict[str, Any] = {}
    if "neuron_hw_counters" in system:
        counts = []
        for index in devices:
            corrected = state["corrected"].get(str(index), {})
            counts.append(
                {
                    "neuron_device_index": index,
                    "mem_ecc_corrected": corrected.get("mem", 0),
                    "mem_ecc_uncorrected": _sysfs_int(
                        root, state["ecc_uncorrected"]["mem"].format(index=index)
                    ),
                    "sram_ecc_uncorrected": _sysfs_int(
                        root, state["ecc_uncorrected"]["sram"].format(index=index)
                    ),
                    "sram_ecc_corrected": corrected.get("sram", 0),
                }
            )
        system_data["neuron_hw_counters"] = {"period": period, "neuron_devices": counts, "error": ""}
    return {
        "neuron_runtime_data": runtimes,
        "system_data": system_data,
        "instance_info": {
            "instance_name": "",
            "instance_id": "i-0fake0fake0fake00",
            "instance_type": f"{state['family'].lower()}.fake",
            "instance_availability_zone": "",
            "instance_availability_zone_id": "",
            "instance_region": "",
            "ami_id": "",
            "subnet_id": "",
            "error": "",
        },
        "neuron_hardware_info": {
            "neuron_device_type": state["device_name"].lower(),
            "neuroncore_version": state["neuroncore_version"],
            "neuron_device_count": len(devices),
            "neuron_device_memory_size": state["memory_bytes"],
            "neuroncore_per_device_count": state["cores_per_device"],
            "logical_neuroncore_config": state["logical_core_config"],
            "error": "",
        },
    }


def main(argv: list[str], root: str) -> int:
    parser = argparse.ArgumentParser(prog="neuron-monitor")
    parser.add_argument("-c", "--config-file")
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args(argv)
    if args.config_file:
        config = json.loads(Path(args.config_file).read_text())
        period = parse_period(str(config.get("period", "5s")))
        runtime = {m["type"] for r in config.get("neuron_runtimes", []) for m in r.get("metrics", [])}
        system = {m["type"] for m in config.get("system_metrics", [])}
    else:
        period, runtime, system = DEFAULT_PERIOD_S, set(ALL_RUNTIME_GROUPS), set(ALL_SYSTEM_GROUPS)
    tree = Path(root)
    with Path(root, STARTS).open("a") as starts:
        starts.write(f"{os.getpid()}\n")
    while True:
        state = read_state(tree)
        if state is None or not (tree / "sys").is_dir():
            return 0  # the fake machine is gone
        if state.get("fault") == "exit":
            print(
                f"neuron-monitor[{os.getpid()}]: failed to open the Neuron driver", file=sys.stderr
            )  # varies
            return 1
        if state.get("fault") == "garbage":
            line = "neuron-monitor: collecting"
        else:
            line = json.dumps(report(tree, state, period, runtime, system), separators=(",", ":"))
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            return 0
        time.sleep(period)

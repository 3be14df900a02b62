"""kxpu resource sections for the scenarios, in the shape of the config file's ``resources`` entries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NPU = "example.com/npu"
SIM_MODEL = "sim-npu"


def simulated(
    state_file: Path | None = None,
    mount_dir: Path | None = None,
    count: int = 4,
    name: str = NPU,
    cdi: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Four simulated NPUs on two NUMA nodes; env names the granted IDs; optionally a read-only mount."""
    section: dict[str, Any] = {
        "count": count,
        "model": SIM_MODEL,
        "memoryMiB": 16384,
        "numaNodes": [i * 2 // count for i in range(count)],
        "env": {"SIM_VISIBLE_DEVICES": "{ids}", "SIM_DEVICE_COUNT": "{count}"},
    }
    if state_file is not None:
        section["stateFile"] = str(state_file)
    if mount_dir is not None:
        section["mounts"] = [{"hostPath": str(mount_dir), "containerPath": "/sim", "readOnly": True}]
    resource: dict[str, Any] = {"name": name, "simulated": section}
    if cdi is not None:
        resource["cdi"] = cdi
    return resource


def sim_ids(count: int = 4) -> set[str]:
    return {f"{SIM_MODEL}-{i}" for i in range(count)}

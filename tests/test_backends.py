"""Backends in-process: discovery, allocation, and change pushes."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kxpu.backends.generic import GenericBackend, GenericConfig, device_name
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.model import Device, Health


async def next_snapshot(stream: AsyncIterator[list[Device]], timeout: float = 5.0) -> list[Device]:
    return await asyncio.wait_for(anext(stream), timeout)


def char_device(path: Path) -> None:
    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 3))


def test_simulated_attributes_are_stable() -> None:
    config = SimulatedConfig(count=2, model="npu", memory_mib=1024, cores=8, numa_nodes=[1, 0])
    first = SimulatedBackend(config).discover()
    again = SimulatedBackend(config).discover()
    assert [d.uuid for d in first] == [d.uuid for d in again]
    assert [(d.id, d.index, d.numa_nodes, d.memory_mib, d.cores) for d in first] == [
        ("npu-0", 0, (1,), 1024, 8),
        ("npu-1", 1, (0,), 1024, 8),
    ]


def test_simulated_state_file_rules(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    backend = SimulatedBackend(SimulatedConfig(count=3, model="n", state_file=state))
    assert all(d.healthy for d in backend.discover())  # no file: all healthy
    state.write_text(json.dumps({"n-0": "Unhealthy", "n-1": "Absent", "n-7": "Unhealthy", "n-2": "Sick"}))
    assert [(d.id, d.health) for d in backend.discover()] == [
        ("n-0", Health.UNHEALTHY),
        ("n-2", Health.HEALTHY),
    ]
    state.write_text("[1, 2]")  # not an object: last good state stays
    assert [d.id for d in backend.discover()] == ["n-0", "n-2"]
    state.write_text("")  # empty file: nothing listed, all healthy
    assert len(backend.discover()) == 3


def test_simulated_allocation_renders_templates() -> None:
    backend = SimulatedBackend(
        SimulatedConfig.model_validate(
            {
                "count": 2,
                "model": "n",
                "env": {"IDS": "{ids}", "IDX": "{indexes}", "U": "{uuids}", "N": "{count}"},
            }
        )
    )
    devices = backend.discover()
    edits = backend.allocate(devices[::-1])
    assert edits.env["IDS"] == "n-1,n-0" and edits.env["IDX"] == "1,0" and edits.env["N"] == "2"
    assert edits.env["U"] == f"{devices[1].uuid},{devices[0].uuid}"


async def test_simulated_watch_pushes_changes(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    backend = SimulatedBackend(SimulatedConfig(count=2, model="n", state_file=state))
    stream = backend.watch()
    assert len(await next_snapshot(stream)) == 2  # the current list first
    tmp = tmp_path / "s.json.tmp"
    tmp.write_text(json.dumps({"n-1": "Unhealthy"}))
    tmp.rename(state)  # atomic replace, as config management tools do
    snapshot = await next_snapshot(stream)
    assert [d.health for d in snapshot] == [Health.HEALTHY, Health.UNHEALTHY]
    state.unlink()
    assert all(d.healthy for d in await next_snapshot(stream))
    await stream.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path", "name"),
    [("/dev/fpga0", "fpga0"), ("/dev/dri/renderD128", "dri_renderD128"), ("/tmp/x/acc el", "acc_el")],
)
def test_generic_device_names(path: str, name: str) -> None:
    assert device_name(path) == name


def test_generic_shares_and_groups(tmp_path: Path) -> None:
    for name in ("fpga0", "fpga1", "npu0"):
        char_device(tmp_path / name)
    (tmp_path / "fpga-dir").mkdir()  # directories never count as devices
    config = GenericConfig.model_validate(
        {
            "groups": [
                {"paths": [str(tmp_path / "fpga*")], "count": 2, "env": {"F": "{ids}"}},
                {
                    "paths": [str(tmp_path / "npu*")],
                    "containerPath": "/dev/npu/{name}",
                    "permissions": "r",
                    "mounts": [{"hostPath": "/opt/npu", "containerPath": "/usr/local/npu"}],
                },
            ]
        }
    )
    backend = GenericBackend(config)
    devices = {d.id: d for d in backend.discover()}
    assert sorted(devices) == ["fpga0::0", "fpga0::1", "fpga1::0", "fpga1::1", "npu0"]
    edits = backend.allocate([devices["fpga0::0"], devices["fpga0::1"], devices["npu0"]])
    nodes = sorted((n.container_path, n.host_path, n.permissions) for n in edits.device_nodes)
    assert nodes == [
        ("/dev/npu/npu0", str(tmp_path / "npu0"), "r"),
        (str(tmp_path / "fpga0"), str(tmp_path / "fpga0"), "rw"),  # two shares, one node
    ]
    assert edits.env == {"F": "fpga0::0,fpga0::1"}
    assert [(m.host_path, m.container_path, m.read_only) for m in edits.mounts] == [
        ("/opt/npu", "/usr/local/npu", True)
    ]


async def test_generic_watch_sees_nodes_in_new_subdirectories(tmp_path: Path) -> None:
    config = GenericConfig.model_validate({"groups": [{"paths": [str(tmp_path / "accel*" / "card*")]}]})
    backend = GenericBackend(config)
    stream = backend.watch()
    assert await next_snapshot(stream) == []
    (tmp_path / "accel0").mkdir()
    await next_snapshot(stream)
    char_device(tmp_path / "accel0" / "card1")
    snapshot = await next_snapshot(stream)
    while not snapshot:  # the mkdir and the mknod may arrive as separate wake-ups
        snapshot = await next_snapshot(stream)
    assert [d.extra["path"] for d in snapshot] == [str(tmp_path / "accel0" / "card1")]
    await stream.aclose()  # type: ignore[attr-defined]

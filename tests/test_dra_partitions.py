"""MIG-style partitions through DRA: the whole device and its partitions published with shared counters, and
the driver refusing to prepare partitions that overlap."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.config import ConfigError, parse_config
from kxpu.dra.checkpoint import Checkpoint, CheckpointError
from kxpu.dra.config import DraSharesConfig
from kxpu.dra.prepare import Preparer
from kxpu.dra.slices import pool_content
from kxpu.model import BackendError, ContainerEdits, Device, index_by_id
from kxpu.testing.dra import FakeDraApi

DRIVER, NODE = "gpu.example.com", "node-a"


def backend(count: int = 2) -> SimulatedBackend:
    return SimulatedBackend(
        SimulatedConfig.model_validate(
            {
                "count": count,
                "model": "sg",
                "memoryMiB": 40960,
                "partitions": {"slices": 7, "profiles": [1, 2, 3]},
            }
        )
    )


def test_partitions_and_their_counters() -> None:
    b = backend(1)
    devices = b.discover()
    assert [d.id for d in devices] == [
        "sg-0",
        *[f"sg-0-1g-{i}" for i in range(7)],
        "sg-0-2g-0",
        "sg-0-2g-2",
        "sg-0-2g-4",
        "sg-0-3g-0",
        "sg-0-3g-3",
    ]
    by_id = index_by_id(devices)
    assert by_id["sg-0-3g-3"].consumes == {"sg-0": {"s3": 1, "s4": 1, "s5": 1}}
    assert by_id["sg-0-3g-3"].memory_mib == 40960 * 3 // 7
    assert by_id["sg-0"].consumes == {"sg-0": {f"s{i}": 1 for i in range(7)}}
    content = pool_content(DRIVER, NODE, devices, 1, "taint", counter_sets=b.counter_sets())
    devices_slice, counters_slice = content.slices
    assert "sharedCounters" not in devices_slice and "devices" not in counters_slice  # one or the other
    assert counters_slice["sharedCounters"] == [
        {"name": "sg-0", "counters": {f"s{i}": {"value": "1"} for i in range(7)}}
    ]
    entry = next(d for d in devices_slice["devices"] if d["name"] == "sg-0-2g-2")
    assert entry["consumesCounters"] == [
        {"counterSet": "sg-0", "counters": {"s2": {"value": "1"}, "s3": {"value": "1"}}}
    ]
    assert entry["attributes"]["profile"] == {"string": "2g"}
    assert all(s["pool"]["resourceSliceCount"] == 2 for s in content.slices)


def test_many_counter_sets_span_slices() -> None:
    b = backend(10)
    content = pool_content(DRIVER, NODE, b.discover(), 1, "withdraw", counter_sets=b.counter_sets())
    counter_slices = [s for s in content.slices if "sharedCounters" in s]
    assert [len(s["sharedCounters"]) for s in counter_slices] == [8, 2]  # at most 8 counter sets a slice
    device_slices = [s for s in content.slices if "devices" in s]
    assert all(len(s["devices"]) <= 64 for s in device_slices)  # devices drawing counters: 64 a slice


def test_partitions_only_through_dra() -> None:
    section = {"count": 1, "partitions": {}}
    with pytest.raises(
        ConfigError, match=r"overlapping partitions: only DRA can serve that \(set serve: dra\)"
    ):
        parse_config({"version": "v1", "resources": [{"name": "example.com/gpu", "simulated": section}]})
    parse_config(
        {"version": "v1", "resources": [{"name": "example.com/gpu", "simulated": section, "serve": "dra"}]}
    )
    with pytest.raises(ConfigError, match="not smaller than the device's 4 slices"):
        parse_config(
            {
                "version": "v1",
                "resources": [
                    {
                        "name": "x.com/g",
                        "simulated": {"count": 1, "partitions": {"slices": 4, "profiles": [4]}},
                        "serve": "dra",
                    }
                ],
            }
        )


def result(device: str) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}


async def test_overlapping_partitions_are_never_prepared(tmp_path: Path) -> None:
    b = backend(1)
    checkpoint = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    api = FakeDraApi()
    preparer = Preparer(DRIVER, NODE, b, index_by_id(b.discover()), checkpoint, tmp_path / "cdi", api)
    first = api.add_claim("a", [result("sg-0-3g-0")])
    beside = api.add_claim("b", [result("sg-0-3g-3")])
    answers = await preparer.prepare([first, beside])
    assert answers[first.uid].error is None and answers[beside.uid].error is None
    for name, device in (("c", "sg-0-2g-2"), ("d", "sg-0"), ("e", "sg-0-1g-5")):
        claim = api.add_claim(name, [result(device)])
        error = (await preparer.prepare([claim]))[claim.uid].error or ""
        assert "would overlap partitions already prepared" in error, (device, error)
    free = api.add_claim("f", [result("sg-0-1g-6")])  # slice 6 is the one left
    assert (await preparer.prepare([free]))[free.uid].error is None
    await preparer.unprepare([first])
    again = api.add_claim("g", [result("sg-0-2g-0")])
    assert (await preparer.prepare([again]))[again.uid].error is None


class Recording(SimulatedBackend):
    """A simulated partitioner whose partitions exist only while realized (as MIG devices made on demand):
    it records which are live, can be told to fail in allocate, and to hold realize until released."""

    def __init__(self) -> None:
        super().__init__(backend(1).config)
        self.live: set[str] = set()
        self.fail: Exception | None = None
        self.entered = threading.Event()
        self.made = threading.Event()
        self.released = threading.Event()
        self.gate: threading.Event | None = None

    def realize(self, devices: Sequence[Device]) -> list[tuple[Device, dict[str, str | int]]]:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.live.update(d.id for d in devices)
        self.made.set()
        return [(d, {"id": d.id}) for d in devices]

    def release(self, handles: Sequence[Mapping[str, str | int]]) -> None:
        for handle in handles:  # idempotent, as Partitioner.release must be
            self.live.discard(str(handle["id"]))
        self.released.set()

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        if self.fail is not None:
            raise self.fail
        return super().allocate(devices)


def recording(tmp_path: Path) -> tuple[Recording, Preparer, FakeDraApi]:
    b = Recording()
    api = FakeDraApi()
    checkpoint = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    return b, Preparer(DRIVER, NODE, b, index_by_id(b.discover()), checkpoint, tmp_path / "cdi", api), api


@pytest.mark.parametrize(
    "failure",
    [BackendError("the vendor library refused"), RuntimeError("a vendor library's surprise"), "opaque"],
)
async def test_a_failed_prepare_releases_the_partitions_it_made(tmp_path: Path, failure: Any) -> None:
    b, preparer, api = recording(tmp_path)
    if failure == "opaque":  # a ClaimError after realize: MPS asked of a backend that cannot enforce shares
        params = {"apiVersion": "kxpu.io/v1alpha1", "kind": "DeviceConfig", "sharing": {"strategy": "MPS"}}
        config = [{"opaque": {"driver": DRIVER, "parameters": params}}]
        preparer.shares = DraSharesConfig()
        claim = api.add_claim("a", [{**result("sg-0-3g-0"), "shareID": "s1"}], config=config)
    else:
        b.fail = failure
        claim = api.add_claim("a", [result("sg-0-3g-0")])
    answer = (await preparer.prepare([claim]))[claim.uid]
    assert answer.error and "\n" not in answer.error
    assert b.live == set(), "the partition made for the claim was left behind"
    assert preparer.checkpoint.claims == {} and not list((tmp_path / "cdi").glob("*.json"))


async def test_a_prepare_cancelled_while_realizing_releases_what_was_made(tmp_path: Path) -> None:
    b, preparer, api = recording(tmp_path)
    b.gate = threading.Event()
    claim = api.add_claim("a", [result("sg-0-3g-0")])
    call = asyncio.create_task(preparer.prepare([claim]))
    assert await asyncio.to_thread(b.entered.wait, 5)
    call.cancel()  # the kubelet's deadline
    with pytest.raises(asyncio.CancelledError):
        await call
    b.gate.set()  # the vendor call returns after all: its partition must not stay
    assert await asyncio.to_thread(b.made.wait, 5)
    assert await asyncio.to_thread(b.released.wait, 5)
    assert b.live == set() and preparer.checkpoint.claims == {}


async def test_unprepare_after_a_crash_between_release_and_save(tmp_path: Path) -> None:
    """The partitions released, then the checkpoint not saved (a full disk, a crash): the claim stays prepared
    in memory as on disk, and the next unprepare releases again (idempotent) and finishes."""
    b, preparer, api = recording(tmp_path)
    claim = api.add_claim("a", [result("sg-0-3g-0")])
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    assert b.live == {"sg-0-3g-0"}
    save = preparer.checkpoint.save

    saves = []

    def full_disk() -> None:
        saves.append(1)
        if len(saves) == 1:  # the claim marked as releasing (written ahead of the release) is saved
            return save()
        raise CheckpointError("cannot write the DRA checkpoint: No space left on device")

    preparer.checkpoint.save = full_disk  # type: ignore[method-assign]
    assert "No space left" in ((await preparer.unprepare([claim]))[claim.uid] or "")
    assert b.live == set() and claim.uid in preparer.checkpoint.claims
    preparer.checkpoint.save = save  # type: ignore[method-assign]
    assert (await preparer.unprepare([claim]))[claim.uid] is None
    assert preparer.checkpoint.claims == {}
    reloaded = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    reloaded.load()
    assert reloaded.claims == {}

"""DRA state in three places at once (the hardware's partitions, the checkpoint, the API's claims) kept in step
through crashes: the write-ahead record of partitions about to be made, the reconciliation at start and on an
overlap, and claims deleted while the driver was down.

The property test drives a preparer over simulated dynamic partitions (a partition table in a file, as a GPU
keeps MIG instances) through any interleaving of prepare, unprepare, claim deletion and restart, with a crash at
any step of a prepare or unprepare: the files on disk (checkpoint, CDI specs, partition table) are put back as they
were at the moment of the crash, what a SIGKILL leaves, and a new preparer starts from them."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kxpu.backends.partitions import PartitionTable
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.dra.checkpoint import Checkpoint, Making, held_devices
from kxpu.dra.prepare import Preparer
from kxpu.model import ContainerEdits, Device, index_by_id
from kxpu.testing.dra import FakeDraApi
from tests.waiting import wait_until

DRIVER, NODE = "gpu.example.com", "node-a"
# Partitions of one 7-slice device: 2g-2 overlaps both 3g ones; 1g-6 overlaps none of them.
PARTITIONS = ("sg-0-3g-0", "sg-0-3g-3", "sg-0-2g-2", "sg-0-1g-6")


def simulated(root: Path, hold: Path | None = None) -> SimulatedConfig:
    return SimulatedConfig.model_validate(
        {
            "count": 1,
            "model": "sg",
            "memoryMiB": 40960,
            "partitions": {
                "slices": 7,
                "profiles": [1, 2, 3],
                "hardwareFile": str(root / "hardware.json"),
                **({"holdFile": str(hold)} if hold else {}),
            },
        }
    )


def result(device: str) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}


def hardware(root: Path) -> set[str]:
    return set(PartitionTable(root / "hardware.json").read())


def preparer(root: Path, api: FakeDraApi, backend: SimulatedBackend | None = None) -> Preparer:
    backend = backend or SimulatedBackend(simulated(root))
    checkpoint = Checkpoint(root / "checkpoint.json", DRIVER)
    checkpoint.load()
    return Preparer(DRIVER, NODE, backend, index_by_id(backend.discover()), checkpoint, root / "cdi", api)


async def start(p: Preparer) -> None:
    """What the driver does at start, before and as it serves."""
    p.remove_orphan_specs()
    await p.reconcile()
    await p.release_deleted_claims()


# -- the partition table itself -------------------------------------------------------------------------------------


def test_dynamic_partitions_are_made_refused_on_overlap_and_destroyed(tmp_path: Path) -> None:
    b = SimulatedBackend(simulated(tmp_path))
    by_id = index_by_id(b.discover())
    made = b.realize([by_id["sg-0-3g-0"]])
    assert made == [(by_id["sg-0-3g-0"], {"id": "sg-0-3g-0"})] and hardware(tmp_path) == {"sg-0-3g-0"}
    with pytest.raises(Exception, match=r"cannot make the partition: \['sg-0-3g-0'\] overlaps it"):
        b.realize([by_id["sg-0"]])
    assert b.reclaim([by_id["sg-0-3g-0"], by_id["sg-0-1g-6"]]) == ["sg-0-3g-0"]
    assert hardware(tmp_path) == set()
    b.release([{"id": "sg-0-3g-0"}])  # idempotent


# -- SIGKILL inside realize --------------------------------------------------------------------------------------

_KILLED_PREPARE = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from kxpu.dra.prepare import ClaimRef
    from kxpu.testing.dra import FakeDraApi
    from kxpu.backends.simulated import SimulatedBackend
    from tests.test_dra_reconcile import preparer, result, simulated
    root, uid = Path(sys.argv[1]), sys.argv[2]
    api = FakeDraApi()
    api.add_claim("doomed", [result("sg-0-1g-1")])
    api.claims[("default", "doomed")]["metadata"]["uid"] = uid
    backend = SimulatedBackend(simulated(root, root / "hold"))
    asyncio.run(preparer(root, api, backend).prepare([ClaimRef("default", uid, "doomed")]))
    """
)


async def test_a_partition_left_by_a_kill_inside_realize_is_destroyed_at_start(tmp_path: Path) -> None:
    """The daemon is SIGKILLed while the backend makes a claim's partition (held half-way by the hold file), the
    claim is deleted while it is down: at start the partition is destroyed, and the whole device can be prepared
    again (before: ``cannot make the partition: ['sg-0-1g-1'] overlaps it`` for ever)."""
    hold = tmp_path / "hold"
    hold.touch()
    root = Path(__file__).resolve().parents[1]
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _KILLED_PREPARE,
        str(tmp_path),
        "uid-doomed",
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        await wait_until(lambda: hardware(tmp_path) == {"sg-0-1g-1"}, 20, "the partition made, held half-way")
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), 10)
    hold.unlink()
    before = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    before.load()
    assert before.claims == {} and set(before.making) == {"uid-doomed"}

    api = FakeDraApi()  # the claim was deleted while the daemon was down
    p = preparer(tmp_path, api)
    assert await p.reconcile() == ["sg-0-1g-1"]
    assert hardware(tmp_path) == set() and p.checkpoint.making == {}
    whole = api.add_claim("whole", [result("sg-0")])
    assert (await p.prepare([whole]))[whole.uid].error is None
    assert hardware(tmp_path) == {"sg-0"}


async def test_an_overlap_on_prepare_reconciles_and_retries(tmp_path: Path) -> None:
    """A partition kxpu recorded making and no claim owns, found only when a prepare overlaps it (start did not
    get to destroy it: the backend failed then): the prepare reconciles and succeeds."""
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    b = p.backend
    assert isinstance(b, SimulatedBackend)
    b.realize([index_by_id(b.discover())["sg-0-3g-3"]])  # what a killed prepare left
    p.checkpoint.making["gone"] = Making("default/gone", ("sg-0-3g-3",))
    p.checkpoint.save()
    claim = api.add_claim("c", [result("sg-0-2g-2")])
    assert (await p.prepare([claim]))[claim.uid].error is None
    assert hardware(tmp_path) == {"sg-0-2g-2"}


async def test_a_partition_kxpu_did_not_record_is_never_destroyed(tmp_path: Path) -> None:
    """Only partitions kxpu wrote down before making them are reclaimed: one made by someone else stays, and the
    prepare that overlaps it fails with the backend's one line."""
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    b = p.backend
    assert isinstance(b, SimulatedBackend)
    b.realize([index_by_id(b.discover())["sg-0-3g-3"]])
    assert await p.reconcile() == []
    claim = api.add_claim("c", [result("sg-0-2g-2")])
    error = (await p.prepare([claim]))[claim.uid].error or ""
    assert "['sg-0-3g-3'] overlaps it" in error and "\n" not in error
    assert hardware(tmp_path) == {"sg-0-3g-3"} and p.checkpoint.making == {}


async def test_claims_deleted_while_the_driver_was_down_are_unprepared_at_start(tmp_path: Path) -> None:
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    kept, deleted, remade = (
        api.add_claim(n, [result(d)]) for n, d in (("k", "sg-0-1g-6"), ("d", "sg-0-3g-0"), ("r", "sg-0-3g-3"))
    )
    answers = await p.prepare([kept, deleted, remade])
    assert all(a.error is None for a in answers.values())
    del api.claims[("default", "d")]
    api.claims[("default", "r")]["metadata"]["uid"] = "made-again"  # deleted and created again under its name
    q = preparer(tmp_path, api)
    assert sorted(await q.release_deleted_claims()) == ["default/d", "default/r"]
    assert set(q.checkpoint.claims) == {kept.uid}
    assert hardware(tmp_path) == {"sg-0-1g-6"}
    # the specs CDI reads (the unprepared claims' are set aside in a subdirectory, which CDI does not read)
    assert [s.name for s in (tmp_path / "cdi").glob("*.json")] == [q.spec_path(kept.uid).name]
    api.fail_next = RuntimeError("the API server is unreachable")
    assert await q.release_deleted_claims() == []  # a claim that cannot be read stays
    assert set(q.checkpoint.claims) == {kept.uid}


async def test_a_claim_prepared_again_after_its_cdi_spec_vanished_releases_its_old_partitions(
    tmp_path: Path,
) -> None:
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    claim = api.add_claim("c", [result("sg-0-3g-0")])
    assert (await p.prepare([claim]))[claim.uid].error is None
    p.spec_path(claim.uid).unlink()  # a tmpfs cleared
    assert (await p.prepare([claim]))[claim.uid].error is None
    assert hardware(tmp_path) == {"sg-0-3g-0"} and p.spec_path(claim.uid).exists()


# -- the property ------------------------------------------------------------------------------------------------


class Crash(BaseException):
    """The process is killed here."""


class World:
    """Counts the steps at which a crash may land; at the chosen one, records the files as they are and raises."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.crash_at: int | None = None
        self.steps = 0
        self.frozen: dict[Path, bytes] | None = None

    def step(self) -> None:
        if self.frozen is not None:
            raise Crash
        self.steps += 1
        if self.crash_at is not None and self.steps == self.crash_at:
            self.frozen = {p: p.read_bytes() for p in self.root.rglob("*") if p.is_file()}
            raise Crash

    def restore(self) -> None:
        """Disk as the killed process left it."""
        assert self.frozen is not None
        for path in [p for p in self.root.rglob("*") if p.is_file()]:
            if path not in self.frozen:
                path.unlink()
        for path, data in self.frozen.items():
            path.write_bytes(data)
        self.frozen = None


class CrashingBackend(SimulatedBackend):
    def __init__(self, config: SimulatedConfig, world: World) -> None:
        super().__init__(config)
        self.world = world

    def realize(self, devices: Sequence[Device]) -> list[tuple[Device, dict[str, str | int]]]:
        made = []
        for device in devices:
            self.world.step()
            made += super().realize([device])
        self.world.step()
        return made

    def release(self, handles: Sequence[Mapping[str, str | int]]) -> None:
        for handle in handles:
            self.world.step()
            super().release([handle])
        self.world.step()

    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        self.world.step()
        return super().allocate(devices)


class CrashingCheckpoint(Checkpoint):
    world: World

    def save(self) -> None:
        self.world.step()
        super().save()
        self.world.step()


class CrashingPreparer(Preparer):
    world: World

    def _write_spec(self, uid: str, entries: list[tuple[str, ContainerEdits]]) -> str:
        self.world.step()
        path = super()._write_spec(uid, entries)
        self.world.step()
        return path


def crashing_preparer(root: Path, api: FakeDraApi, world: World) -> CrashingPreparer:
    backend = CrashingBackend(simulated(root), world)
    checkpoint = CrashingCheckpoint(root / "checkpoint.json", DRIVER)
    checkpoint.world = world
    checkpoint.load()
    p = CrashingPreparer(
        DRIVER, NODE, backend, index_by_id(backend.discover()), checkpoint, root / "cdi", api
    )
    p.world = world
    return p


operation = st.one_of(
    st.tuples(st.just("prepare"), st.integers(0, 3), st.none() | st.integers(1, 8)),
    st.tuples(st.just("unprepare"), st.integers(0, 3), st.none() | st.integers(1, 6)),
    st.tuples(st.just("delete"), st.integers(0, 3), st.none()),
    st.tuples(st.just("restart"), st.just(0), st.none()),
)


async def _run(root: Path, operations: list[tuple[str, int, int | None]]) -> None:
    api = FakeDraApi()
    world = World(root)
    refs = [api.add_claim(f"c{k}", [result(PARTITIONS[k])]) for k in range(4)]
    p = crashing_preparer(root, api, world)
    for op, k, crash_at in operations:
        world.steps, world.crash_at = 0, crash_at
        try:
            if op == "prepare":
                await p.prepare([refs[k]])
            elif op == "unprepare":
                await p.unprepare([refs[k]])
            elif op == "delete":
                api.claims.pop((refs[k].namespace, refs[k].name), None)
            else:
                raise Crash
        except Crash:
            # Killed: what it did after this point never happened; a new process starts from the disk.
            await asyncio.gather(*list(p._background), return_exceptions=True)
            if world.frozen is not None:
                world.restore()
            world.crash_at = None
            p = crashing_preparer(root, api, world)
            await start(p)
    world.crash_at = None
    p = crashing_preparer(root, api, world)
    await start(p)

    prepared = p.checkpoint.claims
    live = {c["metadata"]["uid"] for c in api.claims.values()}
    assert set(prepared) <= live, "a claim deleted from the API is still prepared"
    # The hardware holds exactly the partitions of the live prepared claims.
    assert hardware(root) == {d.id for c in prepared.values() for d in c.devices}
    assert p.checkpoint.making == {}
    # Every CDI spec is a prepared claim's, and every prepared claim has its spec.
    assert {s.name for s in (root / "cdi").glob("*.json")} == {p.spec_path(uid).name for uid in prepared}
    # No device held by a prepared claim is offered elsewhere: another path withholds all of them, and the
    # driver refuses it to any other claim.
    held = held_devices(prepared)
    for uid, claim in prepared.items():
        for d in claim.devices:
            assert d.id in held
            other = api.add_claim(f"other-{uid}", [result(d.device)])
            error = (await p.prepare([other]))[other.uid].error or ""
            assert "already prepared" in error or "would overlap" in error, error
            del api.claims[("default", f"other-{uid}")]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(operation, min_size=1, max_size=10))
def test_any_interleaving_with_crashes_ends_with_hardware_equal_to_the_live_prepared_claims(
    operations: list[tuple[str, int, int | None]],
) -> None:
    root = Path(tempfile.mkdtemp(prefix="kx-rec-", dir="/tmp"))
    try:
        asyncio.run(_run(root, operations))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_partitions_of_a_claim_unprepared_while_no_backend_can_destroy_them_are_destroyed_later(
    tmp_path: Path,
) -> None:
    """The resource left the config with a partitioned claim prepared: the draining driver unprepares it (the pod
    must not hang) and keeps its partition's handle; once the resource is served through DRA again, the partition
    is destroyed. A write-ahead record is kept likewise."""
    from kxpu.dra.leftover import NoDevices

    api = FakeDraApi()
    p = preparer(tmp_path, api)
    claim = api.add_claim("c", [result("sg-0-3g-0")])
    assert (await p.prepare([claim]))[claim.uid].error is None
    p.checkpoint.making["killed"] = Making("default/k", ("sg-0-1g-6",))
    p.checkpoint.save()
    SimulatedBackend(simulated(tmp_path)).realize([index_by_id(p.backend.discover())["sg-0-1g-6"]])  # killed
    assert hardware(tmp_path) == {"sg-0-3g-0", "sg-0-1g-6"}

    draining = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    draining.load()
    d = Preparer(DRIVER, NODE, NoDevices(), {}, draining, tmp_path / "cdi", api)
    d.draining = True
    await start(d)
    assert (await d.unprepare([claim]))[claim.uid] is None
    assert not d.spec_path(claim.uid).exists() and draining.claims == {}
    assert draining.unreleased == [{"id": "sg-0-3g-0"}] and set(draining.making) == {"killed"}

    back = preparer(tmp_path, api)
    assert sorted(await back.reconcile()) == ["sg-0-1g-6", "sg-0-3g-0"]
    assert hardware(tmp_path) == set()
    assert back.checkpoint.unreleased == [] and back.checkpoint.making == {}


async def test_a_reclaim_that_fails_at_start_is_retried_when_a_prepare_overlaps(tmp_path: Path) -> None:
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    SimulatedBackend(simulated(tmp_path)).realize([index_by_id(p.backend.discover())["sg-0-3g-0"]])
    p.checkpoint.making["killed"] = Making("default/k", ("sg-0-3g-0",))
    p.checkpoint.save()

    class Flaky(SimulatedBackend):
        failures = 1

        def reclaim(self, devices: Sequence[Device]) -> list[str]:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("the driver is busy")
            return super().reclaim(devices)

    q = preparer(tmp_path, api, Flaky(simulated(tmp_path)))
    assert await q.reconcile() == []
    assert set(q.checkpoint.making) == {"killed"}  # kept: retried later
    claim = api.add_claim("c", [result("sg-0")])
    assert (await q.prepare([claim]))[claim.uid].error is None
    assert hardware(tmp_path) == {"sg-0"} and q.checkpoint.making == {}


async def test_a_prepare_whose_partition_record_cannot_be_written_makes_nothing(tmp_path: Path) -> None:
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    (tmp_path / "checkpoint.json").mkdir()  # the checkpoint cannot be replaced
    claim = api.add_claim("c", [result("sg-0-3g-0")])
    error = (await p.prepare([claim]))[claim.uid].error or ""
    assert "cannot write the DRA checkpoint" in error and "\n" not in error
    assert hardware(tmp_path) == set() and p.checkpoint.making == {}


async def test_a_partition_made_outside_kxpu_at_the_claims_own_placement_stays(tmp_path: Path) -> None:
    api = FakeDraApi()
    p = preparer(tmp_path, api)
    SimulatedBackend(simulated(tmp_path)).realize([index_by_id(p.backend.discover())["sg-0-3g-3"]])
    claim = api.add_claim("c", [result("sg-0-3g-3")])
    error = (await p.prepare([claim]))[claim.uid].error or ""
    assert "['sg-0-3g-3'] overlaps it" in error
    assert hardware(tmp_path) == {"sg-0-3g-3"} and p.checkpoint.making == {}
    reloaded = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    reloaded.load()
    assert reloaded.making == {}  # nor reclaimed by the next start


async def test_an_unprepare_interrupted_after_destroying_the_partitions_is_finished_at_start(
    tmp_path: Path,
) -> None:
    """Killed between destroying a claim's partitions and dropping its entry (found by the property test): at
    start the claim is not left recorded with partitions that no longer exist; its unprepare is finished."""
    api = FakeDraApi()
    world = World(tmp_path)
    p = crashing_preparer(tmp_path, api, world)
    claim = api.add_claim("c", [result("sg-0-3g-0")])
    assert (await p.prepare([claim]))[claim.uid].error is None
    # Steps of the unprepare: save (marked releasing) 1-2, release 3-4, save 5-6: killed after the release.
    world.steps, world.crash_at = 0, 5
    with pytest.raises(Crash):
        await p.unprepare([claim])
    world.restore()
    assert hardware(tmp_path) == set()
    q = preparer(tmp_path, api)
    assert claim.uid in q.checkpoint.claims and q.checkpoint.releasing == [claim.uid]
    assert await q.reconcile() == ["default/c (unprepared)"]
    assert q.checkpoint.claims == {} and not q.spec_path(claim.uid).exists()

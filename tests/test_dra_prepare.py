"""NodePrepareResources / NodeUnprepareResources logic over a real backend, checkpoint and CDI files."""

from __future__ import annotations

import gc
import json
import os
import weakref
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.cdi.spec import validate_spec
from kxpu.dra import checkpoint as checkpoint_module
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.names import device_name
from kxpu.dra.prepare import ClaimRef, Preparer
from kxpu.model import Device, Health, index_by_id
from kxpu.testing.dra import FakeDraApi

DRIVER = "npu.example.com"
NODE = "node-a"


def result(
    device: str, request: str = "npu", pool: str = NODE, driver: str = DRIVER, **extra: Any
) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": pool, "device": device, **extra}


class Rig:
    def __init__(self, root: Path, count: int = 4) -> None:
        self.root = root
        self.backend = SimulatedBackend(
            SimulatedConfig(count=count, model="sim", env={"NPU_VISIBLE_DEVICES": "{ids}"})
        )
        self.devices = index_by_id(self.backend.discover())
        self.api = FakeDraApi()
        self.cdi = root / "cdi"
        self.preparer = self.make()

    def make(self) -> Preparer:
        checkpoint = Checkpoint(self.root / "plugins" / DRIVER / "checkpoint.json", DRIVER)
        checkpoint.load()
        return Preparer(DRIVER, NODE, self.backend, self.devices, checkpoint, self.cdi, self.api)

    def spec(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.preparer.spec_path(uid).read_text())
        return data


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


async def test_prepare_writes_one_cdi_device_per_request(rig: Rig) -> None:
    claim = rig.api.add_claim("two", [result("sim-0"), result("sim-1"), result("sim-2", request="other")])
    answer = (await rig.preparer.prepare([claim]))[claim.uid]
    assert answer.error is None
    assert [(d.device, d.requests) for d in answer.devices] == [
        ("sim-0", ("npu",)),
        ("sim-1", ("npu",)),
        ("sim-2", ("other",)),
    ]
    kind = f"{DRIVER}/claim"
    # Each request's edits once, on its first device: the kubelet hands a container the CDI IDs of all the
    # devices of the requests it uses.
    assert [d.cdi_device_ids for d in answer.devices] == [
        (f"{kind}={claim.uid}-npu",),
        (),
        (f"{kind}={claim.uid}-other",),
    ]
    spec = rig.spec(claim.uid)
    assert validate_spec(spec) == []
    env = {d["name"]: d["containerEdits"]["env"] for d in spec["devices"]}
    assert env == {
        f"{claim.uid}-npu": ["NPU_VISIBLE_DEVICES=sim-0,sim-1"],
        f"{claim.uid}-other": ["NPU_VISIBLE_DEVICES=sim-2"],
    }


async def test_prepare_is_idempotent_and_survives_a_restart(rig: Rig) -> None:
    claim = rig.api.add_claim("c", [result("sim-3")])
    first = await rig.preparer.prepare([claim])
    del rig.api.claims[("default", "c")]  # a restarted driver must not need the claim again
    again = await rig.make().prepare([claim])
    assert again[claim.uid] == first[claim.uid]
    # Unprepare by a new process: CDI spec and checkpoint entry go; a second unprepare is fine too.
    fresh = rig.make()
    assert await fresh.unprepare([claim]) == {claim.uid: None}
    assert not rig.preparer.spec_path(claim.uid).exists()
    assert rig.make().checkpoint.claims == {}
    assert await fresh.unprepare([claim]) == {claim.uid: None}


async def test_refusals_name_the_problem_and_post_an_event(rig: Rig) -> None:
    cases = {
        "elsewhere": ([result("sim-0", pool="node-b")], "not this node's (node-a)"),
        "unknown": ([result("sim-9")], "device sim-9 is not one of driver npu.example.com's devices"),
        "foreign": (
            [result("sim-0", driver="gpu.nvidia.com")],
            "allocates no device of driver npu.example.com",
        ),
    }
    refs = {name: rig.api.add_claim(name, results) for name, (results, _) in cases.items()}
    rig.cdi.mkdir(parents=True)  # as on a node: the directory is there, and must stay empty
    gone = ClaimRef("default", "uid-gone", "gone")
    answers = await rig.preparer.prepare([*refs.values(), gone])
    for name, (_, message) in cases.items():
        assert message in (answers[refs[name].uid].error or "")
    assert "does not exist" in (answers["uid-gone"].error or "")
    assert {reason for _, reason, _ in rig.api.events} == {"KxpuPrepareFailed"}
    assert len(rig.api.events) == 4
    assert rig.preparer.checkpoint.claims == {}
    assert list(rig.cdi.iterdir()) == [], "a refused claim left a CDI spec behind"


async def test_a_recreated_claim_is_refused(rig: Rig) -> None:
    claim = rig.api.add_claim("c", [result("sim-0")])
    stale = ClaimRef(claim.namespace, "another-uid", claim.name)
    answer = (await rig.preparer.prepare([stale]))["another-uid"]
    assert "deleted and created again" in (answer.error or "")


async def test_a_device_is_never_prepared_for_two_claims(rig: Rig) -> None:
    a = rig.api.add_claim("a", [result("sim-1")])
    b = rig.api.add_claim("b", [result("sim-1")])
    answers = await rig.preparer.prepare([a, b])
    assert answers[a.uid].error is None
    assert "already prepared for ResourceClaim default/a" in (answers[b.uid].error or "")
    await rig.preparer.unprepare([a])
    assert (await rig.preparer.prepare([b]))[b.uid].error is None


async def test_unhealthy_devices_are_refused_until_they_recover(rig: Rig) -> None:
    sick = {**rig.devices, "sim-2": rig.devices["sim-2"].with_health(Health.UNHEALTHY, "state-file")}
    rig.preparer.update_devices(sick)
    claim = rig.api.add_claim("c", [result("sim-2")])
    assert "unhealthy (state-file)" in ((await rig.preparer.prepare([claim]))[claim.uid].error or "")
    rig.preparer.update_devices(rig.devices)
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None


async def test_opaque_config_is_validated_and_applied(rig: Rig) -> None:
    def opaque(params: Any, requests: list[str] | None = None, source: str = "FromClaim") -> dict[str, Any]:
        entry: dict[str, Any] = {"source": source, "opaque": {"driver": DRIVER, "parameters": params}}
        if requests:
            entry["requests"] = requests
        return entry

    good = {"apiVersion": "kxpu.io/v1alpha1", "kind": "DeviceConfig", "env": {"NPU_LOG": "debug"}}
    override = {
        "apiVersion": "kxpu.io/v1alpha1",
        "kind": "DeviceConfig",
        "env": {"NPU_LOG": "info", "B": "2"},
    }
    ok = rig.api.add_claim(
        "ok",
        [result("sim-0")],
        config=[
            opaque(good, source="FromClass"),
            opaque(override, ["npu"]),
            {"opaque": {"driver": "other.x", "parameters": 1}},
        ],
    )
    answers = await rig.preparer.prepare([ok])
    assert answers[ok.uid].error is None
    env = rig.spec(ok.uid)["devices"][0]["containerEdits"]["env"]
    assert sorted(env) == ["B=2", "NPU_LOG=info", "NPU_VISIBLE_DEVICES=sim-0"]
    bad_cases = {
        "typo": ({**good, "evn": {}}, "evn: Extra inputs are not permitted"),
        "kind": ({**good, "kind": "GpuConfig"}, "kind: Input should be 'DeviceConfig'"),
        "bare": ({"env": {}}, "parameters need apiVersion and kind"),
        "name": ({**good, "env": {"A=B": "x"}}, "env name 'A=B'"),
        "clash": (
            {**good, "env": {"NPU_VISIBLE_DEVICES": "sim-3"}},
            "sets NPU_VISIBLE_DEVICES, which driver",
        ),
    }
    refs = {k: rig.api.add_claim(k, [result("sim-1")], config=[opaque(p)]) for k, (p, _) in bad_cases.items()}
    answers = await rig.preparer.prepare(list(refs.values()))
    for key, (_, message) in bad_cases.items():
        assert message in (answers[refs[key].uid].error or ""), (key, answers[refs[key].uid].error)


async def test_orphan_specs_are_removed_but_not_after_a_corrupt_checkpoint(rig: Rig) -> None:
    rig.cdi.mkdir(parents=True)
    orphan = rig.cdi / f"kxpu-dra-{DRIVER}-dead-beef.json"
    mine = json.dumps({"cdiVersion": "0.6.0", "kind": f"{DRIVER}/claim", "devices": []})
    orphan.write_text(mine)
    someone_else = rig.cdi / "vendor.json"
    someone_else.write_text("{}")
    # Driver npu.example.com-x's spec starts with npu.example.com's prefix: not npu.example.com's to remove.
    longer = rig.cdi / f"kxpu-dra-{DRIVER}-x-dead-beef.json"
    longer.write_text(json.dumps({"cdiVersion": "0.6.0", "kind": f"{DRIVER}-x/claim", "devices": []}))
    assert rig.make().remove_orphan_specs() == [orphan]
    assert someone_else.exists() and longer.exists()
    orphan.write_text(mine)
    checkpoint = rig.root / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.write_text("{not json")
    fresh = rig.make()
    assert fresh.checkpoint.set_aside and fresh.checkpoint.claims == {}
    assert fresh.remove_orphan_specs() == [] and orphan.exists()
    assert list(checkpoint.parent.glob("checkpoint.json.corrupt-*"))


async def test_many_devices_in_one_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path, count=64)
    claim = rig.api.add_claim("big", [result(device_name(d.id)) for d in rig.devices.values()])
    answer = (await rig.preparer.prepare([claim]))[claim.uid]
    assert answer.error is None and len(answer.devices) == 64
    env = rig.spec(claim.uid)["devices"][0]["containerEdits"]["env"]
    assert env == ["NPU_VISIBLE_DEVICES=" + ",".join(f"sim-{i}" for i in range(64))]


async def test_devices_are_looked_up_by_their_dra_name(tmp_path: Path) -> None:
    """A kxpu ID that is not a DNS label is published under its DRA name; the scheduler allocates that name,
    and prepare finds the device by it (and not by the raw ID)."""
    rig = Rig(tmp_path)
    odd = Device(id="Sim_0:x")
    rig.preparer.update_devices({odd.id: odd})
    assert device_name(odd.id) != odd.id
    by_name = rig.api.add_claim("by-name", [result(device_name(odd.id))])
    answer = (await rig.preparer.prepare([by_name]))[by_name.uid]
    assert answer.error is None and [(d.device, d.id) for d in answer.devices] == [
        (device_name(odd.id), odd.id)
    ]
    by_id = rig.api.add_claim("by-id", [result(odd.id)])
    assert "is not one of driver" in ((await rig.preparer.prepare([by_id]))[by_id.uid].error or "")


async def test_admin_access_takes_nothing_from_the_devices_users(rig: Rig) -> None:
    """A monitoring claim with adminAccess uses a device beside its users: it neither blocks them nor is
    blocked, across a restart too (the checkpoint records it)."""
    admin = rig.api.add_claim("monitor", [result("sim-0", adminAccess=True)])
    assert (await rig.preparer.prepare([admin]))[admin.uid].error is None
    saved = json.loads((rig.root / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert saved["claims"][admin.uid]["devices"][0]["adminAccess"] is True
    user = rig.api.add_claim("user", [result("sim-0")])
    assert (await rig.make().prepare([user]))[user.uid].error is None
    second = rig.api.add_claim("second", [result("sim-0")])
    assert "already prepared for ResourceClaim default/user" in (
        (await rig.make().prepare([second]))[second.uid].error or ""
    )


async def test_unexpected_errors_are_one_claims_one_line_answer(rig: Rig) -> None:
    """The API server's refusal (403, 429, 5xx), a broken connection, a vendor library's surprise: the claim it
    hit gets a one-line error and an event; the call's other claims are prepared."""
    import httpx2 as httpx

    broken = rig.api.add_claim("broken", [result("sim-0")])
    fine = rig.api.add_claim("fine", [result("sim-1")])
    rig.api.fail_next = httpx.ConnectError("connection reset\nby peer")
    answers = await rig.preparer.prepare([broken, fine])
    error = answers[broken.uid].error or ""
    assert (
        error == "ResourceClaim default/broken: cannot prepare it: ConnectError: connection reset\\nby peer"
    )
    assert answers[fine.uid].error is None
    assert [(ref.name, reason) for ref, reason, _ in rig.api.events] == [("broken", "KxpuPrepareFailed")]

    class Vendor(SimulatedBackend):
        def allocate(self, devices: Any) -> Any:
            raise KeyError("handle")

    rig.backend = Vendor(rig.backend.config)
    surprise = rig.api.add_claim("surprise", [result("sim-2")])
    error = (await rig.make().prepare([surprise]))[surprise.uid].error or ""
    assert error == "ResourceClaim default/surprise: cannot prepare it: KeyError: 'handle'"


async def test_the_checkpoint_reaches_the_disk_before_prepare_answers(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power loss right after the kubelet got its answer must not lose the claim: the checkpoint's content
    and its rename are flushed (fsync or fdatasync of the file before its rename, fsync of its directory)."""

    synced: list[str] = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def flush(fd: int, real: Any = real) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, name, flush)
    claim = rig.api.add_claim("c", [result("sim-0")])
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    directory = str(rig.root / "plugins" / DRIVER)
    assert any(p.startswith(directory + "/.checkpoint.json.") for p in synced), synced
    assert directory in synced


def _checkpoint_fsyncs(monkeypatch: pytest.MonkeyPatch, rig: Rig) -> list[str]:
    """The checkpoint's durable writes, as the kernel sees them (a flush of the file renamed into place each)."""

    synced: list[str] = []
    prefix = str(rig.root / "plugins" / DRIVER / ".checkpoint.json.")
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def flush(fd: int, real: Any = real) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.startswith(prefix):
                synced.append(path)
            real(fd)

        monkeypatch.setattr(os, name, flush)
    return synced


async def test_one_durable_checkpoint_write_per_call_however_many_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's claims come in one call; each flush costs the disk's latency, so the call's claims are recorded
    in one write (before any is answered), and unprepared in one."""
    rig = Rig(tmp_path, count=8)
    synced = _checkpoint_fsyncs(monkeypatch, rig)
    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(6)]
    answers = await rig.preparer.prepare(claims)
    assert [answers[c.uid].error for c in claims] == [None] * 6
    assert len(synced) == 1
    on_disk = Checkpoint(rig.root / "plugins" / DRIVER / "checkpoint.json", DRIVER)
    on_disk.load()
    assert set(on_disk.claims) == {c.uid for c in claims}
    assert await rig.preparer.prepare(claims) == answers and len(synced) == 1  # asked again: nothing written
    assert await rig.preparer.unprepare(claims) == dict.fromkeys((c.uid for c in claims), None)
    assert len(synced) == 2


async def test_a_checkpoint_that_cannot_be_written_fails_every_claim_of_the_call(rig: Rig) -> None:
    """The call's claims share one write: if it fails, none of them is prepared, each gets the one-line error
    and an event, and nothing they wrote stays (their CDI specs); the next call, once the disk is back, prepares
    them."""
    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(3)]
    checkpoint = rig.root / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.mkdir(parents=True)  # the checkpoint cannot be replaced
    answers = await rig.preparer.prepare(claims)
    for claim in claims:
        error = answers[claim.uid].error or ""
        assert error.startswith(f"cannot write the DRA checkpoint {checkpoint}") and "\n" not in error, error
    assert sorted(ref.name for ref, _, _ in rig.api.events) == ["c0", "c1", "c2"]
    assert rig.preparer.checkpoint.claims == {}
    assert list(rig.cdi.glob("*.json")) == []
    checkpoint.rmdir()
    answers = await rig.preparer.prepare(claims)
    assert [answers[c.uid].error for c in claims] == [None, None, None]
    assert len(list(rig.cdi.glob("*.json"))) == 3


async def test_a_call_cancelled_midway_leaves_none_of_its_claims_prepared(tmp_path: Path) -> None:
    """The kubelet's deadline cancels the call after one claim was recorded in memory (its write is the
    call's, still to come): that claim is undone too, so nothing is prepared that the disk does not hold."""
    import asyncio

    rig = Rig(tmp_path)
    waiting = asyncio.Event()

    class Handshake(SimulatedBackend):
        async def allocate_async(self, devices: Any) -> Any:
            if devices[0].id == "sim-1":
                waiting.set()
                await asyncio.Event().wait()  # never answers
            return self.allocate(devices)

        async def preferred_allocation_async(self, available: Any, must: Any, size: int) -> list[str]:
            return []

    rig.backend = Handshake(rig.backend.config)
    preparer = rig.make()
    first, stuck = (rig.api.add_claim(n, [result(f"sim-{i}")]) for i, n in enumerate(("first", "stuck")))
    call = asyncio.ensure_future(preparer.prepare([first, stuck]))
    await asyncio.wait_for(waiting.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert preparer.checkpoint.claims == {}
    assert list(rig.cdi.glob("*.json")) == []
    answers = await rig.make().prepare([first])
    assert answers[first.uid].error is None


async def test_a_call_needs_no_worker_thread_unless_another_process_wrote_the_checkpoint(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handing work to a thread costs more than a prepare's own work on a busy node: the checkpoint lock looks at
    the file with a stat on the loop and reads it in a thread only when another process of the driver replaced
    it (a rolling update's other pod)."""
    import asyncio

    hops: list[str] = []
    real = asyncio.to_thread

    async def to_thread(func: Any, *args: Any) -> Any:
        hops.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args)

    monkeypatch.setattr("kxpu.dra.checkpoint.asyncio.to_thread", to_thread)
    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(2)]
    assert (await rig.preparer.prepare(claims[:1]))[claims[0].uid].error is None
    assert (await rig.preparer.unprepare(claims[:1]))[claims[0].uid] is None
    assert hops == []
    other = rig.make()  # another process of the driver prepares a claim
    assert (await other.prepare(claims[1:]))[claims[1].uid].error is None
    assert (await rig.preparer.prepare(claims[1:]))[claims[1].uid].error is None
    assert hops == ["read_changed"] and set(rig.preparer.checkpoint.claims) == {claims[1].uid}


async def test_the_checkpoint_file_is_the_whole_document_after_any_sequence_of_calls(tmp_path: Path) -> None:
    """Each save re-encodes only the claims it has not written before: the file must still be exactly the whole
    document (the format earlier and later versions read), whatever was prepared, re-prepared or unprepared."""
    from kxpu.dra.checkpoint import VERSION, _claim_to_json

    rig = Rig(tmp_path, count=8)
    path = rig.root / "plugins" / DRIVER / "checkpoint.json"
    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(6)]

    def expected(preparer: Preparer) -> str:
        doc = {
            "version": VERSION,
            "driver": DRIVER,
            "claims": {u: _claim_to_json(c) for u, c in sorted(preparer.checkpoint.claims.items())},
        }
        return json.dumps(doc, separators=(",", ":")) + "\n"

    await rig.preparer.prepare(claims[:2])
    await rig.preparer.prepare(claims[2:5])
    assert path.read_text() == expected(rig.preparer)
    await rig.preparer.unprepare([claims[1], claims[3]])
    assert path.read_text() == expected(rig.preparer)
    rig.preparer.spec_path(claims[0].uid).unlink()  # prepared again from the start: a new record
    await rig.preparer.prepare([claims[0], claims[5]])
    assert path.read_text() == expected(rig.preparer)
    fresh = rig.make()  # another process: loads it, then writes its own after a change
    assert fresh.checkpoint.claims == rig.preparer.checkpoint.claims
    await fresh.unprepare([claims[2]])
    assert path.read_text() == expected(fresh) and claims[2].uid not in path.read_text()
    assert set(json.loads(path.read_text())["claims"]) == {claims[n].uid for n in (0, 4, 5)}


async def test_another_process_writing_twice_within_one_clock_tick_is_still_seen(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writes by the other process of a rolling update, of the same size, within one tick of the file clock
    (coarse: milliseconds) and onto a reused inode number, would leave inode, time and size as this process last
    saw them. The count of writes in the lock file tells it: it reloads, and never prepares from (or writes back
    over) what it held before. The file is made to look unchanged by its identity here, as such a reuse would."""
    path = rig.root / "plugins" / DRIVER / "checkpoint.json"
    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(2)]
    assert (await rig.preparer.prepare(claims[:1]))[claims[0].uid].error is None
    seen = checkpoint_module._identity(path)
    other = rig.make()  # prepares c1, then unprepares c0: two writes, the file back to one claim's size
    assert (await other.prepare(claims[1:]))[claims[1].uid].error is None
    assert (await other.unprepare(claims[:1]))[claims[0].uid] is None
    real = checkpoint_module._identity
    monkeypatch.setattr(checkpoint_module, "_identity", lambda p: seen if p == path else real(p))
    again = rig.api.add_claim("d", [result("sim-1")])
    error = (await rig.preparer.prepare([again]))[again.uid].error or ""
    assert f"already prepared for ResourceClaim default/{claims[1].name}" in error, error
    assert set(json.loads(path.read_text())["claims"]) == {claims[1].uid}


async def test_the_prepared_claims_on_metrics_follow_the_checkpoint(rig: Rig) -> None:
    """``kxpu_dra_claims_prepared`` is what the checkpoint holds when /metrics is asked: this process's prepares
    and unprepares, and what another process of the driver wrote, once this one has reloaded it."""
    from prometheus_client import REGISTRY

    def prepared() -> float | None:
        return REGISTRY.get_sample_value("kxpu_dra_claims_prepared", {"driver": DRIVER})

    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(3)]
    assert prepared() == 0
    assert all(a.error is None for a in (await rig.preparer.prepare(claims[:2])).values())
    assert prepared() == 2
    other = Checkpoint(rig.preparer.checkpoint.path, DRIVER)  # another process of the driver
    other.load()
    async with other.exclusive():
        other.claims.pop(claims[0].uid)
        other.save()
    assert (await rig.preparer.unprepare(claims[2:]))[claims[2].uid] is None  # reloads what the other wrote
    assert prepared() == 1
    assert (await rig.preparer.unprepare(claims[1:2]))[claims[1].uid] is None
    assert prepared() == 0


async def test_a_stopped_preparer_keeps_its_count_on_metrics_and_is_not_kept_in_memory(rig: Rig) -> None:
    """A driver stopped by a reload that removed it: /metrics keeps the count still prepared on the node, and its
    preparer (checkpoint, caches) is freed; a preparer of the same driver started meanwhile is not affected."""
    from prometheus_client import REGISTRY

    def prepared() -> float | None:
        return REGISTRY.get_sample_value("kxpu_dra_claims_prepared", {"driver": DRIVER})

    claims = [rig.api.add_claim(f"c{n}", [result(f"sim-{n}")]) for n in range(3)]
    assert all(a.error is None for a in (await rig.preparer.prepare(claims[:2])).values())
    old = rig.preparer
    newer = rig.preparer = rig.make()  # the driver started again before the old one's stop finished
    old.stop_reporting()
    assert (await newer.prepare(claims[2:]))[claims[2].uid].error is None
    assert prepared() == 3  # still the newer preparer's checkpoint, read live
    newer.stop_reporting()
    assert (await newer.unprepare(claims[:1]))[claims[0].uid] is None
    assert prepared() == 3  # the stopped driver's last count
    gone = weakref.ref(newer)
    del old, newer, rig.preparer
    gc.collect()
    assert gone() is None

"""ResourceClaim.status.devices (KEP-4817): written after prepare, removed at unprepare, off the critical path and
best effort. The fake API server makes the checks the real one makes of each entry (kxpu.testing.dra); the
daemon-level test drives it all over the real DRA sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.dra import claim_status
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.claim_status import ClaimStatusWriter, StatusWriteError
from kxpu.dra.config import DraSharesConfig
from kxpu.dra.prepare import Preparer
from kxpu.model import index_by_id
from kxpu.testing.dra import FakeDraApi
from tests.test_dra_daemon import Rig as DaemonRig
from tests.test_dra_daemon import eventually

DRIVER = "npu.example.com"
NODE = "node-a"


def result(device: str, request: str = "npu", driver: str = DRIVER, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": driver, "pool": NODE, "device": device, **extra}


class Rig:
    def __init__(self, root: Path, shares: DraSharesConfig | None = None) -> None:
        self.backend = SimulatedBackend(
            SimulatedConfig(count=4, model="sim", memory_mib=16384, env={"NPU_VISIBLE_DEVICES": "{ids}"})
        )
        self.devices = index_by_id(self.backend.discover())
        self.api = FakeDraApi()
        checkpoint = Checkpoint(root / "plugins" / DRIVER / "checkpoint.json", DRIVER)
        checkpoint.load()
        self.preparer = Preparer(
            DRIVER, NODE, self.backend, self.devices, checkpoint, root / "cdi", self.api, shares
        )
        self.writer = ClaimStatusWriter(DRIVER, self.api, settle_s=0, quiet_s=0)
        self.preparer.status = self.writer

    def status(self, name: str) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.api.claims[("default", name)]["status"].get("devices", [])
        return entries


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path)
    task = asyncio.create_task(rig.writer.run())
    yield rig
    task.cancel()


async def test_prepare_reports_each_device_and_unprepare_removes_only_its_entries(rig: Rig) -> None:
    claim = rig.api.add_claim(
        "c", [result("sim-1"), result("sim-2"), result("nic-0", request="nic", driver="nic.example.com")]
    )
    # Another driver's entry, written by its own field manager: never touched by this one.
    theirs = {"driver": "nic.example.com", "pool": NODE, "device": "nic-0", "data": {"ip": "10.0.0.9"}}
    rig.api.claims[("default", "c")]["status"]["devices"] = [theirs]
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    await asyncio.wait_for(rig.writer.drained(), 5)
    ours = [d for d in rig.status("c") if d["driver"] == DRIVER]
    assert [(d["pool"], d["device"]) for d in ours] == [(NODE, "sim-1"), (NODE, "sim-2")]
    sim1 = rig.devices["sim-1"]
    assert ours[0]["data"] == {
        "id": "sim-1",
        "uuid": sim1.uuid,
        "model": "sim",
        "memoryMiB": 16384,
        "index": 1,
        "health": "Healthy",
    }
    ready, healthy = ours[0]["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    assert (healthy["type"], healthy["status"]) == ("Healthy", "True")
    assert theirs in rig.status("c")

    assert await rig.preparer.unprepare([claim]) == {claim.uid: None}
    await asyncio.wait_for(rig.writer.drained(), 5)
    assert rig.status("c") == [theirs]
    assert rig.api.status_writes == 2  # one apply at prepare, one at unprepare


async def test_a_claim_unprepared_before_its_entries_were_sent_costs_no_call(tmp_path: Path) -> None:
    rig = Rig(tmp_path)  # the writer is not running yet: the entries wait in its queue
    claim = rig.api.add_claim("c", [result("sim-0")])
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    assert await rig.preparer.unprepare([claim]) == {claim.uid: None}
    task = asyncio.create_task(rig.writer.run())
    await asyncio.wait_for(rig.writer.drained(), 5)
    task.cancel()
    assert rig.api.status_writes == 0 and rig.status("c") == []


async def test_entries_wait_a_moment_and_for_the_kubelet_to_pause(tmp_path: Path) -> None:
    """A pod gone within the settle time costs no call; while the kubelet keeps calling, writes wait (at most
    max_defer_s past their time), then go."""
    rig = Rig(tmp_path)
    rig.writer = rig.preparer.status = ClaimStatusWriter(
        DRIVER, rig.api, settle_s=0.3, quiet_s=0.2, max_defer_s=60
    )
    task = asyncio.create_task(rig.writer.run())
    brief = rig.api.add_claim("brief", [result("sim-0")])
    assert (await rig.preparer.prepare([brief]))[brief.uid].error is None
    assert await rig.preparer.unprepare([brief]) == {brief.uid: None}
    claim = rig.api.add_claim("c", [result("sim-1")])
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    loop = asyncio.get_running_loop()
    until = loop.time() + 0.8
    while loop.time() < until:  # the kubelet busy with other pods, well past the settle time
        rig.writer.busy()
        await asyncio.sleep(0.02)
    assert rig.api.status_writes == 0
    await asyncio.wait_for(rig.writer.drained(), 5)
    task.cancel()
    assert rig.api.status_writes == 1 and [d["device"] for d in rig.status("c")] == ["sim-1"]
    assert rig.status("brief") == []

    capped = ClaimStatusWriter(DRIVER, rig.api, settle_s=0, quiet_s=10, max_defer_s=0.2)
    task = asyncio.create_task(capped.run())
    capped.busy()
    capped.report(claim, [dict(rig.status("c")[0])])
    await asyncio.wait_for(capped.drained(), 5)  # never later than max_defer_s, however busy
    task.cancel()
    assert rig.api.status_writes == 2


async def test_a_device_turning_unhealthy_is_reported_in_the_claims_holding_it(rig: Rig) -> None:
    from kxpu.model import Health

    claim = rig.api.add_claim("c", [result("sim-1")])
    other = rig.api.add_claim("d", [result("sim-2")])
    assert all(a.error is None for a in (await rig.preparer.prepare([claim, other])).values())
    await asyncio.wait_for(rig.writer.drained(), 5)
    writes = rig.api.status_writes
    sick = {**rig.devices, "sim-1": rig.devices["sim-1"].with_health(Health.UNHEALTHY, "xid 79")}
    rig.preparer.update_devices(sick)
    await asyncio.wait_for(rig.writer.drained(), 5)
    (entry,) = rig.status("c")
    healthy = {c["type"]: c for c in entry["conditions"]}["Healthy"]
    assert (healthy["status"], healthy["reason"], healthy["message"]) == (
        "False",
        "DeviceUnhealthy",
        "xid 79",
    )
    assert entry["data"]["health"] == "Unhealthy"
    assert rig.api.status_writes == writes + 1  # only the claim holding the device
    rig.preparer.update_devices(sick)  # the same snapshot again: nothing to say
    await asyncio.wait_for(rig.writer.drained(), 5)
    assert rig.api.status_writes == writes + 1


async def test_a_hanging_api_server_never_holds_up_prepare(rig: Rig) -> None:
    never = asyncio.Event()

    async def hang(*args: Any) -> bool:
        await never.wait()
        return True

    rig.api.apply_claim_status = hang  # type: ignore[method-assign,assignment]
    claims = [rig.api.add_claim(f"c{i}", [result(f"sim-{i}")]) for i in range(4)]
    answers = await asyncio.wait_for(rig.preparer.prepare(claims), 2)
    assert all(a.error is None for a in answers.values())
    assert await asyncio.wait_for(rig.preparer.unprepare(claims), 2) == {c.uid: None for c in claims}


async def test_a_refused_write_is_one_warning_and_the_claim_stays_prepared(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(claim_status, "RETRY_DELAYS", (0.01, 0.01))
    rig.api.status_failures = [
        StatusWriteError('resourceclaims "c" is forbidden: cannot associated-node:patch', transient=False)
    ]
    claim = rig.api.add_claim("c", [result("sim-0")])
    with capture_logs() as logs:
        assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
        await asyncio.wait_for(rig.writer.drained(), 5)
    assert claim.uid in rig.preparer.checkpoint.claims
    assert rig.status("c") == [] and rig.api.status_writes == 1  # a refusal is not retried
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "cannot associated-node:patch" in warnings[0]["error"], warnings
    assert warnings[0]["claim"] == "default/c" and "\n" not in warnings[0]["error"]

    # A transient failure (the API server restarting) is tried again, and the entries arrive.
    rig.api.status_failures = [StatusWriteError("503: unavailable", transient=True)]
    other = rig.api.add_claim("d", [result("sim-1")])
    assert (await rig.preparer.prepare([other]))[other.uid].error is None
    await asyncio.wait_for(rig.writer.drained(), 5)
    assert [d["device"] for d in rig.status("d")] == ["sim-1"]


async def test_a_share_reports_its_share_id_and_grant(tmp_path: Path) -> None:
    rig = Rig(tmp_path, shares=DraSharesConfig())
    task = asyncio.create_task(rig.writer.run())
    share = "a1b2c3d4-0000-4000-8000-000000000001"
    claim = rig.api.add_claim(
        "s", [result("sim-3", shareID=share, consumedCapacity={"memory": "4Gi", "cores": "25"})]
    )
    assert (await rig.preparer.prepare([claim]))[claim.uid].error is None
    await asyncio.wait_for(rig.writer.drained(), 5)
    task.cancel()
    (entry,) = rig.status("s")
    assert entry["shareID"] == share
    assert entry["data"]["granted"] == {"memoryMiB": 4096, "cores": 25}


class RecordingApi(FakeDraApi):
    """The in-memory API server, recording the status writes the daemon sends."""

    def __init__(self, nodes: Mapping[str, str]) -> None:
        super().__init__(nodes)
        self.sent: list[Sequence[Mapping[str, Any]]] = []

    async def apply_claim_status(
        self, namespace: str, name: str, uid: str, devices: Sequence[Mapping[str, Any]]
    ) -> bool:
        self.sent.append(devices)
        return await super().apply_claim_status(namespace, name, uid, devices)


@pytest.fixture
async def daemon_rig() -> AsyncIterator[DaemonRig]:
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    rig = DaemonRig(root)
    rig.api = RecordingApi({NODE: "uid-a"})
    rig.kubelet.api = rig.api
    await rig.kubelet.start()
    yield rig
    await rig.stop()
    await rig.kubelet.stop()
    shutil.rmtree(root, ignore_errors=True)


async def test_the_daemon_reports_prepared_claims_in_their_status(daemon_rig: DaemonRig) -> None:
    rig = daemon_rig
    await rig.start()
    await rig.kubelet.wait_registered(DRIVER)
    await eventually(lambda: len(rig.pool()) == 4)
    claim = rig.api.add_claim("c", [result("sim-1")])
    assert (await rig.kubelet.prepare(DRIVER, claim)).claims[claim.uid].error == ""

    def entries() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = rig.api.claims[("default", "c")]["status"].get("devices", [])
        return found

    await eventually(lambda: [d["device"] for d in entries()] == ["sim-1"])
    assert json.dumps(entries()[0]["data"]).count("sim-1") == 1
    assert (await rig.kubelet.unprepare(DRIVER, claim)).claims[claim.uid].error == ""
    await eventually(lambda: entries() == [])


def test_the_config_switches() -> None:
    from kxpu.dra.config import DraConfig

    assert DraConfig().claim_status is True and DraConfig().device_metadata is False
    parsed = DraConfig.model_validate({"claimStatus": False, "deviceMetadata": True})
    assert parsed.claim_status is False and parsed.device_metadata is True


async def test_the_api_call_is_one_server_side_apply_of_the_status_by_the_drivers_field_manager() -> None:
    """What ``DraKube.apply_claim_status`` sends an API server over HTTP, and how it reads the answers: a
    server-side apply of the status subresource as ``kxpu-<driver>`` (forced: the entries are this driver's), the
    claim's UID in the body; 404/409 (the claim, with this UID, is gone) is no error; 429 and 5xx are worth
    another try, other refusals are not."""
    from aiohttp import web
    from lightkube import AsyncClient, KubeConfig

    from kxpu.kube.dra import DraKube

    seen: list[tuple[str, str, dict[str, str], str, Any]] = []
    tokens: list[str] = []
    answers: list[tuple[int, dict[str, Any]]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        tokens.append(request.headers.get("Authorization", ""))
        seen.append(
            (request.method, request.path, dict(request.query), request.content_type, json.loads(body))
        )
        code, doc = answers.pop(0)
        # As the API server labels its answers (lightkube reads a refusal's Status only under exactly this type).
        return web.Response(
            body=json.dumps(doc).encode(), status=code, headers={"Content-Type": "application/json"}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "u", "user": {"token": "node-token"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
    )
    client = AsyncClient(config=config)
    kube = DraKube(DRIVER, client)
    entry = {"driver": DRIVER, "pool": NODE, "device": "sim-0", "data": {"id": "sim-0"}}

    def status(code: int, message: str) -> tuple[int, dict[str, Any]]:
        return code, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": message,
            "code": code,
        }

    try:
        answers.append((200, {"kind": "ResourceClaim", "metadata": {"name": "c"}}))
        assert await kube.apply_claim_status("ns", "c", "uid-1", [entry]) is True
        method, path, query, content_type, body = seen.pop()
        assert (method, path) == ("PATCH", "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status")
        assert query == {"fieldManager": f"kxpu-{DRIVER}", "force": "true"}
        assert content_type == "application/apply-patch+yaml"
        assert tokens == ["Bearer node-token"]  # the client's credentials
        assert body == {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "uid-1"},
            "status": {"devices": [entry]},
        }
        answers.append((200, {}))
        assert await kube.apply_claim_status("ns", "c", "uid-1", []) is True  # removing: applying none
        assert seen.pop()[4]["status"] == {}
        for gone in (status(404, 'resourceclaims "c" not found'), status(409, "Precondition failed: UID")):
            answers.append(gone)
            assert await kube.apply_claim_status("ns", "c", "uid-1", [entry]) is False
        answers.append(status(429, "slow down"))
        with pytest.raises(StatusWriteError, match="slow down") as busy:
            await kube.apply_claim_status("ns", "c", "uid-1", [entry])
        assert busy.value.transient
        answers.append(status(422, "status.devices[0]: must be an allocated device in the claim"))
        with pytest.raises(StatusWriteError, match="must be an allocated device") as refused:
            await kube.apply_claim_status("ns", "c", "uid-1", [entry])
        assert not refused.value.transient
    finally:
        await client.close()
        await runner.cleanup()

"""A rolling update with maxSurge (docs/dra.md, "Upgrades"): two processes of one DRA driver on a node at once,
each with sockets named after its pod, both registered with the kubelet; the checkpoint and the ResourceSlices
shared without a fight (kxpu.dra.instances). Real gRPC over unix sockets, the kubelet stand-in registering both.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kxpu.api.dra.v1 import api_pb2 as dra
from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.checkpoint import Checkpoint, PreparedClaim
from kxpu.dra.config import DraConfig, check_instance, dra_socket, registration_socket
from kxpu.dra.instances import HostLock
from kxpu.dra.plugin import DraPlugin
from kxpu.dra.prepare import ClaimRef
from kxpu.testing.dra import DraKubeletStandIn, FakeDraApi

NPU = "example.com/npu"
DRIVER = "npu.example.com"
NODE = "node-a"


async def eventually(check: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def result(device: str) -> dict[str, Any]:
    return {"request": "npu", "driver": DRIVER, "pool": NODE, "device": device}


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.plugins = root / "plugins"
        self.registry = root / "registry"
        self.cdi = root / "cdi"
        self.api = FakeDraApi({NODE: "uid-a"})
        self.kubelet = DraKubeletStandIn(self.registry, self.api, NODE)
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, instance: str | None) -> DraPlugin:
        snapshot = DeviceSnapshot()
        backend = SimulatedBackend(SimulatedConfig(count=4, model="sim"))
        plugin = DraPlugin(
            NPU,
            DRIVER,
            NODE,
            backend,
            snapshot,
            self.plugins,
            self.registry,
            self.api,
            self.api,
            DraConfig(cdi_spec_dir=self.cdi),
            instance=instance,
        )
        await snapshot.update(backend.discover())
        self.tasks[instance or ""] = asyncio.create_task(plugin.run())
        return plugin

    async def stop(self, instance: str | None) -> None:
        task = self.tasks.pop(instance or "")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    node = Node(Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp")))
    await node.kubelet.start()
    try:
        yield node
    finally:
        for task in node.tasks.values():
            task.cancel()
        await asyncio.gather(*node.tasks.values(), return_exceptions=True)
        await node.kubelet.stop()


async def call(endpoint: Path, method: str, *claims: ClaimRef) -> dict[str, str]:
    """NodePrepareResources / NodeUnprepareResources on one process's own socket: the kubelet may call either
    of the two (each claim's error, "" for success)."""
    wire = [dra.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
    async with grpc.aio.insecure_channel(f"unix://{endpoint}") as channel:
        stub = dra_grpc.DRAPluginStub(channel)
        if method == "prepare":
            prepared = await stub.NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=wire), timeout=10
            )
            return {uid: r.error for uid, r in prepared.claims.items()}
        unprepared = await stub.NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=wire), timeout=10
        )
        return {uid: r.error for uid, r in unprepared.claims.items()}


def slice_identity(api: FakeDraApi) -> list[tuple[str, str, int]]:
    return sorted(
        (s["metadata"]["name"], s["metadata"]["uid"], s["spec"]["pool"]["generation"])
        for s in api.slices.values()
    )


async def test_surge_update_two_processes_serve_share_claims_and_hand_over_slices(node: Node) -> None:
    old_uid, new_uid = str(uuid.uuid4()), str(uuid.uuid4())
    old = await node.start(old_uid)
    await node.kubelet.wait_registered(DRIVER)
    await eventually(lambda: old.ready and len(node.api.pool(DRIVER, NODE)) == 4)
    assert node.kubelet.drivers[DRIVER].endpoint == str(node.plugins / DRIVER / f"dra-{old_uid}.sock")
    slices = slice_identity(node.api)
    writes = node.api.writes
    before = node.api.add_claim("before", [result("sim-0")])
    assert (await call(dra_socket(node.plugins, DRIVER, old_uid), "prepare", before)) == {before.uid: ""}

    # The new pod starts beside the old one: sockets of its own, registered too, Ready while the old one publishes.
    new = await node.start(new_uid)
    await node.kubelet.wait_registered(DRIVER, times=2)
    assert node.kubelet.drivers[DRIVER].endpoint == str(node.plugins / DRIVER / f"dra-{new_uid}.sock")
    assert registration_socket(node.registry, DRIVER, old_uid).is_socket()
    await eventually(lambda: new.ready)
    assert old.publishing and not new.publishing
    assert (old.describe()["publishing"], new.describe()["instance"]) == (
        True,
        new_uid,
    )  # kxpu status shows it
    await asyncio.sleep(0.3)
    assert node.api.writes == writes  # the waiting process wrote no slice

    # Either process answers for the claims the other prepared: each call works from the checkpoint on disk.
    during = node.api.add_claim("during", [result("sim-1")])
    assert (await call(dra_socket(node.plugins, DRIVER, new_uid), "prepare", during)) == {during.uid: ""}
    twice = node.api.add_claim("twice", [result("sim-1")])
    refused = await call(dra_socket(node.plugins, DRIVER, old_uid), "prepare", twice)
    assert "already prepared" in refused[twice.uid]  # the old one saw the new one's claim
    assert (await call(dra_socket(node.plugins, DRIVER, old_uid), "unprepare", during)) == {during.uid: ""}
    assert not (node.cdi / f"kxpu-dra-{DRIVER}-{during.uid}.json").exists()

    # The old pod goes: its sockets go with it, the new one publishes, the slices stay the same objects.
    await node.stop(old_uid)
    assert not dra_socket(node.plugins, DRIVER, old_uid).exists()
    assert not registration_socket(node.registry, DRIVER, old_uid).exists()
    await eventually(lambda: new.publishing and new.ready)
    await eventually(lambda: new.published_revision == new.snapshot.revision)
    assert slice_identity(node.api) == slices  # no slice deleted and created again, no generation moved
    # The claim the old process prepared is unprepared by the new one, from the checkpoint.
    spec = node.cdi / f"kxpu-dra-{DRIVER}-{before.uid}.json"
    assert spec.exists()
    assert (await node.kubelet.unprepare(DRIVER, before)).claims[before.uid].error == ""
    assert not spec.exists()
    assert new.checkpoint.claims == {}


async def test_a_killed_pods_sockets_are_removed_and_live_ones_kept(node: Node) -> None:
    dead, alive = str(uuid.uuid4()), str(uuid.uuid4())
    listening: list[socket.socket] = []
    for instance, keep in ((dead, False), (alive, True)):
        for path in (
            dra_socket(node.plugins, DRIVER, instance),
            registration_socket(node.registry, DRIVER, instance),
        ):
            path.parent.mkdir(parents=True, exist_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            if keep:
                sock.listen()
                listening.append(sock)
            else:
                sock.close()  # the file stays, as a SIGKILL leaves it
    other_driver = node.registry / f"{DRIVER}-x-reg.sock"  # not a pod UID: never ours to remove
    other_driver.touch()
    try:
        plugin = await node.start(str(uuid.uuid4()))
        await eventually(lambda: plugin.ready)
        assert not dra_socket(node.plugins, DRIVER, dead).exists()
        assert not registration_socket(node.registry, DRIVER, dead).exists()
        assert dra_socket(node.plugins, DRIVER, alive).is_socket()
        assert registration_socket(node.registry, DRIVER, alive).is_socket()
        assert other_driver.exists()
    finally:
        for sock in listening:
            sock.close()


def test_an_instance_that_cannot_name_a_socket_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"^instance 'a/b' \(POD_UID\) cannot name a socket: use the pod's UID"
    ):
        check_instance("a/b")
    with pytest.raises(ValueError, match="unix sockets allow 107"):
        DraPlugin(
            NPU,
            DRIVER,
            NODE,
            SimulatedBackend(SimulatedConfig(count=1)),
            DeviceSnapshot(),
            tmp_path / ("p" * 60),
            tmp_path,
            FakeDraApi(),
            FakeDraApi(),
            instance=str(uuid.uuid4()),
        )


async def test_the_checkpoint_lock_reloads_what_another_process_wrote(tmp_path: Path) -> None:
    path = tmp_path / DRIVER / "checkpoint.json"
    mine, theirs = Checkpoint(path, DRIVER), Checkpoint(path, DRIVER)
    mine.load()
    theirs.load()
    async with theirs.exclusive() as reloaded:
        assert not reloaded
        theirs.claims["u1"] = PreparedClaim("ns", "c", None)
        theirs.save()
        waiting = asyncio.create_task(mine.exclusive().__aenter__())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # one call at a time across processes
    assert await asyncio.wait_for(waiting, 5) is True
    assert set(mine.claims) == {"u1"}
    mine.lock.release()
    async with mine.exclusive() as reloaded:
        assert not reloaded  # nothing changed since: no reload


async def test_a_reload_cancelled_midway_changes_nothing_once_the_lock_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare cancelled (the kubelet's deadline) while its reload reads the file in a thread releases the lock;
    the thread's late result must not then replace what the next holder has written since (a claim prepared by
    the other process would vanish from this one's checkpoint, its device offered twice)."""
    import threading

    path = tmp_path / DRIVER / "checkpoint.json"
    mine, theirs = Checkpoint(path, DRIVER), Checkpoint(path, DRIVER)
    mine.load()
    theirs.load()
    async with theirs.exclusive():
        theirs.claims["old"] = PreparedClaim("ns", "old", None)
        theirs.save()  # mine must reload at its next hold
    reading, go_on = threading.Event(), threading.Event()
    real_read = Path.read_text

    def slow_read(self: Path, *args: Any, **kwargs: Any) -> str:
        text = real_read(self, *args, **kwargs)
        if self == path and not reading.is_set():  # the first reload only
            reading.set()
            go_on.wait(5)  # the old file's text, returned after the lock has moved on
        return text

    monkeypatch.setattr(Path, "read_text", slow_read)
    cancelled = asyncio.create_task(mine.exclusive().__aenter__())
    assert await asyncio.to_thread(reading.wait, 5)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not mine.lock.held
    async with mine.exclusive() as reloaded:  # the next call: reloads (its own read, not slowed) and adds one
        assert reloaded and set(mine.claims) == {"old"}
        mine.claims["new"] = PreparedClaim("ns", "new", None)
        go_on.set()  # the cancelled call's thread finishes its read now
        await asyncio.sleep(0.1)
        assert set(mine.claims) == {"old", "new"}
        mine.save()
    monkeypatch.setattr(Path, "read_text", real_read)
    async with theirs.exclusive():
        assert set(theirs.claims) == {"old", "new"}


def test_the_count_of_writes_is_read_again_at_each_hold(tmp_path: Path) -> None:
    """A holder reads the count once per hold (no other process writes it meanwhile), never across holds: what
    the other process counted while this one did not hold the lock is what it reads next."""
    mine, theirs = HostLock(tmp_path / "checkpoint.json.lock"), HostLock(tmp_path / "checkpoint.json.lock")
    assert mine.try_acquire()
    assert mine.count() == 0
    mine.set_count(5)
    assert mine.count() == 5
    mine.release()
    assert theirs.try_acquire()
    assert theirs.count() == 5
    theirs.set_count(6)
    theirs.release()
    assert mine.peek_count() == 6
    assert mine.try_acquire()
    assert mine.count() == 6
    mine.release()


async def test_the_checkpoint_lock_is_freed_when_its_holder_fails_or_is_cancelled(tmp_path: Path) -> None:
    path = tmp_path / DRIVER / "checkpoint.json"
    mine, theirs = Checkpoint(path, DRIVER), Checkpoint(path, DRIVER)
    mine.load()
    theirs.load()
    with pytest.raises(RuntimeError):
        async with mine.exclusive():
            raise RuntimeError("a prepare failed")
    assert not mine.lock.held
    async with theirs.exclusive():
        waiting = asyncio.create_task(mine.exclusive().__aenter__())
        await asyncio.sleep(0.05)
        waiting.cancel()  # the kubelet's deadline while it waits
        with pytest.raises(asyncio.CancelledError):
            await waiting
    assert not mine.lock.held
    async with mine.exclusive() as reloaded:
        assert mine.lock.held and not reloaded
    assert not mine.lock.held


def test_a_lock_held_elsewhere_is_refused_and_freed_with_its_holder(tmp_path: Path) -> None:
    first, second = HostLock(tmp_path / "publish.lock"), HostLock(tmp_path / "publish.lock")
    assert first.try_acquire() and first.held
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire()
    second.release()


def test_kxpu_plugin_refuses_a_pod_uid_that_cannot_name_a_socket_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from kxpu.cli import main

    config = tmp_path / "config.yaml"
    doc = {
        "version": "v1",
        "kubeletPluginsDir": str(tmp_path / "p"),
        "pluginsRegistryDir": str(tmp_path / "r"),
        "resources": [{"name": NPU, "simulated": {"count": 1}, "serve": "dra"}],
    }
    config.write_text(json.dumps(doc))  # JSON is YAML
    monkeypatch.setenv("NODE_NAME", NODE)
    monkeypatch.setenv("POD_UID", "../escape")
    result = CliRunner().invoke(main, ["plugin", "--config", str(config), "--http-address", ""])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "kxpu: error: instance '../escape' (POD_UID) cannot name a socket: use the pod's UID (downward API "
        "metadata.uid), letters, digits and '-', at most 64 characters"
    ]

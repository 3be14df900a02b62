"""The node wrapper: slots, inventory publishing, and the signed-assignment handshake.

The scheduler's bind runs against an in-memory API (kxpu.testing.sharing.FakeCluster), the
node wrapper reads the same one, and a last test drives the real daemon servicer over its
socket with the kubelet stand-in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.config import parse_config
from kxpu.daemon import Daemon
from kxpu.model import BackendError, Device
from kxpu.sharing import inventory as inv
from kxpu.sharing import signing
from kxpu.sharing.config import SharingConfig
from kxpu.sharing.lock import NodeLock, allocated_key, lock_key
from kxpu.sharing.model import Assignment, ContainerAssignment, DeviceGrant
from kxpu.sharing.node import SharingBackend, parent_id
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import Scheduler
from kxpu.sharing.state import ClusterState
from kxpu.testing import KubeletStandIn
from kxpu.testing.sharing import FakeCluster, FakeNodeLink, pod

NPU = "example.com/npu"
FAMILY = ResourceFamily.derived(NPU)
NODE = "node-a"


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def sim(count: int = 2, **kw: Any) -> SimulatedBackend:
    return SimulatedBackend(
        SimulatedConfig.model_validate(
            {"count": count, "model": "npu", "memoryMiB": 16000, "cores": 64, **kw}
        )
    )


def sharing(**kw: Any) -> SharingConfig:
    return SharingConfig.model_validate({"signingKey": {"file": "/dev/null"}, **kw})


class Rig:
    """A cluster, the scheduler bound to it, and one node's wrapped backend."""

    def __init__(self, split: int = 4, count: int = 2, **config: Any) -> None:
        self.cluster = FakeCluster()
        self.link: FakeNodeLink = self.cluster.link(NODE)
        cfg = sharing(splitCount=split, allocateTimeoutSeconds=0.3, **config)
        self.backend = SharingBackend(sim(count), NPU, cfg, lambda: self.link, NODE)
        self.state = ClusterState([NPU])
        self.scheduler = Scheduler(self.state, [FAMILY], keys=lambda: self.cluster.keyring, api=self.cluster)
        self.slots = self.backend.discover()
        self.state.set_node(NODE, {inv.annotation_key(NPU): inv.encode(self.backend.inventory())})

    async def schedule(self, p: dict[str, Any]) -> None:
        self.cluster.add_pod(p)
        meta = p["metadata"]
        error = await self.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], NODE)
        assert error == "", error

    def free(self, taken: set[str]) -> list[Device]:
        return [d for d in self.slots if d.id not in taken]

    async def admit(self, size: int, taken: set[str]) -> tuple[list[str], dict[str, str]]:
        """As the kubelet: preferred allocation, then Allocate; returns slot IDs and env."""
        chosen = await self.backend.preferred_allocation_async(self.free(taken), [], size)
        by_id = {d.id: d for d in self.slots}
        edits = await self.backend.allocate_async([by_id[i] for i in chosen])
        taken.update(chosen)
        return chosen, edits.env


def test_slots_carry_the_parent_and_inventory_scales() -> None:
    cfg = sharing(splitCount=3, memoryScaling=1.5, coreScaling=2)
    backend = SharingBackend(sim(2, numaNodes=[0, 1]), NPU, cfg, lambda: FakeCluster().link(NODE), NODE)
    slots = backend.discover()
    assert [s.id for s in slots[:3]] == ["npu-0::0", "npu-0::1", "npu-0::2"]
    assert len(slots) == 6 and slots[4].memory_mib == 16000
    # No topology on slots (the kubelet's TopologyManager must not steer away from the assigned
    # slots); the NUMA node stays in the inventory, where the extender's numa-bind reads it.
    assert all(s.numa_nodes == () for s in slots)
    assert parent_id("npu-0::2") == "npu-0"
    (first, second) = backend.inventory().devices
    assert (first.memory_capacity_mib, first.core_capacity, first.split_count) == (24000, 200, 3)
    assert first.uuid.startswith("SIM-") and second.numa == 1


async def test_inventory_is_published_on_start_on_change_and_periodically(tmp_path: Path) -> None:
    state_file = tmp_path / "state.json"
    cluster = FakeCluster()
    link = cluster.link(NODE)
    cfg = sharing(splitCount=2, publishIntervalSeconds=0.2)
    backend = SharingBackend(sim(2, stateFile=str(state_file)), NPU, cfg, lambda: link, NODE)
    key = inv.annotation_key(NPU)

    def published() -> Any:
        text = cluster.node_annotations.get(NODE, {}).get(key)
        return inv.decode(text, NPU) if text else None

    snapshots: list[list[Device]] = []

    async def follow() -> None:
        async for devices in backend.watch():
            snapshots.append(devices)

    task = asyncio.create_task(follow())
    try:
        await eventually(lambda: published() is not None and len(snapshots) == 1)
        assert len(snapshots[0]) == 4
        state_file.write_text(json.dumps({"npu-1": "Unhealthy"}))
        started = time.monotonic()
        await eventually(lambda: published() is not None and not published().devices[1].healthy)
        assert time.monotonic() - started < 1.0  # "within a second of a change"
        assert [d.healthy for d in snapshots[-1]] == [True, True, False, False]
        before = len(link.published)
        await eventually(lambda: len(link.published) >= before + 2)  # heartbeats
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_handshake_gives_the_assigned_devices_and_limits() -> None:
    rig = Rig()
    await rig.schedule(pod("train", [{NPU: 2, "example.com/npumem": 3000, "example.com/npucores": 30}]))
    lock = rig.cluster.lock_holder(NODE, NPU)
    assert lock is not None and lock.pod == "default/train"
    annotations = rig.cluster.pods[("default", "train")]["metadata"]["annotations"]
    assignment = signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION])
    assigned = sorted(g.device for g in assignment.containers[0].devices)

    chosen, env = await rig.admit(2, set())
    assert sorted(parent_id(i) for i in chosen) == assigned
    uuids = {g.device: g.uuid for g in assignment.containers[0].devices}
    assert env["KXPU_VISIBLE_DEVICES"] == ",".join(uuids[g.device] for g in assignment.containers[0].devices)
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m" and env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "3000m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    await rig.backend.settled()
    assert rig.cluster.lock_holder(NODE, NPU) is None  # released after the last container
    assert allocated_key(NPU) in rig.cluster.pods[("default", "train")]["metadata"]["annotations"]


async def test_containers_are_admitted_in_order_and_the_next_pod_waits_for_the_lock() -> None:
    rig = Rig(split=4, count=1)
    await rig.schedule(
        pod("two", [{"example.com/npumem": 1000}, {"example.com/npumem": 2000, "example.com/npucores": 50}])
    )
    # a second pod cannot bind while the first holds the lock
    rig.cluster.add_pod(pod("next", [{"example.com/npumem": 100}]))
    error = await rig.scheduler.bind("default", "next", "uid-default-next", NODE)
    assert "locked" in error
    taken: set[str] = set()
    _, env0 = await rig.admit(1, taken)
    _, env1 = await rig.admit(1, taken)
    assert env0["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m" and "CUDA_DEVICE_SM_LIMIT" not in env0
    assert env1["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m" and env1["CUDA_DEVICE_SM_LIMIT"] == "50"
    await rig.backend.settled()
    assert await rig.scheduler.bind("default", "next", "uid-default-next", NODE) == ""


def _restart(rig: Rig, started: float, count: int = 1) -> None:
    """The node daemon restarts: a new wrapper over the same cluster, nothing kept in memory."""
    cfg = sharing(splitCount=4, allocateTimeoutSeconds=0.3)
    rig.backend = SharingBackend(sim(count), NPU, cfg, lambda: rig.link, NODE, clock=lambda: started)
    rig.slots = rig.backend.discover()


async def test_allocate_reuses_what_preferred_allocation_just_verified_and_reads_again_on_doubt() -> None:
    rig = Rig()
    reads: list[str] = []
    real_lock = rig.link.lock

    async def counting_lock(resource: str) -> NodeLock | None:
        reads.append(resource)
        return await real_lock(resource)

    rig.link.lock = counting_lock  # type: ignore[method-assign]
    await rig.schedule(pod("a", [{"example.com/npumem": 1000}, {"example.com/npumem": 2000}]))
    taken: set[str] = set()
    _, env = await rig.admit(1, taken)  # GetPreferredAllocation reads the lock; its Allocate does not
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m" and len(reads) == 1
    # An Allocate for devices the steered pod does not have (the kubelet chose otherwise) reads again
    # before it refuses.
    chosen = await rig.backend.preferred_allocation_async(rig.free(taken), [], 1)
    other = [d for d in rig.free(taken) if parent_id(d.id) != parent_id(chosen[0])][:1]
    assert len(reads) == 2
    with pytest.raises(BackendError, match="kubelet and scheduler disagree"):
        await rig.backend.allocate_async(other)
    assert len(reads) == 3


async def test_a_restart_mid_admission_never_hands_out_an_earlier_containers_limits() -> None:
    rig = Rig(split=4, count=1)  # one device: both containers get the same devices
    await rig.schedule(
        pod("two", [{"example.com/npumem": 1000}, {"example.com/npumem": 2000, "example.com/npucores": 50}])
    )
    taken: set[str] = set()
    _, env0 = await rig.admit(1, taken)
    assert env0["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    _restart(rig, started=time.time())  # between c0's Allocate and c1's: the kubelet asks only for c1
    with pytest.raises(BackendError, match="c0, c1 have the same devices but different limits"):
        await rig.admit(1, taken)  # c0's grant (1000m, no core limit) must not go to c1
    assert rig.cluster.events[-1][:2] == ("default/two", "KxpuAllocationRefused")


async def test_after_a_restart_equal_grants_other_devices_and_later_pods_are_matched() -> None:
    rig = Rig(split=4, count=1)
    await rig.schedule(pod("same", [{"example.com/npumem": 1000, "example.com/npucores": 30}] * 2))
    _restart(rig, started=time.time())  # the lock predates this process, the grants are equal
    taken: set[str] = set()
    envs = [(await rig.admit(1, taken))[1] for _ in range(2)]
    assert [e["CUDA_DEVICE_MEMORY_LIMIT_0"] for e in envs] == ["1000m", "1000m"]
    await rig.backend.settled()
    assert rig.cluster.lock_holder(NODE, NPU) is None  # both allocated here: released
    # a pod bound after the restart is matched in spec order as usual
    await rig.schedule(pod("later", [{"example.com/npumem": 500}, {"example.com/npumem": 700}]))
    envs = [(await rig.admit(1, taken))[1] for _ in range(2)]
    assert [e["CUDA_DEVICE_MEMORY_LIMIT_0"] for e in envs] == ["500m", "700m"]

    rig = Rig(split=4, count=2)  # spread: different devices tell the containers apart
    await rig.schedule(pod("apart", [{"example.com/npumem": 500}, {"example.com/npumem": 700}]))
    _restart(rig, started=time.time(), count=2)
    taken = set()
    envs = [(await rig.admit(1, taken))[1] for _ in range(2)]
    assert [e["CUDA_DEVICE_MEMORY_LIMIT_0"] for e in envs] == ["500m", "700m"]


async def test_the_decision_at_bind_counts_earlier_binds() -> None:
    rig = Rig(split=4, count=1)
    await rig.schedule(pod("a", [{"example.com/npumem": 10000}]))
    await rig.admit(1, set())
    await rig.backend.settled()
    rig.cluster.add_pod(pod("b", [{"example.com/npumem": 10000}]))
    error = await rig.scheduler.bind("default", "b", "uid-default-b", NODE)
    assert "no longer fits" in error and "not enough memory" in error
    assert rig.cluster.lock_holder(NODE, NPU) is None  # no lock left behind by a refused bind


async def test_a_failed_bind_releases_the_lock_and_leaves_no_assignment() -> None:
    rig = Rig()
    rig.cluster.fail_bind = True
    p = pod("x", [{"example.com/npumem": 100}])
    rig.cluster.add_pod(p)
    error = await rig.scheduler.bind("default", "x", "uid-default-x", NODE)
    assert "binding refused" in error
    assert rig.cluster.lock_holder(NODE, NPU) is None
    assert signing.ASSIGNMENT_ANNOTATION not in rig.cluster.pods[("default", "x")]["metadata"]["annotations"]
    node = rig.state.node(NODE)
    assert node is not None and all(s.memory == 0 for s in node.families[NPU])


async def _refused(rig: Rig, ids: list[str], match: str) -> None:
    by_id = {d.id: d for d in rig.slots}
    with pytest.raises(BackendError, match=match):
        await rig.backend.allocate_async([by_id[i] for i in ids])


async def test_allocate_without_a_lock_is_refused_clearly() -> None:
    rig = Rig()
    await _refused(rig, ["npu-0::0"], "no verified assignment.*no pod holds the example.com/npu lock")


def _forge(rig: Rig, name: str, keys: signing.Keys, **change: Any) -> None:
    """A pod that wrote its own assignment and a lock naming it (what a hostile pod might try)."""
    p = pod(name, [{"example.com/npumem": 100}], node=NODE)
    meta = p["metadata"]
    a = Assignment(
        meta["uid"],
        "default",
        name,
        NODE,
        (ContainerAssignment("c0", NPU, (DeviceGrant("npu-0", "SIM-x", 16000, 100),)),),
        int(time.time()),
    )
    signed = dataclasses.replace(a, **change)
    meta["annotations"][signing.ASSIGNMENT_ANNOTATION] = signing.encode_assignment(signed)
    meta["annotations"][signing.SIGNATURE_ANNOTATION] = signing.sign(signed, keys)
    rig.cluster.add_pod(p)
    now = time.time()
    rig.cluster.node_annotations.setdefault(NODE, {})[lock_key(NPU)] = NodeLock(
        "default", name, meta["uid"], "x", now, now + 60
    ).encode()


@pytest.mark.parametrize(
    ("keys", "change", "match"),
    [
        ([b"e" * 32], {}, "unknown HMAC key"),
        (None, {"node": "node-b"}, "for node 'node-b'"),
        (None, {"pod_uid": "someone-else"}, "UID someone-else"),
        (None, {"issued_at": 1}, "stale"),
    ],
)
async def test_forged_stale_or_foreign_assignments_are_refused_with_an_event(
    keys: list[bytes] | None, change: dict[str, Any], match: str
) -> None:
    rig = Rig()
    _forge(rig, "evil", keys or rig.cluster.keyring, **change)
    await _refused(rig, ["npu-0::0"], match)
    assert rig.cluster.events and rig.cluster.events[-1][:2] == ("default/evil", "KxpuAllocationRefused")


async def test_a_lock_naming_a_replaced_pod_is_refused() -> None:
    rig = Rig()
    _forge(rig, "p", rig.cluster.keyring)
    rig.cluster.pods[("default", "p")]["metadata"]["uid"] = "new-uid"
    await _refused(rig, ["npu-0::0"], "has UID new-uid")


async def test_slots_the_assignment_does_not_name_are_refused() -> None:
    rig = Rig()
    await rig.schedule(pod("p", [{"example.com/npumem": 100}]))
    annotations = rig.cluster.pods[("default", "p")]["metadata"]["annotations"]
    (grant,) = signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).containers[0].devices
    other = "npu-1" if grant.device == "npu-0" else "npu-0"
    await _refused(
        rig, [f"{other}::0"], f"kubelet offered {other} but the assignment gives c0: {grant.device}"
    )
    await _refused(rig, [f"{grant.device}::0", f"{grant.device}::1"], "two slots of one device")


async def test_the_lock_is_recovered_when_its_pod_is_gone_or_done() -> None:
    rig = Rig()
    await rig.schedule(pod("gone", [{"example.com/npumem": 100}]))
    del rig.cluster.pods[("default", "gone")]
    await rig.schedule(pod("after-gone", [{"example.com/npumem": 100}]))  # taken over at once
    rig.cluster.pods[("default", "after-gone")]["status"]["phase"] = "Failed"
    await rig.schedule(pod("after-failed", [{"example.com/npumem": 100}]))
    holder = rig.cluster.lock_holder(NODE, NPU)
    assert holder is not None and holder.name == "after-failed"


async def test_an_expired_lock_is_not_handed_over_while_its_pod_awaits_admission() -> None:
    now = [1000.0]
    rig = Rig()
    rig.cluster.clock = lambda: now[0]
    await rig.schedule(pod("slow", [{"example.com/npumem": 100}]))
    now[0] += rig.cluster.lock_ttl_s + 1  # expired, but the pod is bound here and not admitted yet
    rig.cluster.add_pod(pod("eager", [{"example.com/npumem": 100}]))
    assert "locked" in await rig.scheduler.bind("default", "eager", "uid-default-eager", NODE)
    now[0] += rig.cluster.hard_expiry_s  # the kubelet never came: recovered
    assert await rig.scheduler.bind("default", "eager", "uid-default-eager", NODE) == ""


# -- through the real daemon servicer -------------------------------------------------------


@pytest.fixture
async def kubelet(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[KubeletStandIn]:
    import tempfile

    plugin_dir = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    standin = KubeletStandIn(plugin_dir)
    await standin.start()
    yield standin
    await standin.stop()


async def test_daemon_serves_slots_and_answers_allocate_by_handshake(kubelet: KubeletStandIn) -> None:
    rig = Rig(split=3)
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(kubelet.plugin_dir),
            "resources": [{"name": NPU, "simulated": {"count": 2, "model": "npu", "memoryMiB": 16000}}],
        }
    )
    daemon = Daemon(config, lambda: config, lambda _resource: rig.backend)
    task = asyncio.create_task(daemon.run())
    try:
        view = await kubelet.wait_registered(NPU)
        await kubelet.wait_devices(NPU, lambda d: len(d) == 6)
        assert view.options.get_preferred_allocation_available
        await rig.schedule(pod("p", [{NPU: 1, "example.com/npumem": 4000, "example.com/npucores": 25}]))
        available = sorted(kubelet.view(NPU).devices)
        chosen = await kubelet.preferred(NPU, available, [], 1)
        response = await kubelet.allocate(NPU, chosen)
        env = dict(response.container_responses[0].envs)
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4000m" and env["CUDA_DEVICE_SM_LIMIT"] == "25"
        # a second Allocate with no pod pending is refused with the reason
        with pytest.raises(Exception, match="no verified assignment"):
            await kubelet.allocate(NPU, [available[-1]])
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 10)


def test_the_sharing_section_and_the_cli_wrapping(monkeypatch: pytest.MonkeyPatch) -> None:
    from kxpu import cli
    from kxpu.config import ConfigError
    from kxpu.sharing.control_plane import load_control_plane_config

    resource = {
        "name": NPU,
        "simulated": {"count": 2, "model": "npu", "memoryMiB": 8000},
        "sharing": {"splitCount": 5, "signingKey": {"file": "/etc/kxpu/keys"}, "memoryScaling": 2},
    }
    config = parse_config({"version": "v1", "resources": [resource]})
    (r,) = config.resources
    assert r.sharing is not None and r.sharing.split_count == 5
    monkeypatch.setenv("NODE_NAME", "node-7")
    backend = cli._build(r)
    assert isinstance(backend, SharingBackend) and backend.node_name == "node-7"
    assert len(backend.discover()) == 10
    assert backend.inventory().devices[0].memory_capacity_mib == 16000
    monkeypatch.delenv("NODE_NAME")
    with pytest.raises(ValueError, match="NODE_NAME"):
        cli._build(r)
    bad = dict(resource, sharing={"splitCount": 0})
    with pytest.raises(ConfigError, match=r"resources\[0\]\.sharing\.splitCount"):
        parse_config({"version": "v1", "resources": [bad]})
    assert load_control_plane_config(None).resource_families()[0].memory == "nvidia.com/gpumem"


def test_the_example_configs_load() -> None:
    from kxpu.config import load_config
    from kxpu.sharing.control_plane import load_control_plane_config

    examples = Path(__file__).parent.parent / "examples" / "sharing"
    (resource,) = load_config(examples / "node-config.yaml").resources
    assert resource.sharing is not None and resource.sharing.split_count == 4
    control = load_control_plane_config(examples / "control-plane.yaml")
    assert [f.count for f in control.resource_families()] == ["nvidia.com/gpu", "example.com/npu"]
    assert len(control.trusted_users) == 1 and len(control.node_users) == 1


class StaleKeysLink(FakeNodeLink):
    """A node whose keys were read before a rotation: the old public key only, until read again."""

    stale: signing.Keys = ()
    reads: list[bool]

    async def keys(self, fresh: bool = False) -> signing.Keys:
        self.reads.append(fresh)
        return self.cluster.keyring if fresh else self.stale


async def test_a_node_reads_its_keys_again_when_an_assignment_names_a_key_it_lacks() -> None:
    """Rotation: the extender signs with a new Ed25519 key the node has not read yet; the node reads its
    keys once more and admits, instead of refusing until its next periodic refresh."""
    old = signing.parse_keyring(signing.generate_private_pem())
    new = signing.parse_keyring(signing.generate_private_pem())
    rig = Rig()
    link = StaleKeysLink(rig.cluster, NODE)
    link.stale = signing.parse_keyring(old.public_pems(), private_ok=False)
    link.reads = []
    rig.link = link
    rig.cluster.keyring = signing.parse_keyring(new.public_pems() + old.public_pems(), private_ok=False)
    rig.scheduler.keys = lambda: new
    await rig.schedule(pod("rotated", [{NPU: 1, "example.com/npumem": 1000}]))
    _, env = await rig.admit(1, set())
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"
    assert link.reads == [False, True]
    # a key nobody holds is still refused, after one more read, naming the key
    rig2 = Rig()
    rig2.scheduler.keys = lambda: signing.parse_keyring(signing.generate_private_pem())
    rig2.cluster.keyring = signing.parse_keyring(old.public_pems(), private_ok=False)
    await rig2.schedule(pod("foreign", [{NPU: 1, "example.com/npumem": 1000}]))
    with pytest.raises(
        BackendError, match=r"assignment refused: signed with unknown Ed25519 key [0-9a-f]{8}"
    ):
        await rig2.admit(1, set())

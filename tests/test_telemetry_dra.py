"""Telemetry attributed on both paths at once: a resource served through DRA (two shares of one device held by
two claims, a whole device by a third) and one served through the device plugin, in one daemon, with the kubelet
stand-in serving PodResources (``devices`` and ``dynamic_resources``) over its real socket and writing its device
checkpoint, the claims' ``status.reservedFor`` in the fake API server (no kubelet DRA checkpoint: a real install
cannot mount it), and processes tied to pods through a fake host's /proc/<pid>/cgroup."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest

from kxpu.cli import _build
from kxpu.config import Config, ResourceConfig, parse_config
from kxpu.daemon import Daemon
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.plugin import DraPlugin
from kxpu.dra.prepare import ClaimRef
from kxpu.model import Backend
from kxpu.status import format_table, node_status
from kxpu.testing import KubeletStandIn
from kxpu.testing.dra import DraKubeletStandIn, FakeDraApi
from kxpu.testing.kubelet import ClaimDevice, ClaimUse
from tests.waiting import wait_until

NPU, FPGA = "example.com/npu", "example.com/fpga"
DRIVER, NODE = "npu.example.com", "node-a"
MIB = 1024 * 1024


def series(name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """Every series of ``name`` on /metrics (the process's registry) whose labels include ``labels``."""
    found = []
    for line in generate_latest(REGISTRY).decode().splitlines():
        if not line.startswith(name + "{"):
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("} ")[0]))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append((have, float(line.rsplit(" ", 1)[1])))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Rig:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.kubelet_root = root / "kubelet"
        self.plugins = self.kubelet_root / "plugins"
        self.registry = self.kubelet_root / "plugins_registry"
        self.podres = self.kubelet_root / "pod-resources" / "kubelet.sock"
        self.host = root / "host"
        (self.host / "proc").mkdir(parents=True)
        self.api = FakeDraApi({NODE: "uid-a"})
        self.dra_kubelet = DraKubeletStandIn(self.registry, self.api, NODE)
        self.kubelet = KubeletStandIn(self.kubelet_root / "device-plugins", self.podres)
        self.figures = {NPU: root / "npu.json", FPGA: root / "fpga.json"}
        self.port = free_port()
        self.daemon: Daemon | None = None
        self.task: asyncio.Task[int] | None = None

    def config(self) -> Config:
        def simulated(model: str) -> dict[str, Any]:
            return {
                "count": 2,
                "model": model,
                "memoryMiB": 16384,
                "telemetryFile": str(self.figures_of(model)),
            }

        return parse_config(
            {
                "version": "v1",
                "devicePluginDir": str(self.kubelet_root / "device-plugins"),
                "kubeletPluginsDir": str(self.plugins),
                "pluginsRegistryDir": str(self.registry),
                "podResourcesSocket": str(self.podres),
                "resources": [
                    {
                        "name": NPU,
                        "simulated": simulated("npu"),
                        "serve": "dra",
                        "dra": {"nodeName": NODE, "cdiSpecDir": str(self.root / "cdi"), "shares": {}},
                    },
                    {"name": FPGA, "simulated": simulated("fpga")},
                ],
                "telemetry": {"enabled": True, "intervalSeconds": 0.1, "hostRoot": str(self.host)},
            }
        )

    def figures_of(self, model: str) -> Path:
        return self.figures[NPU if model == "npu" else FPGA]

    def factory(self, resource: ResourceConfig, backend: Backend, snapshot: DeviceSnapshot) -> DraPlugin:
        return DraPlugin(
            resource.name,
            resource.dra_driver,
            NODE,
            backend,
            snapshot,
            self.plugins,
            self.registry,
            self.api,
            self.api,
            resource.dra,
        )

    async def start(self) -> Daemon:
        config = self.config()
        self.daemon = Daemon(config, lambda: config, _build, f"127.0.0.1:{self.port}", dra=self.factory)
        self.task = asyncio.create_task(self.daemon.run())
        return self.daemon

    async def stop(self) -> None:
        if self.daemon is not None and self.task is not None:
            self.daemon.stop()
            await asyncio.wait_for(self.task, 10)

    def process(self, pid: int, pod: tuple[str, str]) -> None:
        """A process of the pod in the fake host's /proc, named as the systemd cgroup driver names it (v2)."""
        uid = self.kubelet.pod_uids[pod].replace("-", "_")
        proc = self.host / "proc" / str(pid)
        proc.mkdir(parents=True, exist_ok=True)
        (proc / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid}.slice/"
            f"cri-containerd-{'b' * 64}.scope\n"
        )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    rig = Rig(root)
    await rig.dra_kubelet.start()
    await rig.kubelet.start()
    yield rig
    await rig.stop()
    await rig.kubelet.stop()
    await rig.dra_kubelet.stop()
    shutil.rmtree(root, ignore_errors=True)


def share(device: str, memory: str, cores: str) -> dict[str, Any]:
    return {
        "request": "npu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": memory, "cores": cores},
    }


async def prepare_and_run(rig: Rig, name: str, result: dict[str, Any], container: str = "main") -> ClaimRef:
    """The claim prepared by the driver, then used by the running container of pod ``name`` (same namespace)."""
    ref = rig.api.add_claim(name, [result], namespace="ml")
    # the scheduler reserves the claim for the pod before binding it
    rig.api.reserve("ml", name, {name: rig.kubelet.pod_uids.setdefault(("ml", name), str(uuid.uuid4()))})
    answer = await rig.dra_kubelet.prepare(DRIVER, ref)
    assert not answer.claims[ref.uid].error, answer.claims[ref.uid].error
    device = ClaimDevice(DRIVER, NODE, result["device"], result.get("shareID"))
    rig.kubelet.use_claim(("ml", name), container, ClaimUse("ml", name, ref.uid, (device,)))
    return ref


async def test_dra_shares_whole_devices_and_device_plugin_pods_are_attributed(rig: Rig) -> None:
    daemon = await rig.start()
    await rig.dra_kubelet.wait_registered(DRIVER, timeout=20)
    await rig.kubelet.wait_registered(FPGA, timeout=20)
    a = await prepare_and_run(rig, "a", share("npu-0", "4Gi", "25"))
    b = await prepare_and_run(rig, "b", share("npu-0", "6Gi", "50"))
    await prepare_and_run(rig, "c", {"request": "npu", "driver": DRIVER, "pool": NODE, "device": "npu-1"})
    await rig.kubelet.allocate(FPGA, ["fpga-0"], pod=("ml", "dp"))
    for pid, pod in ((4242, "a"), (4343, "b"), (4444, "c"), (4545, "dp")):
        rig.process(pid, ("ml", pod))

    def procs(*entries: tuple[int, int]) -> list[dict[str, int]]:
        return [{"pid": pid, "memoryMiB": mib} for pid, mib in entries]

    rig.figures[NPU].write_text(
        json.dumps(
            {
                "npu-0": {"memoryUsedMiB": 6000, "processes": procs((4242, 5000), (4343, 1000))},
                "npu-1": {"memoryUsedMiB": 100, "processes": procs((4444, 100))},
            }
        )
    )
    rig.figures[FPGA].write_text(json.dumps({"fpga-0": {"processes": procs((4545, 10))}}))

    def container(pod: str) -> list[tuple[dict[str, str], float]]:
        return series("kxpu_container_memory_used_bytes", namespace="ml", pod=pod)

    await wait_until(lambda: all(container(p) for p in ("a", "b", "c", "dp")), 20, "every pod's series")
    resources = daemon.status()["resources"]
    uuid = {d["id"]: d["uuid"] for r in (NPU, FPGA) for d in resources[r]["devices"]}
    # Each share is its pod's container, with its claim, used against what the claim was granted.
    (labels_a, used_a), (labels_b, used_b) = container("a")[0], container("b")[0]
    assert labels_a == {
        "resource": NPU,
        "device": uuid["npu-0"],
        "uuid": uuid["npu-0"],
        "namespace": "ml",
        "pod": "a",
        "container": "main",
        "claim": "ml/a",
    }
    assert (used_a, used_b) == (5000 * MIB, 1000 * MIB) and labels_b["claim"] == "ml/b"
    assert series("kxpu_container_memory_granted_bytes", pod="a")[0][1] == 4096 * MIB
    assert series("kxpu_container_compute_granted_ratio", pod="b")[0][1] == 0.5
    assert series("kxpu_container_over_grant", pod="a", kind="memory")[0][1] == 1
    assert series("kxpu_container_over_grant", pod="b", kind="memory")[0][1] == 0
    # A whole device: no grant; the device-plugin pod: no claim.
    assert container("c")[0][0]["claim"] == "ml/c" and not series(
        "kxpu_container_memory_granted_bytes", pod="c"
    )
    assert container("dp")[0][0]["claim"] == "" and container("dp")[0][0]["device"] == uuid["fpga-0"]
    # Every holder, with or without processes, on both paths; the unallocated device still reports.
    holders = {(h["pod"], h["device"], h["claim"]) for h, _ in series("kxpu_device_holder_info")}
    assert holders == {
        ("a", uuid["npu-0"], "ml/a"),
        ("b", uuid["npu-0"], "ml/b"),
        ("c", uuid["npu-1"], "ml/c"),
        ("dp", uuid["fpga-0"], ""),
    }
    assert series("kxpu_device_memory_total_bytes", device=uuid["fpga-1"], vendor="simulated")

    # kxpu status agrees (PodResources over its socket, the daemon's /status over HTTP).
    status = await node_status(rig.podres, f"http://127.0.0.1:{rig.port}")
    held = {d.id: d.holders for d in status.devices}
    assert held["npu-0"] == ["ml/a/main [claim ml/a, 4096 MiB, 25%]", "ml/b/main [claim ml/b, 6144 MiB, 50%]"]
    assert held["npu-1"] == ["ml/c/main [claim ml/c]"] and held["fpga-0"] == ["ml/dp/c0"]
    use = {u.holder.split(" ")[0]: u for d in status.devices for u in d.use}
    assert use["ml/a/main"].over_grant and use["ml/a/main"].memory_used_bytes == 5000 * MIB
    assert "ml/a/main [claim ml/a, 4096 MiB, 25%] (4.9 of 4.0 GiB, OVER GRANT)" in format_table(status)

    # Pod a ends: the kubelet forgets it and the driver unprepares its claim; its labels go, b's stay.
    rig.kubelet.remove_pod("ml", "a")
    await rig.dra_kubelet.unprepare(DRIVER, a)
    await wait_until(
        lambda: not series("kxpu_device_holder_info", pod="a") and not container("a"),
        20,
        "pod a's series gone",
    )
    assert container("b") and series("kxpu_device_holder_info", pod="b", claim="ml/b")
    assert b.uid in daemon.status()["resources"][NPU]["dra"]["claims"]


def test_only_pods_in_reserved_for_are_pod_uids() -> None:
    from kxpu.dra.claim_cache import reserved_pods

    claim = {
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": "a", "uid": "p1"},
                {"resource": "pods", "name": "b", "uid": "p2"},
                {"apiGroup": "example.com", "resource": "pods", "name": "x", "uid": "not-a-pod"},
                {"resource": "jobs", "name": "y", "uid": "not-a-pod-either"},
                {"resource": "pods", "name": "no-uid"},
            ]
        }
    }
    assert reserved_pods(claim) == {"p1", "p2"}
    assert reserved_pods({"status": {}}) == frozenset() and reserved_pods({}) == frozenset()


async def test_a_container_that_starts_after_its_allocation_is_recorded_is_found(
    workdir: Path, plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet writes its checkpoint at Allocate, before the container runs; PodResources lists the container
    only once it runs. Without a further change to any checkpoint, the holder still appears."""
    from kxpu.config import parse_config
    from kxpu.daemon import telemetry
    from kxpu.daemon.telemetry import SourceView, TelemetrySampler
    from kxpu.model import Device
    from tests.test_telemetry import checkpoint

    monkeypatch.setattr(telemetry, "PLACEMENT_SETTLE_EVERY_S", 0.0)
    socket = workdir / "pr.sock"
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    try:
        (plugin_dir / "kubelet_internal_checkpoint").write_text(
            checkpoint(("0b7c8f5e-3f0d-4d7e-8a1c-5d0c6b9e2a41", "main", "x.com/npu", ["n0"], None))
        )
        config = parse_config(
            {
                "version": "v1",
                "devicePluginDir": str(plugin_dir),
                "resources": [{"name": "x.com/npu", "simulated": {"count": 1}}],
                "podResourcesSocket": str(socket),
                "telemetry": {"enabled": True},
            }
        )
        from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig

        backend = SimulatedBackend(SimulatedConfig(count=1, model="n"))
        views = [SourceView("x.com/npu", backend, {"n0": Device("n0", uuid="N0")})]
        sampler = TelemetrySampler(lambda: config, lambda: views)
        assert not (await sampler.tick()).holders  # recorded, not yet running
        kubelet.assignments[("ml", "late", "main")] = [("x.com/npu", ["n0"])]  # the container starts
        holders = (await sampler.tick()).holders
        assert [(h.pod, h.container, h.uuids) for h in holders] == [("late", "main", frozenset({"N0"}))]
    finally:
        await kubelet.stop()


def test_a_claim_shared_by_two_pods_is_settled_by_elimination() -> None:
    """One ResourceClaim used by two pods: its reservedFor gives both pod UIDs, PodResources both names; a pod known from the device plugin (or its other claim) leaves the other UID to the other pod."""
    from kxpu.daemon.holders import ClaimPlacement, DraClaims, build_dra_holders, placed_claims
    from kxpu.dra.checkpoint import PreparedClaim, PreparedDevice

    claim = PreparedClaim("ml", "shared", None, (PreparedDevice(("npu",), NODE, "npu-0", "npu-0", ()),))
    source = DraClaims(NPU, DRIVER, {"c-uid": claim}, {"npu-0": "NPU-0"})
    placements = [
        ClaimPlacement("ml", pod, "main", "ml", "shared", DRIVER, NODE, "npu-0")
        for pod in ("first", "second")
    ]
    unsettled = build_dra_holders([source], placements, {"c-uid": frozenset({"u1", "u2"})})
    assert {(h.pod, h.pod_uid, h.claim) for h in unsettled} == {
        ("first", "", "ml/shared"),
        ("second", "", "ml/shared"),
    }
    settled = build_dra_holders(
        [source], placements, {"c-uid": frozenset({"u1", "u2"})}, {("ml", "first"): "u1"}
    )
    assert {(h.pod, h.pod_uid) for h in settled} == {("first", "u1"), ("second", "u2")}
    # Another driver's claim of the same name, or a device of another pool, holds nothing of this resource.
    other = [ClaimPlacement("ml", "x", "main", "ml", "shared", "gpu.other.com", NODE, "npu-0")]
    assert build_dra_holders([source], other, {}) == []
    # Its sources may be read only once (generators): each is.
    once = build_dra_holders(
        iter([source]), iter(placements), {"c-uid": frozenset({"u1", "u2"})}, {("ml", "first"): "u1"}
    )
    assert once == settled
    assert placed_claims(iter([source]), iter(placements)) == {
        "c-uid": frozenset({("ml", "first"), ("ml", "second")})
    }


def test_partitions_made_for_claims_are_held_under_their_own_uuid() -> None:
    """Two MIG-style partitions of one GPU, made for two claims at prepare: each holder names the partition's
    UUID (kept in its release handle), not the GPU's, so a process the driver reports under the partition is
    its claim's."""
    from kxpu.daemon.holders import ClaimPlacement, DraClaims, build_dra_holders
    from kxpu.dra.checkpoint import PreparedClaim, PreparedDevice

    def prepared(device: str, uuid: str) -> PreparedClaim:
        made = PreparedDevice(
            ("gpu",), NODE, device, device, (), partition={"gpu": "GPU-0", "uuid": uuid, "gi": 1}
        )
        return PreparedClaim("ml", device, None, (made,))

    claims = {"u-a": prepared("gpu-0-mig-1g-a", "MIG-a"), "u-b": prepared("gpu-0-mig-1g-b", "MIG-b")}
    source = DraClaims(
        "nvidia.com/gpu", "gpu.nvidia.com", claims, {"gpu-0-mig-1g-a": "", "gpu-0-mig-1g-b": ""}
    )
    placements = [
        ClaimPlacement(
            "ml", f"pod-{x}", "main", "ml", f"gpu-0-mig-1g-{x}", "gpu.nvidia.com", NODE, f"gpu-0-mig-1g-{x}"
        )
        for x in "ab"
    ]
    pods = {"u-a": frozenset({"p-a"}), "u-b": frozenset({"p-b"})}
    holders = {h.pod: h for h in build_dra_holders([source], placements, pods)}
    assert (holders["pod-a"].uuids, holders["pod-a"].pod_uid) == (frozenset({"MIG-a"}), "p-a")
    assert (holders["pod-b"].uuids, holders["pod-b"].claim) == (frozenset({"MIG-b"}), "ml/gpu-0-mig-1g-b")
    assert not holders["pod-a"].grants  # a partition is its whole: no share grant


async def test_claim_pods_come_from_the_synced_cache_else_from_a_get(tmp_path: Path) -> None:
    """The pod UIDs of a prepared claim: from the claim cache while it is synced (no API read), from a GET of the
    claim otherwise; a claim recreated under the same name (another UID) gives nothing, nor does one not prepared."""
    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
    from kxpu.dra.checkpoint import PreparedClaim
    from kxpu.dra.claim_cache import ClaimCache

    api = FakeDraApi({NODE: "uid-a"})
    ref = api.add_claim("a", [{"request": "npu", "driver": DRIVER, "pool": NODE, "device": "npu-0"}], "ml")
    api.reserve("ml", "a", {"pod-a": "uid-pod-a"})
    cache = ClaimCache(DRIVER, NODE)
    plugin = DraPlugin(
        NPU,
        DRIVER,
        NODE,
        SimulatedBackend(SimulatedConfig(count=1, model="npu")),
        DeviceSnapshot(),
        tmp_path / "plugins",
        tmp_path / "registry",
        api,
        api,
        claim_cache=cache,
    )
    plugin.checkpoint.claims[ref.uid] = PreparedClaim("ml", "a", None)
    assert await plugin.claim_pods([ref.uid, "not-prepared"]) == {ref.uid: frozenset({"uid-pod-a"})}  # a GET
    cached = copy.deepcopy(api.claims[("ml", "a")])
    cached["status"]["reservedFor"].append({"resource": "pods", "name": "pod-b", "uid": "uid-pod-b"})
    cache.apply("MODIFIED", cached)
    cache.synced = True
    api.fail_next = RuntimeError("no API read while the cache is synced")
    assert await plugin.claim_pods([ref.uid]) == {ref.uid: frozenset({"uid-pod-a", "uid-pod-b"})}
    api.fail_next = None
    cache.forget()
    api.claims[("ml", "a")]["metadata"]["uid"] = "recreated"
    assert await plugin.claim_pods([ref.uid]) == {}


async def test_pod_resources_are_read_over_one_kept_channel_that_survives_a_kubelet_restart(
    workdir: Path, plugin_dir: Path
) -> None:
    """Telemetry asks PodResources every minute or more often: over one kept channel (a channel per read kept
    about 0.05 MB of RSS per 100 reads), opened again after a failed read, so a restarted kubelet is found."""
    from kxpu.daemon.holders import HolderError, PodResourcesClient

    socket = workdir / "pr.sock"
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    client = PodResourcesClient()
    try:
        kubelet.assignments[("ml", "p", "main")] = [("x.com/npu", ["n0"])]
        first = await client.read(socket)
        channel = client._channel
        assert (
            (await client.read(socket)).devices == first.devices == {("x.com/npu", "n0"): ("ml", "p", "main")}
        )
        assert client._channel is channel, "a second read opened another channel"
        await kubelet.stop()
        with pytest.raises(HolderError, match="kubelet PodResources API at"):
            await client.read(socket, timeout=2)
        await kubelet.start()  # a new socket at the same path
        assert (await client.read(socket)).devices == first.devices
    finally:
        await client.close()
        await kubelet.stop()

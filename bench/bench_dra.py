"""kxpu as a DRA driver, measured across processes against the real API server and scheduler.

On the e2e harness's cluster (normal, or ``--control-plane-only``: etcd, kube-apiserver, kube-scheduler,
kube-controller-manager; taken under its lock and brought up and down here if it was not running):

1. **NodePrepareResources**: ``kxpu plugin`` runs as its own process serving 64 simulated devices with
   ``serve: dra`` for an API-only Node; this process plays the kubelet over the real sockets (plugin
   registration, then DRAPlugin v1). Each of ``--claims`` ResourceClaims is created in the API server with
   its allocation in ``status`` (what the scheduler writes), then prepared (the driver reads the claim from
   the API server, checks it, writes the claim's CDI spec and its checkpoint) and unprepared. Target: p99
   ≤ 5 ms, spec write included.
2. **Health → ResourceSlice**: the simulated state file flips a device ``--flips`` times; a watch on the
   driver's ResourceSlices times each flip until the slice shows (or no longer shows) its taint. Target:
   p99 ≤ 1 s.
3. **Scheduling throughput**: ``--nodes`` API-only nodes, each with 8 devices, published in each of
   ``--shapes`` in turn (``bench/dra_shapes.py``: ``dp`` the extended resource ``example.com/npu: 8``, the
   device plugin's path; ``kxpu`` kxpu's own publisher; ``example`` the Go example driver's devices; others
   that each change one factor: attributes, slices per pool, counters, consumable capacity, the DeviceClass's
   selector). Per shape, only its slices are published; ``--pods`` pods asking for one device go through one
   kube-scheduler (its own, client QPS 500, the same for every shape), each DRA pod with its ResourceClaim
   (created by the same clients just before the pod: the work a claim template gives the controller-manager,
   without its default 20 QPS cap). Counted when bound, then all deleted before the next shape. ``--rounds``
   rounds, the order changing each round (a cold scheduler or a noisy neighbour hits no shape every time);
   reported: each figure's median over rounds, and each shape's pods/s and scheduler CPU per pod as a ratio
   to ``kxpu``'s in the same round (median over rounds).

``python bench/bench_dra.py [--claims 200] [--flips 40] [--nodes 500] [--pods 1000] [--only prepare|health|schedule]
[--shapes dp,kxpu,example|all] [--rounds 3] [--control-plane-only] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.generic_resource import create_global_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dra_shapes import DEVICES_PER_NODE, SHAPES, Shape
from measure import cpu_seconds, percentile

from e2e.cluster import Cluster, held_up
from kxpu.dra.prepare import ClaimRef
from kxpu.kube.dra import DraKube
from kxpu.logs import configure_logging
from kxpu.testing.dra import DraKubeletStandIn

REPO = Path(__file__).resolve().parent.parent
NODE = "kxpu-bench-dra"
DRIVER = "npu.example.com"
BENCH_LABEL = "kxpu-bench-dra"
NS = "default"
EXTENDED = "example.com/npu"
SCHEDULER = "kxpu-bench-dra"
SCHEDULER_PORT = 10269
TARGETS = {"prepare_p99_ms": 5.0, "health_p99_ms": 1000.0}
_DeviceClass = create_global_resource("resource.k8s.io", "v1", "DeviceClass", "deviceclasses")


async def gather_limited(limit: int, coros: list[Awaitable[Any]]) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(coro: Awaitable[Any]) -> None:
        async with gate:
            await coro

    await asyncio.gather(*(one(c) for c in coros))


async def api_only_node(client: AsyncClient, name: str, extended: int = 0) -> None:
    with contextlib.suppress(Exception):
        await client.delete(Node, name)
    await client.create(Node(metadata=ObjectMeta(name=name, labels={BENCH_LABEL: "true"})))
    resources = {
        "cpu": "64",
        "memory": "256Gi",
        "pods": "250",
        **({EXTENDED: str(extended)} if extended else {}),
    }
    await client.patch(
        Node.Status,
        name,
        {"status": {"capacity": resources, "allocatable": resources}},
        patch_type=PatchType.MERGE,
    )


# -- 1 and 2: the driver as its own process -----------------------------------------------------------------
class Driver:
    """``kxpu plugin`` serving 64 simulated devices through DRA for the API-only node, in a temp directory."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        self.work = work
        self.state = work / "state.json"
        self.state.write_text("{}")
        self.registry = work / "registry"
        self.cdi = work / "cdi"
        config = {
            "version": "v1",
            "devicePluginDir": str(work / "dp"),
            "kubeletPluginsDir": str(work / "plugins"),
            "pluginsRegistryDir": str(self.registry),
            "resources": [
                {
                    "name": "example.com/npu",
                    "simulated": {
                        "count": 64,
                        "model": "sim",
                        "memoryMiB": 16384,
                        "stateFile": str(self.state),
                    },
                    "serve": "dra",
                    "dra": {"nodeName": NODE, "cdiSpecDir": str(self.cdi)},
                }
            ],
        }
        (work / "config.yaml").write_text(json.dumps(config))
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        self.log = (work / "kxpu.log").open("ab")
        self.proc = subprocess.Popen(
            [
                str(REPO / ".venv" / "bin" / "kxpu"),
                "plugin",
                "--config",
                str(work / "config.yaml"),
                "--http-address",
                "",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def unallocated_claim(name: str) -> dict[str, Any]:
    """A claim as a user writes it; its allocation is then written into ``status`` as the scheduler does."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "labels": {BENCH_LABEL: "true"}},
        "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": DRIVER}}]}},
    }


async def prepare_latency(client: AsyncClient, driver: Driver, claims: int) -> dict[str, float]:
    kubelet = DraKubeletStandIn(driver.registry)
    await kubelet.start()
    try:
        await kubelet.wait_registered(DRIVER, timeout=60)
        refs: list[ClaimRef] = []
        for i in range(claims):
            name = f"bench-{i:04d}-{uuid.uuid4().hex[:6]}"
            created = await client.create(codecs.from_dict(unallocated_claim(name)))
            allocation = {
                "devices": {
                    "results": [{"request": "npu", "driver": DRIVER, "pool": NODE, "device": f"sim-{i % 64}"}]
                }
            }
            await client.patch(
                ResourceClaim.Status,
                name,
                {"status": {"allocation": allocation}},
                namespace=NS,
                patch_type=PatchType.MERGE,
            )
            refs.append(ClaimRef(NS, str(created.metadata.uid), name))  # type: ignore[union-attr]
        cpu0 = cpu_seconds(driver.proc.pid)
        prepare, unprepare = [], []
        for ref in refs:
            t0 = time.perf_counter()
            answer = await kubelet.prepare(DRIVER, ref)
            prepare.append((time.perf_counter() - t0) * 1000)
            error = answer.claims[ref.uid].error
            if error:
                raise RuntimeError(f"prepare failed: {error}")
            t0 = time.perf_counter()
            await kubelet.unprepare(DRIVER, ref)
            unprepare.append((time.perf_counter() - t0) * 1000)
        driver_cpu = cpu_seconds(driver.proc.pid) - cpu0
        for ref in refs:
            await client.delete(ResourceClaim, ref.name, namespace=NS)
        return {
            "claims": claims,
            "prepare_p50_ms": round(percentile(prepare, 50), 2),
            "prepare_p99_ms": round(percentile(prepare, 99), 2),
            "unprepare_p50_ms": round(percentile(unprepare, 50), 2),
            "unprepare_p99_ms": round(percentile(unprepare, 99), 2),
            "driver_cpu_ms_per_claim": round(1000 * driver_cpu / claims, 2),
        }
    finally:
        await kubelet.stop()


async def health_latency(client: AsyncClient, driver: Driver, flips: int) -> dict[str, float]:
    """Each flip (un)taints sim-7; the watch sees the slice that reflects it."""
    seen: asyncio.Queue[tuple[float, bool]] = asyncio.Queue()

    async def watch() -> None:
        async for _, obj in client.watch(
            ResourceSlice, fields={"spec.driver": DRIVER, "spec.nodeName": NODE}
        ):
            devices = obj.spec.devices or []
            tainted = any(d.name == "sim-7" and d.taints for d in devices)
            seen.put_nowait((time.perf_counter(), tainted))

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(1)  # the watch is open and its initial events are in
    while not seen.empty():
        seen.get_nowait()
    latencies = []
    try:
        for n in range(flips):
            want = n % 2 == 0
            t0 = time.perf_counter()
            driver.state.write_text(json.dumps({"sim-7": "Unhealthy"} if want else {}))
            while True:
                at, tainted = await asyncio.wait_for(seen.get(), 30)
                if tainted == want:
                    latencies.append((at - t0) * 1000)
                    break
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return {
        "flips": flips,
        "health_p50_ms": round(percentile(latencies, 50), 1),
        "health_p99_ms": round(percentile(latencies, 99), 1),
    }


# -- 3: scheduling throughput --------------------------------------------------------------------------------
def start_scheduler(
    cluster: Cluster,
    work: Path,
    profiles: list[dict[str, Any]] | None = None,
    port: int = SCHEDULER_PORT,
    **settings: Any,
) -> subprocess.Popen[bytes]:
    """A kube-scheduler of its own (client QPS 500), with ``profiles`` (default: one, ``SCHEDULER``) and other
    top-level ``settings`` of its KubeSchedulerConfiguration."""
    config = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(cluster.kubeconfig), "qps": 500, "burst": 1000},
        "leaderElection": {"leaderElect": False},
        "profiles": profiles or [{"schedulerName": SCHEDULER}],
        **settings,
    }
    path = work / "kube-scheduler.yaml"
    path.write_text(json.dumps(config))
    log = (work / "kube-scheduler.log").open("ab")
    return subprocess.Popen(
        [
            str(cluster.k8s_bin / "kube-scheduler"),
            "--config",
            str(path),
            "--secure-port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def pod(name: str, dra: bool) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "none"}
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER,
        "tolerations": [{"operator": "Exists"}],
        "nodeSelector": {BENCH_LABEL: "true"},
        "containers": [container],
    }
    if dra:
        container["resources"] = {"claims": [{"name": "npu"}]}
        spec["resourceClaims"] = [{"name": "npu", "resourceClaimName": name}]
    else:
        container["resources"] = {"limits": {EXTENDED: "1"}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {BENCH_LABEL: "true"}},
        "spec": spec,
    }


async def throughput(
    client: AsyncClient, pods: int, prefix: str, driver: str | None, timeout: float
) -> dict[str, float]:
    """``pods`` pods named ``<prefix>-…``, each asking for one device: of ``driver``'s DeviceClass through a
    ResourceClaim, or (``driver`` None) the extended resource."""
    created: dict[str, float] = {}
    bound: dict[str, float] = {}
    done = asyncio.Event()

    async def watch() -> None:
        async for _, obj in client.watch(Pod, namespace=NS, labels={BENCH_LABEL: "true"}):
            name = str(obj.metadata.name) if obj.metadata else ""
            if name.startswith(prefix) and name not in bound and obj.spec is not None and obj.spec.nodeName:
                bound[name] = time.perf_counter()
                if len(bound) == pods:
                    done.set()

    async def create(name: str) -> None:
        if driver is not None:
            claim = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": NS, "labels": {BENCH_LABEL: "true"}},
                "spec": {"devices": {"requests": [{"name": "npu", "exactly": {"deviceClassName": driver}}]}},
            }
            await client.create(codecs.from_dict(claim))
        await client.create(codecs.from_dict(pod(name, driver is not None)))
        created[name] = time.perf_counter()

    watcher = asyncio.create_task(watch())
    await asyncio.sleep(0.5)
    start = time.perf_counter()
    await gather_limited(32, [create(f"{prefix}{i:05d}") for i in range(pods)])
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout)
    end = max(bound.values(), default=time.perf_counter())
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    latencies = [(bound[n] - created[n]) * 1000 for n in bound if n in created]
    return {
        "bound": len(bound),
        "pods_per_s": round(len(bound) / (end - start), 1),
        "bind_p50_ms": round(percentile(latencies, 50), 1) if latencies else float("nan"),
        "bind_p99_ms": round(percentile(latencies, 99), 1) if latencies else float("nan"),
    }


async def wait_gone(client: AsyncClient, kind: Any, timeout: float, **where: Any) -> None:
    """Until nothing of ``kind`` matches (a claim goes once the controller-manager has released it)."""
    deadline = time.monotonic() + timeout
    while [o async for o in client.list(kind, **where)]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{kind.__name__} objects still there after {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def delete_pods_and_claims(client: AsyncClient) -> None:
    pods = [p async for p in client.list(Pod, namespace=NS, labels={BENCH_LABEL: "true"})]
    await gather_limited(
        32,
        [client.delete(Pod, str(p.metadata.name), namespace=NS, grace_period=0) for p in pods if p.metadata],
    )
    claims = [c async for c in client.list(ResourceClaim, namespace=NS, labels={BENCH_LABEL: "true"})]

    async def release(name: str) -> None:
        # An allocated claim keeps the scheduler's delete-protection finalizer until the controller-manager
        # (20 QPS) deallocates it: taken off here, so that no shape's cleanup runs into the next one's pods.
        with contextlib.suppress(Exception):
            await client.patch(
                ResourceClaim,
                name,
                {"metadata": {"finalizers": None}},
                namespace=NS,
                patch_type=PatchType.MERGE,
            )
        with contextlib.suppress(Exception):
            await client.delete(ResourceClaim, name, namespace=NS)

    await gather_limited(32, [release(str(c.metadata.name)) for c in claims if c.metadata])


async def delete_labelled(client: AsyncClient) -> None:
    await delete_pods_and_claims(client)
    nodes = [n async for n in client.list(Node, labels={BENCH_LABEL: "true"})]
    await gather_limited(32, [client.delete(Node, str(n.metadata.name)) for n in nodes if n.metadata])
    with contextlib.suppress(Exception):
        await client.delete(_DeviceClass, DRIVER)


async def delete_bench_slices(client: AsyncClient) -> None:
    """Every slice and DeviceClass of the scheduling arms' drivers (``<shape>.bench.example.com``)."""
    for shape in SHAPES.values():
        driver = shape.driver()
        kube = DraKube(driver, client)
        slices = [s async for s in client.list(ResourceSlice, fields={"spec.driver": driver})]
        await gather_limited(16, [kube.delete_slice(str(s.metadata.name)) for s in slices if s.metadata])
        with contextlib.suppress(Exception):
            await client.delete(_DeviceClass, driver)


def arm_order(shapes: list[str], round_: int) -> list[str]:
    """Round 0 as given, 1 reversed, 2 rotated by half, …: no shape always goes first (a cold scheduler) or
    always follows the same one."""
    if round_ % 3 == 1:
        return shapes[::-1]
    if round_ % 3 == 2:
        half = len(shapes) // 2
        return shapes[half:] + shapes[:half]
    return list(shapes)


async def one_arm(
    client: AsyncClient, shape: Shape, names: list[str], pods: int, round_: int, pids: dict[str, int]
) -> dict[str, float]:
    """Publish ``shape`` on every node (nothing else published), send the pods, take it all away again."""
    kube = DraKube(shape.driver(), client)
    driver = None
    if shape.publish is not None:
        driver = shape.driver()
        await client.create(
            codecs.from_dict(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": driver},
                    "spec": {"selectors": [{"cel": {"expression": shape.expression()}}]},
                }
            )
        )
        publish = shape.publish
        await gather_limited(16, [publish(kube, driver, n) for n in names])
        await asyncio.sleep(2)  # the scheduler's informers have the slices
    load = os.getloadavg()[0]
    cpu = {k: cpu_seconds(p) for k, p in pids.items()}
    result: dict[str, float] = await throughput(client, pods, f"{shape.name}-r{round_}-", driver, timeout=300)
    for k, p in pids.items():
        result[f"{k}_cpu_ms_per_pod"] = round(1000 * (cpu_seconds(p) - cpu[k]) / pods, 2)
    result["load1"] = round(load, 2)
    await delete_pods_and_claims(client)
    await wait_gone(client, Pod, 120, namespace=NS, labels={BENCH_LABEL: "true"})
    await wait_gone(client, ResourceClaim, 120, namespace=NS, labels={BENCH_LABEL: "true"})
    await delete_bench_slices(client)
    return result


def summary(runs: dict[str, list[dict[str, float]]], base: str) -> dict[str, Any]:
    """Per shape, the median of each figure over the rounds, and the median over rounds of its pods/s and
    scheduler CPU per pod as a ratio to ``base``'s in the same round."""
    out: dict[str, Any] = {}
    for name, rounds in runs.items():
        for key in rounds[0]:
            out[f"{name}_{key}"] = round(statistics.median(r[key] for r in rounds), 2)
        if base in runs and name != base:
            for key in ("pods_per_s", "kube_scheduler_cpu_ms_per_pod"):
                ratios = [r[key] / b[key] for r, b in zip(rounds, runs[base], strict=True) if b[key]]
                if ratios:
                    out[f"{name}_{key}_vs_{base}"] = round(statistics.median(ratios), 3)
    return out


def shape_table(result: dict[str, Any]) -> str:
    """The scheduling arms as a Markdown table: medians over the rounds, ratios to ``kxpu`` within a round."""
    rows = [
        "| shape | pods/s | vs kxpu | scheduler CPU ms/pod | vs kxpu | API server CPU ms/pod | bind p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in result["runs"]:

        def get(key: str, name: str = name) -> Any:
            return result.get(f"{name}_{key}", "")

        rows.append(
            f"| {name} | {get('pods_per_s')} | {get('pods_per_s_vs_kxpu')} | {get('kube_scheduler_cpu_ms_per_pod')} "
            f"| {get('kube_scheduler_cpu_ms_per_pod_vs_kxpu')} | {get('kube_apiserver_cpu_ms_per_pod')} "
            f"| {get('bind_p50_ms')} / {get('bind_p99_ms')} |"
        )
    return "\n".join(rows)


async def scheduling(
    client: AsyncClient,
    cluster: Cluster,
    work: Path,
    nodes: int,
    pods: int,
    shapes: list[str],
    rounds: int,
) -> dict[str, Any]:
    names = [f"kxpu-bench-dra-{i:04d}" for i in range(nodes)]
    t0 = time.perf_counter()
    await gather_limited(16, [api_only_node(client, n, DEVICES_PER_NODE) for n in names])
    await delete_bench_slices(client)
    print(f"{nodes} nodes with example.com/npu: 8 in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    scheduler = start_scheduler(cluster, work)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in shapes}
    try:
        await asyncio.sleep(3)  # its informers sync
        pids = {
            "kube_scheduler": scheduler.pid,
            **{k: p for k in ("kube_apiserver", "etcd") if (p := cluster.pid(k.replace("_", "-")))},
        }
        for round_ in range(rounds):
            for name in arm_order(shapes, round_):
                got = await one_arm(client, SHAPES[name], names, pods, round_, pids)
                runs[name].append(got)
                print(
                    f"{time.strftime('%H:%M:%S')} round {round_} {name:10} {json.dumps(got)}", file=sys.stderr
                )
        return {"nodes": nodes, "pods": pods, "rounds": rounds, **summary(runs, "kxpu"), "runs": runs}
    finally:
        scheduler.terminate()
        scheduler.wait(20)


async def run(args: argparse.Namespace, cluster: Cluster, work: Path) -> dict[str, Any]:
    client = AsyncClient(field_manager="kxpu-bench")
    result: dict[str, Any] = {}
    try:
        await delete_labelled(client)
        if args.only in (None, "prepare", "health"):
            await api_only_node(client, NODE)
            await client.create(
                codecs.from_dict(
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "DeviceClass",
                        "metadata": {"name": DRIVER},
                        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
                    }
                )
            )
            driver = Driver(cluster, work)
            try:
                if args.only in (None, "prepare"):
                    result.update(await prepare_latency(client, driver, args.claims))
                if args.only in (None, "health"):
                    result.update(await health_latency(client, driver, args.flips))
            finally:
                driver.stop()
                slices = [s async for s in client.list(ResourceSlice, fields={"spec.driver": DRIVER})]
                for s in slices:
                    await client.delete(ResourceSlice, str(s.metadata.name))  # type: ignore[union-attr]
        if args.only in (None, "schedule"):
            shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
            result.update(await scheduling(client, cluster, work, args.nodes, args.pods, shapes, args.rounds))
        return result
    finally:
        with contextlib.suppress(Exception):
            await delete_labelled(client)
        with contextlib.suppress(Exception):
            await delete_bench_slices(client)
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--flips", type=int, default=40)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument(
        "--shapes",
        default="dp,kxpu,example",
        help=f"scheduling arms, comma-separated, or all: {', '.join(SHAPES)} (bench/dra_shapes.py)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="scheduling rounds, the arms' order alternating"
    )
    parser.add_argument("--only", choices=["prepare", "health", "schedule"])
    parser.add_argument("--control-plane-only", action="store_true", help="the harness's node-less cluster")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    unknown = set(args.shapes.split(",")) - {*SHAPES, "all"}
    if unknown:
        parser.error(f"unknown --shapes {', '.join(sorted(unknown))}: choose from {', '.join(SHAPES)} or all")
    if os.geteuid() != 0:
        print("needs root: it uses the e2e cluster", file=sys.stderr)
        return 2
    configure_logging("warning")  # the publisher's line per node and shape would bury the figures
    cluster = Cluster.default(control_plane_only=args.control_plane_only)
    work = Path(tempfile.mkdtemp(prefix="kx-bdra-", dir="/tmp"))
    try:
        with held_up(cluster, 1800, "bench_dra"):
            result = asyncio.run(run(args, cluster, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "kubernetes": cluster.release,
        "cluster": "control-plane-only" if args.control_plane_only else "e2e",
        **result,
    }
    if args.json:
        print(json.dumps(result))
    elif "runs" in result:
        print(shape_table(result))
    else:
        for key, value in result.items():
            if key == "runs":
                continue
            target = TARGETS.get(key)
            mark = "" if target is None else (" ✓" if float(value) <= target else f" ✗ (target ≤ {target})")
            print(f"{key:36} {value}{mark}")
    ok = all(float(result[k]) <= v for k, v in TARGETS.items() if k in result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

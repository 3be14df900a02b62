"""Fractional sharing two ways on the same API-only nodes, in one run: the stock kube-scheduler with DRA
consumable capacity (no extender, webhook or node lock) against kxpu's scheduler extender.

On the e2e harness's cluster (normal, or ``--control-plane-only``: etcd, kube-apiserver, kube-scheduler and,
where built, kube-controller-manager; taken under its lock, brought up and down here if it was not running),
``--nodes`` API-only Nodes each get ``--devices`` devices of 80 GiB and 100 % cores, published both ways as
kxpu's node daemon would:

- for the extender: the sharing label, the inventory annotation and the slots (``bench_sharing_e2e``), with
  more slots per device than the workload can use, so memory and cores decide, as with DRA;
- for DRA: a ResourceSlice pool per node, written by kxpu's own ``SlicePublisher`` with ``dra.shares``
  (``allowMultipleAllocations``, ``memory`` and ``cores`` capacities with request policies), selected by a
  DeviceClass. Needs ``DRAConsumableCapacity`` (beta and on by default from Kubernetes 1.36).

One seeded workload (``--pods`` shares of 1-16 GiB and 5, 10 or 15 % of the cores, one device each; every pod
also requests 1 CPU and 4 GiB of its node, as an accelerator pod does) then goes through each path in turn
(in ``--paths`` order), pods created by ``--concurrency`` clients as fast as the API server takes them and
counted when a watch sees them bound; each path's pods (and claims) are deleted before the next starts:

- ``extender``: pods with kxpu's sharing names in ``resources.limits``, admitted by kxpu's webhook and
  scheduled by a kube-scheduler calling ``kxpu scheduler`` (``--policy``, default binpack as in the chart);
  this process plays each node daemon's part after Allocate (marks the pod, releases the node lock);
- ``dra``: each pod with its own ResourceClaim asking ``capacity.requests`` (created just before the pod by the
  same client: what a claim template has the controller-manager do, without its 20 QPS cap), scheduled by a
  stock kube-scheduler with its default profile;
- ``extender-mostallocated``, ``dra-mostallocated``: the same with NodeResourcesFit scoring MostAllocated in
  the kube-scheduler's profile, the stock scheduler's own knob for packing nodes (its default, LeastAllocated,
  spreads pods by their CPU and memory requests, against the extender's binpack score; 1.37's DRA plugin scores
  only ``firstAvailable`` choices, not free capacity, and within a node its allocator takes the first device
  that fits).

Both kube-schedulers have the same client QPS (500), back-off (1-2 s) and otherwise default settings (e.g. at
500 nodes each pod's filter stops after the first ~230 feasible nodes). Reported per path: pods bound per second
(from the first create to the last bind; ``creates done`` says when the last create was answered: a path whose
pods are bound as fast as they are created is bounded by the creating side, here one Python process and the
API server), bind latency p50/p99 (create answered → bound), CPU per pod of
each process, and packing: the devices used, read back from the API (the pods' signed assignments; the claims'
allocations), against first-fit-decreasing over the same workload offline and the lower bound
``ceil(total / device)``, and the memory utilisation of the devices used. The run fails loudly if a pod is
left unbound, a share is not what its pod asked, or a device is over-committed (the sum of its grants past
its capacity as published in the API).

``python bench/bench_dra_sharing.py [--nodes 20] [--pods 200] [--devices 4] [--paths extender,dra,dra-mostallocated]
[--policy binpack|spread] [--seed 1] [--control-plane-only] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import ssl
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightkube import ApiError, AsyncClient, codecs
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice
from lightkube.types import PatchType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_dra import start_scheduler
from bench_sharing_e2e import (
    BENCH_LABEL,
    create_node,
    delete_bench_objects,
    gather_limited,
    measure_binding,
    pod_manifest,
    stand_in_node,
)
from measure import cpu_seconds
from packing import first_fit_decreasing, lower_bound

from e2e.cluster import Cluster, held_up
from e2e.sharing_support import CORES, EXTENDER_METRICS_PORT, MEM, NS, RES, Sharing
from kxpu.dra.publisher import SlicePublisher
from kxpu.dra.quantity import as_mib, parse_quantity
from kxpu.dra.slices import SharePolicy
from kxpu.kube.dra import DraKube
from kxpu.logs import configure_logging
from kxpu.model import Device
from kxpu.sharing import inventory, signing

DRIVER = "share.bench.example.com"  # also the DeviceClass's name
DRA_NS = "default"
DRA_SCHEDULER = "kxpu-bench-dra-share"
DRA_PACKED = "kxpu-bench-dra-share-packed"
DRA_SCHEDULER_PORT = 10271
DEVICE_GIB = 80
DEVICE_MIB = DEVICE_GIB * 1024
MAX_SHARE_GIB = 16
CORE_CHOICES = (5, 10, 15)
# Extender slots per device: more than any device can take here (cores of at least 5 % → at most 20 shares).
SPLIT = 32
# What each pod asks of its node besides its share, on both paths (nodes have 64 CPUs and 256 GiB): as a real
# accelerator pod does, and what NodeResourcesFit's scores see (a pod without requests is 0.1 CPU to them, too
# little for an integer score to tell a node with a few pods from an empty one).
POD_REQUESTS = {"cpu": "1", "memory": "4Gi"}
PATHS = ("extender", "extender-mostallocated", "dra", "dra-mostallocated")
PREFIX = {"extender": "ext", "extender-mostallocated": "extma", "dra": "dra", "dra-mostallocated": "drama"}
PROFILE = {"dra": DRA_SCHEDULER, "dra-mostallocated": DRA_PACKED}
# kube-scheduler's own knob for packing nodes (its default, LeastAllocated, spreads pods by their requests)
MOST_ALLOCATED = [{"name": "NodeResourcesFit", "args": {"scoringStrategy": {"type": "MostAllocated"}}}]


class BenchError(RuntimeError):
    """What the run found wrong: an over-commit, a share other than asked, pods left unbound."""


@dataclass(frozen=True, slots=True)
class Share:
    memory_gib: int
    cores: int


def workload(pods: int, seed: int) -> list[Share]:
    """The same shares for every path: pod ``i`` asks ``workload[i]``."""
    rng = random.Random(seed)
    return [Share(rng.randint(1, MAX_SHARE_GIB), rng.choice(CORE_CHOICES)) for _ in range(pods)]


# -- the two ways of asking ----------------------------------------------------------------------------------
def extender_pod(name: str, share: Share) -> dict[str, Any]:
    limits = {RES: "1", MEM: str(share.memory_gib * 1024), CORES: str(share.cores)}
    manifest = pod_manifest(name, limits=limits)
    manifest["spec"]["containers"][0]["resources"]["requests"] = dict(POD_REQUESTS)
    return manifest


def dra_claim(name: str, share: Share) -> dict[str, Any]:
    request = {
        "deviceClassName": DRIVER,
        "allocationMode": "ExactCount",
        "count": 1,
        "capacity": {"requests": {"memory": f"{share.memory_gib}Gi", "cores": str(share.cores)}},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": DRA_NS, "labels": {BENCH_LABEL: "true"}},
        "spec": {"devices": {"requests": [{"name": "npu", "exactly": request}]}},
    }


def dra_pod(name: str, scheduler: str) -> dict[str, Any]:
    manifest = pod_manifest(name)
    manifest["metadata"]["namespace"] = DRA_NS
    spec = manifest["spec"]
    spec["schedulerName"] = scheduler
    spec["resourceClaims"] = [{"name": "npu", "resourceClaimName": name}]
    spec["containers"][0]["resources"] = {"claims": [{"name": "npu"}], "requests": dict(POD_REQUESTS)}
    return manifest


# -- what the API says was granted ---------------------------------------------------------------------------
@dataclass
class Usage:
    """Per device: capacity (memory MiB, cores %, slots or None) and the grants on it."""

    capacity: dict[str, tuple[int, int, int | None]]
    memory: dict[str, int]
    cores: dict[str, int]
    shares: dict[str, int]

    @classmethod
    def empty(cls) -> Usage:
        return cls({}, {}, {}, {})

    def grant(self, device: str, memory_mib: int, cores: int) -> None:
        if device not in self.capacity:
            raise BenchError(f"a share was granted on {device}, which no node publishes")
        self.memory[device] = self.memory.get(device, 0) + memory_mib
        self.cores[device] = self.cores.get(device, 0) + cores
        self.shares[device] = self.shares.get(device, 0) + 1

    def check(self, path: str) -> None:
        """BenchError naming every over-committed device."""
        over = []
        for device, memory in self.memory.items():
            cap_memory, cap_cores, slots = self.capacity[device]
            cores, shares = self.cores[device], self.shares[device]
            if memory > cap_memory or cores > cap_cores or (slots is not None and shares > slots):
                over.append(
                    f"{device}: {memory} of {cap_memory} MiB, {cores} of {cap_cores} % cores, {shares} shares"
                    + (f" of {slots} slots" if slots is not None else "")
                )
        if over:
            raise BenchError(f"{path}: over-commit on {len(over)} device(s): " + "; ".join(over[:10]))

    def packing(self, shares: list[Share]) -> dict[str, float]:
        used = len(self.memory)
        items = [(s.memory_gib * 1024, s.cores) for s in shares]
        ffd = first_fit_decreasing(items, DEVICE_MIB)
        memory = sum(self.memory.values())
        capacity = sum(self.capacity[d][0] for d in self.memory)
        return {
            "devices_used": used,
            "nodes_used": len({d.split("/", 1)[0] for d in self.memory}),
            "ffd_devices": ffd,
            "lower_bound_devices": lower_bound(items, DEVICE_MIB),
            "used_over_ffd": round(used / ffd, 3),
            "memory_utilisation": round(memory / capacity, 3) if capacity else 0.0,
            "max_shares_per_device": max(self.shares.values(), default=0),
        }


async def extender_usage(client: AsyncClient, keys: signing.Keys, asked: dict[str, Share]) -> Usage:
    """From the nodes' inventories and the pods' signed assignments (verified as the node verifies them)."""
    usage = Usage.empty()
    async for node in client.list(Node, labels={BENCH_LABEL: "true"}):
        assert node.metadata is not None
        text = (node.metadata.annotations or {}).get(inventory.annotation_key(RES))
        if text is None:
            continue
        for d in inventory.decode(text, RES).devices:
            usage.capacity[f"{node.metadata.name}/{d.uuid}"] = (
                d.memory_capacity_mib,
                d.core_capacity,
                d.split_count,
            )
    async for pod in client.list(Pod, namespace=NS, labels={BENCH_LABEL: "true"}):
        meta, spec = pod.metadata, pod.spec
        assert meta is not None and spec is not None
        name = str(meta.name)
        if name not in asked or not spec.nodeName:
            continue
        annotations = meta.annotations or {}
        try:
            assignment = signing.verify(
                annotations.get(signing.ASSIGNMENT_ANNOTATION),
                annotations.get(signing.SIGNATURE_ANNOTATION),
                keys,
                pod_uid=str(meta.uid),
                namespace=NS,
                name=name,
                node=spec.nodeName,
                now=time.time(),
                max_age_s=3600,
            )
        except signing.SignatureError as exc:
            raise BenchError(f"extender: pod {name}: {exc}") from None
        grants = [g for c in assignment.containers for g in c.devices]
        share = asked[name]
        if len(grants) != 1 or (grants[0].memory_mib, grants[0].cores) != (
            share.memory_gib * 1024,
            share.cores,
        ):
            raise BenchError(f"extender: pod {name} asked {share} and was granted {grants}")
        usage.grant(f"{spec.nodeName}/{grants[0].uuid}", grants[0].memory_mib, grants[0].cores)
    return usage


async def dra_usage(client: AsyncClient, asked: dict[str, Share]) -> Usage:
    """From the ResourceSlices' capacities and the claims' allocations (``consumedCapacity`` of each result)."""
    usage = Usage.empty()
    async for piece in client.list(ResourceSlice, fields={"spec.driver": DRIVER}):
        spec = piece.to_dict()["spec"]
        for d in spec.get("devices") or []:
            capacity = d.get("capacity") or {}
            if "memory" not in capacity or "cores" not in capacity:
                raise BenchError(
                    f"dra: device {d['name']} of {spec['pool']['name']} has no memory/cores capacity"
                )
            usage.capacity[f"{spec['pool']['name']}/{d['name']}"] = (
                as_mib(capacity["memory"]["value"]),
                int(parse_quantity(capacity["cores"]["value"])),
                None,
            )
    async for obj in client.list(ResourceClaim, namespace=DRA_NS, labels={BENCH_LABEL: "true"}):
        claim = obj.to_dict()
        name = claim["metadata"]["name"]
        if name not in asked:
            continue
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []
        share = asked[name]
        if len(results) != 1:
            raise BenchError(f"dra: claim {name} has {len(results)} allocation results, not 1")
        (result,) = results
        consumed = result.get("consumedCapacity") or {}
        if not result.get("shareID") or "memory" not in consumed or "cores" not in consumed:
            raise BenchError(
                f"dra: claim {name} got device {result.get('device')} without a share (consumedCapacity "
                f"{consumed or 'absent'}): is DRAConsumableCapacity on?"
            )
        memory, cores = as_mib(consumed["memory"]), int(parse_quantity(consumed["cores"]))
        if (memory, cores) != (share.memory_gib * 1024, share.cores):
            raise BenchError(f"dra: claim {name} asked {share} and consumed {consumed}")
        usage.grant(f"{result['pool']}/{result['device']}", memory, cores)
    return usage


# -- set-up and clean-up -------------------------------------------------------------------------------------
async def delete_dra_objects(client: AsyncClient, timeout: float = 120) -> None:
    """The DRA path's pods and claims, gone from the API (an allocated claim keeps the scheduler's finalizer
    until the controller-manager clears it, and a control-plane-only cluster may have none: it is dropped
    here) so that the next path starts on free devices."""
    labels: dict[str, Any] = {BENCH_LABEL: "true"}

    async def drop(name: str) -> None:
        with contextlib.suppress(ApiError):  # gone already
            await client.delete(ResourceClaim, name, namespace=DRA_NS)
        with contextlib.suppress(ApiError):
            await client.patch(
                ResourceClaim,
                name,
                {"metadata": {"finalizers": None}},
                namespace=DRA_NS,
                patch_type=PatchType.MERGE,
            )

    deadline = time.monotonic() + timeout
    while True:
        pods = [
            str(p.metadata.name)
            async for p in client.list(Pod, namespace=DRA_NS, labels=labels)
            if p.metadata
        ]
        await gather_limited(32, [client.delete(Pod, n, namespace=DRA_NS, grace_period=0) for n in pods])
        claims = [
            str(c.metadata.name)
            async for c in client.list(ResourceClaim, namespace=DRA_NS, labels=labels)
            if c.metadata
        ]
        if not claims and not pods:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{len(claims)} claims and {len(pods)} pods still there after {timeout:.0f}s")
        await gather_limited(32, [drop(n) for n in claims])
        await asyncio.sleep(0.5)  # poll: deletions land asynchronously


async def delete_extender_pods(client: AsyncClient, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pods = [p async for p in client.list(Pod, namespace=NS, labels={BENCH_LABEL: "true"})]
        if not pods:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"{len(pods)} extender pods still there after {timeout:.0f}s")
        await gather_limited(
            32,
            [
                client.delete(Pod, str(p.metadata.name), namespace=NS, grace_period=0)
                for p in pods
                if p.metadata
            ],
        )
        await asyncio.sleep(0.5)  # poll: deletions land asynchronously


async def clean(client: AsyncClient) -> None:
    """Everything of an earlier or this run: pods, claims, slices, the DeviceClass, the nodes."""
    await delete_dra_objects(client)
    await delete_bench_objects(client)  # the extender's pods and every bench node
    # a node's slices go with it where a controller-manager collects garbage; else here
    kube = DraKube(DRIVER, client)
    slices = [s async for s in client.list(ResourceSlice, fields={"spec.driver": DRIVER})]
    await gather_limited(16, [kube.delete_slice(str(s.metadata.name)) for s in slices if s.metadata])
    with contextlib.suppress(ApiError):
        await client.delete(DeviceClass, DRIVER)


async def make_nodes(client: AsyncClient, nodes: int, devices: int) -> list[str]:
    names = [f"kxpu-bench-{i:04d}" for i in range(nodes)]
    kube = DraKube(DRIVER, client)

    async def one(name: str) -> None:
        await create_node(client, name, devices=devices, memory_mib=DEVICE_MIB, split=SPLIT)
        shares = [
            Device(id=f"npu-{i}", model="bench-npu", uuid=f"NPU-{name}-{i}", memory_mib=DEVICE_MIB, index=i)
            for i in range(devices)
        ]
        await SlicePublisher(kube, DRIVER, name, "taint", shares=SharePolicy()).publish(shares)

    t0 = time.perf_counter()
    await gather_limited(16, [one(n) for n in names])
    selector = {"cel": {"expression": f'device.driver == "{DRIVER}"'}}
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DRIVER},
        "spec": {"selectors": [selector]},
    }
    await client.create(codecs.from_dict(device_class))
    print(
        f"{nodes} nodes x {devices} devices of {DEVICE_GIB} GiB, both ways, in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )
    return names


def extender_nodes() -> int:
    """How many nodes the extender's cache holds (from its allocation gauges); -1 when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{EXTENDER_METRICS_PORT}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return -1
    prefix = "kxpu_scheduler_node_memory_allocated_mib{"
    return len(
        {line.split('node="', 1)[1].split('"', 1)[0] for line in text.splitlines() if line.startswith(prefix)}
    )


def https_ok(url: str) -> bool:
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=insecure) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


async def until(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(ready):
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)  # poll: the condition lives in another process


# -- one path ------------------------------------------------------------------------------------------------
async def run_path(
    client: AsyncClient,
    path: str,
    shares: list[Share],
    args: argparse.Namespace,
    pids: dict[str, int],
    keys: signing.Keys,
) -> dict[str, Any]:
    names = [f"{PREFIX[path]}-{i:05d}" for i in range(len(shares))]
    asked = dict(zip(names, shares, strict=True))
    if path.startswith("extender"):

        async def create(name: str) -> None:
            await client.create(codecs.from_dict(extender_pod(name, asked[name])))

        async def node_side(pod: Pod) -> None:
            await stand_in_node(client, pod)

        namespace, on_bound = NS, node_side
    else:

        async def create(name: str) -> None:
            await client.create(codecs.from_dict(dra_claim(name, asked[name])))
            await client.create(codecs.from_dict(dra_pod(name, PROFILE[path])))

        namespace, on_bound = DRA_NS, None
    cpu = {k: cpu_seconds(p) for k, p in pids.items()}
    result: dict[str, Any] = {"path": path}
    result.update(
        await measure_binding(
            client,
            names,
            create,
            namespace=namespace,
            labels={BENCH_LABEL: "true"},
            concurrency=args.concurrency,
            timeout=args.timeout,
            on_bound=on_bound,
        )
    )
    result["cpu_ms_per_pod"] = {
        k: round(1000 * (cpu_seconds(p) - cpu[k]) / len(shares), 1) for k, p in pids.items()
    }
    extender = path.startswith("extender")
    usage = await (extender_usage(client, keys, asked) if extender else dra_usage(client, asked))
    usage.check(path)
    result.update(usage.packing(shares))
    if sum(usage.shares.values()) != result["bound"]:
        raise BenchError(
            f"{path}: {result['bound']} pods bound but {sum(usage.shares.values())} shares granted"
        )
    return result


async def run(args: argparse.Namespace, cluster: Cluster, sharing: Sharing, work: Path) -> dict[str, Any]:
    client = AsyncClient(field_manager="kxpu-bench")
    shares = workload(args.pods, args.seed)
    paths = args.paths.split(",")
    scheduler = None
    try:
        await clean(client)
        await make_nodes(client, args.nodes, args.devices)
        await until(
            f"the extender's cache to hold {args.nodes} nodes", lambda: extender_nodes() >= args.nodes, 120
        )
        pids: dict[str, int] = {"bench": os.getpid()}
        for component in ("kube-apiserver", "etcd"):
            pid = cluster.pid(component)
            if pid is not None:
                pids[component.replace("-", "_")] = pid
        for name, proc in (
            ("extender", sharing.extender.proc),
            ("webhook", sharing.webhook.proc),
            ("kube_scheduler_extender", sharing.scheduler.proc),
        ):
            if proc is not None:
                pids[name] = proc.pid
        results = []
        for path in paths:
            if path.startswith("extender"):
                profile = {"pluginConfig": MOST_ALLOCATED} if path == "extender-mostallocated" else {}
                if profile != sharing.scheduler_profile:
                    await asyncio.to_thread(functools.partial(sharing.restart_scheduler, **profile))
                    assert sharing.scheduler.proc is not None
                    pids["kube_scheduler_extender"] = sharing.scheduler.proc.pid
            elif scheduler is None:
                (work / "dra").mkdir(exist_ok=True)
                scheduler = start_scheduler(
                    cluster,
                    work / "dra",
                    profiles=[
                        {"schedulerName": DRA_SCHEDULER},
                        {"schedulerName": DRA_PACKED, "pluginConfig": MOST_ALLOCATED},
                    ],
                    port=DRA_SCHEDULER_PORT,
                    podInitialBackoffSeconds=1,  # as the extender path's kube-scheduler
                    podMaxBackoffSeconds=2,
                )
                pids["kube_scheduler_dra"] = scheduler.pid
                await until(
                    "the DRA kube-scheduler's /readyz",
                    lambda: https_ok(f"https://127.0.0.1:{DRA_SCHEDULER_PORT}/readyz"),
                    60,
                )
            print(f"{path}: {len(shares)} pods on {args.nodes} nodes", file=sys.stderr)
            result = await run_path(client, path, shares, args, pids, sharing.verify_keys())
            results.append(result)
            print(
                f"{path}: {result['bound']}/{result['pods']} bound, {result['pods_per_s']} pods/s, "
                f"{result['devices_used']} devices (FFD {result['ffd_devices']})",
                file=sys.stderr,
            )
            if path.startswith("extender"):
                await delete_extender_pods(client)
            else:
                await delete_dra_objects(client)
        return {"paths": results}
    finally:
        if scheduler is not None:
            scheduler.terminate()
            scheduler.wait(20)
        try:
            await clean(client)
        except Exception as exc:  # clean-up: report, never hide the run's own failure
            print(f"clean-up failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        await client.close()


def table(report: dict[str, Any]) -> str:
    rows = [
        "| path | pods bound/s | creates done (s) | bind p50 / p99 (ms) | devices used | FFD | lower bound | used / FFD "
        "| memory used on used devices | nodes used |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["paths"]:
        rows.append(
            f"| {r['path']} | {r['pods_per_s']} ({r['bound']}/{r['pods']}) | {r['create_s']} of {r['total_s']} "
            f"| {r['bind_p50_ms']} / {r['bind_p99_ms']} "
            f"| {r['devices_used']} | {r['ffd_devices']} | {r['lower_bound_devices']} | {r['used_over_ffd']} "
            f"| {100 * r['memory_utilisation']:.0f} % | {r['nodes_used']} |"
        )
    rows.append("")
    rows.append(
        "CPU ms per pod: "
        + "; ".join(
            f"{r['path']}: " + ", ".join(f"{k} {v}" for k, v in r["cpu_ms_per_pod"].items())
            for r in report["paths"]
        )
    )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--devices", type=int, default=4, help="devices per node")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument(
        "--policy", choices=["binpack", "spread"], default="binpack", help="extender's node policy"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent pod creates")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for each path's pods to be bound")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--control-plane-only", action="store_true", help="the harness's node-less cluster")
    parser.add_argument("--out", type=Path, help="also write the report here as JSON")
    args = parser.parse_args()
    configure_logging("warning", "text")  # not kxpu's publisher's line per node
    unknown = [p for p in args.paths.split(",") if p not in PATHS]
    if unknown:
        parser.error(f"--paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    if min(args.nodes, args.pods, args.devices) < 1:
        parser.error("--nodes, --pods and --devices must be at least 1")
    if os.geteuid() != 0:
        print("needs root: it uses the e2e cluster", file=sys.stderr)
        return 2
    cluster = Cluster.default(control_plane_only=args.control_plane_only)
    load = os.getloadavg()
    with held_up(cluster, 1800, "bench_dra_sharing"):
        work = Path(tempfile.mkdtemp(prefix="kxpu-bench-dra-sharing-"))
        sharing = Sharing(
            cluster, work, node_policy=args.policy, inventory_stale_s=3600, client_qps=500, log_level="info"
        )
        try:
            sharing.start(node=False)
            result = asyncio.run(run(args, cluster, sharing, work))
        except BenchError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            print(f"logs: {work}", file=sys.stderr)
            return 1
        except BaseException:
            print(f"logs: {work}", file=sys.stderr)
            raise
        finally:
            sharing.close()
    report: dict[str, Any] = {
        "kubernetes": cluster.release,
        "cluster": "control-plane-only" if args.control_plane_only else "e2e",
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "nodes": args.nodes,
        "devices_per_node": args.devices,
        "device_gib": DEVICE_GIB,
        "pods": args.pods,
        "seed": args.seed,
        "extender_policy": args.policy,
        **result,
    }
    print(
        f"{args.pods} shares (1-{MAX_SHARE_GIB} GiB, {'/'.join(map(str, CORE_CHOICES))} % cores) on "
        f"{args.nodes} API-only nodes x {args.devices} devices of {DEVICE_GIB} GiB, Kubernetes {cluster.release}, "
        f"{os.cpu_count()} CPUs, load {report['load_before'][0]} before / {report['load_after'][0]} after\n"
    )
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    unbound = [r["path"] for r in report["paths"] if r["bound"] != r["pods"]]
    if unbound:
        print(f"FAILED: pods left unbound on {', '.join(unbound)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

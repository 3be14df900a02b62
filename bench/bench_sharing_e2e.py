"""End-to-end scheduling throughput of fractional sharing: real kube-scheduler + ``kxpu scheduler``, API-only nodes.

On the e2e harness cluster (taken under its lock; brought up and down here if it was not running), 500 Node
objects are created through the API server with a published kxpu inventory (4 devices of 16000 MiB, split 10)
and allocatable slots; no kubelet serves them, so pods are measured until they are *bound*, not Running. A
second kube-scheduler calls the extender (filter, prioritize, bind with the node lock and the signed
assignment); pods are created through kxpu's admission webhook (mutating and validating), as in a
deployment. The node side of the handshake is stood in for: when a pod is bound, this process does what the
node daemon does after Allocate (marks the pod allocated and releases the node lock), so a node takes its next
pod as a real one would. Pods are created by ``--concurrency`` concurrent clients, as fast as the API server
takes them.

Reported: pods bound per second (from the first create to the last bind), the bind latency (create
answered → binding seen by a watch), p50/p99, the CPU each process used meanwhile and the extender's own
time per filter/prioritize/bind. Target: >= 50 pods/s. ``--baseline`` runs plain pods (10m CPU) through
the same kube-scheduler, with the same client QPS, behind the same webhook: kube-scheduler calls no
extender for a pod that asks for none of its managed resources, so this is what the machine does without
kxpu's filter, lock and signed bind. (The cluster's own kube-scheduler would be no baseline: its default
client QPS of 50 caps it at about 55 pods/s on any machine.) Everything created is deleted.

``--control-plane-only`` uses the harness's node-less cluster instead (etcd, kube-apiserver, kube-scheduler;
``python -m e2e.cluster up --control-plane-only``), which is all API-only nodes need: for a machine without
containerd, a kubelet, kubectl or kube-controller-manager (``KXPU_K8S_BIN`` names a directory of binaries).
Nothing here runs kubectl in either mode.

``--node-lock lease|annotation`` (default lease): where the extender locks a node between bind and Allocate.
Reported for both, per pod bound: the API server's write requests (``apiserver_request_total``, verbs create,
update, patch, delete) by resource, and the watch events a watcher of every Node receives (as each CNI agent,
kube-proxy or monitoring agent of a cluster does) and a watcher of the lock Leases (the extender alone).

``python bench/bench_sharing_e2e.py [--nodes 500] [--pods 1000] [--policy spread] [--baseline]
[--node-lock lease] [--control-plane-only] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightkube.resources.coordination_v1 import Lease
from measure import cpu_seconds, percentile

from e2e.cluster import Cluster, held_up
from e2e.sharing_support import CORES, EXTENDER_METRICS_PORT, MEM, NS, RES, SCHEDULER, SPLIT, Sharing
from kxpu.kube.client import get_raw
from kxpu.kube.sharing.api import release
from kxpu.kube.sharing.lease import LeaseLocks
from kxpu.sharing import inventory
from kxpu.sharing.inventory import SHARING_NODE_LABEL
from kxpu.sharing.lock import BIND_PHASE_ANNOTATION, LOCK_PROTOCOL_ANNOTATION, allocated_key, lock_key
from kxpu.sharing.model import NodeInventory, SharedDevice
from kxpu.timeouts import wait_event

BENCH_LABEL = "kxpu-bench"
DEVICES_PER_NODE = 4
DEVICE_MIB = 16000
TARGET_PODS_PER_S = 50.0


def node_inventory(
    name: str, devices: int = DEVICES_PER_NODE, memory_mib: int = DEVICE_MIB, split: int = SPLIT
) -> str:
    """The inventory annotation kxpu's node daemon would publish: ``devices`` of ``memory_mib``, ``split`` slots."""
    shared = tuple(
        SharedDevice(
            id=f"{name}-npu-{i}",
            uuid=f"NPU-{name}-{i}",
            model="bench-npu",
            memory_mib=memory_mib,
            memory_capacity_mib=memory_mib,
            core_capacity=100,
            split_count=split,
            numa=0,
            healthy=True,
            index=i,
        )
        for i in range(devices)
    )
    return inventory.encode(NodeInventory(RES, shared, time.time()))


async def create_node(
    client: AsyncClient,
    name: str,
    devices: int = DEVICES_PER_NODE,
    memory_mib: int = DEVICE_MIB,
    split: int = SPLIT,
) -> None:
    """An API-only Node as kxpu's node daemon leaves it: the sharing label, the inventory, the slots."""
    meta = ObjectMeta(
        name=name,
        labels={BENCH_LABEL: "true", SHARING_NODE_LABEL: "true"},
        # as a daemon of this release announces: it reads lock Leases
        annotations={
            inventory.annotation_key(RES): node_inventory(name, devices, memory_mib, split),
            LOCK_PROTOCOL_ANNOTATION: "lease",
        },
    )
    await client.create(Node(metadata=meta))
    slots = str(devices * split)
    resources = {"cpu": "64", "memory": "256Gi", "pods": "250", RES: slots}
    status = {"status": {"capacity": resources, "allocatable": resources}}
    await client.patch(Node.Status, name, status, patch_type=PatchType.MERGE)


def pod_manifest(name: str, baseline: bool = False, limits: dict[str, str] | None = None) -> dict[str, Any]:
    """A shared-device pod (one device, 1000 MiB and 10 % unless ``limits`` says otherwise); with ``baseline``,
    a plain one (for the same kube-scheduler, which then skips the extender)."""
    if limits is None:
        limits = {"cpu": "10m"} if baseline else {RES: "1", MEM: "1000", CORES: "10"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {BENCH_LABEL: "true"}},
        "spec": {
            "schedulerName": SCHEDULER,
            "tolerations": [{"operator": "Exists"}],  # the API-only nodes get not-ready taints
            "nodeSelector": {BENCH_LABEL: "true"},  # never the harness's real node
            "containers": [{"name": "main", "image": "none", "resources": {"limits": limits}}],
        },
    }


async def gather_limited(limit: int, coros: list[Any]) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(coro: Any) -> None:
        async with gate:
            await coro

    await asyncio.gather(*(one(c) for c in coros))


async def stand_in_node(client: AsyncClient, pod: Pod, lease: bool = True) -> None:
    """What the node daemon does once a pod's last container is allocated: mark it, release the lock (read at
    Allocate, then released with one JSON patch naming it)."""
    meta = pod.metadata
    assert meta is not None and pod.spec is not None and pod.spec.nodeName
    patch = {
        "metadata": {
            "annotations": {allocated_key(RES): str(int(time.time())), BIND_PHASE_ANNOTATION: "allocated"}
        }
    }
    await client.patch(Pod, str(meta.name), patch, namespace=NS, patch_type=PatchType.MERGE)
    if lease:
        locks = LeaseLocks(client, NS)
        got = await locks.read(pod.spec.nodeName, RES)
        await locks.release(pod.spec.nodeName, RES, str(meta.uid), got[1] if got else None)
    else:
        node = await client.get(Node, pod.spec.nodeName)
        held = ((node.metadata.annotations if node.metadata else None) or {}).get(lock_key(RES))
        await release(client, pod.spec.nodeName, RES, str(meta.uid), held)


async def delete_bench_objects(client: AsyncClient) -> None:
    """The bench's pods (at once: no kubelet serves their nodes) and nodes, by label."""
    pods = [p async for p in client.list(Pod, namespace=NS, labels={BENCH_LABEL: "true"})]
    await gather_limited(
        32,
        [client.delete(Pod, str(p.metadata.name), namespace=NS, grace_period=0) for p in pods if p.metadata],
    )
    nodes = [n async for n in client.list(Node, labels={BENCH_LABEL: "true"})]
    await gather_limited(32, [client.delete(Node, str(n.metadata.name)) for n in nodes if n.metadata])


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "create", "update", "patch", "delete")


async def api_writes(client: AsyncClient) -> dict[str, float]:
    """The API server's write requests so far, by resource (subresource joined with '/')."""
    text = await get_raw(client, "/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":  # the parser drops _total
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total") or sample.labels.get("verb") not in WRITE_VERBS:
                continue
            resource = sample.labels.get("resource", "")
            if sample.labels.get("subresource"):
                resource += "/" + sample.labels["subresource"]
            out[resource] = out.get(resource, 0.0) + sample.value
    return out


async def count_events(client: AsyncClient, kind: Any, counts: dict[str, int], key: str, **kw: Any) -> None:
    """Count the watch events a watcher of ``kind`` receives (from now)."""
    async for _ in client.watch(kind, **kw):
        counts[key] = counts.get(key, 0) + 1


async def measure_binding(
    client: AsyncClient,
    names: list[str],
    create: Callable[[str], Awaitable[None]],
    *,
    namespace: str,
    labels: dict[str, Any],
    concurrency: int,
    timeout: float,
    on_bound: Callable[[Pod], Coroutine[Any, Any, None]] | None = None,
    lock_namespace: str = NS,
) -> dict[str, float]:
    """Create one pod per name (``create``, by ``concurrency`` clients) and time each until a watch on
    ``namespace``/``labels`` sees it bound; ``on_bound`` runs for each bound pod (the node's side)."""
    created: dict[str, float] = {}
    bound: dict[str, float] = {}
    wanted = set(names)
    done = asyncio.Event()
    node_side: set[asyncio.Task[None]] = set()

    async def watch() -> None:
        async for _, pod in client.watch(Pod, namespace=namespace, labels=labels):
            name = str(pod.metadata.name) if pod.metadata else ""
            if name not in wanted or name in bound or pod.spec is None or not pod.spec.nodeName:
                continue
            bound[name] = time.perf_counter()
            if on_bound is not None:
                task = asyncio.create_task(on_bound(pod))
                node_side.add(task)
                task.add_done_callback(node_side.discard)
            if len(bound) == len(wanted):
                done.set()

    async def one(name: str) -> None:
        await create(name)
        created[name] = time.perf_counter()

    watcher = asyncio.create_task(watch())
    events: dict[str, int] = {}
    # a watcher of every Node (what each CNI agent, kube-proxy, ... is) and of the lock Leases (the extender)
    counters = [
        asyncio.create_task(count_events(client, Node, events, "node")),
        asyncio.create_task(count_events(client, Lease, events, "lease", namespace=lock_namespace)),
    ]
    await asyncio.sleep(0.5)  # the watches are open before the first pod
    writes_before = await api_writes(client)
    start = time.perf_counter()
    await gather_limited(concurrency, [one(n) for n in names])
    created_all = time.perf_counter()
    if not await wait_event(done, timeout):
        print(f"timed out: {len(bound)}/{len(names)} bound after {timeout:.0f}s", file=sys.stderr)
    end = max(bound.values(), default=time.perf_counter())
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await asyncio.gather(*node_side, return_exceptions=True)
    await asyncio.sleep(1.0)  # the last releases' events arrive
    for counter in counters:
        counter.cancel()
    await asyncio.gather(*counters, return_exceptions=True)
    writes_after = await api_writes(client)
    per_pod: dict[str, float] = {}
    n = max(1, len(bound))
    for resource, value in writes_after.items():
        delta = value - writes_before.get(resource, 0.0)
        if delta > 0:
            per_pod[f"writes_per_pod_{resource.replace('/', '_')}"] = round(delta / n, 2)
    per_pod["writes_per_pod"] = round(sum(per_pod.values()), 2)
    per_pod["node_watch_events_per_pod"] = round(events.get("node", 0) / n, 2)
    per_pod["lease_watch_events_per_pod"] = round(events.get("lease", 0) / n, 2)
    latencies = [(bound[n] - created[n]) * 1000 for n in bound if n in created]
    return {
        "pods": len(names),
        "bound": len(bound),
        "create_s": round(created_all - start, 2),
        "total_s": round(end - start, 2),
        "pods_per_s": round(len(bound) / (end - start), 1),
        "bind_p50_ms": round(percentile(latencies, 50), 1) if latencies else float("nan"),
        "bind_p99_ms": round(percentile(latencies, 99), 1) if latencies else float("nan"),
        **per_pod,
    }


async def measure(
    client: AsyncClient,
    pods: int,
    concurrency: int,
    timeout: float,
    baseline: bool = False,
    lease: bool = True,
) -> dict[str, float]:
    async def create(name: str) -> None:
        await client.create(codecs.from_dict(pod_manifest(name, baseline)))

    async def node_side(pod: Pod) -> None:
        await stand_in_node(client, pod, lease)

    return await measure_binding(
        client,
        [f"bench-{i:05d}" for i in range(pods)],
        create,
        namespace=NS,
        labels={BENCH_LABEL: "true"},
        concurrency=concurrency,
        timeout=timeout,
        on_bound=None if baseline else node_side,  # no kxpu lock to release for a plain pod
    )


def extender_request_seconds() -> dict[str, tuple[float, float]]:
    """verb → (total seconds, count) from the extender's own histogram (its time per request, not the wire's)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{EXTENDER_METRICS_PORT}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kxpu_scheduler_request_duration_seconds":
            for sample in family.samples:
                into = {"_sum": sums, "_count": counts}.get(sample.name.removeprefix(family.name))
                if into is not None:
                    into[sample.labels["verb"]] = sample.value
    return {verb: (sums[verb], counts.get(verb, 0.0)) for verb in sums}


async def run(args: argparse.Namespace, sharing: Sharing) -> dict[str, float]:
    client = AsyncClient(field_manager="kxpu-bench")
    names = [f"kxpu-bench-{i:04d}" for i in range(args.nodes)]
    try:
        t0 = time.perf_counter()
        await gather_limited(16, [create_node(client, n) for n in names])
        print(f"{args.nodes} nodes created in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        await asyncio.sleep(2)  # the extender's node watch catches up
        procs = {
            "extender": sharing.extender.proc,
            "webhook": sharing.webhook.proc,
            "kube_scheduler": sharing.scheduler.proc,
        }
        pids = {name: proc.pid for name, proc in procs.items() if proc is not None}
        for component in ("kube-apiserver", "etcd", "kube-scheduler"):  # the rest of the two cores' work
            pid = sharing.cluster.pid(component)
            if pid is not None:
                pids[("cluster_" if component == "kube-scheduler" else "") + component.replace("-", "_")] = (
                    pid
                )
        pids["bench"] = os.getpid()
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        before = extender_request_seconds()
        result = await measure(
            client, args.pods, args.concurrency, args.timeout, args.baseline, args.node_lock == "lease"
        )
        for name, pid in pids.items():
            result[f"{name}_cpu_s"] = round(cpu_seconds(pid) - cpu[name], 2)
        for verb, (total, count) in extender_request_seconds().items():
            t0, c0 = before.get(verb, (0.0, 0.0))
            if count > c0:
                result[f"extender_{verb}_mean_ms"] = round(1000 * (total - t0) / (count - c0), 2)
                result[f"extender_{verb}_requests"] = int(count - c0)
        return result
    finally:
        try:
            await delete_bench_objects(client)
        except Exception as exc:  # clean-up: report, never hide the run's own failure
            print(f"deleting the bench's pods and nodes failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent pod creates")
    parser.add_argument("--policy", choices=["spread", "binpack"], default="spread", help="node policy")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="plain pods (10m CPU) through the same kube-scheduler, which calls no extender for them: the ceiling",
    )
    parser.add_argument(
        "--control-plane-only",
        action="store_true",
        help="the harness's node-less cluster (etcd, kube-apiserver, kube-scheduler): no kubelet, containerd, "
        "kubectl or controller-manager needed",
    )
    parser.add_argument(
        "--node-lock",
        choices=["lease", "annotation"],
        default="lease",
        help="where the extender locks a node",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root: it uses the e2e cluster", file=sys.stderr)
        return 2
    cluster = Cluster.default(control_plane_only=args.control_plane_only)
    with held_up(cluster, 900, "bench_sharing_e2e"):
        work = Path(tempfile.mkdtemp(prefix="kxpu-bench-sharing-"))
        sharing = Sharing(
            cluster,
            work,
            node_policy=args.policy,
            inventory_stale_s=3600,
            client_qps=500,
            log_level="info",
            node_lock=args.node_lock,
        )
        try:
            sharing.start(node=False)
            result = asyncio.run(run(args, sharing))
        except BaseException:
            for name, path in sharing.logs.items():
                print(f"--- {name}: {path}", file=sys.stderr)
            raise
        finally:
            sharing.close()
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "policy": args.policy,
        "baseline": args.baseline,
        "node_lock": args.node_lock,
        "cluster": "control-plane-only" if args.control_plane_only else "e2e",
        **result,
    }
    if args.json:
        print(json.dumps(report))
    else:
        mode = "baseline" if args.baseline else args.policy
        print(
            f"{report['bound']}/{report['pods']} pods bound on {args.nodes} API-only nodes ({mode}) in "
            f"{report['total_s']}s (creates took {report['create_s']}s): {report['pods_per_s']} pods/s "
            f"(target >= {TARGET_PODS_PER_S:.0f}); bind latency p50 {report['bind_p50_ms']} ms, "
            f"p99 {report['bind_p99_ms']} ms"
        )
        writes = {
            k.removeprefix("writes_per_pod_"): v for k, v in report.items() if k.startswith("writes_per_pod_")
        }
        print(
            f"per pod ({args.node_lock} lock): {report['writes_per_pod']} API writes ("
            + ", ".join(f"{k} {v}" for k, v in sorted(writes.items()))
            + f"); watch events: every-Node watcher {report['node_watch_events_per_pod']}, "
            f"lock-Lease watcher {report['lease_watch_events_per_pod']}"
        )
        cpu = {k.removesuffix("_cpu_s"): v for k, v in report.items() if k.endswith("_cpu_s")}
        print("CPU seconds used meanwhile: " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
        verbs = [k.split("_")[1] for k in report if k.startswith("extender_") and k.endswith("_requests")]
        print(
            "extender requests: "
            + ", ".join(
                f"{v} {report[f'extender_{v}_requests']} x {report[f'extender_{v}_mean_ms']} ms"
                for v in verbs
            )
        )
    return 0 if result["pods_per_s"] >= TARGET_PODS_PER_S and result["bound"] == result["pods"] else 1


if __name__ == "__main__":
    sys.exit(main())

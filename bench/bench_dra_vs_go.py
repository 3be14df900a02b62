"""kxpu's DRA driver side by side with the Go example driver (kubernetes-sigs/dra-example-driver), in one run.

On the e2e harness's cluster (``--control-plane-only`` by default: etcd, kube-apiserver, scheduler,
controller-manager; taken under its lock with ``e2e.cluster.held_up``), for one API-only Node, each contender
runs as its own process against the same API server, one after the other:

- **kxpu** (``kxpu plugin``, 64 simulated devices, ``serve: dra``), with its claim cache (``dra.claimCache``,
  the default) and without it (a GET per prepare, as before the cache);
- **go**: ``dra-example-kubeletplugin`` (built from its Go module by ``hack/dra-example/build.sh``), 64
  devices, its client's rate limit raised (``--kube-api-qps 1000 --kube-api-burst 2000``) so its own work is
  measured, not client-go's default 5 QPS;
- **bare**: ``bench/bare_dra_registrar.py``, a grpc.aio server that only registers (the floor for start-up).

This process plays the kubelet over the real sockets (``DraKubeletStandIn``: plugin registration, then the
DRAPlugin service). Per driver, ``--claims`` ResourceClaims are created with their allocation written into
``status`` as the scheduler does, once the driver's ResourceSlices are in the API; each is then prepared and
unprepared. Reported: exec → registered with the kubelet, NodePrepareResources p50/p99,
NodeUnprepareResources p50, the driver's CPU per claim (prepare + unprepare), its RSS after the claims, and
the ratios to the Go driver. ``--baseline TREE`` runs kxpu from another source tree (a git worktree of an
earlier commit) and from this one, both as ``python -S -m kxpu`` with the same claims: before and after in one
run. ``--foreign N`` then creates N claims allocated to other nodes' pools while kxpu
(with its cache) runs, and reports its RSS before and after and what its cache holds. ``--status`` adds kxpu
runs that hold the claims prepared (64 at a time, one per device) until their ``status.devices`` entries are in
the API, then unprepare them until the entries are gone, with ``dra.claimStatus`` on and off (for ``--baseline``, on, from both trees): the
CPU those writes cost per claim (the one-at-a-time runs unprepare each claim before its entries are due).

``python bench/bench_dra_vs_go.py [--claims 300] [--foreign 0] [--rounds 1] [--baseline TREE] [--status] [--json]
[--full-cluster]``; ``--startup RUNS [--baseline TREE]``: only exec → registered, without a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from lightkube import AsyncClient, codecs
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_dra import api_only_node, gather_limited
from measure import compile_tree, cpu_seconds, percentile, rss_mb

from e2e.cluster import Cluster, held_up
from kxpu.dra.prepare import ClaimRef
from kxpu.testing.dra import DraKubeletStandIn

REPO = Path(__file__).resolve().parent.parent
NODE = "kxpu-bench-vs-go"
NS = "default"
LABEL = "kxpu-bench-vs-go"
DEVICES = 64
KXPU_DRIVER = "npu.example.com"
GO_DRIVER = "gpu.example.com"  # the example driver's name (its consts.DriverName)
HTTP_PORT = 19411


def go_binary() -> Path:
    out = subprocess.run(
        [str(REPO / "hack" / "dra-example" / "build.sh")], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


class Contender:
    """One driver process in its own directory (kubelet plugin and registry directories, CDI specs). ``hold``:
    every claim is prepared before the first is unprepared, and the driver's status.devices entries are waited
    for after each half (what the claim-status writes cost)."""

    hold = False

    def __init__(self, name: str, driver: str, device: str, work: Path) -> None:
        self.name, self.driver, self.device = name, driver, device
        self.work = work
        self.registry = work / "registry"
        self.plugins = work / "plugins"
        self.cdi = work / "cdi"
        for d in (self.registry, self.plugins, self.cdi):
            d.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port: int | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, kubeconfig: Path) -> None:
        log = (self.work / "driver.log").open("ab")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "NODE_NAME": NODE}
        # In its own directory: ``python -m kxpu`` would otherwise import kxpu from the current directory first.
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.work
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def scrape(self) -> dict[str, float]:
        """kxpu's /metrics, ``name{labels}`` → value (empty for the Go driver)."""
        if self.metrics_port is None:
            return {}
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out


class Kxpu(Contender):
    def __init__(self, work: Path, cache: bool, status: bool = True, hold: bool = False) -> None:
        name = (
            ("kxpu" if cache else "kxpu-no-cache")
            + ("-held" if hold else "")
            + ("" if status else "-no-status")
        )
        super().__init__(name, KXPU_DRIVER, "sim-{i}", work)
        self.hold = hold
        self.metrics_port = HTTP_PORT
        config = {
            "version": "v1",
            "devicePluginDir": str(work / "dp"),
            "kubeletPluginsDir": str(self.plugins),
            "pluginsRegistryDir": str(self.registry),
            "resources": [
                {
                    "name": "example.com/npu",
                    "simulated": {"count": DEVICES, "model": "sim", "memoryMiB": 16384},
                    "serve": "dra",
                    # claimCache only when off: a --baseline tree from before the cache has no such key.
                    "dra": {"nodeName": NODE, "cdiSpecDir": str(self.cdi)}
                    | ({} if cache else {"claimCache": False})
                    | ({} if status else {"claimStatus": False}),
                }
            ],
        }
        (work / "config.yaml").write_text(json.dumps(config))

    def command(self) -> list[str]:
        return [
            str(REPO / ".venv" / "bin" / "kxpu"),
            "plugin",
            "--config",
            str(self.work / "config.yaml"),
            "--http-address",
            f"127.0.0.1:{HTTP_PORT}",
            "--log-level",
            "warning",
        ]


class KxpuFromTree(Kxpu):
    """``kxpu plugin`` from another source tree (``--baseline``) or this one, started the same way for both
    (``python -S -m kxpu``, the tree and this venv's site-packages on the path): start-up only."""

    def __init__(self, work: Path, tree: Path, name: str, hold: bool = False) -> None:
        super().__init__(work, cache=True, hold=hold)
        self.name, self.tree = name, tree
        self.metrics_port = None

    def command(self) -> list[str]:
        return [str(REPO / ".venv" / "bin" / "python"), "-S", "-m", "kxpu", *super().command()[1:]]

    def start(self, kubeconfig: Path) -> None:
        site = next((REPO / ".venv" / "lib").glob("python3*/site-packages"))
        os.environ["PYTHONPATH"] = f"{self.tree}:{site}"
        try:
            super().start(kubeconfig)
        finally:
            del os.environ["PYTHONPATH"]


class GoExample(Contender):
    def __init__(self, work: Path, binary: Path) -> None:
        super().__init__("go", GO_DRIVER, "gpu-{i}", work)
        self.binary = binary

    def command(self) -> list[str]:
        return [
            str(self.binary),
            f"--node-name={NODE}",
            f"--cdi-root={self.cdi}",
            f"--num-devices={DEVICES}",
            f"--kubelet-registrar-directory-path={self.registry}",
            f"--kubelet-plugins-directory-path={self.plugins}",
            "--kube-api-qps=1000",
            "--kube-api-burst=2000",
        ]


class Bare(Contender):
    def __init__(self, work: Path) -> None:
        super().__init__("bare", "bare.example.com", "", work)

    def command(self) -> list[str]:
        return [
            str(REPO / ".venv" / "bin" / "python"),
            str(REPO / "bench" / "bare_dra_registrar.py"),
            self.driver,
            str(self.registry),
            str(self.plugins),
        ]


def claim_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "labels": {LABEL: "true"}},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "bench.example.com"}}]}
        },
    }


async def allocated_claim(client: AsyncClient, name: str, driver: str, pool: str, device: str) -> ClaimRef:
    created = await client.create(codecs.from_dict(claim_body(name)))
    allocation = {
        "devices": {"results": [{"request": "gpu", "driver": driver, "pool": pool, "device": device}]}
    }
    await client.patch(
        ResourceClaim.Status,
        name,
        {"status": {"allocation": allocation}},
        namespace=NS,
        patch_type=PatchType.MERGE,
    )
    return ClaimRef(NS, str(created.metadata.uid), name)  # type: ignore[union-attr]


async def delete_claims(client: AsyncClient) -> None:
    names = [
        str(c.metadata.name)
        async for c in client.list(ResourceClaim, namespace=NS, labels={LABEL: "true"}, chunk_size=500)
        if c.metadata is not None
    ]

    async def delete(name: str) -> None:
        with contextlib.suppress(Exception):
            await client.delete(ResourceClaim, name, namespace=NS)

    await gather_limited(32, [delete(n) for n in names])


async def status_entries(client: AsyncClient, driver: str, expected: int) -> bool:
    """Whether exactly ``expected`` of the bench's claims carry ``driver``'s entries in status.devices."""
    found = 0
    async for claim in client.list(ResourceClaim, namespace=NS, labels={LABEL: "true"}, chunk_size=500):
        devices = claim.status.devices if claim.status is not None else None
        found += any(d.driver == driver for d in devices or [])
    return found == expected


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def run_contender(
    client: AsyncClient | None, c: Contender, kubeconfig: Path, claims: int
) -> dict[str, float]:
    kubelet = DraKubeletStandIn(c.registry)
    await kubelet.start()
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        c.start(kubeconfig)
        registered = await kubelet.wait_registered(c.driver, timeout=60)
        out: dict[str, float] = {
            "exec_to_registered_ms": round((registered.registered_at - started) * 1000, 1)
        }
        if not claims or client is None:
            return out

        async def published() -> bool:
            fields: dict[str, Any] = {"spec.driver": c.driver, "spec.nodeName": NODE}
            return any([s async for s in client.list(ResourceSlice, fields=fields)])

        await wait_for(published, 60, f"{c.name}'s ResourceSlices")
        tag = uuid.uuid4().hex[:6]
        refs: list[ClaimRef] = []

        async def make(i: int) -> None:
            name = f"vs-{c.name.replace('@', '-')}-{tag}-{i:04d}"
            refs.append(await allocated_claim(client, name, c.driver, NODE, c.device.format(i=i % DEVICES)))

        await gather_limited(16, [make(i) for i in range(claims)])
        refs.sort(key=lambda r: r.name)
        before = await asyncio.to_thread(c.scrape)
        assert c.proc is not None
        cpu0 = cpu_seconds(c.proc.pid)
        prepare, unprepare = [], []

        async def prepare_one(ref: ClaimRef) -> None:
            t0 = time.perf_counter()
            answer = await kubelet.prepare(c.driver, ref)
            prepare.append((time.perf_counter() - t0) * 1000)
            error = answer.claims[ref.uid].error
            if error:
                raise RuntimeError(f"{c.name}: prepare failed: {error}")

        async def unprepare_one(ref: ClaimRef) -> None:
            t0 = time.perf_counter()
            answer_u = await kubelet.unprepare(c.driver, ref)
            unprepare.append((time.perf_counter() - t0) * 1000)
            if answer_u.claims[ref.uid].error:
                raise RuntimeError(f"{c.name}: unprepare failed: {answer_u.claims[ref.uid].error}")

        if c.hold:  # as many claims at once as there are devices (the claims share them round robin)
            for start in range(0, len(refs), DEVICES):
                batch = refs[start : start + DEVICES]
                for ref in batch:
                    await prepare_one(ref)
                if "no-status" not in c.name:
                    written = functools.partial(status_entries, client, c.driver, len(batch))
                    await wait_for(written, 300, "status.devices")
                for ref in batch:
                    await unprepare_one(ref)
                if "no-status" not in c.name:
                    removed = functools.partial(status_entries, client, c.driver, 0)
                    await wait_for(removed, 300, "status.devices gone")
        else:
            for ref in refs:
                await prepare_one(ref)
                await unprepare_one(ref)
        cpu = cpu_seconds(c.proc.pid) - cpu0
        out.update(
            {
                "prepare_p50_ms": round(percentile(prepare, 50), 2),
                "prepare_p99_ms": round(percentile(prepare, 99), 2),
                "unprepare_p50_ms": round(percentile(unprepare, 50), 2),
                "cpu_ms_per_claim": round(1000 * cpu / claims, 2),
                "rss_mb": round(rss_mb(c.proc.pid), 1),
            }
        )
        after = await asyncio.to_thread(c.scrape)
        if after:
            key = 'kxpu_dra_claim_reads_total{driver="%s",source="%s"}'
            for source in ("cache", "api"):
                k = key % (c.driver, source)
                out[f"claim_reads_{source}"] = after.get(k, 0) - before.get(k, 0)
        return out
    finally:
        c.stop()
        await kubelet.stop()
        if client is not None:
            await delete_claims(client)


async def foreign(client: AsyncClient, c: Kxpu, kubeconfig: Path, count: int) -> dict[str, float]:
    """RSS of kxpu (with its cache) before and after ``count`` claims allocated to other nodes appear."""
    kubelet = DraKubeletStandIn(c.registry)
    await kubelet.start()
    try:
        c.start(kubeconfig)
        await kubelet.wait_registered(c.driver, timeout=60)
        assert c.proc is not None
        mine = await allocated_claim(client, f"vs-mine-{uuid.uuid4().hex[:6]}", c.driver, NODE, "sim-0")

        async def cached(n: float) -> bool:
            return (await asyncio.to_thread(c.scrape)).get(
                f'kxpu_dra_claim_cache_claims{{driver="{c.driver}"}}'
            ) == n

        await wait_for(lambda: cached(1), 60, "kxpu's cache to hold its node's one claim")
        rss0 = rss_mb(c.proc.pid)
        tag = uuid.uuid4().hex[:6]
        t0 = time.perf_counter()
        await gather_limited(
            32,
            [
                allocated_claim(
                    client, f"vs-far-{tag}-{i:05d}", c.driver, f"node-{i % 100}", f"sim-{i % DEVICES}"
                )
                for i in range(count)
            ],
        )
        created_s = time.perf_counter() - t0
        # Then one more of this node's: once the cache holds it, every earlier event has been handled.
        late = await allocated_claim(client, f"vs-mine-{tag}-late", c.driver, NODE, "sim-1")
        await wait_for(lambda: cached(2), 120, "kxpu's cache to see the last claim")
        rss1 = rss_mb(c.proc.pid)
        answer = await kubelet.prepare(c.driver, mine, late)
        errors = [a.error for a in answer.claims.values() if a.error]
        if errors:
            raise RuntimeError(f"prepare failed: {errors}")
        return {
            "foreign_claims": count,
            "foreign_create_s": round(created_s, 1),
            "cache_claims_after": 2,
            "rss_before_mb": round(rss0, 1),
            "rss_after_mb": round(rss1, 1),
        }
    finally:
        c.stop()
        await kubelet.stop()
        await delete_claims(client)


async def bench(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    binary = go_binary()
    client = AsyncClient(field_manager="kxpu-bench")
    results: dict[str, Any] = {}
    try:
        await api_only_node(client, NODE)
        await delete_claims(client)
        with tempfile.TemporaryDirectory(prefix="kxpu-vs-go-") as tmp:
            for _ in range(args.rounds):
                for make in (
                    lambda w: Bare(w),
                    lambda w: GoExample(w, binary),
                    lambda w: Kxpu(w, cache=True),
                    lambda w: Kxpu(w, cache=False),
                ):
                    work = Path(tempfile.mkdtemp(dir=tmp))
                    contender = make(work)
                    claims = 0 if isinstance(contender, Bare) else args.claims
                    got = await run_contender(client, contender, cluster.kubeconfig, claims)
                    for k, v in got.items():
                        results.setdefault(contender.name, {}).setdefault(k, []).append(v)
                runs: list[Contender] = []
                if args.baseline is not None:
                    runs += [
                        KxpuFromTree(Path(tempfile.mkdtemp(dir=tmp)), tree, name)
                        for name, tree in (("kxpu-start@baseline", args.baseline), ("kxpu-start@tree", REPO))
                    ]
                if args.status:  # the claims held prepared until their status is written, then unprepared
                    runs += [
                        Kxpu(Path(tempfile.mkdtemp(dir=tmp)), cache=True, hold=True),
                        Kxpu(Path(tempfile.mkdtemp(dir=tmp)), cache=True, status=False, hold=True),
                    ]
                    if args.baseline is not None:
                        runs += [
                            KxpuFromTree(Path(tempfile.mkdtemp(dir=tmp)), tree, name, hold=True)
                            for name, tree in (
                                ("kxpu-held@baseline", args.baseline),
                                ("kxpu-held@tree", REPO),
                            )
                        ]
                for run in runs:
                    try:
                        got = await run_contender(client, run, cluster.kubeconfig, args.claims)
                    except Exception as exc:  # the figures of the other runs still come out
                        print(f"{run.name}: {exc}", file=sys.stderr)
                        continue
                    for k, v in got.items():
                        results.setdefault(run.name, {}).setdefault(k, []).append(v)
            if args.foreign:
                results["foreign"] = await foreign(
                    client,
                    Kxpu(Path(tempfile.mkdtemp(dir=tmp)), cache=True),
                    cluster.kubeconfig,
                    args.foreign,
                )
    finally:
        await delete_claims(client)
        await client.close()
    # The median over rounds, per figure.
    for name, figures in results.items():
        if name != "foreign":
            results[name] = {k: sorted(v)[len(v) // 2] for k, v in figures.items()}
    return results


async def startup(runs: int, baseline: Path | None) -> dict[str, float]:
    """exec → registered without a cluster (KUBECONFIG points nowhere: the API calls fail after registration),
    interleaved runs of the bare registrar, ``--baseline``'s kxpu and this tree's; medians."""
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kxpu-startup-") as tmp:
        for _ in range(runs):
            trees = [("kxpu@baseline", baseline)] if baseline is not None else []
            for name, tree in [("bare", None), *trees, ("kxpu@tree", REPO)]:
                work = Path(tempfile.mkdtemp(dir=tmp))
                contender = Bare(work) if tree is None else KxpuFromTree(work, tree, name)
                got = await run_contender(None, contender, Path("/nonexistent"), 0)
                samples.setdefault(name, []).append(got["exec_to_registered_ms"])
    return {name: round(statistics.median(v), 1) for name, v in samples.items()}


def table(results: dict[str, Any]) -> str:
    go = results["go"]
    rows = [
        ("NodePrepareResources p50 (ms)", "prepare_p50_ms"),
        ("NodePrepareResources p99 (ms)", "prepare_p99_ms"),
        ("NodeUnprepareResources p50 (ms)", "unprepare_p50_ms"),
        ("driver CPU per claim (ms)", "cpu_ms_per_claim"),
        ("exec → registered (ms)", "exec_to_registered_ms"),
        ("RSS after the claims (MB)", "rss_mb"),
    ]
    names = ["kxpu", "kxpu-no-cache", "go", "bare"]
    lines = [
        "| | " + " | ".join(names) + " | kxpu / go | kxpu-no-cache / go |",
        "|---" * (len(names) + 3) + "|",
    ]
    for title, key in rows:
        cells = [str(results[n].get(key, "")) for n in names]
        ratios = [
            f"{results[n][key] / go[key]:.2f}x" if key in results[n] and go.get(key) else ""
            for n in ("kxpu", "kxpu-no-cache")
        ]
        lines.append(f"| {title} | " + " | ".join(cells + ratios) + " |")
    bare = results["bare"]["exec_to_registered_ms"]
    lines.append(
        f"\nexec → registered, kxpu / bare grpc.aio server: {results['kxpu']['exec_to_registered_ms'] / bare:.2f}x"
    )
    for name in ("kxpu", "kxpu-no-cache"):
        lines.append(
            f"{name}: claims read from the cache {results[name].get('claim_reads_cache', 0):g}, "
            f"by GET {results[name].get('claim_reads_api', 0):g}"
        )
    for mode, what in (("start", "one claim at a time"), ("held", "all claims held, status.devices written")):
        if f"kxpu-{mode}@baseline" not in results or f"kxpu-{mode}@tree" not in results:
            continue
        before, after = results[f"kxpu-{mode}@baseline"], results[f"kxpu-{mode}@tree"]
        lines.append(
            f"\n--baseline against this tree ({what}), both started as `python -S -m kxpu`, same claims:"
        )
        lines.append("| | baseline | this tree | tree / baseline |\n|---|---|---|---|")
        for title, key in rows:
            if key in before and key in after:
                ratio = f"{after[key] / before[key]:.2f}x" if before[key] else ""
                lines.append(f"| {title} | {before[key]} | {after[key]} | {ratio} |")
    if "kxpu-held" in results and "kxpu-held-no-status" in results:
        held, quiet = results["kxpu-held"], results["kxpu-held-no-status"]
        lines.append(
            f"\nall claims held (prepared, then unprepared): CPU per claim {held['cpu_ms_per_claim']} ms with "
            f"claim-status writes, {quiet['cpu_ms_per_claim']} ms without: "
            f"{held['cpu_ms_per_claim'] - quiet['cpu_ms_per_claim']:.2f} ms per claim for its two status writes"
        )
    if "foreign" in results:
        f = results["foreign"]
        lines.append(
            f"{f['foreign_claims']} claims allocated to other nodes: kxpu RSS {f['rss_before_mb']} → "
            f"{f['rss_after_mb']} MB, its cache holds {f['cache_claims_after']} (its node's two)"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--foreign", type=int, default=0, help="claims allocated to other nodes (e.g. 10000)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every contender; the median is reported"
    )
    parser.add_argument(
        "--full-cluster", action="store_true", help="the normal cluster, not the control plane"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another kxpu source tree (a git worktree): its start-up and claims beside this tree's",
    )
    parser.add_argument(
        "--startup",
        type=int,
        metavar="RUNS",
        help="only exec → registered, without a cluster (no root): RUNS interleaved runs of each",
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="also hold every claim prepared until kxpu wrote its status.devices, with and without those writes",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for tree in (args.baseline, REPO):  # every kxpu this bench starts, as it ships: compiled
        if tree is not None:
            compile_tree(REPO / ".venv" / "bin" / "python", tree)
    if args.startup:
        medians = asyncio.run(startup(args.startup, args.baseline))
        print(
            f"exec → registered, no cluster, medians of {args.startup} interleaved runs ({os.cpu_count()} CPUs):"
        )
        for name, ms in medians.items():
            print(f"  {name}: {ms} ms")
        return 0
    if os.geteuid() != 0:
        print("bench_dra_vs_go.py needs root (the e2e cluster)", file=sys.stderr)
        return 2
    cluster = Cluster.default(control_plane_only=not args.full_cluster)
    with held_up(cluster, wait=3600, purpose="bench_dra_vs_go"):
        results = asyncio.run(bench(cluster, args))
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    print(
        f"kxpu vs the Go DRA example driver, {os.cpu_count()} CPUs ({cpu}), Python {sys.version.split()[0]}\n"
    )
    print(table(results))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The DRA driver's own CPU per claim, over its real socket, with the API server out of the way; and its profile.

A server process runs kxpu's ``Preparer`` (64 simulated devices, the checkpoint and CDI specs on disk) behind
the DRAPlugin v1 service on a unix socket, its claims in its claim cache as the watch would have put them there
(what answers prepare in a daemon: no round trip); this process calls ``NodePrepareResources`` then
``NodeUnprepareResources`` for each claim, one at a time, as the kubelet does for a pod, after a warm-up.
Reported: the server's CPU time per claim (prepare + unprepare), prepare p50, and the same for a bare grpc.aio
server answering the same calls with fixed answers (the floor). ``--files-floor`` adds a bare server that also does
the file work kxpu must do for each claim and nothing else (the claim's CDI spec written atomically and removed, the
checkpoint written durably for the prepare and again for the unprepare, through ``kxpu.atomicfile`` as kxpu does):
the floor of gRPC and those files on this machine. ``--baseline TREE`` runs another kxpu source
tree's server in turn with this one (interleaved rounds: before and after on the same machine, same load).
``--profile FILE`` then runs this tree's server once more under cProfile (CPU time, not wall; not counted in the
figures) and writes its profile for ``python -m pstats``.

``python bench/bench_dra_prepare_cpu.py [--claims 320] [--rounds 3] [--baseline TREE] [--files-floor]
[--profile FILE]``.
Needs no cluster and no root.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

# After PYTHONPATH, which names the tree a server imports kxpu from (``--baseline``).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from measure import cpu_seconds, percentile

from kxpu.api.dra.v1 import api_pb2 as dra
from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
from kxpu.atomicfile import write_atomically

REPO = Path(__file__).resolve().parent.parent
DRIVER = "npu.example.com"
NODE = "node-a"
WARM_UP = 20


async def serve(work: Path, claims: int, bare: bool, files: bool, profile: str | None) -> None:
    """The server side (``--serve``): writes the claims' references to ``work/refs.json``, then ``work/ready``."""
    from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
    from kxpu.dra.checkpoint import Checkpoint
    from kxpu.dra.claim_cache import ClaimCache
    from kxpu.dra.prepare import Preparer
    from kxpu.dra.service import DraPluginServicer
    from kxpu.logs import configure_logging
    from kxpu.model import index_by_id
    from kxpu.testing.dra import FakeDraApi

    configure_logging("warning", "json")
    import kxpu  # where from: a --baseline server importing this tree's would measure the wrong code

    (work / "kxpu-from").write_text(str(Path(kxpu.__file__).resolve().parent.parent))
    backend = SimulatedBackend(SimulatedConfig(count=64, model="sim", env={"NPU_VISIBLE_DEVICES": "{ids}"}))
    api = FakeDraApi()
    refs = [
        api.add_claim(
            f"c{i:04d}", [{"request": "npu", "driver": DRIVER, "pool": NODE, "device": f"sim-{i % 64}"}]
        )
        for i in range(claims)
    ]
    (work / "refs.json").write_text(json.dumps([[r.namespace, r.uid, r.name] for r in refs]))
    server = grpc.aio.server()
    if bare:
        dra_grpc.add_DRAPluginServicer_to_server(Bare(work if files else None), server)
    else:
        checkpoint = Checkpoint(work / "plugins" / "checkpoint.json", DRIVER)
        checkpoint.load()
        devices = index_by_id(backend.discover())
        preparer = Preparer(DRIVER, NODE, backend, devices, checkpoint, work / "cdi", api)
        preparer.claim_cache = cache = ClaimCache(DRIVER, NODE)
        for claim in api.claims.values():
            cache.apply("ADDED", claim)
        cache.synced = True
        dra_grpc.add_DRAPluginServicer_to_server(DraPluginServicer(preparer, NODE), server)
    server.add_insecure_port(f"unix://{work}/dra.sock")
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    profiler = cProfile.Profile(time.process_time) if profile else None
    if profiler is not None:
        loop.add_signal_handler(signal.SIGUSR1, profiler.enable)  # after the warm-up
    (work / "ready").touch()
    await stop.wait()
    if profiler is not None and profile:
        profiler.disable()
        profiler.dump_stats(profile)
    await server.stop(0)


class Bare(dra_grpc.DRAPluginServicer):
    """The floor: the same calls answered with fixed answers; with ``work``, after kxpu's file work for each
    claim (the same files, as large as kxpu's, written the same way), the loop blocked as kxpu's is."""

    def __init__(self, work: Path | None = None) -> None:
        self.work = None if work is None else str(work)
        if self.work is not None:
            os.makedirs(f"{self.work}/cdi")
            os.makedirs(f"{self.work}/plugins")

    def _spec(self, uid: str) -> str:
        return f"{self.work}/cdi/kxpu-dra-{DRIVER}-{uid}.json"

    def _checkpoint(self, claims: dict[str, Any]) -> None:
        text = json.dumps({"version": "v1", "driver": DRIVER, "claims": claims}, separators=(",", ":"))
        write_atomically(f"{self.work}/plugins/checkpoint.json", text + "\n", mode=0o600, durable=True)

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Any
    ) -> dra.NodePrepareResourcesResponse:
        if self.work is not None:
            recorded = {}
            for claim in request.claims:
                cdi = f"{DRIVER}/claim={claim.uid}-npu"
                device = {
                    "name": f"{claim.uid}-npu",
                    "containerEdits": {"env": ["NPU_VISIBLE_DEVICES=sim-0"]},
                }
                spec = {"cdiVersion": "0.5.0", "kind": f"{DRIVER}/claim", "devices": [device]}
                write_atomically(self._spec(claim.uid), json.dumps(spec, separators=(",", ":")) + "\n")
                recorded[claim.uid] = {
                    "namespace": claim.namespace,
                    "name": claim.name,
                    "cdiSpec": self._spec(claim.uid),
                    "devices": [
                        {
                            "requests": ["npu"],
                            "pool": NODE,
                            "device": "sim-0",
                            "id": "sim-0",
                            "cdiDeviceIDs": [cdi],
                        }
                    ],
                }
            self._checkpoint(recorded)
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].devices.add(
                request_names=["npu"], pool_name=NODE, device_name="sim-0", cdi_device_ids=["x/y=z"]
            )
        return response

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Any
    ) -> dra.NodeUnprepareResourcesResponse:
        if self.work is not None:
            for claim in request.claims:
                os.unlink(self._spec(claim.uid))
            self._checkpoint({})
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].error = ""
        return response


def start(command: list[str], tree: Path, work: Path) -> subprocess.Popen[bytes]:
    """The server, importing kxpu from ``tree`` first."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(command, env=env, cwd=work)


async def drive(name: str, tree: Path, claims: int, profile: str | None) -> dict[str, float]:
    """One server (``tree``'s kxpu, or the bare one) driven over its socket; its CPU per claim, prepare p50."""
    with tempfile.TemporaryDirectory(prefix="kxpu-prepare-cpu-") as tmp:
        work = Path(tmp)
        command = [sys.executable, __file__, "--serve", str(work), "--claims", str(claims)]
        command += ["--bare"] if name.startswith("bare") else []
        command += ["--files"] if name == "bare+files" else []
        command += ["--profile", profile] if profile else []
        proc = start(command, tree, work)
        try:
            deadline = time.monotonic() + 60
            while not (work / "ready").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: the server did not start (exit {proc.poll()})")
                await asyncio.sleep(0.02)
            imported = (work / "kxpu-from").read_text()
            if Path(imported) != tree.resolve():
                raise RuntimeError(f"{name}: the server imported kxpu from {imported}, not {tree}")
            refs = [
                dra.Claim(namespace=n, uid=u, name=c)
                for n, u, c in json.loads((work / "refs.json").read_text())
            ]
            async with grpc.aio.insecure_channel(f"unix://{work}/dra.sock") as channel:
                stub = dra_grpc.DRAPluginStub(channel)

                async def pair(ref: dra.Claim) -> float:
                    started = time.perf_counter()
                    answer = await stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=[ref]))
                    took = time.perf_counter() - started
                    if answer.claims[ref.uid].error:
                        raise RuntimeError(f"{name}: prepare failed: {answer.claims[ref.uid].error}")
                    await stub.NodeUnprepareResources(dra.NodeUnprepareResourcesRequest(claims=[ref]))
                    return took

                for ref in refs[:WARM_UP]:
                    await pair(ref)
                if profile:
                    proc.send_signal(signal.SIGUSR1)
                cpu = cpu_seconds(proc.pid)
                latencies = [await pair(ref) for ref in refs[WARM_UP:]]
                cpu = cpu_seconds(proc.pid) - cpu
            measured = len(refs) - WARM_UP
            return {
                "cpu_ms_per_claim": round(1000 * cpu / measured, 2),
                "prepare_p50_ms": round(1000 * percentile(latencies, 50), 2),
            }
        finally:
            proc.terminate()
            proc.wait(20)


async def bench(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    contenders = [
        ("bare", REPO),
        *([("bare+files", REPO)] if args.files_floor else []),
        *([("kxpu@baseline", args.baseline)] if args.baseline else []),
        ("kxpu", REPO),
    ]
    samples: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for name, tree in contenders:
            for key, value in (await drive(name, tree, args.claims, None)).items():
                samples.setdefault(name, {}).setdefault(key, []).append(value)
    if args.profile:  # a run of its own: the profiler's cost is not counted in the figures
        await drive("kxpu", REPO, args.claims, args.profile)
    return {name: {k: statistics.median(v) for k, v in got.items()} for name, got in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--claims", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--baseline", type=Path, help="another kxpu source tree, run in turn with this one")
    parser.add_argument(
        "--files-floor", action="store_true", help="also a bare server doing kxpu's file work for each claim"
    )
    parser.add_argument("--profile", help="write a cProfile (CPU time) of this tree's server here")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--files", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.claims, args.bare, args.files, args.profile))
        return 0
    results = asyncio.run(bench(args))
    load = os.getloadavg()[0]
    print(
        f"DRA driver CPU over its socket, {os.cpu_count()} CPUs, load {load:.1f}, medians of {args.rounds}:"
    )
    for name, figures in results.items():
        print(
            f"  {name}: {figures['cpu_ms_per_claim']} ms CPU per claim, prepare p50 {figures['prepare_p50_ms']} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

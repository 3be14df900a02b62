"""Per-share truth for every vendor that reports per-process memory: the real ``amd``, ``ascend``, ``cambricon`` and
``neuron`` (through neuron-monitor) backends over their fakes as the daemon's telemetry sources, two containers sharing one device (each with the grant
the sharing extender wrote into its Allocate response, kept in the kubelet's checkpoint), processes tied to them
through /proc/<pid>/cgroup: each container's use against its grant, the over-grant signal, and the vendor label."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kxpu.backends.amd import AmdBackend, AmdConfig
from kxpu.backends.ascend import AscendBackend, AscendConfig
from kxpu.backends.ascend.dcmi import DcmiSource
from kxpu.backends.cambricon import CambriconBackend, CambriconConfig
from kxpu.backends.host import Host
from kxpu.backends.neuron import NeuronBackend, NeuronConfig
from kxpu.config import parse_config
from kxpu.daemon import telemetry_metrics
from kxpu.daemon.telemetry import SourceView, TelemetrySampler
from kxpu.model import Backend, Grant, index_by_id
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_amd import FakeAmd
from kxpu.testing.fake_cambricon import FakeCambricon
from kxpu.testing.fake_dcmi import FakeDcmi
from kxpu.testing.fake_neuron import FakeNeuron
from tests.test_telemetry import checkpoint

GIB = 1024**3
MIB = 1024**2
UIDS = ("1b7c8f5e-3f0d-4d7e-8a1c-5d0c6b9e2a41", "2b7c8f5e-3f0d-4d7e-8a1c-5d0c6b9e2a42")
PIDS = (4242, 4343)


@dataclass
class Vendor:
    resource: str
    backend: Backend
    run: Callable[[list[tuple[int, int]]], None]  # [(pid, bytes)] on device 0
    cleanup: Callable[[], None]


def amd(tmp: Path) -> Vendor:
    fake = FakeAmd("mi210-4x-xgmi")
    backend = AmdBackend(AmdConfig.model_validate({"hostRoot": str(fake.root)}))

    def run(processes: list[tuple[int, int]]) -> None:
        for pid, used in processes:
            fake.run_process(pid, {(0, 0): used})

    return Vendor("amd.com/gpu", backend, run, fake.cleanup)


def ascend(tmp: Path) -> Vendor:
    fake = FakeDcmi("910b-8x", tmp / "dcmi")
    config = AscendConfig.model_validate({"hostRoot": str(fake.root)})
    config.resource_name("huawei.com/Ascend910")
    backend = AscendBackend(config, DcmiSource(fake.root, fake))
    return Vendor("huawei.com/Ascend910", backend, lambda p: fake.set_usage(0, processes=p), fake.cleanup)


def cambricon(tmp: Path) -> Vendor:
    fake = FakeCambricon("mlu370-x8-4x")
    config = CambriconConfig.model_validate({"hostRoot": str(fake.root)})
    backend = CambriconBackend(config, library=fake.library, host=Host(fake.root))

    def run(processes: list[tuple[int, int]]) -> None:
        fake.set_usage(0, processes=[(pid, used // 1024) for pid, used in processes])  # cndev counts KiB

    return Vendor("cambricon.com/mlu", backend, run, fake.cleanup)


def neuron(tmp: Path) -> Vendor:
    """Per-process memory from neuron-monitor (the fake one, a real child process), each process on its own core."""
    fake = FakeNeuron("trn1-32xl-tools")
    config = NeuronConfig.model_validate({"hostRoot": str(fake.root), "neuronMonitor": {"periodSeconds": 1}})
    backend = NeuronBackend(config)

    def run(processes: list[tuple[int, int]]) -> None:
        for core, (pid, used) in enumerate(processes):
            fake.run_app(pid, {core: (25.0, {"tensors": used})})
        deadline = time.monotonic() + 20
        while {p.pid for p in backend.sample().processes} != {pid for pid, _ in processes}:
            assert time.monotonic() < deadline, "neuron-monitor did not report the processes"
            time.sleep(0.05)

    return Vendor("aws.amazon.com/neuron", backend, run, fake.cleanup)


VENDORS: dict[str, Callable[[Path], Vendor]] = {
    "amd": amd,
    "ascend": ascend,
    "cambricon": cambricon,
    "neuron": neuron,
}


@pytest.fixture(params=sorted(VENDORS))
def vendor(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Vendor]]:
    made = VENDORS[request.param](tmp_path)
    yield request.param, made
    close = getattr(made.backend, "close", None)
    if close is not None:
        close()
    made.cleanup()


async def test_each_share_is_its_containers_use_against_its_grant(
    vendor: tuple[str, Vendor], workdir: Path, plugin_dir: Path
) -> None:
    name, v = vendor
    devices = index_by_id(v.backend.discover())
    device = min(devices.values(), key=lambda d: d.index if d.index is not None else 0)
    uuid = device.uuid or device.id
    socket = workdir / "pr.sock"
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    host = workdir / "host"
    for uid, pid in zip(UIDS, PIDS, strict=True):
        (host / "proc" / str(pid)).mkdir(parents=True)
        (host / "proc" / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{uid}/{'d' * 64}\n")
    kubelet.assignments[("ml", "a", "main")] = [(v.resource, [device.id])]
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            "resources": [{"name": "x.com/any", "simulated": {"count": 1}}],
            "podResourcesSocket": str(socket),
            "telemetry": {"enabled": True, "hostRoot": str(host)},
        }
    )
    # Two shares of device 0, as the extender granted them (4 GiB and 30 %, 8 GiB and 50 %); each share has its
    # own ID of the device (the sharing wrapper's slots), as the kubelet allocates one ID to one container.
    slot = f"{device.id}::1"
    (plugin_dir / "kubelet_internal_checkpoint").write_text(
        checkpoint(
            (UIDS[0], "main", v.resource, [device.id], [Grant(uuid, 4 * GIB, 0.3)]),
            (UIDS[1], "main", v.resource, [slot], [Grant(uuid, 8 * GIB, 0.5)]),
        )
    )
    kubelet.assignments[("ml", "b", "main")] = [(v.resource, [slot])]
    snapshot: dict[str, Any] = {**devices, slot: device}
    views = [SourceView(v.resource, v.backend, snapshot)]
    sampler = TelemetrySampler(lambda: config, lambda: views)
    telemetry_metrics.COLLECTOR.source = lambda: sampler.latest
    try:
        v.run([(PIDS[0], 5 * GIB), (PIDS[1], 2 * GIB)])
        snap = await sampler.tick()
        assert not snap.errors, snap.errors
        assert {d.vendor for _, d in snap.devices} == {name}
        used = {c.pod: c for c in snap.containers if c.pod}
        assert set(used) == {"a", "b"}, snap.containers
        a, b = used["a"], used["b"]
        assert (a.uuid, a.memory_used_bytes, a.grant) == (uuid, 5 * GIB, Grant(uuid, 4 * GIB, 0.3))
        assert (b.memory_used_bytes, b.grant) == (2 * GIB, Grant(uuid, 8 * GIB, 0.5))
        assert a.memory_exceeded and not b.memory_exceeded
        assert snap.over == {(a.key, "memory")}
        status = {c["pod"]: c for c in sampler.status()["containers"]}
        assert status["a"]["overGrant"] and not status["b"]["overGrant"]
        assert status["a"]["memoryGrantedBytes"] == 4 * GIB
    finally:
        telemetry_metrics.COLLECTOR.source = None
        await kubelet.stop()

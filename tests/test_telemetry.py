"""Telemetry's parts: the grants annotation, the process → pod join (cgroups, the kubelet's checkpoint,
PodResources), the sampler's excursions and metrics, the nvidia backend's sample over the fake NVML (which
holds the binding's shapes and errors), and the simulated backend's."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import REGISTRY

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.config import parse_config
from kxpu.daemon import telemetry_metrics
from kxpu.daemon.holders import (
    CheckpointReader,
    HolderError,
    ProcessOwner,
    attribute,
    build_holders,
    owner_of,
    parse_checkpoint,
)
from kxpu.daemon.telemetry import SourceView, TelemetrySampler
from kxpu.daemon.telemetry_snapshot import GrantExceeded
from kxpu.model import (
    BackendError,
    Grant,
    GrantError,
    TelemetrySample,
    TelemetrySource,
    decode_grants,
    encode_grants,
    find_capability,
)
from kxpu.sharing.node import SharingBackend
from kxpu.testing import KubeletStandIn
from kxpu.testing.fake_nvml import FakeNvml, FakeProcess
from tests.nvidia_support import make
from tests.test_sharing_node import sharing

UID = "0b7c8f5e-3f0d-4d7e-8a1c-5d0c6b9e2a41"
CID = "c" * 64
MIB = 2**20


# ---------------------------------------------------------------------------------------------- grants


def test_grants_round_trip_and_refuse_garbage() -> None:
    grants = [Grant("GPU-1", 3000 * MIB, 0.3), Grant("GPU-2", None, None)]
    assert decode_grants(encode_grants(grants)) == grants
    for text, message in [
        ("{", "not JSON"),
        ('{"uuid": "x"}', "must be a JSON list"),
        ('[{"memoryMiB": 1}]', "needs a uuid"),
        ('[{"uuid": "x", "memoryMiB": -1}]', "memoryMiB must be a non-negative integer"),
        ('[{"uuid": "x", "cores": true}]', "cores must be a non-negative integer"),
    ]:
        with pytest.raises(GrantError, match=message):
            decode_grants(text)


# ---------------------------------------------------------------------------------------------- the join


@pytest.mark.parametrize(
    "cgroup",
    [
        f"4:memory:/kubepods/burstable/pod{UID}/{CID}\n",  # v1, cgroupfs driver
        f"12:pids:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",  # v1, systemd driver
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
        f"crio-{CID}.scope\n",  # v2, CRI-O
        f"0::/kubepods/pod{UID}/{CID}\n",  # v2, cgroupfs, guaranteed QoS
    ],
)
def test_a_process_is_found_in_its_pod_from_any_cgroup_layout(tmp_path: Path, cgroup: str) -> None:
    (tmp_path / "proc" / "77").mkdir(parents=True)
    (tmp_path / "proc" / "77" / "cgroup").write_text(cgroup)
    assert owner_of(tmp_path, 77) == ProcessOwner(UID, CID)


def test_processes_outside_pods_or_gone_have_no_owner(tmp_path: Path) -> None:
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "cgroup").write_text("0::/init.scope\n1:name=systemd:/\n")
    assert owner_of(tmp_path, 1) is None
    assert owner_of(tmp_path, 2) is None  # no such process (any more)


def _alloc(grants: list[Grant] | None) -> str:
    response = pb.ContainerAllocateResponse(envs={"A": "1"})
    if grants is not None:
        response.annotations["kxpu.io/grants"] = encode_grants(grants)
    return base64.b64encode(response.SerializeToString()).decode()


def checkpoint(*entries: tuple[str, str, str, list[str], list[Grant] | None]) -> str:
    return json.dumps(
        {
            "Data": {
                "PodDeviceEntries": [
                    {
                        "PodUID": uid,
                        "ContainerName": container,
                        "ResourceName": resource,
                        "DeviceIDs": {"0": ids},
                        "AllocResp": _alloc(grants),
                    }
                    for uid, container, resource, ids, grants in entries
                ],
                "RegisteredDevices": {},
            },
            "Checksum": 1234,
        }
    )


def test_the_checkpoint_gives_pod_uids_containers_devices_and_grants(tmp_path: Path) -> None:
    text = checkpoint(
        ("u1", "main", "nvidia.com/gpu", ["GPU-a::0"], [Grant("GPU-a", 3000 * MIB, 0.3)]),
        ("u1", "side", "nvidia.com/gpu", ["GPU-a::1"], None),
        ("u2", "main", "example.com/npu", ["npu-0"], None),
    )
    entries = parse_checkpoint(text)
    assert [(e.pod_uid, e.container, e.device_ids) for e in entries] == [
        ("u1", "main", ("GPU-a::0",)),
        ("u1", "side", ("GPU-a::1",)),
        ("u2", "main", ("npu-0",)),
    ]
    assert entries[0].grants == (Grant("GPU-a", 3000 * MIB, 0.3),) and entries[1].grants == ()
    # An odd entry is skipped, the rest kept; a file that is no checkpoint is an error naming it.
    odd = json.loads(text)
    odd["Data"]["PodDeviceEntries"].insert(0, {"PodUID": "x"})
    assert len(parse_checkpoint(json.dumps(odd))) == 3
    reader = CheckpointReader(tmp_path / "kubelet_internal_checkpoint")
    assert reader.refresh() and reader.entries == []  # no file yet: nothing held
    reader.path.write_text("garbage")
    with pytest.raises(HolderError, match="kubelet_internal_checkpoint: not a kubelet device checkpoint"):
        reader.refresh()
    reader.path.write_text(text)
    assert reader.refresh() and len(reader.entries) == 3
    assert not reader.refresh()  # unchanged: not read again


def test_processes_are_given_to_the_container_holding_their_device() -> None:
    entries = parse_checkpoint(
        checkpoint(
            ("u1", "main", "nvidia.com/gpu", ["GPU-a::0"], [Grant("GPU-a", 3000 * MIB, 0.3)]),
            ("u2", "a", "nvidia.com/gpu", ["GPU-b::0"], None),
            ("u2", "b", "nvidia.com/gpu", ["GPU-b::1"], None),
            ("u3", "gone", "nvidia.com/gpu", ["GPU-b::2"], None),  # no longer in PodResources
        )
    )
    placed = {
        ("nvidia.com/gpu", "GPU-a::0"): ("ml", "train", "main"),
        ("nvidia.com/gpu", "GPU-b::0"): ("ml", "pair", "a"),
        ("nvidia.com/gpu", "GPU-b::1"): ("ml", "pair", "b"),
    }
    uuid_of = {"nvidia.com/gpu": {f"GPU-{g}::{n}": f"GPU-{g}" for g in "ab" for n in range(4)}}
    holders = build_holders(entries, placed, uuid_of)
    assert set(holders) == {"u1", "u2"}
    who = attribute(ProcessOwner("u1"), "GPU-a", holders)
    assert (who.namespace, who.pod, who.container, who.grant) == (
        "ml",
        "train",
        "main",
        Grant("GPU-a", 3000 * MIB, 0.3),
    )
    # Two containers of one pod on one device: the pod is known, the container is not.
    pair = attribute(ProcessOwner("u2"), "GPU-b", holders)
    assert (pair.namespace, pair.pod, pair.container) == ("ml", "pair", "")
    # A pod's process on a device it does not hold; a process of no pod.
    assert attribute(ProcessOwner("u1"), "GPU-b", holders).container == ""
    assert attribute(None, "GPU-a", holders).pod == ""
    assert attribute(ProcessOwner("u9"), "GPU-a", holders).pod_uid == "u9"


# ---------------------------------------------------------------------------------------------- the sampler


class Scripted:
    """A telemetry source whose samples the test sets."""

    def __init__(self) -> None:
        self.sample_value = TelemetrySample()
        self.fail: Exception | None = None

    def sample(self) -> TelemetrySample:
        if self.fail is not None:
            raise self.fail
        return self.sample_value


async def test_the_sampler_ties_use_to_grants_and_reports_each_excursion_once(
    workdir: Path, plugin_dir: Path
) -> None:
    from kxpu.model import DeviceUsage, ProcessUsage

    socket = workdir / "pr.sock"
    kubelet = KubeletStandIn(plugin_dir, pod_resources_socket=socket)
    await kubelet.start()
    host = workdir / "host"
    for pid in (10, 11):
        (host / "proc" / str(pid)).mkdir(parents=True)
        (host / "proc" / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{UID}/{CID}\n")
    (plugin_dir / "kubelet_internal_checkpoint").write_text(
        checkpoint((UID, "main", "x.com/gpu", ["g0::0"], [Grant("G0", 1000 * MIB, 0.5)]))
    )
    kubelet.assignments[("ml", "train", "main")] = [("x.com/gpu", ["g0::0"])]
    config = parse_config(
        {
            "version": "v1",
            "devicePluginDir": str(plugin_dir),
            "resources": [{"name": "x.com/gpu", "simulated": {"count": 1}}],
            "podResourcesSocket": str(socket),
            "telemetry": {"enabled": True, "hostRoot": str(host)},
        }
    )
    source = Scripted()
    from kxpu.model import Device

    views = [SourceView("x.com/gpu", source, {"g0::0": Device("g0::0", uuid="G0")})]  # type: ignore[arg-type]
    reported: list[GrantExceeded] = []

    async def on_exceeded(event: GrantExceeded) -> None:
        reported.append(event)

    sampler = TelemetrySampler(lambda: config, lambda: views, on_exceeded)
    telemetry_metrics.COLLECTOR.source = lambda: sampler.latest

    def process(pid: int, mib: int, compute: float | None = None) -> ProcessUsage:
        return ProcessUsage("G0", pid, mib * MIB, compute)

    try:
        device = DeviceUsage(
            "G0", 0, "gpu", 0.5, 0.1, 900 * MIB, 16000 * MIB, 100.0, 40.0, {"sm": 1e9}, {}, {79: 1}
        )
        source.sample_value = TelemetrySample((device,), (process(10, 400, 0.2), process(11, 500, 0.1)))
        snap = await sampler.tick()
        (usage,) = snap.containers
        assert (usage.namespace, usage.pod, usage.container, usage.pids) == ("ml", "train", "main", (10, 11))
        assert usage.memory_used_bytes == 900 * MIB and usage.compute_utilization == pytest.approx(0.3)
        assert not snap.over and not reported

        source.sample_value = TelemetrySample((device,), (process(10, 900), process(11, 500, 0.6)))
        snap = await sampler.tick()
        assert snap.over == {(usage.key, "memory"), (usage.key, "compute")}
        await sampler.tick()  # still over: no second report
        await asyncio.sleep(0)
        assert sorted(e.kind for e in reported) == ["compute", "memory"]
        memory = next(e for e in reported if e.kind == "memory")
        assert memory.message == (
            "container main of pod ml/train uses 1.37 GiB of device memory, granted 0.98 GiB on G0 (x.com/gpu)"
        )
        labels = {
            "resource": "x.com/gpu",
            "device": "G0",
            "uuid": "G0",
            "namespace": "ml",
            "pod": "train",
            "container": "main",
            "claim": "",
        }
        sample = REGISTRY.get_sample_value
        assert sample("kxpu_container_grant_exceeded_total", {**labels, "kind": "memory"}) == 1
        assert sample("kxpu_container_over_grant", {**labels, "kind": "compute"}) == 1
        assert sample("kxpu_container_memory_granted_bytes", labels) == 1000 * MIB
        assert (
            sample(
                "kxpu_device_xid_errors_total",
                {"resource": "x.com/gpu", "device": "G0", "uuid": "G0", "vendor": "", "xid": "79"},
            )
            == 1
        )
        assert (
            sample(
                "kxpu_device_clock_hertz",
                {"resource": "x.com/gpu", "device": "G0", "uuid": "G0", "vendor": "", "clock": "sm"},
            )
            == 1e9
        )

        source.sample_value = TelemetrySample((device,), (process(10, 100),))
        snap = await sampler.tick()
        assert not snap.over and sample("kxpu_container_over_grant", {**labels, "kind": "memory"}) == 0
        source.sample_value = TelemetrySample((device,), (process(10, 5000),))
        await sampler.tick()
        assert sample("kxpu_container_grant_exceeded_total", {**labels, "kind": "memory"}) == 2

        # Sources that fail are reported, not fatal; a container that is gone stops being exported.
        source.fail = BackendError("NVML is not initialized")
        (kubelet.pod_resources_socket or socket).unlink()
        snap = await sampler.tick()
        assert snap.errors == ("x.com/gpu: sampling failed: NVML is not initialized",)
        assert sample("kxpu_container_memory_used_bytes", labels) is None
        assert sample("kxpu_container_grant_exceeded_total", {**labels, "kind": "memory"}) is None
        assert sampler.status()["errors"] == list(snap.errors)
    finally:
        telemetry_metrics.COLLECTOR.source = None
        await kubelet.stop()


def test_telemetry_is_found_through_wrappers() -> None:
    backend = SimulatedBackend(SimulatedConfig.model_validate({"count": 2}))
    wrapped = SharingBackend(backend, "x.com/npu", sharing(), lambda: None, "node")  # type: ignore[arg-type,return-value]
    assert find_capability(wrapped, TelemetrySource) is backend  # type: ignore[type-abstract]
    assert not isinstance(wrapped, TelemetrySource)


def test_telemetry_config_is_validated() -> None:
    base: dict[str, Any] = {"version": "v1", "resources": [{"name": "x.com/a", "simulated": {"count": 1}}]}
    config = parse_config({**base, "telemetry": {"enabled": True}})
    assert config.kubelet_checkpoint == Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
    for bad, message in [
        ({"intervalSeconds": 0}, "telemetry.intervalSeconds: Input should be greater than or equal to 0.1"),
        ({"hostRoot": "host"}, "telemetry.hostRoot: host must be an absolute path"),
        ({"sample": True}, "telemetry.sample: Extra inputs are not permitted"),
    ]:
        with pytest.raises(Exception, match=message):
            parse_config({**base, "telemetry": bad})


# ---------------------------------------------------------------------------------------------- backends


def test_nvidia_sample_reads_the_gpus_and_their_processes() -> None:
    backend, fake = make("a100-8x", devices=[0, 1])
    try:
        fake.set_processes(0, [FakeProcess(100, 2048, sm_util=40), FakeProcess(101, None, mps=True)])
        fake.set_telemetry(
            0,
            utilization=(55, 20),
            power_mw=301500,
            temperature_c=61,
            ecc={(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 3},
        )
        fake.inject_xid(0, 13)  # an application Xid: ignored for health, counted for telemetry
        sample = backend.sample()
        assert [d.uuid for d in sample.devices] == [fake.gpus[0].uuid, fake.gpus[1].uuid]
        d0 = sample.devices[0]
        assert (d0.compute_utilization, d0.memory_bandwidth_utilization) == (0.55, 0.2)
        assert (d0.power_watts, d0.temperature_celsius) == (301.5, 61.0)
        assert d0.memory_used_bytes == 2048 * MIB and d0.memory_total_bytes == 81920 * MIB
        assert d0.clocks_hz == {"sm": 210e6, "memory": 1593e6, "graphics": 210e6}
        assert d0.ecc_errors == {"corrected": 3, "uncorrected": 0}
        procs = {p.pid: p for p in sample.processes}
        assert procs[100].memory_used_bytes == 2048 * MIB and procs[100].compute_utilization == 0.4
        assert procs[101].memory_used_bytes is None and procs[101].compute_utilization is None
        again = backend.sample()  # no newer per-process sample than the one read: no SM share
        assert {p.pid: p.compute_utilization for p in again.processes}[100] in (0.4, None)
    finally:
        backend.close()
    with pytest.raises(BackendError, match="NVML is not initialized"):
        backend.sample()


async def test_nvidia_xids_are_counted_from_the_health_thread() -> None:
    backend, fake = make("a100-8x", devices=[0], event_wait_ms=50)
    updates = backend.watch()
    try:
        await anext(updates)
        fake.inject_xid(0, 13)
        fake.inject_xid(0, 13)
        deadline = asyncio.get_running_loop().time() + 5
        while backend.sample().devices[0].xid_errors != {13: 2}:
            assert asyncio.get_running_loop().time() < deadline, backend.sample().devices[0]
            await asyncio.sleep(0.02)
    finally:
        await updates.aclose()
        backend.close()


def test_nvidia_sample_under_mig_reports_processes_by_mig_device() -> None:
    backend, fake = make("h100-mig-mixed", migStrategy="mixed", migProfile="3g.40gb")
    try:
        gpu = fake.gpus[0]
        mig = gpu.migs[0]
        fake.set_processes(0, [FakeProcess(7, 1024, gi=mig.gi, ci=mig.ci)])
        sample = backend.sample()
        (device,) = sample.devices
        assert device.uuid == gpu.uuid and device.compute_utilization is None  # not offered in MIG mode
        assert [(p.uuid, p.pid) for p in sample.processes] == [(mig.uuid, 7)]
    finally:
        backend.close()


def test_fake_nvml_telemetry_calls_have_the_bindings_shapes_and_errors() -> None:
    fake = FakeNvml("h100-mig-mixed")
    fake.nvmlInit()
    whole, mig_on = fake.nvmlDeviceGetHandleByIndex(1), fake.nvmlDeviceGetHandleByIndex(0)
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(mig_on, 0)

    def code(call: Any) -> int | None:
        try:
            call()
        except pynvml.NVMLError as exc:
            return int(exc.value)
        return None

    assert isinstance(fake.nvmlDeviceGetUtilizationRates(whole), pynvml.c_nvmlUtilization_t)
    assert code(lambda: fake.nvmlDeviceGetUtilizationRates(mig_on)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert code(lambda: fake.nvmlDeviceGetProcessUtilization(whole, 0)) == pynvml.NVML_ERROR_NOT_FOUND
    assert code(lambda: fake.nvmlDeviceGetTemperature(whole, 5)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(lambda: fake.nvmlDeviceGetPowerUsage(mig)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.nvmlDeviceGetComputeRunningProcesses(whole) == []
    fake.set_processes(1, [FakeProcess(3, 10)])
    (proc,) = fake.nvmlDeviceGetComputeRunningProcesses(whole)
    assert isinstance(proc, pynvml.nvmlFriendlyObject)
    assert vars(proc) == {
        "pid": 3,
        "usedGpuMemory": 10 * MIB,
        "gpuInstanceId": 0xFFFFFFFF,
        "computeInstanceId": 0xFFFFFFFF,
    }
    assert fake.nvmlDeviceGetMPSComputeRunningProcesses(whole) == []
    assert code(lambda: fake.nvmlDeviceSetComputeMode(whole, 1)) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert code(lambda: fake.nvmlDeviceSetComputeMode(whole, 9)) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    fake.nvmlDeviceSetComputeMode(whole, pynvml.NVML_COMPUTEMODE_PROHIBITED)
    assert fake.nvmlDeviceGetComputeMode(whole) == pynvml.NVML_COMPUTEMODE_PROHIBITED
    fake.lose_gpu(1, xid=None)
    assert code(lambda: fake.nvmlDeviceGetPowerUsage(whole)) == pynvml.NVML_ERROR_GPU_IS_LOST


def test_simulated_sample_reads_its_telemetry_file(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.json"
    backend = SimulatedBackend(
        SimulatedConfig.model_validate({"count": 2, "memoryMiB": 1024, "telemetryFile": str(path)})
    )
    idle = backend.sample()
    assert [d.compute_utilization for d in idle.devices] == [0.0, 0.0] and idle.processes == ()
    path.write_text(
        json.dumps(
            {"sim-1": {"utilization": 0.5, "memoryUsedMiB": 100, "processes": [{"pid": 9, "memoryMiB": 100}]}}
        )
    )
    busy = backend.sample()
    assert busy.devices[1].memory_used_bytes == 100 * MIB and busy.devices[1].memory_total_bytes == 1024 * MIB
    assert [(p.uuid, p.pid) for p in busy.processes] == [(busy.devices[1].uuid, 9)]
    for garbage in ("[", "[1]", '{"sim-0": {"processes": [{"memoryMiB": 1}]}}'):
        path.write_text(garbage)
        with pytest.raises(BackendError, match=f"telemetryFile {path}"):
            backend.sample()

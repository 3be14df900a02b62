"""Dynamic MIG (``migStrategy: dynamic``) over the fake NVML: every placement of every MIG profile published with
the GPU's shared counters, GPU and compute instances created on prepare and destroyed on unprepare, and the
fake driver refusing overlaps exactly where the counters do."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kxpu.backends.nvidia import NvidiaBackend
from kxpu.config import ConfigError, parse_config
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.names import device_name
from kxpu.dra.prepare import Preparer
from kxpu.dra.publisher import SlicePublisher
from kxpu.dra.slices import pool_content
from kxpu.model import BackendError, Device, index_by_id
from kxpu.testing.dra import FakeDraApi
from kxpu.testing.fake_nvml import FakeNvml
from tests.nvidia_support import make

DRIVER, NODE = "gpu.nvidia.com", "node-a"


@pytest.fixture
def h100() -> Iterator[tuple[NvidiaBackend, FakeNvml]]:
    backend, fake = make("h100-mig-dynamic", migStrategy="dynamic", passDeviceSpecs=True)
    yield backend, fake
    backend.close()


def by_id(backend: NvidiaBackend) -> dict[str, Device]:
    return index_by_id(backend.discover())


def test_every_placement_is_published_with_the_gpus_counters(h100: tuple[NvidiaBackend, FakeNvml]) -> None:
    backend, fake = h100
    devices = backend.discover()
    whole = [d for d in devices if not d.consumes]
    assert [d.uuid for d in whole] == [fake.gpus[2].uuid]  # the GPU with MIG off is offered whole, as before
    gpu0 = sorted(d.id for d in devices if d.id.startswith("gpu-0-"))
    # nvidia-smi mig -lgipp on an H100: 1g.10gb and 1g.10gb+me at 0-6, 1g.20gb at 0,2,4,6, 2g at 0,2,4, 3g at 0,4,
    # 4g and 7g at 0.
    assert len(gpu0) == 7 + 7 + 4 + 3 + 2 + 1 + 1
    assert {
        "gpu-0-mig-1g10gb-19-6",
        "gpu-0-mig-1g10gb-me-20-3",
        "gpu-0-mig-1g20gb-15-6",
        "gpu-0-mig-7g80gb-0-0",
    } <= set(gpu0)
    assert all(device_name(i) == i for i in gpu0)  # already DNS labels: the DRA device name is the ID

    sets = {c.name: dict(c.counters) for c in backend.counter_sets()}
    assert set(sets) == {"gpu-0-counter-set", "gpu-1-counter-set"}
    assert sets["gpu-0-counter-set"] == {
        **{f"memory-slice-{i}": 1 for i in range(8)},
        "multiprocessors": 132,  # the 7g.80gb profile's
        "copy-engines": 8,
        "decoders": 7,
        "jpeg-engines": 7,
        "ofa-engines": 1,
    }
    three = by_id(backend)["gpu-0-mig-3g40gb-9-4"]
    assert three.consumes == {
        "gpu-0-counter-set": {
            **{f"memory-slice-{i}": 1 for i in range(4, 8)},
            "multiprocessors": 60,
            "copy-engines": 3,
            "decoders": 3,
            "jpeg-engines": 3,
        }
    }
    assert three.memory_mib == 40448 and three.uuid is None
    assert three.extra["migProfile"] == "3g.40gb" and three.extra["placement"] == 4
    assert three.extra["parentUuid"] == fake.gpus[0].uuid
    # Every device says which it is: a DeviceClass selecting type "mig" keeps a request's migProfile selector
    # off whole GPUs (which have no migProfile: CEL would fail on them).
    assert {d.extra["type"] for d in devices} == {"gpu", "mig"} and whole[0].extra["type"] == "gpu"
    media = by_id(backend)["gpu-1-mig-1g10gb-me-20-0"]
    assert media.consumes["gpu-1-counter-set"]["ofa-engines"] == 1  # the GPU's one OFA: one +me at a time

    content = pool_content(DRIVER, NODE, devices, 1, "taint", counter_sets=backend.counter_sets())
    shared = [c for s in content.slices for c in s.get("sharedCounters", [])]
    assert [c["name"] for c in shared] == ["gpu-0-counter-set", "gpu-1-counter-set"]
    assert all(len(c["counters"]) <= 32 for c in shared)  # the API's limit per counter set
    entries = [d for s in content.slices for d in s.get("devices", [])]
    assert len(entries) == 51 and all(len(s.get("devices", [])) <= 64 for s in content.slices)
    entry = next(d for d in entries if d["name"] == "gpu-0-mig-3g40gb-9-4")
    assert entry["attributes"]["migProfile"] == {"string": "3g.40gb"}
    assert entry["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"


async def test_the_pool_with_its_counter_sets_is_published_at_the_first_try(
    h100: tuple[NvidiaBackend, FakeNvml],
) -> None:
    """The publisher counted devices in every slice, and slices of counters have none: a KeyError after writing."""
    backend, _ = h100
    api = FakeDraApi({NODE: "node-uid"})
    publisher = SlicePublisher(api, DRIVER, NODE)
    assert await publisher.publish(backend.discover(), counter_sets=backend.counter_sets())
    written = await api.list_slices(DRIVER, NODE)
    assert sum(len(s["spec"].get("devices") or []) for s in written) == 51
    assert sum(len(s["spec"].get("sharedCounters") or []) for s in written) == 2


def test_labels_count_gpus_not_placements(h100: tuple[NvidiaBackend, FakeNvml]) -> None:
    labels = h100[0].node_labels()
    assert labels["nvidia.com/gpu.count"] == "3" and labels["nvidia.com/gpu.memory"] == "81559"
    assert labels["nvidia.com/mig.strategy"] == "dynamic"


def test_a100_profiles_as_the_driver_names_them() -> None:
    backend, _ = make("a100-mig-dynamic", migStrategy="dynamic")
    try:
        devices = by_id(backend)
        assert devices["gpu-0-mig-1g5gb-19-0"].memory_mib == 4864  # A100-SXM4-40GB: 1g.5gb is 4.75 GiB
        assert devices["gpu-0-mig-1g10gb-15-2"].extra["migProfile"] == "1g.10gb"
        assert devices["gpu-1-mig-1g10gb-19-0"].memory_mib == 9728  # A100-SXM4-80GB: 1g.10gb is 9.5 GiB
        assert devices["gpu-1-mig-7g80gb-0-0"].consumes["gpu-1-counter-set"]["multiprocessors"] == 98
        assert {c.name: c.counters["decoders"] for c in backend.counter_sets()} == {
            "gpu-0-counter-set": 5,
            "gpu-1-counter-set": 5,
        }
    finally:
        backend.close()


def test_realize_creates_the_instance_and_release_destroys_it(h100: tuple[NvidiaBackend, FakeNvml]) -> None:
    backend, fake = h100
    placement = by_id(backend)["gpu-0-mig-3g40gb-9-4"]
    ((device, handle),) = backend.realize([placement])
    (gi,) = fake.mig_state()
    assert (gi["gpu"], gi["gi"], gi["profileId"], gi["start"], gi["size"]) == (0, 2, 9, 4, 4)  # swizzle ID 2
    assert device.uuid == gi["cis"][0]["uuid"] and str(device.uuid).startswith("MIG-")
    assert handle == {
        "gpu": fake.gpus[0].uuid,
        "gpuInstance": 2,
        "computeInstance": 0,
        "profileId": 9,
        "start": 4,
        "uuid": device.uuid,
    }
    json.dumps(handle)  # kept in the checkpoint as is
    edits = backend.allocate([device])
    assert edits.env["NVIDIA_VISIBLE_DEVICES"] == device.uuid
    paths = [n.container_path for n in edits.device_nodes]
    # The GPU and the MIG capabilities of the new GPU instance and compute instance (minors from /proc).
    assert paths[:3] == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap1020", "/dev/nvidia-caps/nvidia-cap1021"]
    with pytest.raises(BackendError, match="does not exist"):
        backend.allocate([by_id(backend)["gpu-0-mig-1g10gb-19-0"]])  # never realized

    backend.release([handle])
    assert fake.mig_state() == []
    assert fake.calls["nvmlComputeInstanceDestroy"] == 1 and fake.calls["nvmlGpuInstanceDestroy"] == 1
    backend.release([handle])  # again (the kubelet repeats unprepare): already gone is success
    assert fake.calls["nvmlGpuInstanceDestroy"] == 1


def test_processes_on_an_instance_made_at_prepare_are_sampled_under_its_mig_uuid(
    h100: tuple[NvidiaBackend, FakeNvml],
) -> None:
    """Telemetry ties a process to its claim's partition by the MIG device's UUID: NVML lists the process on the
    GPU with its GPU and compute instance IDs, and the instance did not exist when the GPUs were discovered."""
    from kxpu.testing.fake_nvml import FakeProcess

    backend, fake = h100
    ((device, handle),) = backend.realize([by_id(backend)["gpu-0-mig-3g40gb-9-4"]])
    gi, ci = int(handle["gpuInstance"]), int(handle["computeInstance"])
    fake.set_processes(0, [FakeProcess(4242, 300, gi=gi, ci=ci), FakeProcess(4343, 10)])
    found = {p.pid: p for p in backend.sample().processes}
    assert found[4242].uuid == device.uuid and found[4242].memory_used_bytes == 300 * 1024 * 1024
    assert found[4343].uuid == fake.gpus[0].uuid  # not in a MIG instance: the GPU's
    fake.set_processes(0, [])
    backend.release([handle])


def test_release_leaves_an_instance_that_is_not_its_own(h100: tuple[NvidiaBackend, FakeNvml]) -> None:
    backend, fake = h100
    ((_, handle),) = backend.realize([by_id(backend)["gpu-0-mig-1g10gb-19-0"]])
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    # Someone destroys kxpu's instance and makes another at the same place: a new MIG UUID.
    gi = fake.nvmlDeviceGetGpuInstanceById(gpu, int(handle["gpuInstance"]))
    fake.nvmlComputeInstanceDestroy(fake.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
    fake.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    backend.release([handle])
    (left,) = fake.mig_state()
    assert left["cis"][0]["uuid"] != handle["uuid"]


def test_an_instance_left_by_a_restart_is_taken_over(h100: tuple[NvidiaBackend, FakeNvml]) -> None:
    """kxpu made the MIG device, then died before recording the claim: the kubelet's next prepare finds it."""
    backend, fake = h100
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    left = fake.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu, 14, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(2, 2))
    )
    fake.nvmlGpuInstanceCreateComputeInstance(left, 1)
    ((device, handle),) = backend.realize([by_id(backend)["gpu-0-mig-2g20gb-14-2"]])
    (gi,) = fake.mig_state()
    assert device.uuid == gi["cis"][0]["uuid"] and handle["gpuInstance"] == gi["gi"]
    backend.release([handle])
    # Only the GPU instance was made: its compute instance is made now.
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu, 9, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(4, 4))
    )
    ((device, handle),) = backend.realize([by_id(backend)["gpu-0-mig-3g40gb-9-4"]])
    assert [len(g["cis"]) for g in fake.mig_state()] == [1]
    # A different profile at overlapping slices is not kxpu's to take.
    with pytest.raises(BackendError, match="no room for it on the GPU"):
        backend.realize([by_id(backend)["gpu-0-mig-1g10gb-19-5"]])


def test_an_overlapping_instance_made_outside_kxpu_is_a_clear_error(
    h100: tuple[NvidiaBackend, FakeNvml],
) -> None:
    backend, fake = h100
    gpu = fake.nvmlDeviceGetHandleByIndex(1)
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu, 14, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(2, 2))
    )  # 2g at 2-3
    with pytest.raises(BackendError) as info:
        backend.realize([by_id(backend)["gpu-1-mig-1g10gb-19-0"], by_id(backend)["gpu-1-mig-4g40gb-5-0"]])
    message = str(info.value)
    assert message.startswith(
        "gpu-1-mig-4g40gb-5-0: cannot create GPU instance 4g.40gb at memory slice 0 on GPU 1"
    )
    assert "a MIG instance that exists already overlaps it" in message and "\n" not in message
    # All or none: the 1g made before the failure was destroyed again.
    assert [(g["gpu"], g["profile"]) for g in fake.mig_state()] == [(1, "2g.20gb")]


def test_a_failed_compute_instance_leaves_no_gpu_instance(
    h100: tuple[NvidiaBackend, FakeNvml], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, fake = h100

    def refuse(gpu_instance: Any, profile_id: int) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlGpuInstanceCreateComputeInstance", refuse)
    with pytest.raises(BackendError, match=r"gpu-0-mig-2g20gb-14-2: cannot create its compute instance"):
        backend.realize([by_id(backend)["gpu-0-mig-2g20gb-14-2"]])
    assert fake.mig_state() == []


def test_without_root_the_error_says_so() -> None:
    fake = FakeNvml("h100-mig-dynamic")
    fake.profile.privileged = False
    backend, _ = make(fake, migStrategy="dynamic")
    try:
        with pytest.raises(BackendError, match=r"kxpu must run as root to create MIG instances"):
            backend.realize([by_id(backend)["gpu-0-mig-1g10gb-19-0"]])
    finally:
        backend.close()


def test_dynamic_mig_is_dra_only_and_alone() -> None:
    resource: dict[str, Any] = {"name": "nvidia.com/gpu", "nvidia": {"migStrategy": "dynamic"}}
    with pytest.raises(ConfigError, match=r"overlapping MIG partitions: only DRA can serve that"):
        parse_config({"version": "v1", "resources": [resource]})
    parse_config({"version": "v1", "resources": [{**resource, "serve": "dra"}]})
    shared = {"migStrategy": "dynamic", "sharing": {"timeSlicing": {"resources": [{"replicas": 2}]}}}
    with pytest.raises(ConfigError, match=r"migStrategy dynamic .* cannot be combined with sharing"):
        parse_config(
            {"version": "v1", "resources": [{"name": "nvidia.com/gpu", "nvidia": shared, "serve": "dra"}]}
        )


def result(device: str) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}


async def test_prepare_gives_the_container_its_mig_device_and_unprepare_destroys_it(
    h100: tuple[NvidiaBackend, FakeNvml], tmp_path: Path
) -> None:
    backend, fake = h100
    api = FakeDraApi()
    checkpoint = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    preparer = Preparer(DRIVER, NODE, backend, by_id(backend), checkpoint, tmp_path / "cdi", api)
    claim = api.add_claim("mig", [result("gpu-0-mig-1g20gb-15-6")])
    answer = (await preparer.prepare([claim]))[claim.uid]
    assert answer.error is None
    (gi,) = fake.mig_state()
    uuid = gi["cis"][0]["uuid"]
    spec = json.loads(preparer.spec_path(claim.uid).read_text())
    env = spec["devices"][0]["containerEdits"]["env"]
    assert f"NVIDIA_VISIBLE_DEVICES={uuid}" in env
    saved = json.loads((tmp_path / "checkpoint.json").read_text())
    assert uuid in json.dumps(saved)  # what releasing it needs survives a restart

    overlapping = api.add_claim("over", [result("gpu-0-mig-2g20gb-14-4")])  # slices 4-5: free, so it is made
    assert (await preparer.prepare([overlapping]))[overlapping.uid].error is None
    clash = api.add_claim("clash", [result("gpu-0-mig-3g40gb-9-4")])  # slices 4-7: taken twice over
    error = (await preparer.prepare([clash]))[clash.uid].error or ""
    assert "would overlap partitions already prepared" in error
    assert len(fake.mig_state()) == 2

    assert (await preparer.unprepare([claim, overlapping])) == {claim.uid: None, overlapping.uid: None}
    assert fake.mig_state() == []


# ---------------------------------------------------------------------------------------------- property


class Counters:
    """The DRA scheduler's rule: a set of devices fits when, per counter set, what they draw fits what it holds."""

    def __init__(self, backend: NvidiaBackend) -> None:
        self.capacity = {c.name: dict(c.counters) for c in backend.counter_sets()}

    def fits(self, devices: list[Device]) -> bool:
        drawn: dict[tuple[str, str], int] = {}
        for device in devices:
            for name, counters in device.consumes.items():
                for counter, amount in counters.items():
                    drawn[(name, counter)] = drawn.get((name, counter), 0) + amount
        return all(amount <= self.capacity[name].get(counter, 0) for (name, counter), amount in drawn.items())


_BACKENDS: dict[str, tuple[NvidiaBackend, FakeNvml]] = {}


def _machine(profile: str) -> tuple[NvidiaBackend, FakeNvml]:
    if profile not in _BACKENDS:
        _BACKENDS[profile] = make(profile, migStrategy="dynamic")
    return _BACKENDS[profile]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=st.sampled_from(["h100-mig-dynamic", "a100-mig-dynamic"]),
    steps=st.lists(st.integers(0, 10**6), max_size=25),
)
def test_counters_and_the_driver_agree_and_instances_never_overlap(profile: str, steps: list[int]) -> None:
    """Any sequence of allocations and releases: a placement the counters admit next to the allocated ones is
    created by the (fake) driver, one they refuse is refused by it too, and the instances that exist never
    share a memory slice."""
    backend, fake = _machine(profile)
    placements = [d for d in backend.discover() if d.consumes]
    counters = Counters(backend)
    held: dict[str, tuple[Device, dict[str, str | int]]] = {}
    try:
        for step in steps:
            if held and step % 4 == 0:  # release one
                key = sorted(held)[step // 4 % len(held)]
                backend.release([held.pop(key)[1]])
                continue
            wanted = placements[step % len(placements)]
            if wanted.id in held:
                continue
            admitted = counters.fits([*(d for d, _ in held.values()), wanted])
            try:
                ((_, handle),) = backend.realize([wanted])
            except BackendError as exc:
                assert not admitted, f"{wanted.id} fits the counters but the driver refused it: {exc}"
                assert "no room for it on the GPU" in str(exc)
                continue
            assert admitted, f"{wanted.id} was made though the counters refuse it beside {sorted(held)}"
            held[wanted.id] = (wanted, handle)
            live = fake.mig_state()
            assert len(live) == len(held)
            for gpu in {g["gpu"] for g in live}:
                slices = [
                    s for g in live if g["gpu"] == gpu for s in range(g["start"], g["start"] + g["size"])
                ]
                assert len(slices) == len(set(slices)), live
    finally:
        backend.release([h for _, h in held.values()])
    assert fake.mig_state() == []


async def test_instances_left_by_a_killed_prepare_are_reclaimed_at_start(
    h100: tuple[NvidiaBackend, FakeNvml], tmp_path: Path
) -> None:
    """The daemon was killed inside realize (a GPU instance made, with or without its compute instance) and the
    claim deleted meanwhile: at start the instances kxpu recorded making are destroyed, one made outside kxpu
    stays, and the whole GPU can be allocated again (before: "no room for it on the GPU" for ever)."""
    from kxpu.dra.checkpoint import Making

    backend, fake = h100
    gpu0, gpu1 = fake.nvmlDeviceGetHandleByIndex(0), fake.nvmlDeviceGetHandleByIndex(1)
    whole = fake.nvmlDeviceCreateGpuInstanceWithPlacement(
        gpu0, 19, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(1, 1))
    )
    fake.nvmlGpuInstanceCreateComputeInstance(whole, 0)  # 1g at slice 1, with its compute instance
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(  # 2g at slices 4-5, killed before the compute instance
        gpu0, 14, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(4, 2))
    )
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(  # someone else's, on the other GPU
        gpu1, 14, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(2, 2))
    )
    checkpoint = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    checkpoint.making = {
        "killed-1": Making("default/a", ("gpu-0-mig-1g10gb-19-1",)),
        "killed-2": Making("default/b", ("gpu-0-mig-2g20gb-14-4",)),
    }
    checkpoint.save()
    checkpoint.load()
    api = FakeDraApi()
    preparer = Preparer(DRIVER, NODE, backend, by_id(backend), checkpoint, tmp_path / "cdi", api)
    reclaimed = await preparer.reconcile()
    assert [r.split(" ")[0] for r in reclaimed] == ["gpu-0-mig-1g10gb-19-1", "gpu-0-mig-2g20gb-14-4"]
    assert [(g["gpu"], g["profile"]) for g in fake.mig_state()] == [(1, "2g.20gb")]
    assert checkpoint.making == {}
    claim = api.add_claim("whole", [result("gpu-0-mig-7g80gb-0-0")])
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    assert backend.reclaim([by_id(backend)["gpu-0-mig-1g10gb-19-1"]]) == []  # idempotent: nothing there

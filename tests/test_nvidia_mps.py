"""MPS in the nvidia backend, over the fake NVML and the stand-in nvidia-cuda-mps-control: config rules, the
daemons' lifecycle (start, adopt, die, restart, stop), compute modes, what containers get, fractional grants
through the sharing wrapper (with and without CDI), and HAMi-core preloading."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from pydantic import ValidationError

from kxpu.backends.nvidia import NvidiaBackend, NvidiaConfig
from kxpu.backends.nvidia.mps import PINNED_MEMORY_ENV, PIPE_ENV, THREAD_PERCENTAGE_ENV, MpsDaemon, MpsLimits
from kxpu.cdi import with_cdi
from kxpu.model import BackendError, DeviceShare, decode_grants
from kxpu.sharing import inventory as inv
from kxpu.sharing.node import SharingBackend, parent_id
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import Scheduler
from kxpu.sharing.state import ClusterState
from kxpu.testing.fake_mps import FAIL_ENV, commands, install, read_record
from kxpu.testing.fake_nvml import FakeNvml
from kxpu.testing.sharing import FakeCluster, pod
from tests import nvidia_support
from tests.nvidia_support import next_list
from tests.test_sharing_node import sharing

GPU = "nvidia.com/gpu"


def make(*args: Any, **kwargs: Any) -> tuple[NvidiaBackend, FakeNvml]:
    """The backend as the daemon has it once its watch started: MPS running (or its fallback)."""
    backend, fake = nvidia_support.make(*args, **kwargs)
    try:
        backend.start_mps()
    except BaseException:
        backend.close()
        raise
    return backend, fake


@pytest.fixture
def driver(workdir: Path) -> Iterator[Path]:
    root = workdir / "driver"
    install(root)
    yield root
    for pid_file in (workdir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"):  # nothing outlives a test
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def mps_config(workdir: Path, driver: Path, replicas: int | None = 2, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "deviceIDStrategy": "index",
        "nvidiaDriverRoot": str(driver),
        "mpsRoot": str(workdir / "mps"),
        "mps": {"shmDir": "/dev/shm", "checkIntervalSeconds": 0.05, **extra.pop("mps", {})},
        **extra,
    }
    if replicas is not None:
        config["sharing"] = {"mps": {"resources": [{"replicas": replicas}]}}
    else:
        config["mps"]["enabled"] = True
    return config


def log_dir(workdir: Path, uuid: str) -> Path:
    return workdir / "mps" / uuid / "log"


# ---------------------------------------------------------------------------------------------- config


def test_config_follows_nvidias_keys_and_refuses_what_cannot_work() -> None:
    cfg = NvidiaConfig.model_validate({"sharing": {"mps": {"resources": [{"replicas": 4}]}}})
    assert cfg.mps_active and cfg.replicated and cfg.sharing.replicas.fail_requests_greater_than_one
    assert cfg.resource_name(GPU) == GPU
    renamed = NvidiaConfig.model_validate(
        {"sharing": {"mps": {"renameByDefault": True, "resources": [{"replicas": 2}]}}}
    )
    assert renamed.resource_name(GPU) == "nvidia.com/gpu.shared"
    bad = [
        ({"sharing": {"mps": {"resources": []}}}, "at least 1 item"),
        ({"sharing": {"mps": {"resources": [{"replicas": 1}]}}}, "greater than or equal to 2"),
        (
            {
                "sharing": {
                    "mps": {"resources": [{"replicas": 2}]},
                    "timeSlicing": {"resources": [{"replicas": 2}]},
                }
            },
            "either timeSlicing or mps",
        ),
        ({"migStrategy": "mixed", "mps": {"enabled": True}}, "migStrategy mixed is not supported with MPS"),
        ({"mpsRoot": "run/mps"}, "mpsRoot run/mps must be an absolute path"),
        ({"mps": {"shmDir": "shm"}}, "shmDir shm must be an absolute path"),
        ({"mps": {"onUnavailable": "ignore"}}, "'fail' or 'time-slicing'"),
        ({"hamiCore": {}}, "library"),
        ({"hamiCore": {"library": "libvgpu.so"}}, "must be an absolute path"),
    ]
    for section, message in bad:
        with pytest.raises(ValidationError, match=message):
            NvidiaConfig.model_validate(section)


# ---------------------------------------------------------------------------------------------- replicas


def test_listing_devices_never_touches_mps(workdir: Path, driver: Path) -> None:
    """Built but not watched (``kxpu devices``): no daemon, no compute mode change, nothing allocated."""
    backend, fake = nvidia_support.make("v100-4x-nvlink", **mps_config(workdir, driver))
    try:
        devices = backend.discover()
        assert {d.health_reason for d in devices} == {"mps-not-running"}
        with pytest.raises(BackendError, match="MPS is not running yet"):
            backend.allocate([devices[0]])
        assert not list((workdir / "mps").glob("*/pipe/*"))
        assert all(g.compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT for g in fake.gpus)
    finally:
        backend.close()
    assert not list((workdir / "mps").glob("*/pipe/*"))


async def test_replicas_get_their_gpus_daemon_capped_at_an_equal_share(workdir: Path, driver: Path) -> None:
    backend, fake = make("a100-8x", **mps_config(workdir, driver, replicas=4))
    try:
        devices = backend.discover()
        assert len(devices) == 32 and all(d.extra["sharingStrategy"] == "mps" for d in devices)
        uuid = fake.gpus[2].uuid
        # A100 80 GB: 81920 MiB / 4 and 100 / 4, on the daemon that sees GPU 2 only (as device 0).
        record = read_record(log_dir(workdir, uuid))
        assert record[0]["event"] == "start" and record[0]["env"]["CUDA_VISIBLE_DEVICES"] == uuid
        assert commands(log_dir(workdir, uuid))[1:] == [
            "set_default_device_pinned_mem_limit 0 20480M",
            "set_default_active_thread_percentage 25",
        ]
        assert all(g.compute_mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS for g in fake.gpus)

        edits = backend.allocate([d for d in devices if d.id == "2::3"])
        assert edits.env == {"NVIDIA_VISIBLE_DEVICES": "2", PIPE_ENV: f"/mps/{uuid}/pipe"}
        assert [(m.container_path, m.host_path, m.read_only) for m in edits.mounts] == [
            (f"/mps/{uuid}/pipe", str(workdir / "mps" / uuid / "pipe"), False),
            ("/dev/shm", "/dev/shm", False),
        ]
        (grant,) = decode_grants(edits.annotations["kxpu.io/grants"])
        assert (grant.uuid, grant.memory_bytes, grant.compute_ratio) == (uuid, 20480 * 2**20, 0.25)
        with pytest.raises(BackendError, match="maximum request size for shared resources is 1"):
            backend.allocate([d for d in devices if d.id in ("2::0", "2::1")])
        labels = backend.node_labels()
        assert (
            labels["nvidia.com/gpu.sharing-strategy"] == "mps" and labels["nvidia.com/mps.capable"] == "true"
        )
    finally:
        backend.close()
    # Quit, and the compute mode each GPU had before.
    assert all(g.compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT for g in fake.gpus)
    assert commands(log_dir(workdir, fake.gpus[2].uuid))[-1] == "quit"
    assert not any((workdir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))


async def test_several_replicas_of_one_gpu_are_allowed_when_asked_but_never_two_gpus(
    workdir: Path, driver: Path
) -> None:
    config = mps_config(workdir, driver)
    config["sharing"]["mps"]["failRequestsGreaterThanOne"] = False
    backend, fake = make("v100-4x-nvlink", **config)
    try:
        by_id = {d.id: d for d in backend.discover()}
        assert (
            backend.allocate([by_id["1::0"], by_id["1::1"]]).env[PIPE_ENV] == f"/mps/{fake.gpus[1].uuid}/pipe"
        )
        with pytest.raises(
            BackendError, match="talks to one GPU's MPS server, but this request spans 2 GPUs"
        ):
            backend.allocate([by_id["1::0"], by_id["2::0"]])
    finally:
        backend.close()


async def test_a_dead_daemon_makes_its_gpus_replicas_unhealthy_until_it_runs_again(
    workdir: Path, driver: Path
) -> None:
    backend, fake = make("v100-4x-nvlink", event_wait_ms=100, **mps_config(workdir, driver))
    updates = backend.watch()
    try:
        await next_list(updates)
        uuid = fake.gpus[3].uuid
        daemon = backend.mps.daemon(uuid) if backend.mps else None
        assert daemon is not None
        first = daemon.pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        down = await next_list(updates, lambda ds: any(not d.healthy for d in ds))
        assert {d.id: d.health_reason for d in down if not d.healthy} == {
            "3::0": "mps-daemon-down",
            "3::1": "mps-daemon-down",
        }
        await next_list(updates, lambda ds: all(d.healthy for d in ds))
        second = daemon.pid()
        assert second is not None and second != first
        starts = [r for r in read_record(log_dir(workdir, uuid)) if r["event"] == "start"]
        assert len(starts) == 2
        assert (
            commands(log_dir(workdir, uuid))[-1] == "set_default_active_thread_percentage 50"
        )  # configured again
    finally:
        await updates.aclose()
        backend.close()


def test_a_running_daemon_is_adopted_not_started_twice(workdir: Path, driver: Path) -> None:
    fake = FakeNvml("v100-4x-nvlink")
    uuid = fake.gpus[0].uuid
    earlier = MpsDaemon(uuid, workdir / "mps", driver / "usr/bin/nvidia-cuda-mps-control", MpsLimits(), {})
    earlier.start()
    pid = earlier.pid()
    backend, _ = make(fake, **mps_config(workdir, driver))
    try:
        daemon = backend.mps.daemon(uuid) if backend.mps else None
        assert daemon is not None and daemon.adopted and daemon.pid() == pid
        assert len([r for r in read_record(log_dir(workdir, uuid)) if r["event"] == "start"]) == 1
        assert "set_default_active_thread_percentage 50" in commands(log_dir(workdir, uuid))
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------- faults


def test_mps_cannot_start_without_the_binary_the_right_shm_or_compute_mode(
    workdir: Path, driver: Path
) -> None:
    with pytest.raises(BackendError, match=r"nodriver/usr/bin/nvidia-cuda-mps-control not found") as err:
        make("v100-4x-nvlink", **mps_config(workdir, workdir / "nodriver"))
    assert "mps.onUnavailable: time-slicing" in str(err.value)

    with pytest.raises(BackendError, match=r"this process's /dev/shm is not .* mps.shmDir: /dev/shm"):
        (workdir / "shm").mkdir()
        make("v100-4x-nvlink", **mps_config(workdir, driver, mps={"shmDir": str(workdir / "shm")}))

    fake = FakeNvml("v100-4x-nvlink")
    with pytest.raises(
        BackendError, match=r"compute mode DEFAULT; MPS needs EXCLUSIVE_PROCESS.*nvidia-smi -i 0"
    ):
        make(fake, **mps_config(workdir, driver, mps={"setComputeMode": False}))
    fake.profile.privileged = False
    with pytest.raises(BackendError, match=r"Insufficient Permissions\) \(kxpu must run as root\)"):
        make(fake, **mps_config(workdir, driver))
    assert not list((workdir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))

    refused = {FAIL_ENV: "commands"}
    with pytest.raises(BackendError, match=r"refused 'set_default_device_pinned_mem_limit 0 8192M'"):
        make("v100-4x-nvlink", environ=refused, **mps_config(workdir, driver))
    # What this call started it stopped again: no daemon is left behind by a failed start.
    assert not list((workdir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))
    with pytest.raises(BackendError, match="failed to start"):
        make("v100-4x-nvlink", environ={FAIL_ENV: "start"}, **mps_config(workdir, driver))


def test_the_fallback_serves_plain_replicas_and_restores_the_compute_mode(
    workdir: Path, driver: Path
) -> None:
    fake = FakeNvml("v100-4x-nvlink")
    backend, _ = make(
        fake,
        environ={FAIL_ENV: "start"},
        **mps_config(workdir, driver, mps={"onUnavailable": "time-slicing"}),
    )
    try:
        devices = backend.discover()
        assert len(devices) == 8 and all(
            d.healthy and d.extra["sharingStrategy"] == "time-slicing" for d in devices
        )
        assert backend.allocate([devices[0]]).env == {"NVIDIA_VISIBLE_DEVICES": "0"}
        assert all(g.compute_mode == pynvml.NVML_COMPUTEMODE_DEFAULT for g in fake.gpus)
    finally:
        backend.close()


def test_mig_and_too_many_replicas_are_refused_whatever_the_fallback(workdir: Path, driver: Path) -> None:
    fallback = mps_config(workdir, driver, mps={"onUnavailable": "time-slicing"})
    with pytest.raises(BackendError, match=r"GPU 0 \(GPU-.*\) is in MIG mode: MPS cannot share it"):
        make("h100-mig-mixed", **fallback)
    with pytest.raises(BackendError, match=r"at most 16 clients on compute capability 7\.0"):
        make("v100-4x-nvlink", **mps_config(workdir, driver, replicas=17))


def test_a_daemon_that_waits_for_its_clients_keeps_its_gpus_compute_mode(workdir: Path, driver: Path) -> None:
    fake = FakeNvml("v100-4x-nvlink")
    linger = {FAIL_ENV: "linger"}  # quit is answered, but the daemon stays while "clients" run
    backend, _ = make(fake, environ=linger, **mps_config(workdir, driver, mps={"stopTimeoutSeconds": 0.3}))
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 5  # stopping does not wait for the clients
    assert all(g.compute_mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS for g in fake.gpus)
    assert len(list((workdir / "mps").glob("*/pipe/nvidia-cuda-mps-control.pid"))) == 4


# ---------------------------------------------------------------------------------------------- fractional


class ShareRig:
    """The sharing wrapper over the nvidia backend with MPS for grants (no replicas), and its scheduler."""

    def __init__(self, backend: Any) -> None:
        family = ResourceFamily.derived(GPU)
        self.cluster = FakeCluster()
        self.link = self.cluster.link("node-a")
        self.backend = SharingBackend(
            backend, GPU, sharing(splitCount=4, allocateTimeoutSeconds=0.5), lambda: self.link, "node-a"
        )
        self.state = ClusterState([GPU])
        self.scheduler = Scheduler(self.state, [family], keys=lambda: self.cluster.keyring, api=self.cluster)
        self.slots = self.backend.discover()
        self.state.set_node("node-a", {inv.annotation_key(GPU): inv.encode(self.backend.inventory())})

    async def admit(self, name: str, limits: dict[str, int]) -> Any:
        self.cluster.add_pod(pod(name, [limits]))
        assert await self.scheduler.bind("default", name, f"uid-default-{name}", "node-a") == ""
        chosen = await self.backend.preferred_allocation_async(self.slots, [], limits[GPU])
        by_id = {d.id: d for d in self.slots}
        return await self.backend.allocate_async([by_id[i] for i in chosen]), chosen


@pytest.mark.parametrize("cdi", [False, True])
async def test_fractional_grants_are_enforced_by_each_containers_mps_limits(
    workdir: Path, driver: Path, cdi: bool
) -> None:
    nvidia, fake = make("v100-4x-nvlink", **mps_config(workdir, driver, replicas=None))
    inner: Any = with_cdi(nvidia, GPU, "nvidia.com/gpu", workdir / "cdi") if cdi else nvidia
    if cdi:
        inner.discover()  # writes the spec the CDI wrapper answers from
    rig = ShareRig(inner)
    try:
        edits, chosen = await rig.admit(
            "small", {GPU: 1, "nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 30}
        )
        uuid = next(g.uuid for g in fake.gpus if str(fake.gpus.index(g)) == parent_id(chosen[0]))
        assert edits.env[PINNED_MEMORY_ENV] == "0=3000M" and edits.env[THREAD_PERCENTAGE_ENV] == "30"
        assert edits.env[PIPE_ENV] == f"/mps/{uuid}/pipe"
        assert (
            edits.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m" and edits.env["CUDA_DEVICE_SM_LIMIT"] == "30"
        )
        (grant,) = decode_grants(edits.annotations["kxpu.io/grants"])
        assert (grant.uuid, grant.memory_bytes, grant.compute_ratio) == (uuid, 3000 * 2**20, 0.3)
        if cdi:
            assert edits.cdi_devices == [f"nvidia.com/gpu={parent_id(chosen[0])}"]
        # No replicas: the daemon sets no defaults, each container brings its own limits.
        assert commands(log_dir(workdir, uuid)) == ["get_default_active_thread_percentage"]
        await rig.backend.settled()

        memory_only, _ = await rig.admit("mem", {GPU: 1, "nvidia.com/gpumem": 1000})
        assert (
            memory_only.env[PINNED_MEMORY_ENV] == "0=1000M" and THREAD_PERCENTAGE_ENV not in memory_only.env
        )
        await rig.backend.settled()
        with pytest.raises(BackendError, match="spans 2 GPUs"):
            await rig.admit("two", {GPU: 2, "nvidia.com/gpumem": 1000})
    finally:
        rig.backend.close()


def test_allocate_shares_without_mps_is_plain_allocate() -> None:
    backend, _ = make("v100-4x-nvlink")
    try:
        device = backend.discover()[0]
        assert backend.allocate_shares([DeviceShare(device, 3000, 30)]) == backend.allocate([device])
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------- HAMi-core


def test_hami_core_is_mounted_and_preloaded(workdir: Path) -> None:
    lib = workdir / "libvgpu.so"
    lib.write_bytes(b"\x7fELF")
    preload = workdir / "state" / "ld.so.preload"
    backend, _ = make("v100-4x-nvlink", hamiCore={"library": str(lib), "preloadFile": str(preload)})
    try:
        edits = backend.allocate([backend.discover()[0]])
        assert preload.read_text() == "/usr/local/vgpu/libvgpu.so\n"
        assert [(m.container_path, m.host_path, m.read_only) for m in edits.mounts] == [
            ("/usr/local/vgpu/libvgpu.so", str(lib), True),
            ("/etc/ld.so.preload", str(preload), True),
            ("/tmp/vgpulock", "/tmp/vgpulock", False),
        ]
    finally:
        backend.close()
    with pytest.raises(BackendError, match="hamiCore: cannot write /proc/"):
        make("v100-4x-nvlink", hamiCore={"library": str(lib), "preloadFile": "/proc/kxpu/ld.so.preload"})


def test_replicas_of_some_gpus_only(workdir: Path, driver: Path) -> None:
    text = json.dumps({"sharing": {"mps": {"resources": [{"replicas": 2, "devices": [0, 1]}]}}})
    assert NvidiaConfig.model_validate_json(text).sharing.replicas.resources[0].devices == [0, 1]
    config = mps_config(workdir, driver)
    config["sharing"]["mps"]["resources"][0]["devices"] = [1]
    backend, fake = make("v100-4x-nvlink", **config)
    try:
        ids = [d.id for d in backend.discover()]
        assert ids == ["0", "1::0", "1::1", "2", "3"]
        assert isinstance(backend, NvidiaBackend) and backend.mps is not None
        # Every served GPU gets a daemon; whole GPUs have no default limits.
        assert commands(log_dir(workdir, fake.gpus[0].uuid)) == ["get_default_active_thread_percentage"]
        assert backend.allocate([backend.discover()[0]]).env[PIPE_ENV] == f"/mps/{fake.gpus[0].uuid}/pipe"
    finally:
        backend.close()


def test_the_gpu_check_script_runs_over_the_fake(tmp_path: Path) -> None:
    """hack/gpu-mps-check is meant for a GPU machine; over the fake it must still run every step."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "hack" / "gpu-mps-check"
    env = {k: v for k, v in os.environ.items() if k != "KXPU_FAKE_NVML"}
    result = subprocess.run(
        [sys.executable, str(script), "--fake", "--out", str(tmp_path / "mps.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((tmp_path / "mps.json").read_text())
    results = {r["check"]: r["result"] for r in doc["checks"]}
    assert set(results.values()) <= {"PASS", "skip"} and len(results) >= 20
    assert (
        results["a replica that raises its own limit to 16384 MiB is capped at the daemon's 8192 MiB (±5 %)"]
        == "PASS"
    )


def test_the_mps_example_config_loads() -> None:
    from kxpu.config import load_config

    config = load_config(Path(__file__).resolve().parent.parent / "examples" / "nvidia-mps.yaml")
    assert config.telemetry.enabled and config.telemetry.events
    gpu, frac = config.resources
    assert isinstance(gpu.backend_config, NvidiaConfig) and gpu.backend_config.sharing.mps is not None
    assert isinstance(frac.backend_config, NvidiaConfig) and frac.backend_config.mps.enabled
    assert frac.sharing is not None and frac.sharing.split_count == 8

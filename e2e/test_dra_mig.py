"""Dynamic MIG on the real cluster: the nvidia backend over the fake NVML's H100s (``migStrategy: dynamic``,
``serve: dra``) publishes every MIG placement with the GPUs' shared counters; the stock kube-scheduler allocates
claims for a MIG profile to placements that never overlap, a claim that would overlap stays Pending with the
scheduler's reason, each pod sees the MIG device kxpu created for it, and deleting a pod destroys it."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.conftest import E2E
from kxpu.testing.fake_nvml import FAKE_NVML_CONTROL_ENV, FAKE_NVML_ENV, query_control

DRIVER = "gpu.nvidia.com"
REPORT = 'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"\necho end-of-report'


def visible(log: str) -> str:
    match = re.search(r"^GPUS=(.*)$", log, re.M)
    assert match, log
    return match.group(1)


def unschedulable(e2e: E2E, name: str) -> str | None:
    for event in kube.events_for(e2e.cluster, name):
        if event.get("reason") == "FailedScheduling":
            return str(event.get("message"))
    return None


def test_mig_partitions_over_the_fake_nvml_never_overlap(e2e: E2E, tmp_path: Path) -> None:
    control = tmp_path / "nvml-control.sock"
    dra.forget_driver(e2e, DRIVER)
    e2e.kxpu(
        [{"name": "nvidia.com/gpu", "nvidia": {"migStrategy": "dynamic"}, "serve": "dra"}],
        env={FAKE_NVML_ENV: "h100-mig-dynamic", FAKE_NVML_CONTROL_ENV: str(control)},
    )
    # Two H100s in MIG mode, 25 placements each (nvidia-smi mig -lgipp's), and one H100 with MIG off, whole.
    kube.wait_until(
        "51 devices in the pool", lambda: len(dra.pool_devices(e2e.cluster, DRIVER)) == 51 or None, 60
    )
    counter_sets = {
        c["name"]: c["counters"]
        for s in dra.slices(e2e.cluster, DRIVER)
        for c in s["spec"].get("sharedCounters") or []
    }
    assert set(counter_sets) == {"gpu-0-counter-set", "gpu-1-counter-set"}
    assert counter_sets["gpu-0-counter-set"]["memory-slice-7"] == {"value": "1"}
    assert counter_sets["gpu-0-counter-set"]["multiprocessors"] == {"value": "132"}

    def mig_state() -> list[dict[str, Any]]:
        state: list[dict[str, Any]] = query_control(control, op="mig-state")
        return state

    assert mig_state() == []  # nothing is created before a claim is prepared

    attr = f'device.attributes["{DRIVER}"]'
    # As NVIDIA's mig.nvidia.com class: the class picks MIG devices, so a request's migProfile selector never
    # meets a whole GPU (which has no migProfile).
    cls = dra.device_class(e2e, "kxpu-mig", DRIVER, f'{attr}.type == "mig"')
    three = dra.claim_template(
        e2e, "mig-3g", [{"name": "gpu", "exactly": dra.exactly(cls, 1, f'{attr}.migProfile == "3g.40gb"')}]
    )
    pods = [dra.claim_pod(e2e, f"mig-{i}", REPORT, three) for i in range(4)]
    seen: dict[str, str] = {}  # pod → the MIG device UUID it was given
    allocated: dict[str, str] = {}  # pod → the DRA device the scheduler chose
    for pod in pods:
        kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
        seen[pod.name] = visible(kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report"))
        (allocated[pod.name],) = dra.allocated_devices(dra.pod_claim(e2e.cluster, pod.name), DRIVER)
    # Two 3g.40gb a GPU (memory slices 0-3 and 4-7): the only way four fit.
    assert sorted(allocated.values()) == [
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-1-mig-3g40gb-9-0",
        "gpu-1-mig-3g40gb-9-4",
    ]
    state = mig_state()
    assert sorted((g["gpu"], g["profile"], g["start"]) for g in state) == [
        (0, "3g.40gb", 0),
        (0, "3g.40gb", 4),
        (1, "3g.40gb", 0),
        (1, "3g.40gb", 4),
    ]
    # Each pod sees the MIG device made for its placement, a different one each.
    uuid_at = {(g["gpu"], g["start"]): g["cis"][0]["uuid"] for g in state}
    for name, device in allocated.items():
        gpu, start = int(device.split("-")[1]), int(device.rsplit("-", 1)[1])
        assert seen[name] == uuid_at[(gpu, start)], (name, device, state)

    # Every memory slice is taken: a 1g.10gb claim would overlap, so the scheduler leaves it Pending.
    one = dra.claim_template(
        e2e, "mig-1g", [{"name": "gpu", "exactly": dra.exactly(cls, 1, f'{attr}.migProfile == "1g.10gb"')}]
    )
    small = dra.claim_pod(e2e, "mig-small", REPORT, one)
    reason = kube.wait_until(
        f"FailedScheduling for {small.name}", partial(unschedulable, e2e, small.name), 60
    )
    assert "claim" in reason.lower(), reason  # the scheduler says it cannot allocate the claim
    assert kube.get_pod(e2e.cluster, small.name)["status"]["phase"] == "Pending"
    assert len(mig_state()) == 4

    # Deleting a pod destroys its MIG device; the pending claim then gets a placement inside the freed slices.
    gone = pods[0].name
    freed = allocated[gone]
    e2e.cluster.kubectl("delete", "pod", gone, "--wait=true", "--timeout=60s")
    kube.wait_until(
        "the deleted pod's MIG device destroyed",
        lambda: seen[gone] not in {c["uuid"] for g in mig_state() for c in g["cis"]} or None,
        60,
    )
    kube.wait_pod_phase(e2e.cluster, small.name, "Running")
    mine = visible(kube.wait_pod_log(e2e.cluster, small.name, "end-of-report"))
    (device,) = dra.allocated_devices(dra.pod_claim(e2e.cluster, small.name), DRIVER)
    freed_gpu, freed_start = int(freed.split("-")[1]), int(freed.rsplit("-", 1)[1])
    assert device.startswith(f"gpu-{freed_gpu}-mig-1g10gb-19-"), device
    assert freed_start <= int(device.rsplit("-", 1)[1]) < freed_start + 4, (freed, device)
    state = mig_state()
    assert mine in {c["uuid"] for g in state for c in g["cis"]}
    assert len(state) == 4
    for gpu in (0, 1):  # the instances that exist never share a memory slice
        slices = [s for g in state if g["gpu"] == gpu for s in range(g["start"], g["start"] + g["size"])]
        assert len(slices) == len(set(slices)), state

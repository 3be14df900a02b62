"""Devices that line up, on the real cluster: the scheduler's ``matchAttribute`` over the attributes kxpu reads
from a fake machine's topology.

The machine: the fake NVML's ``a100-pcie-4x-bridged`` (four GPUs, NVLink bridges joining 0000:17 with 0000:31
and 0000:98 with 0000:b1, each pair under its own PCIe root complex) and, through the generic backend, one
RDMA NIC whose fake sysfs puts it under the second pair's root complex (pci0000:80).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from e2e import dra, kube
from e2e.conftest import E2E
from kxpu.testing.fake_host import FakeHost

GPU_DRIVER = "gpu.nvidia.com"
NIC_DRIVER = "nic.example.com"
STD = "resource.kubernetes.io"
ISLAND = {"0000:17:00.0": "nvlink-0000:17:00.0", "0000:31:00.0": "nvlink-0000:17:00.0"}
ISLAND |= {"0000:98:00.0": "nvlink-0000:98:00.0", "0000:b1:00.0": "nvlink-0000:98:00.0"}
ROOT = {"0000:17:00.0": "pci0000:00", "0000:31:00.0": "pci0000:00", "0000:98:00.0": "pci0000:80"}
ROOT |= {"0000:b1:00.0": "pci0000:80"}
NIC_MAJOR_MINOR = (231, 192)  # uverbs0's numbers; only the fake sysfs below says what they are
REPORT = 'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"\necho end-of-report'


def fake_nic(tmp_path: Path) -> tuple[Path, Path]:
    """A verbs node (``<tmp>/dev/uverbs0``) and a sysfs tree placing it on PCI 0000:81:00.0 under pci0000:80."""
    devdir = tmp_path / "dev"
    devdir.mkdir()
    node = devdir / "uverbs0"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(*NIC_MAJOR_MINOR))
    node.chmod(0o666)
    sysfs = FakeHost(tmp_path / "nic-host")
    nic = "pci0000:80/0000:80:01.0/0000:81:00.0"
    sysfs.write_attribute(f"/sys/devices/{nic}/numa_node", 1)
    sysfs.symlink("/sys/bus/pci/devices/0000:81:00.0", f"../../../devices/{nic}")
    sysfs.symlink(
        "/sys/dev/char/{}:{}".format(*NIC_MAJOR_MINOR), f"../../devices/{nic}/infiniband_verbs/uverbs0"
    )
    sysfs.symlink(f"/sys/devices/{nic}/infiniband_verbs/uverbs0/device", "../..")
    return devdir, sysfs.root / "sys"


def bus_of(devices: list[dict[str, Any]]) -> dict[str, str]:
    """Pool device name → its PCI address (the standard attribute)."""
    return {str(d["name"]): str(d["attributes"][f"{STD}/pciBusID"]["string"]) for d in devices}


def pinned(e2e: E2E, cls: str, bus: str) -> kube.PodSpec:
    """A running pod holding the GPU at ``bus``."""
    selector = f'device.attributes["{STD}"].pciBusID == "{bus}"'
    template = dra.claim_template(
        e2e, f"pin-{bus[5:7]}", [{"name": "gpu", "exactly": dra.exactly(cls, 1, selector)}]
    )
    pod = dra.claim_pod(e2e, f"pin-{bus[5:7]}", REPORT, template)
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running")
    return pod


def test_claims_line_devices_up_by_link_domain_and_pcie_root(e2e: E2E, tmp_path: Path) -> None:
    devdir, sysfs = fake_nic(tmp_path)
    dra.forget_driver(e2e, GPU_DRIVER)
    dra.forget_driver(e2e, NIC_DRIVER)
    e2e.kxpu(
        [
            {"name": "nvidia.com/gpu", "nvidia": {"deviceIDStrategy": "uuid"}, "serve": "dra"},
            {
                "name": "example.com/nic",
                "generic": {"groups": [{"paths": [str(devdir / "uverbs*")]}], "sysfsRoot": str(sysfs)},
                "serve": "dra",
            },
        ],
        env={"KXPU_FAKE_NVML": "a100-pcie-4x-bridged"},
    )

    def four_gpus() -> list[dict[str, Any]] | None:
        devices = dra.pool_devices(e2e.cluster, GPU_DRIVER)
        return devices if len(devices) == 4 else None

    gpus = kube.wait_until("4 GPUs in the pool", four_gpus, 60)
    (nic,) = kube.wait_until(
        "the NIC in its pool", lambda: dra.pool_devices(e2e.cluster, NIC_DRIVER) or None, 60
    )

    # What the API server holds: the standard attributes and the link domain, read from the fake topology.
    bus = bus_of(gpus)
    for device in gpus:
        address = bus[device["name"]]
        assert device["attributes"]["linkDomain"] == {"string": ISLAND[address]}, device
        assert device["attributes"][f"{STD}/pcieRoot"] == {"string": ROOT[address]}, device
    assert nic["attributes"][f"{STD}/pcieRoot"] == {"string": "pci0000:80"}, nic
    assert nic["attributes"][f"{STD}/pciBusID"] == {"string": "0000:81:00.0"}, nic
    assert nic["attributes"][f"{STD}/numaNode"] == {"int": 1}, nic
    gpu_class = dra.device_class(e2e, "kxpu-gpu", GPU_DRIVER)
    nic_class = dra.device_class(e2e, "kxpu-nic", NIC_DRIVER)

    # A GPU and the NIC on one root complex: first-fit would take 0000:17 (pci0000:00); the constraint makes
    # the scheduler take a GPU under the NIC's root.
    paired = dra.claim_template(
        e2e,
        "gpu-nic",
        [
            {"name": "gpu", "exactly": dra.exactly(gpu_class)},
            {"name": "nic", "exactly": dra.exactly(nic_class)},
        ],
        constraints=[{"requests": ["gpu", "nic"], "matchAttribute": f"{STD}/pcieRoot"}],
    )
    pair_pod = dra.claim_pod(e2e, "gpu-nic", REPORT, paired)
    kube.wait_pod_phase(e2e.cluster, pair_pod.name, "Running")
    claim = dra.pod_claim(e2e.cluster, pair_pod.name)
    (gpu,) = dra.allocated_devices(claim, GPU_DRIVER)
    assert ROOT[bus[gpu]] == "pci0000:80", claim["status"]["allocation"]
    assert len(dra.allocated_devices(claim, NIC_DRIVER)) == 1
    kube.delete_pods(e2e.cluster, f"kxpu-e2e={e2e.label}")

    # Two GPUs on one NVLink island. One GPU of each island is taken: two GPUs are free, but not a linked
    # pair, so the claim is refused (the pod stays unschedulable) until an island is whole again.
    first, second = pinned(e2e, gpu_class, "0000:17:00.0"), pinned(e2e, gpu_class, "0000:98:00.0")
    linked = dra.claim_template(
        e2e,
        "two-linked",
        [{"name": "gpus", "exactly": dra.exactly(gpu_class, 2)}],
        constraints=[{"requests": ["gpus"], "matchAttribute": f"{GPU_DRIVER}/linkDomain"}],
    )
    pod = dra.claim_pod(e2e, "two-linked", REPORT, linked)

    def unschedulable() -> str | None:
        status = kube.get_pod(e2e.cluster, pod.name).get("status", {})
        assert status.get("phase") == "Pending", status
        for condition in status.get("conditions", []):
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
                return str(condition.get("message"))
        return None

    message = kube.wait_until("the two-GPU pod reported unschedulable", unschedulable, timeout=60)
    assert "claim" in message.lower(), message
    assert not dra.allocated_devices(dra.pod_claim(e2e.cluster, pod.name), GPU_DRIVER)

    e2e.cluster.kubectl(
        "delete", "pod", first.name, "--wait=true", "--timeout=60s"
    )  # island 0000:17 is whole
    kube.wait_pod_phase(e2e.cluster, pod.name, "Running", timeout=120)
    got = sorted(bus[d] for d in dra.allocated_devices(dra.pod_claim(e2e.cluster, pod.name), GPU_DRIVER))
    assert got == ["0000:17:00.0", "0000:31:00.0"], got
    uuids = {str(d["name"]): d["attributes"]["uuid"]["string"] for d in gpus}
    log = kube.wait_pod_log(e2e.cluster, pod.name, "end-of-report")
    visible = re.search(r"^GPUS=(.*)$", log, re.M)
    assert visible, log
    by_bus = {bus[name]: uuid for name, uuid in uuids.items()}
    assert sorted(visible.group(1).split(",")) == sorted(by_bus[b] for b in got), log
    assert kube.get_pod(e2e.cluster, second.name)["status"]["phase"] == "Running"

"""Node labels in the style of NVIDIA's GPU Feature Discovery, and the NFD features file that carries them.

``gpu_labels`` is a pure function of the discovered devices and a few node facts, so it is
tested without NVML and reused by ``kxpu devices``. Resource-scoped keys use NVIDIA's fixed
names (``nvidia.com/gpu.*`` for whole GPUs and ``single`` MIG, ``nvidia.com/mig-<profile>.*``
under ``mixed``), whatever the kxpu resource is called, as GFD does.

Writing labels to the API server needs a Kubernetes client kxpu does not have yet; the
file is for Node Feature Discovery's local source (``features.d``), which NFD turns into
labels (allow the ``nvidia.com`` namespace with ``-extra-label-ns``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kxpu.atomicfile import write_atomically
from kxpu.model import Device

_FAMILIES = {
    1: "tesla",
    2: "fermi",
    3: "kepler",
    5: "maxwell",
    6: "pascal",
    8: "ampere",
    9: "hopper",
    10: "blackwell",
}


def arch_family(major: int, minor: int) -> str:
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8 and minor == 9:
        return "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


def _physical(devices: Sequence[Device]) -> list[Device]:
    """One device per physical GPU or MIG device (replicas collapsed)."""
    seen: dict[str, Device] = {}
    for device in devices:
        seen.setdefault(device.uuid or device.id, device)
    return list(seen.values())


def gpu_labels(
    devices: Sequence[Device],
    *,
    driver_version: str | None,
    cuda_driver_version: tuple[int, int] | None,
    mig_strategy: str,
    mig_capable: bool,
    renamed: bool = False,
) -> dict[str, str]:
    """GFD-style labels for the devices one NVIDIA resource serves; empty when it serves none."""
    if not devices:
        return {}
    labels: dict[str, str] = {}
    if driver_version:
        parts = driver_version.split(".")
        labels["nvidia.com/cuda.driver-version.major"] = parts[0]
        labels["nvidia.com/cuda.driver-version.minor"] = parts[1] if len(parts) > 1 else ""
        labels["nvidia.com/cuda.driver-version.revision"] = parts[2] if len(parts) > 2 else ""
        labels["nvidia.com/cuda.driver-version.full"] = driver_version
    if cuda_driver_version:
        major, minor = cuda_driver_version
        labels["nvidia.com/cuda.runtime-version.major"] = str(major)
        labels["nvidia.com/cuda.runtime-version.minor"] = str(minor)
        labels["nvidia.com/cuda.runtime-version.full"] = f"{major}.{minor}"
    labels["nvidia.com/mig.capable"] = str(mig_capable).lower()
    labels["nvidia.com/mig.strategy"] = mig_strategy

    physical = _physical(devices)
    first = physical[0]
    profile = first.extra.get("migProfile")
    replicas = min(int(d.extra.get("replicas", 1)) for d in devices)
    shared = replicas > 1
    strategy = str(first.extra.get("sharingStrategy", "time-slicing")) if shared else "none"
    labels["nvidia.com/gpu.sharing-strategy"] = strategy
    if strategy == "mps":
        labels["nvidia.com/mps.capable"] = "true"

    prefix = f"nvidia.com/mig-{profile}" if profile and mig_strategy == "mixed" else "nvidia.com/gpu"
    product = (first.model or "unknown").replace(" ", "-")
    if profile and mig_strategy == "single":
        product += f"-MIG-{profile}"
    if shared and not renamed:
        product += "-SHARED"
    labels[f"{prefix}.product"] = product
    labels[f"{prefix}.count"] = str(len(physical))
    labels[f"{prefix}.replicas"] = str(replicas)
    memories = [d.memory_mib for d in physical if d.memory_mib is not None]
    if memories:
        labels[f"{prefix}.memory"] = str(min(memories))
    capability = first.extra.get("computeCapability")
    if isinstance(capability, str) and "." in capability:
        major_s, minor_s = capability.split(".", 1)
        labels[f"{prefix}.compute.major"] = major_s
        labels[f"{prefix}.compute.minor"] = minor_s
        labels[f"{prefix}.family"] = arch_family(int(major_s), int(minor_s))
    if profile:
        for key, extra_key in (("slices.gi", "giSlices"), ("slices.ci", "ciSlices")):
            value = first.extra.get(extra_key)
            if value is not None:
                labels[f"{prefix}.{key}"] = str(value)
    return labels


def write_features_file(path: Path, labels: Mapping[str, str]) -> None:
    """Replace ``path`` atomically with ``key=value`` lines (NFD's local feature source format)."""
    write_atomically(path, "".join(f"{key}={value}\n" for key, value in sorted(labels.items())))

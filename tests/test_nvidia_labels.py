"""GPU Feature Discovery-style labels: a pure function of the devices, and the NFD features file."""

from __future__ import annotations

from pathlib import Path

from kxpu.backends.nvidia.labels import gpu_labels, write_features_file
from kxpu.model import Device, NodeLabeller
from tests.nvidia_support import make, next_list


def test_whole_gpu_labels_match_gfd_names_and_values() -> None:
    backend, _ = make("a100-8x")
    assert isinstance(backend, NodeLabeller)
    labels = backend.node_labels()
    assert labels == {
        "nvidia.com/cuda.driver-version.major": "550",
        "nvidia.com/cuda.driver-version.minor": "54",
        "nvidia.com/cuda.driver-version.revision": "15",
        "nvidia.com/cuda.driver-version.full": "550.54.15",
        "nvidia.com/cuda.runtime-version.major": "12",
        "nvidia.com/cuda.runtime-version.minor": "4",
        "nvidia.com/cuda.runtime-version.full": "12.4",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "none",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.family": "ampere",
    }
    backend.close()


def test_time_slicing_counts_gpus_not_replicas_and_marks_the_product_shared() -> None:
    backend, _ = make("a100-8x", sharing={"timeSlicing": {"resources": [{"replicas": 10}]}})
    labels = backend.node_labels()
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.replicas"] == "10"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-SHARED"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    backend.close()
    renamed, _ = make(
        "a100-8x", sharing={"timeSlicing": {"renameByDefault": True, "resources": [{"replicas": 2}]}}
    )
    assert renamed.node_labels()["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    renamed.close()


def test_mig_single_and_mixed_labels() -> None:
    single, _ = make("h100-mig-single", migStrategy="single")
    labels = single.node_labels()
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    assert labels["nvidia.com/gpu.count"] == "14"
    assert labels["nvidia.com/gpu.memory"] == "9856"
    assert labels["nvidia.com/mig.strategy"] == "single"
    single.close()
    mixed, _ = make("h100-mig-mixed", migStrategy="mixed", migProfile="1g.10gb")
    labels = mixed.node_labels()
    assert labels["nvidia.com/mig-1g.10gb.count"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.slices.gi"] == "1"
    assert labels["nvidia.com/mig-1g.10gb.family"] == "hopper"
    assert not any(k.startswith("nvidia.com/gpu.product") for k in labels)
    mixed.close()


def test_no_devices_no_labels() -> None:
    assert (
        gpu_labels(
            [], driver_version="1.2.3", cuda_driver_version=(12, 0), mig_strategy="none", mig_capable=False
        )
        == {}
    )


def test_labels_are_a_pure_function_of_devices() -> None:
    devices = [
        Device(
            id=f"g{i}",
            model="Tesla T4",
            uuid=f"GPU-{i}",
            memory_mib=15360,
            extra={"computeCapability": "7.5"},
        )
        for i in range(2)
    ]
    labels = gpu_labels(
        devices, driver_version="535.1", cuda_driver_version=None, mig_strategy="none", mig_capable=False
    )
    assert labels["nvidia.com/gpu.family"] == "turing"
    assert labels["nvidia.com/cuda.driver-version.revision"] == ""
    assert labels["nvidia.com/gpu.count"] == "2"
    assert "nvidia.com/cuda.runtime-version.full" not in labels


async def test_features_file_written_when_serving_and_removed_on_close(tmp_path: Path) -> None:
    path = tmp_path / "features.d" / "kxpu-gpu"
    backend, _ = make("a100-8x", labels={"featuresFile": str(path)})
    assert not path.exists()  # listing devices writes nothing; serving does
    updates = backend.watch()
    await next_list(updates)
    lines = path.read_text().splitlines()
    assert "nvidia.com/gpu.count=8" in lines
    assert lines == sorted(lines)
    await updates.aclose()
    backend.close()
    assert not path.exists()


def test_features_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_features_file(path, {"a": "1"})
    inode = path.stat().st_ino
    write_features_file(path, {"a": "2"})
    assert path.read_text() == "a=2\n"
    assert path.stat().st_ino != inode  # a new file renamed over the old one, never a partial write
    assert [p.name for p in tmp_path.iterdir()] == ["f"]

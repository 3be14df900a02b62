"""Discovery through (fake) NVML: what a device says about its GPU, and what happens without a driver."""

from __future__ import annotations

import pytest

from kxpu.backends.nvidia.discovery import cuda_version, linux_pci_address, mig_profile_name
from kxpu.model import BackendError, Health
from kxpu.testing.fake_nvml import FakeNvml
from tests.nvidia_support import make, next_list


def test_a100_node_gives_eight_gpus_with_their_facts() -> None:
    backend, fake = make("a100-8x")
    devices = backend.discover()
    assert [d.id for d in devices] == [g.uuid for g in fake.gpus]
    first, last = devices[0], devices[7]
    assert first.model == "NVIDIA A100-SXM4-80GB"
    assert (first.index, first.memory_mib, first.pci_bus_id) == (0, 81920, "00000000:07:00.0")
    assert first.numa_nodes == (0,) and last.numa_nodes == (1,)
    assert first.extra["computeCapability"] == "8.0"
    assert last.extra["minor"] == 7
    assert all(d.health is Health.HEALTHY for d in devices)
    assert backend.inventory.driver_version == "550.54.15"
    assert backend.inventory.cuda_driver_version == (12, 4)
    backend.close()
    assert not fake.initialized  # NVML shut down


def test_index_strategy_names_gpus_by_index() -> None:
    backend, _ = make("a100-8x", deviceIDStrategy="index")
    assert [d.id for d in backend.discover()] == [str(i) for i in range(8)]
    backend.close()


def test_numa_node_falls_back_to_sysfs_when_nvml_cannot_say() -> None:
    backend, fake = make("h100-mig-mixed", migStrategy="none")
    assert not fake.gpus[1].numa_via_nvml
    assert [d.numa_nodes for d in backend.discover()] == [(0,), (1,)]
    backend.close()


def test_devices_selector_serves_only_the_named_gpus() -> None:
    fake = FakeNvml("a100-8x")
    backend, _ = make(fake, devices=[1, fake.gpus[6].uuid, "99"])
    assert [d.index for d in backend.discover()] == [1, 6]
    backend.close()


def test_no_driver_with_fail_on_init_error_raises_a_clear_error() -> None:
    with pytest.raises(
        BackendError, match=r"NVML unavailable.*NVML Shared Library Not Found.*failOnInitError"
    ):
        make("no-driver")


async def test_no_driver_without_fail_on_init_error_serves_zero_devices() -> None:
    backend, _ = make("no-driver", failOnInitError=False)
    assert backend.discover() == []
    updates = backend.watch()
    assert await next_list(updates) == []
    await updates.aclose()
    backend.close()


def test_gpu_fallen_off_the_bus_at_start_is_reported_unhealthy_not_dropped() -> None:
    backend, fake = make("a100-lost")
    devices = backend.discover()
    assert [d.id for d in devices] == [g.uuid for g in fake.gpus]
    assert devices[0].healthy
    assert devices[1].health is Health.UNHEALTHY
    assert devices[1].health_reason == "discovery-failed"
    backend.close()


def test_pci_address_as_linux_writes_it() -> None:
    assert linux_pci_address("00000000:3B:00.0") == "0000:3b:00.0"
    assert linux_pci_address("00000001:AF:00.0") == "0001:af:00.0"


def test_cuda_version_decoding() -> None:
    assert cuda_version(12040) == (12, 4)
    assert cuda_version(11080) == (11, 8)


@pytest.mark.parametrize(
    ("gi", "ci", "memory_mib", "total_mib", "name"),
    [
        (1, 1, 9856, 81559, "1g.10gb"),  # H100 80GB
        (3, 3, 40192, 81559, "3g.40gb"),
        (7, 7, 80896, 81559, "7g.80gb"),
        (1, 1, 4864, 40536, "1g.5gb"),  # A100 40GB
        (2, 1, 9984, 40536, "1c.2g.10gb"),  # a compute instance smaller than its GPU instance
    ],
)
def test_mig_profile_names_match_nvidia(gi: int, ci: int, memory_mib: int, total_mib: int, name: str) -> None:
    assert mig_profile_name(gi, ci, memory_mib, total_mib * 1024 * 1024) == name

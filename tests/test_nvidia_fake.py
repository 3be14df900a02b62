"""The fake NVML must look like nvidia-ml-py at the boundary the backend uses, or the tests prove nothing."""

from __future__ import annotations

import ctypes
import inspect
import threading
import time

import pynvml
import pytest

from kxpu.testing.fake_nvml import PROFILES, FakeHandle, FakeNvml


def test_every_fake_nvml_function_exists_in_the_real_binding_with_compatible_arguments() -> None:
    names = [n for n in dir(FakeNvml) if n.startswith("nvml") and callable(getattr(FakeNvml, n))]
    assert len(names) > 30
    for name in names:
        real = getattr(pynvml, name, None)
        assert real is not None, f"pynvml has no {name}"
        fake_params = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]
        real_params = list(inspect.signature(real).parameters)
        assert len(fake_params) == len(real_params), f"{name}: {fake_params} vs {real_params}"


def test_errors_and_constants_are_the_bindings_own() -> None:
    fake = FakeNvml("a100-8x")
    assert fake.NVMLError is pynvml.NVMLError
    assert fake.NVML_ERROR_TIMEOUT == pynvml.NVML_ERROR_TIMEOUT == 10
    assert fake.NVML_ERROR_GPU_IS_LOST == 15
    assert fake.NVML_ERROR_LIBRARY_NOT_FOUND == 12
    assert fake.nvmlEventTypeXidCriticalError == 0x8
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_return_shapes_match_the_binding() -> None:
    fake = FakeNvml("a100-8x")
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    memory = fake.nvmlDeviceGetMemoryInfo(handle)
    assert isinstance(memory, pynvml.c_nvmlMemory_t)
    assert memory.total == 81920 * 1024 * 1024
    pci = fake.nvmlDeviceGetPciInfo(handle)
    assert isinstance(pci, pynvml.nvmlPciInfo_t)
    assert pci.busId == "00000000:07:00.0"  # decoded to str, as the binding does
    assert pci.busIdLegacy == "0000:07:00.0"
    assert fake.nvmlDeviceGetCudaComputeCapability(handle) == (8, 0)
    assert isinstance(fake.nvmlDeviceGetUUID(handle), str)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(8)


def test_whole_gpu_answers_mig_questions_as_driver_580_did_on_an_h100() -> None:
    """Recorded by hack/gpu-check on a real H100 (docs/nvidia.md, "On a real GPU")."""
    fake = FakeNvml("a100-8x")  # MIG-capable, MIG off
    fake.nvmlInit()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    is_mig = fake.nvmlDeviceIsMigDeviceHandle(gpu)
    assert isinstance(is_mig, ctypes.c_uint) and not is_mig
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetAttributes(gpu)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstanceId(gpu)


def test_mig_profiles_and_placements_as_driver_580_answered_on_an_h100_with_mig_off() -> None:
    """Read on a real H100 80GB HBM3 with MIG off (ctypes against libnvidia-ml, nothing created): every GPU instance
    profile's info and placements, the codes for profiles it lacks or does not know, and what GetGpuInstanceById
    and GetGpuInstanceRemainingCapacity answer with no instance."""
    fake = FakeNvml("h100-mig-dynamic")
    fake.nvmlInit()
    gpu = fake.nvmlDeviceGetHandleByIndex(2)  # the H100 with MIG off
    seen = {}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT + 1):
        try:
            info = fake.nvmlDeviceGetGpuInstanceProfileInfo(gpu, index)
        except pynvml.NVMLError as exc:
            seen[index] = exc.value
            continue
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        count = ctypes.c_uint(0)
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, None, ctypes.byref(count))
        found = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, info.id, found, ctypes.byref(count))
        seen[index] = (
            info.id,
            info.name,
            info.sliceCount,
            info.instanceCount,
            (info.multiprocessorCount, info.copyEngineCount, info.decoderCount, info.encoderCount),
            (info.jpegCount, info.ofaCount, info.memorySizeMB),
            [(found[n].start, found[n].size) for n in range(count.value)],
            fake.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, info.id),
        )
    ones = [(n, 1) for n in range(7)]
    assert seen == {
        0: (19, "MIG 1g.10gb", 1, 7, (16, 1, 1, 0), (1, 0, 9984), ones, 7),
        1: (14, "MIG 2g.20gb", 2, 3, (32, 2, 2, 0), (2, 0, 20096), [(0, 2), (2, 2), (4, 2)], 3),
        2: (9, "MIG 3g.40gb", 3, 2, (60, 3, 3, 0), (3, 0, 40448), [(0, 4), (4, 4)], 2),
        3: (5, "MIG 4g.40gb", 4, 1, (64, 4, 4, 0), (4, 0, 40448), [(0, 4)], 1),
        4: (0, "MIG 7g.80gb", 7, 1, (132, 8, 7, 0), (7, 1, 81152), [(0, 8)], 1),
        7: (20, "MIG 1g.10gb+me", 1, 1, (16, 1, 1, 0), (1, 1, 9984), ones, 1),
        9: (15, "MIG 1g.20gb", 1, 4, (26, 1, 1, 0), (1, 0, 20096), [(0, 2), (2, 2), (4, 2), (6, 2)], 4),
        **{i: pynvml.NVML_ERROR_NOT_SUPPORTED for i in (5, 6, 8, 10, 11, 12, 13, 14, 15, 16)},
        17: pynvml.NVML_ERROR_INVALID_ARGUMENT,  # 3_SLICE_GFX: newer than driver 580
        18: pynvml.NVML_ERROR_INVALID_ARGUMENT,
    }
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetGpuInstanceById(gpu, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # MIG off: nothing can be created
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(
            gpu, 19, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(0, 1))
        )
    mig_on = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # the C function takes the placement by pointer
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(mig_on, 19, pynvml.c_nvmlGpuInstancePlacement_t(0, 1))


def test_mig_handles_answer_like_mig_devices() -> None:
    fake = FakeNvml("h100-mig-mixed")
    fake.nvmlInit()
    gpu = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMigMode(gpu) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)
    attrs = fake.nvmlDeviceGetAttributes(mig)
    assert isinstance(attrs, pynvml.c_nvmlDeviceAttributes)
    assert (attrs.gpuInstanceSliceCount, attrs.memorySizeMB) == (1, 9856)
    assert fake.nvmlDeviceGetUUID(mig).startswith("MIG-")
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 4)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetNumaNodeId(gpu)  # this profile leaves NUMA to sysfs


def test_event_wait_blocks_until_the_timeout_then_raises_timeout() -> None:
    fake = FakeNvml("a100-8x")
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    start = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait(es, 150)
    assert time.monotonic() - start >= 0.14


def test_event_wait_wakes_on_an_injected_xid_only_for_registered_events() -> None:
    fake = FakeNvml("a100-8x")
    fake.nvmlInit()
    es = fake.nvmlEventSetCreate()
    assert fake.inject_xid(0, 79) == 0  # nothing registered yet: the event is not delivered
    fake.nvmlDeviceRegisterEvents(FakeHandle(0), pynvml.nvmlEventTypeXidCriticalError, es)
    threading.Timer(0.05, fake.inject_xid, (0, 48)).start()
    event = fake.nvmlEventSetWait(es, 5000)
    assert (event.device, event.eventType, event.eventData) == (FakeHandle(0), 0x8, 48)
    assert event.gpuInstanceId == 0xFFFFFFFF


def test_lost_gpu_answers_gpu_is_lost_except_for_its_cached_uuid() -> None:
    fake = FakeNvml("a100-8x")
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(3)
    fake.lose_gpu(3, xid=None)
    assert fake.nvmlDeviceGetUUID(handle).startswith("GPU-")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(handle)


def test_no_driver_profile_fails_init_like_a_node_without_the_library() -> None:
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        FakeNvml("no-driver").nvmlInit()


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profiles_build_and_have_unique_uuids(name: str) -> None:
    fake = FakeNvml(name)
    uuids = [g.uuid for g in fake.gpus] + [m.uuid for g in fake.gpus for m in g.migs]
    assert len(uuids) == len(set(uuids))

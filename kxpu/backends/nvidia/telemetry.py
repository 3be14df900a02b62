"""What NVML tells about the GPUs a resource serves and the processes on them, for the daemon's telemetry.

One ``sample()`` reads, per GPU: utilization (``nvmlDeviceGetUtilizationRates``: the share of the
last sample period a kernel ran, and memory was read or written), memory, power, temperature, SM /
memory / graphics clocks, volatile ECC totals, and the processes with a context on it: ordinary ones
(``nvmlDeviceGetComputeRunningProcesses``) and MPS clients (``nvmlDeviceGetMPSComputeRunningProcesses``),
with each process's SM share since the previous sample (``nvmlDeviceGetProcessUtilization``). A
process inside a MIG instance is reported under that MIG device's UUID. Figures a GPU does not offer
(utilization in MIG mode, ECC on boards without it) are left out; a GPU that stops answering is
reported without figures rather than failing the sample. Xid counts come from the health thread.

What operators use dcgm-exporter for, each named with the DCGM field it corresponds to (docs/telemetry.md):
energy (``nvmlDeviceGetTotalEnergyConsumption``, mJ: DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION), PCIe throughput
(``nvmlDeviceGetPcieThroughput``, KB/s over 20 ms: DCGM_FI_DEV_PCIE_TX_THROUGHPUT / _RX_), remapped rows
(``nvmlDeviceGetRemappedRows``: DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, _UNCORRECTABLE_, DCGM_FI_DEV_ROW_REMAP_PENDING,
_FAILURE) and the reasons clocks are held down (``nvmlDeviceGetCurrentClocksEventReasons``, or the older
``…ThrottleReasons``: DCGM_FI_DEV_CLOCKS_EVENT_REASONS, a bitmask here split into one flag per reason), and on
NVLink data bytes (``nvmlDeviceGetFieldValues`` with NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX / _RX per active link,
KiB counters summed: DCGM_FI_PROF_NVLINK_TX_BYTES / _RX_ as a rate), and on Hopper and newer the GPM profiling counters between this sample and the previous one (``nvmlGpmSampleGet`` into
two samples kept per GPU, ``nvmlGpmMetricsGet``): graphics engine, SM and tensor activity, SM occupancy, DRAM
bandwidth (DCGM_FI_PROF_GR_ENGINE_ACTIVE, _SM_ACTIVE, _PIPE_TENSOR_ACTIVE, _SM_OCCUPANCY, _DRAM_ACTIVE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from kxpu.backends.nvidia.discovery import GpuInfo
from kxpu.backends.nvidia.health import HealthMonitor
from kxpu.backends.nvidia.nvml import Nvml, text
from kxpu.model import DeviceUsage, ProcessUsage, TelemetrySample

T = TypeVar("T")
NO_INSTANCE = 0xFFFFFFFF
# nvmlClocksEventReason* bits → the ``reason`` label
CLOCK_EVENT_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


# GPM metric IDs (NVML_GPM_METRIC_*) → the ``counter`` label; NVML gives percent
GPM_METRICS = {
    "graphics_active": 1,  # NVML_GPM_METRIC_GRAPHICS_UTIL
    "sm_active": 2,  # NVML_GPM_METRIC_SM_UTIL
    "sm_occupancy": 3,  # NVML_GPM_METRIC_SM_OCCUPANCY
    "tensor_active": 5,  # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    "dram_active": 10,  # NVML_GPM_METRIC_DRAM_BW_UTIL
}


class GpuSampler:
    def __init__(self, nvml: Nvml, gpus: Sequence[GpuInfo], monitor: HealthMonitor | None) -> None:
        self.nvml = nvml
        self.gpus = [g for g in gpus if g.handle is not None and g.error is None]
        self.monitor = monitor
        self._last_seen_us: dict[str, int] = {}  # per GPU: newest process-utilization sample read
        self._gpm: dict[str, list[Any]] = {}  # per GPU: [previous sample, next sample] (NVML's memory)
        self._gpm_taken: set[str] = set()  # GPUs whose previous sample holds a reading
        self._gpm_unsupported: set[str] = set()
        self._nvlinks: dict[str, list[int]] = {}  # per GPU: its active NVLinks, asked once

    def close(self) -> None:
        """Free the GPM samples (call with NVML still up)."""
        for samples in self._gpm.values():
            for sample in samples:
                self._read(partial(self.nvml.nvmlGpmSampleFree, sample))
        self._gpm.clear()
        self._gpm_taken.clear()

    def _nvlink_bytes(self, gpu: GpuInfo) -> dict[str, int]:
        """Data bytes over all active NVLinks since the driver loaded (per-link KiB counters summed)."""
        nvml, h = self.nvml, gpu.handle
        links = self._nvlinks.get(gpu.uuid)
        if links is None:
            enabled = int(getattr(nvml, "NVML_FEATURE_ENABLED", 1))
            links = self._nvlinks[gpu.uuid] = [
                link
                for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)))
                if self._read(partial(nvml.nvmlDeviceGetNvLinkState, h, link)) == enabled
            ]
        if not links or not hasattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX"):
            return {}
        fields = [
            (int(getattr(nvml, f"NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{d}")), link)
            for d in ("TX", "RX")
            for link in links
        ]
        values = self._read(partial(nvml.nvmlDeviceGetFieldValues, h, fields))
        if values is None:
            return {}
        totals: dict[str, int] = {}
        for (field_id, _), value in zip(fields, values, strict=False):
            if value.nvmlReturn == nvml.NVML_SUCCESS:
                direction = "tx" if field_id == nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX else "rx"
                totals[direction] = totals.get(direction, 0) + int(value.value.ullVal) * 1024
        return totals

    def _pcie(self, gpu: GpuInfo) -> dict[str, float]:
        """PCIe bytes per second each way over the driver's last 20 ms (``nvmlDeviceGetPcieThroughput`` waits
        that long per direction: most of a sample's wall time). Not the byte counters NVML_FI_DEV_PCIE_COUNT_TX /
        _RX_BYTES: on an H200 they wrapped several times a second at 60 GB/s, so no rate between samples."""
        nvml, h = self.nvml, gpu.handle
        return {
            direction: float(kbps) * 1024
            for direction, counter in (("tx", "NVML_PCIE_UTIL_TX_BYTES"), ("rx", "NVML_PCIE_UTIL_RX_BYTES"))
            if (kbps := self._read(partial(nvml.nvmlDeviceGetPcieThroughput, h, getattr(nvml, counter))))
            is not None
        }

    def _profiling(self, gpu: GpuInfo) -> dict[str, float]:
        """GPM's counters between the previous sample and this one; none on the first, or before Hopper."""
        nvml, h, key = self.nvml, gpu.handle, gpu.uuid
        if key in self._gpm_unsupported or not hasattr(nvml, "nvmlGpmSampleGet"):
            return {}
        samples = self._gpm.get(key)
        if samples is None:
            support = self._read(lambda: nvml.nvmlGpmQueryDeviceSupport(h))
            made = [self._read(nvml.nvmlGpmSampleAlloc) for _ in range(2)]
            if support is None or not support.isSupportedDevice or None in made:
                for sample in made:
                    if sample is not None:
                        self._read(partial(nvml.nvmlGpmSampleFree, sample))
                self._gpm_unsupported.add(key)
                return {}
            samples = self._gpm[key] = made
        previous, current = samples
        if self._read(partial(nvml.nvmlGpmSampleGet, h, current)) is None:
            return {}
        samples.reverse()  # this sample is the previous one next time
        if key not in self._gpm_taken:
            self._gpm_taken.add(key)
            return {}
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version = nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(GPM_METRICS)
        request.sample1, request.sample2 = previous, current
        for i, metric in enumerate(GPM_METRICS.values()):
            request.metrics[i].metricId = metric
        got = self._read(partial(nvml.nvmlGpmMetricsGet, request))
        if got is None:
            return {}
        return {
            name: float(got.metrics[i].value) / 100
            for i, name in enumerate(GPM_METRICS)
            if got.metrics[i].nvmlReturn == nvml.NVML_SUCCESS
        }

    def _read(self, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except self.nvml.NVMLError:
            return None

    def _memory(self, handle: Any) -> Any:
        """Memory info v2 where the driver has it: its ``used`` leaves out the driver's reserved memory, as
        ``nvidia-smi`` does (v1's ``used`` counts it: about 600 MiB more on an H200); v1 on older drivers."""
        nvml = self.nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None:
            memory = self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=version))
            if memory is not None:
                return memory
        return self._read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))

    def sample(self) -> TelemetrySample:
        xids = self.monitor.xid_counts() if self.monitor is not None else {}
        devices: list[DeviceUsage] = []
        processes: list[ProcessUsage] = []
        for gpu in self.gpus:
            devices.append(self._device(gpu, xids.get(gpu.uuid, {})))
            processes += self._processes(gpu)
        return TelemetrySample(tuple(devices), tuple(processes))

    def _device(self, gpu: GpuInfo, xids: dict[int, int]) -> DeviceUsage:
        nvml, h = self.nvml, gpu.handle
        util = self._read(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        memory = self._memory(h)
        power = self._read(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        temperature = self._read(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        clocks: dict[str, float] = {}
        for name, kind in (
            ("sm", "NVML_CLOCK_SM"),
            ("memory", "NVML_CLOCK_MEM"),
            ("graphics", "NVML_CLOCK_GRAPHICS"),
        ):
            mhz = self._read(partial(nvml.nvmlDeviceGetClockInfo, h, getattr(nvml, kind)))
            if mhz is not None:
                clocks[name] = float(mhz) * 1e6
        ecc: dict[str, int] = {}
        for name, kind in (
            ("corrected", "NVML_MEMORY_ERROR_TYPE_CORRECTED"),
            ("uncorrected", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"),
        ):
            count = self._read(
                partial(nvml.nvmlDeviceGetTotalEccErrors, h, getattr(nvml, kind), nvml.NVML_VOLATILE_ECC)
            )
            if count is not None:
                ecc[name] = int(count)
        energy = self._read(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        pcie = self._pcie(gpu)
        rows = self._read(lambda: nvml.nvmlDeviceGetRemappedRows(h))
        reasons = None
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            call = getattr(nvml, name, None)  # the newer name is missing from older nvidia-ml-py
            if call is not None and (reasons := self._read(partial(call, h))) is not None:
                break
        return DeviceUsage(
            uuid=gpu.uuid,
            index=gpu.index,
            model=gpu.name,
            vendor="nvidia",
            compute_utilization=None if util is None else int(util.gpu) / 100,
            memory_bandwidth_utilization=None if util is None else int(util.memory) / 100,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            power_watts=None if power is None else int(power) / 1000,
            temperature_celsius=None if temperature is None else float(temperature),
            clocks_hz=clocks,
            ecc_errors=ecc,
            xid_errors=dict(xids),
            energy_joules=None if energy is None else int(energy) / 1000,
            pcie_bytes_per_second=pcie,
            remapped_rows={}
            if rows is None
            else {"correctable": int(rows[0]), "uncorrectable": int(rows[1])},
            row_remap={} if rows is None else {"pending": bool(rows[2]), "failure": bool(rows[3])},
            clock_event_reasons={}
            if reasons is None
            else {name: bool(int(reasons) & bit) for name, bit in CLOCK_EVENT_REASONS.items()},
            profiling=self._profiling(gpu),
            nvlink_bytes=self._nvlink_bytes(gpu),
        )

    def _processes(self, gpu: GpuInfo) -> list[ProcessUsage]:
        nvml, h = self.nvml, gpu.handle
        found: dict[int, Any] = {}
        for list_them in (
            nvml.nvmlDeviceGetComputeRunningProcesses,
            nvml.nvmlDeviceGetMPSComputeRunningProcesses,
        ):
            for proc in self._read(partial(list_them, h)) or []:
                found.setdefault(int(proc.pid), proc)
        if not found:
            return []
        sm = self._sm_shares(gpu)
        mig_uuid = {(m.gi, m.ci): m.uuid for m in gpu.migs}
        instances = {
            (
                int(getattr(proc, "gpuInstanceId", NO_INSTANCE)),
                int(getattr(proc, "computeInstanceId", NO_INSTANCE)),
            )
            for proc in found.values()
        }
        if any(key[0] != NO_INSTANCE and key not in mig_uuid for key in instances):
            mig_uuid |= self._live_migs(gpu)
        out = []
        for pid, proc in found.items():
            gi, ci = (
                int(getattr(proc, "gpuInstanceId", NO_INSTANCE)),
                int(getattr(proc, "computeInstanceId", NO_INSTANCE)),
            )
            used = proc.usedGpuMemory
            out.append(
                ProcessUsage(
                    uuid=mig_uuid.get((gi, ci), gpu.uuid),
                    pid=pid,
                    memory_used_bytes=None if used is None else int(used),
                    compute_utilization=sm.get(pid),
                )
            )
        return out

    def _live_migs(self, gpu: GpuInfo) -> dict[tuple[int, int], str]:
        """(GPU instance, compute instance) → MIG device UUID as NVML has them now: a MIG device made after
        discovery (dynamic MIG, at prepare) is not among ``gpu.migs``; its processes are its claim's, under its
        own UUID. Asked only while such a process runs (IDs are reused, so nothing is kept)."""
        nvml, found = self.nvml, {}
        for slot in range(self._read(lambda: int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))) or 0):
            mig = self._read(partial(nvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu.handle, slot))
            if mig is None:
                continue  # an empty slot
            gi = self._read(partial(nvml.nvmlDeviceGetGpuInstanceId, mig))
            ci = self._read(partial(nvml.nvmlDeviceGetComputeInstanceId, mig))
            uuid = self._read(partial(nvml.nvmlDeviceGetUUID, mig))
            if gi is not None and ci is not None and uuid is not None:
                found[(int(gi), int(ci))] = text(uuid)
        return found

    def _sm_shares(self, gpu: GpuInfo) -> dict[int, float]:
        """Each process's SM share in the samples newer than the last read (NOT_FOUND: none since)."""
        last = self._last_seen_us.get(gpu.uuid, 0)
        samples = self._read(lambda: self.nvml.nvmlDeviceGetProcessUtilization(gpu.handle, last)) or []
        shares: dict[int, float] = {}
        for s in samples:
            shares[int(s.pid)] = max(shares.get(int(s.pid), 0.0), int(s.smUtil) / 100)
            self._last_seen_us[gpu.uuid] = max(self._last_seen_us.get(gpu.uuid, 0), int(s.timeStamp))
        return shares

"""What amdgpu's sysfs and KFD tell about the GPUs (and partitions) a resource serves, for the daemon's telemetry.

Read per GPU from its PCI directory, as the driver documents them (``Documentation/gpu/amdgpu``):
``gpu_busy_percent`` (share of time the graphics/compute engine was busy), ``mem_busy_percent`` (the memory
controller's), ``mem_info_vram_used`` / ``mem_info_vram_total`` (bytes), ``pp_dpm_sclk`` / ``pp_dpm_mclk`` (the
current DPM level is the line marked ``*``), the amdgpu ``hwmon`` directory (``power1_average``, or
``power1_input`` where the driver hides the average as on MI300, in microwatts; ``temp<N>_input`` in
millidegrees, ``temp<N>_label`` edge / junction / mem) and ``ras/<block>_err_count`` (``ue:`` / ``ce:``
lines). Processes come from KFD: ``/sys/class/kfd/kfd/proc/<pid>/vram_<gpu_id>`` is the VRAM a process holds
on the KFD node with that ``gpu_id`` (host PIDs); KFD gives no per-process compute share.

On a partitioned GPU (MI300 CPX and the like) each partition reports its own memory (KFD's size of the node
and what its processes hold); the figures the driver keeps for the whole GPU (busy, power, temperature,
clocks, RAS) go on its first partition, so that sums over devices stay right. A file the GPU does not have is
a figure left out, never a zero; a file that cannot be read is that GPU's figures left out, with its error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kxpu.backends.amd.sysfs import DRIVER_DIR, Unit
from kxpu.backends.host import Host, HostFileError
from kxpu.model import DeviceUsage, ProcessUsage, TelemetrySample

KFD_PROC = "/sys/class/kfd/kfd/proc"
_LEVEL = re.compile(r"^\s*\d+:\s*(\d+)\s*Mhz\s*\*\s*$", re.IGNORECASE | re.MULTILINE)
_TEMPERATURES = {"edge": "temperature", "junction": "junction", "mem": "memory"}


@dataclass(frozen=True, slots=True)
class SampledUnit:
    """A served unit and the UUID the daemon knows it by."""

    uuid: str
    unit: Unit
    first_of_gpu: bool  # carries the GPU-wide figures
    whole_gpu: bool  # the GPU is not partitioned: its vram_used is the unit's


class AmdSampler:
    def __init__(self, host: Host, vendor: str) -> None:
        self.host = host
        self.vendor = vendor

    def sample(self, units: Sequence[SampledUnit]) -> tuple[TelemetrySample, list[str]]:
        """The figures, and one message per GPU whose files could not be read (its figures left out)."""
        errors: list[str] = []
        processes = self._processes(units)
        used_by_unit: dict[str, int] = {}
        for p in processes:
            used_by_unit[p.uuid] = used_by_unit.get(p.uuid, 0) + (p.memory_used_bytes or 0)
        devices = []
        for s in units:
            try:
                devices.append(self._device(s, used_by_unit))
            except HostFileError as exc:
                errors.append(str(exc))
                devices.append(DeviceUsage(uuid=s.uuid, index=None, vendor=self.vendor))
        return TelemetrySample(tuple(devices), tuple(processes)), errors

    def _device(self, s: SampledUnit, used_by_unit: dict[str, int]) -> DeviceUsage:
        h, unit = self.host, s.unit
        base = f"{DRIVER_DIR}/{unit.gpu.bdf}"
        index = unit.render - 128 if unit.render is not None else None
        model = unit.gpu.product_name
        if s.whole_gpu:
            used, total = (
                h.read_int(f"{base}/mem_info_vram_used", 10),
                h.read_int(f"{base}/mem_info_vram_total", 10),
            )
        else:
            used = used_by_unit.get(s.uuid, 0) if unit.kfd is not None else None
            total = unit.kfd.memory_bytes if unit.kfd is not None else None
        if not s.first_of_gpu:
            return DeviceUsage(
                uuid=s.uuid,
                index=index,
                model=model,
                vendor=self.vendor,
                memory_used_bytes=used,
                memory_total_bytes=total,
            )
        busy, mem_busy = (
            h.read_int(f"{base}/gpu_busy_percent", 10),
            h.read_int(f"{base}/mem_busy_percent", 10),
        )
        hwmon = self._hwmon(base)
        power = temperature = None
        temperatures: dict[str, float] = {}
        if hwmon is not None:
            micro = h.read_int(f"{hwmon}/power1_average", 10)
            if micro is None:
                micro = h.read_int(f"{hwmon}/power1_input", 10)
            power = None if micro is None else micro / 1e6
            for n in range(1, 4):
                milli = h.read_int(f"{hwmon}/temp{n}_input", 10)
                label = h.read(f"{hwmon}/temp{n}_label") or ("edge" if n == 1 else f"temp{n}")
                if milli is not None:
                    temperatures[_TEMPERATURES.get(label, label)] = milli / 1000
            temperature = temperatures.get("temperature")
        clocks = {
            name: mhz * 1e6
            for name, file in (("sm", "pp_dpm_sclk"), ("memory", "pp_dpm_mclk"))
            if (mhz := self._current_level(f"{base}/{file}")) is not None
        }
        return DeviceUsage(
            uuid=s.uuid,
            index=index,
            model=model,
            vendor=self.vendor,
            compute_utilization=None if busy is None else busy / 100,
            memory_bandwidth_utilization=None if mem_busy is None else mem_busy / 100,
            memory_used_bytes=used,
            memory_total_bytes=total,
            power_watts=power,
            temperature_celsius=temperature,
            clocks_hz=clocks,
            ecc_errors=self._ras(base),
            temperatures_celsius={k: v for k, v in temperatures.items() if k != "temperature"},
        )

    def _hwmon(self, base: str) -> str | None:
        for name in self.host.listdir(f"{base}/hwmon"):
            if (self.host.read(f"{base}/hwmon/{name}/name") or "") == "amdgpu":
                return f"{base}/hwmon/{name}"
        return None

    def _current_level(self, path: str) -> int | None:
        text = self.host.read(path)
        if text is None:
            return None
        found = _LEVEL.search(text)
        if found is None:
            raise HostFileError(f"{path}: no current level ('<n>: <MHz>Mhz *') in {text[:60]!r}")
        return int(found.group(1))

    def _ras(self, base: str) -> dict[str, int]:
        """Corrected and uncorrected counts summed over the RAS blocks; none where the GPU has no RAS."""
        totals: dict[str, int] = {}
        for name in self.host.listdir(f"{base}/ras"):
            if not name.endswith("_err_count"):
                continue
            path = f"{base}/ras/{name}"
            for line in (self.host.read(path) or "").splitlines():
                key, _, value = line.partition(":")
                kind = {"ue": "uncorrected", "ce": "corrected"}.get(key.strip())
                if kind is None:
                    continue
                try:
                    totals[kind] = totals.get(kind, 0) + int(value.strip())
                except ValueError:
                    raise HostFileError(
                        f"{path}: expected '{key.strip()}: <count>', found {line[:40]!r}"
                    ) from None
        return totals

    def _processes(self, units: Sequence[SampledUnit]) -> list[ProcessUsage]:
        by_gpu_id = {s.unit.kfd.gpu_id: s.uuid for s in units if s.unit.kfd is not None and s.unit.kfd.gpu_id}
        out = []
        for name in self.host.listdir(KFD_PROC):
            if not name.isdigit():
                continue
            for gpu_id, uuid in by_gpu_id.items():
                try:
                    used = self.host.read_int(f"{KFD_PROC}/{name}/vram_{gpu_id}", 10)
                except HostFileError:
                    continue  # the process is exiting: its directory goes away under us
                if used is not None:
                    out.append(ProcessUsage(uuid=uuid, pid=int(name), memory_used_bytes=used))
        return out

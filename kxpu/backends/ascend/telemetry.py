"""What DCMI tells about the NPUs a resource serves, for the daemon's telemetry.

Per chip, as the DCMI API reference defines the calls (``dcmi_interface_api.h``):
``dcmi_get_device_utilization_rate`` for the overall NPU (13), AI Core (2), AI CPU (3), Vector Core (12),
on-chip memory (HBM, 6) and its bandwidth (10), in percent; ``dcmi_get_device_hbm_info`` (HBM size and use
in MB, its temperature and frequency) or, on chips without HBM (310P), ``dcmi_get_device_memory_info_v3``
(size and available MB); ``dcmi_get_device_power_info`` (0.1 W); ``dcmi_get_device_temperature`` (°C);
``dcmi_get_device_frequency`` (AI Core, MHz); ``dcmi_get_device_health`` (0 healthy, 1-3 alarm levels);
``dcmi_get_device_resource_info`` (each process's PID and device memory in bytes).

A call that answers "not supported" (-8255) is a figure left out; any other error leaves that figure out
too and is reported once per call and code, the chip's other figures still sampled.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TypeVar

from kxpu.backends.ascend import dcmi
from kxpu.backends.ascend.dcmi import Dcmi, DcmiError
from kxpu.backends.ascend.discovery import Npu
from kxpu.model import DeviceUsage, ProcessUsage, TelemetrySample

T = TypeVar("T")
MIB = 1024 * 1024
ENGINES = {
    "aicore": dcmi.UTILIZATION_AICORE,
    "aicpu": dcmi.UTILIZATION_AICPU,
    "vectorcore": dcmi.UTILIZATION_VECTORCORE,
}


class NpuSampler:
    def __init__(self, lib: Dcmi, errors: list[str]) -> None:
        self.lib = lib
        self.errors = errors  # "<call> returned <code> (…)" of calls that failed otherwise than unsupported

    def _read(self, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except DcmiError as exc:
            if exc.code != dcmi.ERR_NOT_SUPPORT and str(exc) not in self.errors:
                self.errors.append(str(exc))
            return None

    def _uint(self, name: str, card: int, dev: int, *args: int) -> int:
        out = ctypes.c_uint()
        dcmi.check(name, getattr(self.lib, name)(card, dev, *args, ctypes.byref(out)))
        return int(out.value)

    def _int(self, name: str, card: int, dev: int) -> int:
        out = ctypes.c_int()
        dcmi.check(name, getattr(self.lib, name)(card, dev, ctypes.byref(out)))
        return int(out.value)

    def _rate(self, card: int, dev: int, kind: int) -> float | None:
        value = self._read(lambda: self._uint("dcmi_get_device_utilization_rate", card, dev, kind))
        return None if value is None else value / 100

    def _hbm(self, card: int, dev: int) -> dcmi.DcmiHbmInfo:
        info = dcmi.DcmiHbmInfo()
        dcmi.check(
            "dcmi_get_device_hbm_info", self.lib.dcmi_get_device_hbm_info(card, dev, ctypes.byref(info))
        )
        return info

    def _memory(self, card: int, dev: int) -> dcmi.DcmiMemoryInfo:
        info = dcmi.DcmiMemoryInfo()
        dcmi.check(
            "dcmi_get_device_memory_info_v3",
            self.lib.dcmi_get_device_memory_info_v3(card, dev, ctypes.byref(info)),
        )
        return info

    def _processes(self, card: int, dev: int) -> list[tuple[int, int]]:
        entries = (dcmi.DcmiProcMemInfo * dcmi.MAX_PROC_NUM)()
        count = ctypes.c_int()
        dcmi.check(
            "dcmi_get_device_resource_info",
            self.lib.dcmi_get_device_resource_info(card, dev, entries, ctypes.byref(count)),
        )
        return [
            (int(e.proc_id), int(e.proc_mem_usage)) for e in entries[: max(0, min(count.value, len(entries)))]
        ]

    def device(self, uuid: str, npu: Npu) -> tuple[DeviceUsage, list[ProcessUsage]]:
        card, dev = npu.card_id, npu.device_id
        hbm = self._read(lambda: self._hbm(card, dev))
        used = total = None
        temperatures: dict[str, float] = {}
        clocks: dict[str, float] = {}
        if hbm is not None:
            used, total = int(hbm.memory_usage) * MIB, int(hbm.memory_size) * MIB
            temperatures["hbm"] = float(hbm.temp)
            if hbm.freq:
                clocks["memory"] = float(hbm.freq) * 1e6
        else:
            ddr = self._read(lambda: self._memory(card, dev))
            if ddr is not None:
                total = int(ddr.memory_size) * MIB
                used = total - int(ddr.memory_available) * MIB
        aicore_mhz = self._read(
            lambda: self._uint("dcmi_get_device_frequency", card, dev, dcmi.FREQ_AICORE_CURRENT)
        )
        if aicore_mhz:
            clocks["aicore"] = float(aicore_mhz) * 1e6
        power = self._read(lambda: self._int("dcmi_get_device_power_info", card, dev))
        temperature = self._read(lambda: self._int("dcmi_get_device_temperature", card, dev))
        health = self._read(lambda: self._uint_health(card, dev))
        bandwidth = self._rate(card, dev, dcmi.UTILIZATION_HBM_BANDWIDTH)
        engines = {
            name: r for name, kind in ENGINES.items() if (r := self._rate(card, dev, kind)) is not None
        }
        overall = self._rate(card, dev, dcmi.UTILIZATION_NPU)
        usage = DeviceUsage(
            uuid=uuid,
            index=npu.phy_id,
            model=f"{npu.chip_type or 'Ascend'}{npu.chip_name}" if npu.chip_name else None,
            vendor="ascend",
            compute_utilization=overall if overall is not None else engines.get("aicore"),
            memory_bandwidth_utilization=bandwidth,
            memory_used_bytes=used,
            memory_total_bytes=total,
            power_watts=None if power is None else power / 10,
            temperature_celsius=None if temperature is None else float(temperature),
            clocks_hz=clocks,
            temperatures_celsius=temperatures,
            engines=engines,
            health_code=health,
        )
        listed = self._read(lambda: self._processes(card, dev)) or []
        return usage, [ProcessUsage(uuid=uuid, pid=pid, memory_used_bytes=size) for pid, size in listed]

    def _uint_health(self, card: int, dev: int) -> int:
        return self._uint("dcmi_get_device_health", card, dev)


def sample_npus(lib: Dcmi, npus: Sequence[tuple[str, Npu]], errors: list[str]) -> TelemetrySample:
    sampler = NpuSampler(lib, errors)
    devices, processes = [], []
    for uuid, npu in npus:
        usage, procs = sampler.device(uuid, npu)
        devices.append(usage)
        processes += procs
    return TelemetrySample(tuple(devices), tuple(processes))

"""What HLML tells about the Gaudi devices a resource serves, for the daemon's telemetry.

Per device, through ``pyhlml`` (names and units as its docstrings give them): ``hlmlDeviceGetUtilizationRates``
(``aip`` percent over the past second), ``hlmlDeviceGetMemoryInfo`` (bytes), ``hlmlDeviceGetPowerUsage`` (mW),
``hlmlDeviceGetTemperature`` on the AIP, the board and the HBM (°C), ``hlmlDeviceGetClockInfo`` of the SoC
(MHz), ``hlmlDeviceGetTotalECCErrors`` (corrected and uncorrected, volatile) and
``hlmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded). HLML lists no processes, so Gaudi
devices have no per-process (per-container) figures.

``HLML_ERROR_NOT_SUPPORTED`` is a figure left out; any other error leaves that figure out too and is reported
once (by call and error), the device's other figures still sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from kxpu.backends.gaudi.hlml import HlmlSource, describe, is_code
from kxpu.model import DeviceUsage, TelemetrySample

T = TypeVar("T")


class AipSampler:
    def __init__(self, source: HlmlSource, errors: list[str]) -> None:
        self.source = source
        self.hlml = source.module
        self.errors = errors

    def _read(self, name: str, call: Callable[[], T]) -> T | None:
        try:
            return call()
        except self.hlml.HLMLError as exc:
            if not is_code(self.source, exc, "HLML_ERROR_NOT_SUPPORTED"):
                message = f"{name}: {describe(exc)}"
                if message not in self.errors:
                    self.errors.append(message)
            return None

    def device(self, uuid: str, index: int, name: str | None, handle: Any) -> DeviceUsage:
        h, t = self.hlml, self.source.types
        util = self._read("hlmlDeviceGetUtilizationRates", lambda: h.hlmlDeviceGetUtilizationRates(handle))
        memory = self._read("hlmlDeviceGetMemoryInfo", lambda: h.hlmlDeviceGetMemoryInfo(handle))
        power = self._read("hlmlDeviceGetPowerUsage", lambda: h.hlmlDeviceGetPowerUsage(handle))
        sensors = t.HLML_TEMPERATURE_SENSORS
        temperatures = {
            label: float(value)
            for label, sensor in (
                ("aip", sensors.HLML_TEMPERATURE_ON_AIP),
                ("board", sensors.HLML_TEMPERATURE_ON_BOARD),
                ("hbm", sensors.HLML_TEMPERATURE_HBM),
            )
            if (
                value := self._read(
                    "hlmlDeviceGetTemperature", partial(h.hlmlDeviceGetTemperature, handle, int(sensor))
                )
            )
            is not None
        }
        soc = self._read(
            "hlmlDeviceGetClockInfo",
            lambda: h.hlmlDeviceGetClockInfo(handle, int(t.HLML_CLOCK_TYPE.HLML_CLOCK_SOC)),
        )
        ecc: dict[str, int] = {}
        for kind, error_type in (
            ("corrected", t.HLML_MEMORY_ERROR_TYPE.HLML_MEMORY_ERROR_TYPE_CORRECTED),
            ("uncorrected", t.HLML_MEMORY_ERROR_TYPE.HLML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            count = self._read(
                "hlmlDeviceGetTotalECCErrors",
                partial(
                    h.hlmlDeviceGetTotalECCErrors,
                    handle,
                    int(error_type),
                    int(t.HLML_ECC_COUNTER_TYPE.HLML_VOLATILE_ECC),
                ),
            )
            if count is not None:
                ecc[kind] = int(count)
        energy = self._read(
            "hlmlDeviceGetTotalEnergyConsumption", lambda: h.hlmlDeviceGetTotalEnergyConsumption(handle)
        )
        return DeviceUsage(
            uuid=uuid,
            index=index,
            model=name,
            vendor="gaudi",
            compute_utilization=None if util is None else int(util.aip) / 100,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            power_watts=None if power is None else int(power) / 1000,
            temperature_celsius=temperatures.pop("aip", None),
            temperatures_celsius=temperatures,
            clocks_hz={} if soc is None else {"soc": float(soc) * 1e6},
            ecc_errors=ecc,
            energy_joules=None if energy is None else int(energy) / 1000,
        )


def sample_aips(
    source: HlmlSource, aips: Sequence[tuple[str, int, str | None, Any]], errors: list[str]
) -> TelemetrySample:
    sampler = AipSampler(source, errors)
    return TelemetrySample(tuple(sampler.device(*aip) for aip in aips))

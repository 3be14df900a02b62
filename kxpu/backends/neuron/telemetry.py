"""What the Neuron driver's sysfs counters tell about the devices a resource serves, for the daemon's telemetry.

The driver's metrics tree (``neuron_sysfs_metrics.c``, aws-neuron-driver): per NeuronCore,
``neuron_core<K>/stats/memory_usage/device_mem/{present,total,peak}`` (bytes of device memory the core's
runtime holds now, ever, at most) and one directory per category under it with the same three files
(``model_code``, ``tensors``, ``constants``, ``model_shared_scratchpad``, ``nonshared_scratchpad``,
``runtime_memory``, ``driver_memory``, ``collectives``, ``notifications``, ``dma_rings``,
``uncategorized``). A device reports the sum over its cores: memory in use (``present``) and in use by
category; its size is the model's (as ``neuron-ls`` reports it); uncorrectable ECC counts come from
``stats/hardware/{mem,sram}_ecc_uncorrected`` (the driver keeps no corrected count), and power as a share of
the device's maximum from ``stats/power/utilization`` (no watts: the driver reads a percentage from firmware).
Busy time and per-process figures are the runtime's (``monitor.py``: ``neuron-monitor``), not the driver's:
Neuron devices report no utilization and no processes here.

Which cores a device has and which category directories each core's ``device_mem`` holds is fixed while the
driver is loaded: it is listed once per discovery (``Layout``), so a sample reads only the counters (a listing
and a stat per category per core per sample made Neuron the costliest backend to sample).
"""

from __future__ import annotations

from collections.abc import Sequence

from kxpu.backends.host import Host, HostFileError
from kxpu.backends.neuron.sysfs import MEMORY_GIB, NeuronDevice
from kxpu.model import DeviceUsage, TelemetrySample

GIB = 1024**3
DEVICE_MEM = "stats/memory_usage/device_mem"
POWER_UTILIZATION = "stats/power/utilization"
POWER_VALID = "POWER_STATUS_VALID"


def _cores(host: Host, device_dir: str) -> list[str]:
    names = [n for n in host.listdir(device_dir) if n.startswith("neuron_core") and n[11:].isdigit()]
    return sorted(names, key=lambda n: int(n[11:]))


Layout = dict[str, tuple[tuple[str, tuple[str, ...]], ...]]  # device path → (core's device_mem, categories)


def _layout(host: Host, device_dir: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    cores = []
    for core in _cores(host, device_dir):
        base = f"{device_dir}/{core}/{DEVICE_MEM}"
        cores.append((base, tuple(n for n in host.listdir(base) if host.is_dir(f"{base}/{n}"))))
    return tuple(cores)


def power_utilization(host: Host, device_dir: str, errors: list[str]) -> float | None:
    """``stats/power/utilization`` (``neuron_power.c``, driver 2.24+): ``<status>,<unix time>,<min>,<max>,<avg>``, the
    last minute's power as a percentage of the device's maximum with the idle baseline backed out, ``%u.%02u``.
    Only ``POWER_STATUS_VALID`` carries figures (``POWER_STATUS_NO_DATA`` for the first minute, ``…_INVALID``);
    a line of another shape costs the power figure and one log line, not the device's other figures."""
    path = f"{device_dir}/{POWER_UTILIZATION}"
    try:
        text = host.read(path)
    except HostFileError as exc:
        errors.append(str(exc))
        return None
    if text is None:
        return None
    fields = text.split(",")
    try:
        if len(fields) != 5:
            raise ValueError
        average = float(fields[4])
    except ValueError:
        errors.append(f"{path}: expected '<status>,<time>,<min>,<max>,<avg>', found {text[:60]!r}")
        return None
    return average / 100 if fields[0] == POWER_VALID else None


def sample_devices(
    host: Host, devices: Sequence[tuple[str, NeuronDevice]], errors: list[str], layout: Layout | None = None
) -> TelemetrySample:
    """``layout``: kept between samples by the caller (emptied at each discovery); a device whose counters
    cannot be read is listed again next time."""
    layout = {} if layout is None else layout
    out = []
    for uuid, dev in devices:
        used: int | None = None
        categories: dict[str, int] = {}
        try:
            if (cores := layout.get(dev.path)) is None:
                cores = layout[dev.path] = _layout(host, dev.path)
            for base, names in cores:
                present = host.read_int(f"{base}/present", 10)
                if present is not None:
                    used = (used or 0) + present
                for name in names:
                    value = host.read_int(f"{base}/{name}/present", 10)
                    if value is not None:
                        categories[name] = categories.get(name, 0) + value
            power = power_utilization(host, dev.path, errors)
            ecc = {
                kind: count
                for kind in ("mem", "sram")
                if (count := host.read_int(f"{dev.path}/stats/hardware/{kind}_ecc_uncorrected", 10))
                is not None
            }
        except HostFileError as exc:
            layout.pop(dev.path, None)
            errors.append(str(exc))
            out.append(DeviceUsage(uuid=uuid, index=dev.index, model=dev.device_name, vendor="neuron"))
            continue
        size = MEMORY_GIB.get(dev.device_name or "")
        out.append(
            DeviceUsage(
                uuid=uuid,
                index=dev.index,
                model=dev.device_name,
                vendor="neuron",
                memory_used_bytes=used,
                memory_total_bytes=None if size is None else size * GIB,
                memory_by_category=categories,
                ecc_errors={"uncorrected": sum(ecc.values())} if ecc else {},
                power_utilization=power,
            )
        )
    return TelemetrySample(tuple(out))

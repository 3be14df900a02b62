"""What one telemetry tick found: the immutable snapshot that ``/metrics`` (``telemetry_metrics.py``) and
``/status`` read, and the excursions the sampler (``telemetry.py``) reports. Plain data, so that both sides
import it and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from kxpu.daemon.holders import Holder
from kxpu.model import DeviceUsage, Grant, ProcessUsage

ContainerKey = tuple[str, str, str, str, str, str]  # resource, device UUID, namespace, pod, container, claim
COMPUTE_MARGIN = 0.05  # per-process SM utilization is a sampled figure; don't flag noise as an excursion


@dataclass(frozen=True, slots=True)
class ProcessView:
    resource: str
    usage: ProcessUsage
    namespace: str
    pod: str
    container: str
    claim: str = ""


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One container's use of one device: the sum over its processes there."""

    resource: str
    uuid: str
    namespace: str
    pod: str
    container: str
    claim: str
    pod_uid: str
    pids: tuple[int, ...]
    memory_used_bytes: int | None
    compute_utilization: float | None
    grant: Grant | None

    @property
    def memory_exceeded(self) -> bool:
        g = self.grant
        return (
            g is not None
            and g.memory_bytes is not None
            and self.memory_used_bytes is not None
            and self.memory_used_bytes > g.memory_bytes
        )

    @property
    def compute_exceeded(self) -> bool:
        g = self.grant
        return (
            g is not None
            and g.compute_ratio is not None
            and 0 < g.compute_ratio < 1
            and self.compute_utilization is not None
            and self.compute_utilization > g.compute_ratio + COMPUTE_MARGIN
        )

    @property
    def key(self) -> ContainerKey:
        return (self.resource, self.uuid, self.namespace, self.pod, self.container, self.claim)


@dataclass(frozen=True, slots=True)
class GrantExceeded:
    """A container went above its grant (one report per excursion)."""

    usage: ContainerUsage
    kind: str  # "memory" or "compute"

    @property
    def message(self) -> str:
        u, g = self.usage, self.usage.grant
        assert g is not None
        if self.kind == "memory":
            used, granted = _gib(u.memory_used_bytes), _gib(g.memory_bytes)
            what = f"uses {used} of device memory, granted {granted}"
        else:
            used_pct = round((u.compute_utilization or 0) * 100)
            what = f"uses {used_pct}% of the device's compute, granted {round((g.compute_ratio or 0) * 100)}%"
        return (
            f"container {u.container or '?'} of pod {u.namespace}/{u.pod} {what} on {u.uuid} ({u.resource})"
        )


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.2f} GiB"


@dataclass(frozen=True, slots=True)
class Snapshot:
    taken_at: float = 0.0  # time.time() of the tick
    duration_s: float = 0.0
    devices: tuple[tuple[str, DeviceUsage], ...] = ()  # (resource, figures)
    processes: tuple[ProcessView, ...] = ()
    containers: tuple[ContainerUsage, ...] = ()
    holders: tuple[Holder, ...] = ()  # every container holding a sampled device, processes or not
    errors: tuple[str, ...] = ()
    over: frozenset[tuple[ContainerKey, str]] = field(default_factory=frozenset)

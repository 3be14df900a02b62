"""The contract between a device backend and the daemon that serves it.

A backend implements ``discover`` and ``allocate``; everything else is an optional
capability, found with ``isinstance`` checks on the protocols below, and decides what
the daemon advertises to the kubelet (as Intel's Go framework does with optional
interfaces). Backends never import the daemon, gRPC or Kubernetes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from kxpu.model.device import Device
from kxpu.model.edits import ContainerEdits
from kxpu.model.telemetry import TelemetrySample


class BackendError(Exception):
    """A backend could not do what was asked; the message is shown to operators as is."""


class Backend(ABC):
    """The required part: what devices exist and what a container gets for some of them."""

    @abstractmethod
    def discover(self) -> list[Device]:
        """Return every device now, healthy or not. May block briefly (it runs in a worker thread)."""

    @abstractmethod
    def allocate(self, devices: Sequence[Device]) -> ContainerEdits:
        """Edits for one container. The daemon has already checked the devices exist and are healthy.

        Called on the event loop: keep it fast and non-blocking.
        """


@runtime_checkable
class Watcher(Protocol):
    """Pushes changes (health flips, hot-plug) instead of being polled."""

    def watch(self) -> AsyncIterator[list[Device]]:
        """Yield the full device list each time it changes; runs until cancelled."""
        ...


@runtime_checkable
class PreferredAllocator(Protocol):
    """Chooses which devices a container should get (the daemon then offers GetPreferredAllocation)."""

    def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]: ...


@runtime_checkable
class AsyncAllocator(Protocol):
    """Must await something off the node (an API server handshake) to answer; the daemon then awaits
    ``allocate_async`` instead of calling ``allocate``, and ``preferred_allocation_async`` instead of
    ``preferred_allocation``. Still runs on the loop: await, never block."""

    async def allocate_async(self, devices: Sequence[Device]) -> ContainerEdits: ...

    async def preferred_allocation_async(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> list[str]: ...


@runtime_checkable
class PreStarter(Protocol):
    """Needs a step before each container starts (the daemon then asks for PreStartContainer)."""

    def pre_start(self, devices: Sequence[Device]) -> None: ...


@runtime_checkable
class Closable(Protocol):
    """Holds something to release when the resource stops (a library handle, a thread)."""

    def close(self) -> None: ...


@runtime_checkable
class NodeLabeller(Protocol):
    """Knows node labels describing its devices (GPU Feature Discovery style); ``kxpu devices`` shows them."""

    def node_labels(self) -> dict[str, str]: ...


@runtime_checkable
class TelemetrySource(Protocol):
    """Can tell how busy its devices are and which processes use them (``kxpu.model.telemetry``).

    ``sample()`` may block briefly (it runs in a worker thread, on the daemon's interval); figures the
    backend cannot read are left ``None``. It must be safe to call while the backend is being closed
    (answer what is known, or raise ``BackendError``)."""

    def sample(self) -> TelemetrySample: ...


@dataclass(frozen=True, slots=True)
class DeviceShare:
    """Part of one device for one container, as a scheduler granted it: memory in MiB, compute in percent
    (0: no compute limit, 100: the whole device)."""

    device: Device
    memory_mib: int
    cores: int


@runtime_checkable
class ShareAllocator(Protocol):
    """Can enforce a container's share of a device itself (NVIDIA MPS limits, say). A wrapper that knows the
    shares (fractional sharing) calls ``allocate_shares`` instead of ``allocate``; the edits are the same
    as ``allocate``'s for those devices, plus whatever makes the limits hold."""

    def allocate_shares(self, shares: Sequence[DeviceShare]) -> ContainerEdits: ...


@dataclass(frozen=True, slots=True)
class CounterSet:
    """What the partitions of one physical device draw from (DRA shared counters): named amounts, such as
    one counter per memory slice of a GPU, so that partitions covering the same slice exclude each other."""

    name: str  # a DNS label, unique within the backend
    counters: Mapping[str, int]


@runtime_checkable
class Partitioner(Protocol):
    """Offers devices that overlap: a whole GPU and the MIG-style partitions it could be cut into. Each such
    device says what it draws from its physical device (``Device.consumes``); the DRA scheduler never
    allocates devices that together draw more than a counter set holds. Only DRA can serve this (a device
    plugin's kubelet would hand out overlapping devices), so the device-plugin path refuses it.

    A partition may exist only while it is used (dynamic partitioning): ``realize`` creates the chosen
    devices before a container gets them and returns them as they now are, each with what ``release`` needs
    to destroy it again (kept on disk: the process that releases may not be the one that realized). Both may
    block (they run in a worker thread); a backend whose partitions always exist returns its devices as they
    are and an empty handle.

    ``release`` must be idempotent: a handle whose partition is already gone (released by an earlier call
    whose process died before recording it, or destroyed by hand) is not an error. The DRA driver releases
    before it forgets a claim, so after a crash in between it releases the same handles again."""

    def counter_sets(self) -> Sequence[CounterSet]: ...

    def realize(self, devices: Sequence[Device]) -> Sequence[tuple[Device, Mapping[str, str | int]]]: ...

    def release(self, handles: Sequence[Mapping[str, str | int]]) -> None: ...


@runtime_checkable
class ConfigWarner(Protocol):
    """Settings accepted but doing nothing now (a device glob that matches no path), for the daemon's /status."""

    def config_warnings(self) -> list[str]: ...


@runtime_checkable
class PartitionReclaimer(Protocol):
    """A Partitioner whose partitions live in the hardware beyond the process that made them (dynamic MIG):
    it can destroy one that exists although nothing recorded making it (the process was killed inside
    ``realize``, before the DRA driver could write the handle down), from the device alone.

    ``reclaim`` is asked only for devices the driver wrote down, before ``realize``, that it was about to make
    (so it never destroys a partition someone else made), and only once no prepared claim holds them. It
    destroys whatever partition exists at exactly each device's placement and profile, returns a short
    description of each one destroyed (for the log), and is idempotent: nothing there is not an error.
    Blocks (a worker thread)."""

    def reclaim(self, devices: Sequence[Device]) -> Sequence[str]: ...


@runtime_checkable
class Wrapper(Protocol):
    """Decorates another backend (CDI, fractional sharing): ``inner`` is the one it wraps."""

    inner: Backend


_C = TypeVar("_C")


def find_capability(backend: Backend, capability: type[_C]) -> _C | None:
    """The outermost of ``backend`` and the backends it wraps that offers ``capability``.

    For capabilities a wrapper need not translate (telemetry is about physical devices, which wrappers
    leave alone), so that every wrapper does not have to forward them."""
    seen: set[int] = set()
    current: object = backend
    while current is not None and id(current) not in seen:
        if isinstance(current, capability):
            return current
        seen.add(id(current))
        current = getattr(current, "inner", None) if isinstance(current, Wrapper) else None
    return None


@dataclass(frozen=True, slots=True)
class Capabilities:
    watch: bool
    preferred_allocation: bool
    pre_start: bool
    close: bool


def capabilities_of(backend: Backend) -> Capabilities:
    return Capabilities(
        watch=isinstance(backend, Watcher),
        preferred_allocation=isinstance(backend, PreferredAllocator),
        pre_start=isinstance(backend, PreStarter),
        close=isinstance(backend, Closable),
    )

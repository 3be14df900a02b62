"""The contract between a device backend and the daemon that serves it.

A backend implements ``discover`` and ``allocate``; everything else is an optional
capability, found with ``isinstance`` checks on the protocols below, and decides what
the daemon advertises to the kubelet (as Intel's Go framework does with optional
interfaces). Backends never import the daemon, gRPC or Kubernetes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kxpu.model.device import Device
from kxpu.model.edits import ContainerEdits


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

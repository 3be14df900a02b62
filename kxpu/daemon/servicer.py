"""The DevicePlugin gRPC service for one resource: the kubelet-facing half of a resource.

It owns no lifecycle (see ``resource.py``); it answers from the latest device snapshot,
refuses anything it cannot vouch for, and wakes every ListAndWatch stream on a change.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.daemon import metrics
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.daemon.wire import (
    KUBELET_MAX_MESSAGE_BYTES,
    edits_to_pb,
)
from kxpu.logs import get_logger, log_failure
from kxpu.model import (
    AsyncAllocator,
    Backend,
    BackendError,
    Device,
    PreferredAllocator,
    PreStarter,
    capabilities_of,
    numa_packed,
)

log = get_logger("kxpu.daemon.servicer")


class Refused(Exception):
    """A request the daemon will not grant; carries the gRPC status the kubelet gets."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(
        self,
        resource: str,
        backend: Backend,
        snapshot: DeviceSnapshot,
        on_dropped: Callable[[], None] | None = None,
    ) -> None:
        self.resource = resource
        # Called when the kubelet has closed every ListAndWatch stream of ours while we were not stopping: it no
        # longer holds this plugin (a kubelet before 1.37 drops the newest plugin when an older one goes).
        self._on_dropped = on_dropped
        self.backend = backend
        self.snapshot = snapshot
        caps = capabilities_of(backend)
        # Resolved once: isinstance on runtime-checkable protocols is too slow for the Allocate path.
        self._awaits = isinstance(backend, AsyncAllocator)
        self._prefers = caps.preferred_allocation
        self.options = pb.DevicePluginOptions(
            pre_start_required=caps.pre_start,
            get_preferred_allocation_available=caps.preferred_allocation,
        )
        self.log = log.bind(resource=resource)
        self._allocate_seconds = metrics.ALLOCATE_SECONDS.labels(resource)  # looked up once, not per call
        self._sent: dict[int, int] = {}  # open ListAndWatch stream → the snapshot version it last sent
        self._open = 0  # ListAndWatch streams open now
        self._streams = itertools.count()
        self._failed = asyncio.Event()
        self._failure: Exception | None = None
        self._closing = asyncio.Event()

    def kubelet_synced(self) -> bool:
        """Some open ListAndWatch stream has sent the current device list: the kubelet has the devices."""
        return self.snapshot.version in self._sent.values()

    def close_streams(self) -> None:
        """End every ListAndWatch stream now (the daemon is stopping): the kubelet learns at once that this plugin
        is gone, rather than when the server's grace period runs out with the listener already closed (its calls
        meanwhile refused), so a successor standing by takes over within milliseconds."""
        self._closing.set()

    async def stream_failure(self) -> Exception:
        """Wait until a ListAndWatch stream fails to send; returns why."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    async def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.DevicePluginOptions]
    ) -> pb.DevicePluginOptions:
        return self.options

    async def ListAndWatch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[pb.Empty, pb.ListAndWatchResponse]
    ) -> AsyncIterator[pb.ListAndWatchResponse]:
        self.log.info("kubelet opened ListAndWatch")
        stream = next(self._streams)
        self._open += 1
        sent = -1
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            while not self._closing.is_set():
                version = self.snapshot.version
                if version != sent:
                    message = self.snapshot.message
                    healthy = sum(d.health == "Healthy" for d in message.devices)
                    self.log.info("sending device list", devices=len(message.devices), healthy=healthy)
                    yield message
                    sent = self._sent[stream] = version
                newer = asyncio.ensure_future(self.snapshot.wait_newer_than(sent))
                try:
                    await asyncio.wait({newer, closing}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    newer.cancel()
        except Exception as exc:  # never silent: the kubelet would hold the devices unhealthy, unexplained
            self._failure = RuntimeError(f"ListAndWatch could not send the device list: {exc}")
            self._failed.set()
            log_failure(self.log, "ListAndWatch failed; restarting the resource", exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"kxpu could not send the device list: {exc}")
        finally:
            closing.cancel()
            self._sent.pop(stream, None)
            self._open -= 1
            self.log.info("ListAndWatch closed")
            if not self._open and not self._closing.is_set() and self._on_dropped is not None:
                self._on_dropped()

    def _lookup(self, ids: Sequence[str], where: str) -> list[Device]:
        """The devices behind ``ids``, or Refused: never grant what the snapshot cannot vouch for."""
        if not ids:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: no device IDs requested")
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: device IDs requested twice: {', '.join(duplicates)}",
            )
        devices = self.snapshot.devices
        unknown = [i for i in ids if i not in devices]
        if unknown:
            raise Refused(
                grpc.StatusCode.NOT_FOUND,
                f"{where}: unknown {self.resource} device IDs: {', '.join(unknown)}",
            )
        unhealthy = [i for i in ids if not devices[i].healthy]
        if unhealthy:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{where}: {self.resource} devices are unhealthy: {', '.join(unhealthy)}",
            )
        return [devices[i] for i in ids]

    async def Allocate(
        self,
        request: pb.AllocateRequest,
        context: grpc.aio.ServicerContext[pb.AllocateRequest, pb.AllocateResponse],
    ) -> pb.AllocateResponse:
        started = time.perf_counter()
        try:
            return await self._allocate(request, context)
        finally:
            self._allocate_seconds.observe(time.perf_counter() - started)

    async def _allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AllocateResponse:
        response = pb.AllocateResponse()
        total = len(request.container_requests)
        if total == 0:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "Allocate with no container requests"
            )
        granted: dict[str, int] = {}  # device ID → the container request that got it
        for n, container in enumerate(request.container_requests, start=1):
            ids = list(container.devices_ids)
            # The kubelet does not say which pod this is; name what we can.
            where = f"container request {n}/{total}"
            try:
                devices = self._lookup(ids, where)
                twice = sorted(i for i in ids if i in granted)
                if twice:
                    raise Refused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{where}: device IDs also requested by container request "
                        f"{granted[twice[0]]}/{total}: {', '.join(twice)}",
                    )
                if self._awaits:
                    edits = await cast(AsyncAllocator, self.backend).allocate_async(devices)
                else:
                    edits = self.backend.allocate(devices)
                response.container_responses.append(edits_to_pb(edits))
            except Refused as exc:
                await self._refuse(context, exc.code, str(exc), ids=ids)
            except BackendError as exc:
                await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, f"{where}: {exc}", ids=ids)
            except Exception as exc:
                log_failure(self.log, "backend failed to allocate", exc, ids=ids)
                metrics.ALLOCATE_ERRORS.labels(self.resource, grpc.StatusCode.INTERNAL.name).inc()
                await context.abort(grpc.StatusCode.INTERNAL, f"{where}: backend error: {exc}")
            granted.update(dict.fromkeys(ids, n))
            # Debug, not info: the kubelet's request names no pod, so the line could not say whose devices these
            # are (the PodResources API and `kxpu status` do), and at info it was a tenth of each call's CPU.
            self.log.debug("allocated", request=where, ids=ids)
        size = response.ByteSize()
        if size > KUBELET_MAX_MESSAGE_BYTES:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the Allocate answer is {size} bytes; the kubelet accepts at most {KUBELET_MAX_MESSAGE_BYTES}",
                ids=[i for c in request.container_requests for i in c.devices_ids],
            )
        return response

    async def GetPreferredAllocation(
        self,
        request: pb.PreferredAllocationRequest,
        context: grpc.aio.ServicerContext[pb.PreferredAllocationRequest, pb.PreferredAllocationResponse],
    ) -> pb.PreferredAllocationResponse:
        """Only known devices, each once, ``must_include`` first; the kubelet keeps what it offered."""
        response = pb.PreferredAllocationResponse()
        devices = self.snapshot.devices
        for container in request.container_requests:
            available = [devices[i] for i in dict.fromkeys(container.available_deviceIDs) if i in devices]
            must = [devices[i] for i in dict.fromkeys(container.must_include_deviceIDs) if i in devices]
            size = container.allocation_size
            if size <= 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"allocation size {size} must be > 0")
            if len(must) > size:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{len(must)} devices must be included in an allocation of {size}",
                )
            started = time.perf_counter()
            chosen = await self._preferred(available, must, size)
            metrics.PREFERRED_SECONDS.labels(self.resource).observe(time.perf_counter() - started)
            response.container_responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return response

    async def _preferred(self, available: list[Device], must: list[Device], size: int) -> list[str]:
        if self._prefers:
            try:
                if self._awaits:
                    chosen = await cast(AsyncAllocator, self.backend).preferred_allocation_async(
                        available, must, size
                    )
                else:
                    chosen = cast(PreferredAllocator, self.backend).preferred_allocation(
                        available, must, size
                    )
                if _valid_choice(chosen, available, must, size):
                    return chosen
                self.log.warning("backend preferred allocation ignored: breaks the request", chosen=chosen)
            except Exception as exc:
                log_failure(
                    self.log, "backend preferred allocation failed; using the NUMA-packed default", exc
                )
        return numa_packed(available, must, size)

    async def PreStartContainer(
        self,
        request: pb.PreStartContainerRequest,
        context: grpc.aio.ServicerContext[pb.PreStartContainerRequest, pb.PreStartContainerResponse],
    ) -> pb.PreStartContainerResponse:
        ids = list(request.devices_ids)
        if isinstance(self.backend, PreStarter):
            unknown = [i for i in ids if i not in self.snapshot.devices]
            if unknown or not ids:
                reason = (
                    f"unknown {self.resource} device IDs: {', '.join(unknown)}" if ids else "no device IDs"
                )
                self.log.warning("pre-start refused", reason=reason, ids=ids)
                code = grpc.StatusCode.NOT_FOUND if ids else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, f"pre-start: {reason}")
            try:
                devices = [self.snapshot.devices[i] for i in ids]
                await asyncio.to_thread(self.backend.pre_start, devices)
            except Exception as exc:
                log_failure(self.log, "pre-start failed", exc, ids=ids)
                await context.abort(grpc.StatusCode.INTERNAL, f"pre-start of {', '.join(ids)} failed: {exc}")
        return pb.PreStartContainerResponse()

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        code: grpc.StatusCode,
        message: str,
        ids: Sequence[str] = (),
    ) -> None:
        self.log.warning("request refused", code=code.name, reason=message, ids=list(ids))
        metrics.ALLOCATE_ERRORS.labels(self.resource, code.name).inc()
        await context.abort(code, message)


def _valid_choice(chosen: list[str], available: list[Device], must: list[Device], size: int) -> bool:
    allowed = {d.id for d in available} | {d.id for d in must}
    return (
        len(chosen) == len(set(chosen))
        and set(chosen) <= allowed
        and {d.id for d in must} <= set(chosen)
        and len(chosen) == min(size, len(allowed))
    )

"""A kubelet stand-in that behaves as the kubelet's device manager does, over real unix sockets.

It serves ``Registration`` on ``kubelet.sock``; ``Register`` validates the request, dials
the plugin back and calls ``GetDevicePluginOptions`` *before* answering (the synchronous
dance that breaks naive plugins), then consumes ``ListAndWatch`` in the background where
each message replaces the resource's device set. ``restart()`` does what a kubelet start
does to the directory: delete every unix socket, then listen on a fresh ``kubelet.sock``.

Allocations made for a named pod are remembered as the kubelet does: for the PodResources API, and
in the device checkpoint ``kubelet_internal_checkpoint`` in the plugin directory (pod UID, container
name, resource, device IDs by NUMA node, the Allocate response in base64), which the daemon's
telemetry reads. The stand-in writes no real ``Checksum`` (kxpu never checks it).

Containers using DRA claims (``use_claim``) are listed in PodResources' ``dynamic_resources`` (claim
name and namespace, and per device the driver, pool, device name and share ID, as the kubelet fills them).
The kubelet's own DRA checkpoint is not written: kxpu never reads it (pod UIDs come from the claim's
``status.reservedFor``, ``FakeDraApi.reserve``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import stat
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.api.podresources.v1 import api_pb2 as podres
from kxpu.api.podresources.v1 import api_pb2_grpc as podres_grpc
from kxpu.config import check_extended_resource_name

HEALTHY = "Healthy"
DIAL_TIMEOUT_SECONDS = 10.0


@dataclass
class DeviceListEvent:
    at: float  # time.monotonic()
    devices: dict[str, str]  # ID → health as the kubelet would count it


@dataclass
class PluginView:
    """What the kubelet knows of one registered resource."""

    resource: str
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginAsyncStub
    registered_at: float
    history: list[DeviceListEvent] = field(default_factory=list)
    stream_task: asyncio.Task[None] | None = None
    # the kubelet let go of it (its stream ended, or another one's did: before 1.37)
    disconnected: bool = False
    orphaned: bool = False  # 1.37: its client forgotten after a second registration of its socket

    @property
    def devices(self) -> dict[str, str]:
        return self.history[-1].devices if self.history else {}

    @property
    def capacity(self) -> int:
        return len(self.devices)

    @property
    def allocatable(self) -> int:
        return sum(1 for health in self.devices.values() if health == HEALTHY)


# (namespace, pod, container) → [(resource, device IDs)], as the kubelet's checkpoint remembers it.
PodAssignments = dict[tuple[str, str, str], list[tuple[str, list[str]]]]


@dataclass(frozen=True)
class ClaimDevice:
    """One device of a DRA claim, as the kubelet lists it (``ClaimResource``)."""

    driver: str
    pool: str
    device: str
    share_id: str | None = None
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimUse:
    """A container's use of a DRA claim (``DynamicResource``), and the claim's UID for the DRA checkpoint."""

    namespace: str
    name: str
    uid: str
    devices: tuple[ClaimDevice, ...]


class _PodResourcesLister(podres_grpc.PodResourcesListerServicer):
    """The kubelet's read side: which pod holds which device, and what is allocatable."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    async def List(
        self, request: podres.ListPodResourcesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> podres.ListPodResourcesResponse:
        pods: dict[tuple[str, str], podres.PodResources] = {}
        kubelet = self.kubelet
        for namespace, pod, container in {**kubelet.assignments, **kubelet.claim_uses}:
            entry = pods.setdefault((namespace, pod), podres.PodResources(name=pod, namespace=namespace))
            held = kubelet.assignments.get((namespace, pod, container), [])
            entry.containers.append(
                podres.ContainerResources(
                    name=container,
                    devices=[podres.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in held],
                    dynamic_resources=[
                        podres.DynamicResource(
                            claim_name=use.name,
                            claim_namespace=use.namespace,
                            claim_resources=[
                                podres.ClaimResource(
                                    cdi_devices=[podres.CDIDevice(name=n) for n in d.cdi_devices],
                                    driver_name=d.driver,
                                    pool_name=d.pool,
                                    device_name=d.device,
                                    share_id=d.share_id,
                                )
                                for d in use.devices
                            ],
                        )
                        for use in kubelet.claim_uses.get((namespace, pod, container), [])
                    ],
                )
            )
        return podres.ListPodResourcesResponse(pod_resources=list(pods.values()))

    async def Get(
        self, request: podres.GetPodResourcesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> podres.GetPodResourcesResponse:
        listed = await self.List(podres.ListPodResourcesRequest(), context)
        for pod in listed.pod_resources:
            if (pod.namespace, pod.name) == (request.pod_namespace, request.pod_name):
                return podres.GetPodResourcesResponse(pod_resources=pod)
        await context.abort(
            grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found"
        )
        raise AssertionError("unreachable")

    async def GetAllocatableResources(
        self, request: podres.AllocatableResourcesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> podres.AllocatableResourcesResponse:
        return podres.AllocatableResourcesResponse(
            devices=[
                podres.ContainerDevices(
                    resource_name=name, device_ids=[i for i, h in view.devices.items() if h == HEALTHY]
                )
                for name, view in self.kubelet.plugins.items()
            ]
        )


class KubeletStandIn(pb_grpc.RegistrationServicer):
    """The kubelet's device manager. ``endpoints_per_socket`` is Kubernetes 1.37's: a resource keeps every
    registered socket (new calls go to the newest) and its devices count unhealthy only when the last one's stream
    ends. Without it, as before 1.37, a new registration replaces the resource's plugin but leaves the old one's
    stream open, and when any of the resource's streams ends the kubelet disconnects the newest plugin and counts
    the devices unhealthy (kubelet/cm/devicemanager/plugin/v1beta1/handler.go, runClient)."""

    def __init__(
        self, plugin_dir: Path, pod_resources_socket: Path | None = None, endpoints_per_socket: bool = False
    ) -> None:
        self.plugin_dir = plugin_dir
        self.endpoints_per_socket = endpoints_per_socket
        # resource → socket name → plugin (endpoints_per_socket): the ones the kubelet holds besides the newest
        self.endpoints: dict[str, dict[str, PluginView]] = {}
        self._superseded: list[
            PluginView
        ] = []  # before 1.37: replaced plugins whose streams the kubelet reads on
        # resource → every device list the node took, from whichever plugin (what the Node's allocatable follows)
        self.resource_history: dict[str, list[DeviceListEvent]] = {}
        self.pod_resources_socket = pod_resources_socket
        self.assignments: PodAssignments = {}
        self.claim_uses: dict[
            tuple[str, str, str], list[ClaimUse]
        ] = {}  # (namespace, pod, container) → claims
        self.pod_uids: dict[tuple[str, str], str] = {}  # (namespace, pod) → UID, as the API server gave it
        self.responses: dict[
            tuple[str, str, str, str], bytes
        ] = {}  # (ns, pod, container, resource) → Allocate
        self.checkpoint = plugin_dir / "kubelet_internal_checkpoint"
        self.socket = plugin_dir / "kubelet.sock"
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[tuple[float, str]] = []  # (monotonic time, resource)
        self.rejections: list[str] = []
        self.reject_next = 0  # tests: refuse this many registrations, as a kubelet in trouble would
        self.open_list_and_watch = True  # tests: False registers without taking the devices
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Condition()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        if self.pod_resources_socket is not None:
            self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                self.pod_resources_socket.unlink()
            podres_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesLister(self), server)
            server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop serving and drop every plugin connection (kubelet down)."""
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        views = {
            id(v): v
            for v in [
                *self.plugins.values(),
                *self._superseded,
                *(v for e in self.endpoints.values() for v in e.values()),
            ]
        }
        self.endpoints.clear()
        self._superseded.clear()
        for view in views.values():
            await self._drop(view)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()

    async def restart(self) -> None:
        """What a kubelet (re)start does: remove every unix socket in the directory, then serve anew."""
        await self.stop()
        for entry in self.plugin_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
        await self.start()

    async def _drop(self, view: PluginView) -> None:
        if view.stream_task is not None:
            view.stream_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await view.stream_task
        await view.channel.close(None)

    # -- the Registration service ----------------------------------------------------------------

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext[pb.RegisterRequest, pb.Empty]
    ) -> pb.Empty:
        reason = self._validate(request)
        if reason is None and self.reject_next > 0:
            self.reject_next -= 1
            reason = "registration refused by the test"
        if reason is None:
            try:
                view = await self._dial(request)
            except (grpc.RpcError, TimeoutError) as exc:
                reason = f"failed to dial device plugin {request.endpoint}: {exc}"
        held = self.endpoints.get(request.resource_name, {})
        if reason is None and self.endpoints_per_socket and request.endpoint in held:
            # 1.37 dials, then refuses a socket it holds; its clean-up forgets the client it held there too, so the
            # end of that one's stream goes unnoticed and its endpoint stays (connectClient, deregisterClient).
            held[request.endpoint].orphaned = True
            await view.channel.close(None)
            reason = f"device plugin already connected: {self.plugin_dir / request.endpoint}"
        if reason is not None:
            self.rejections.append(reason)
            await context.abort(grpc.StatusCode.UNKNOWN, reason)
        old = self.plugins.get(request.resource_name)
        if self.endpoints_per_socket:
            self.endpoints.setdefault(request.resource_name, {})[request.endpoint] = view
        elif old is not None and not old.disconnected:
            self._superseded.append(old)
        self.plugins[request.resource_name] = view
        if self.open_list_and_watch:
            view.stream_task = asyncio.create_task(self._consume(view))
        self.registrations.append((view.registered_at, request.resource_name))
        async with self._changed:
            self._changed.notify_all()
        return pb.Empty()

    def _validate(self, request: pb.RegisterRequest) -> str | None:
        if request.version != "v1beta1":
            return f"requested API version {request.version!r} is not supported by kubelet"
        try:
            check_extended_resource_name(request.resource_name)
        except ValueError as exc:
            return f"invalid name of device plugin socket: {exc}"
        if not request.endpoint or "/" in request.endpoint:
            return f"endpoint {request.endpoint!r} must be a file name in {self.plugin_dir}"
        return None

    async def _dial(self, request: pb.RegisterRequest) -> PluginView:
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        try:
            stub: pb_grpc.DevicePluginAsyncStub = pb_grpc.DevicePluginStub(channel)
            options = await stub.GetDevicePluginOptions(
                pb.Empty(), timeout=DIAL_TIMEOUT_SECONDS, wait_for_ready=True
            )
        except BaseException:
            await channel.close(None)
            raise
        return PluginView(
            resource=request.resource_name,
            endpoint=request.endpoint,
            options=options,
            channel=channel,
            stub=stub,
            registered_at=time.monotonic(),
        )

    async def _consume(self, view: PluginView) -> None:
        try:
            async for message in view.stub.ListAndWatch(pb.Empty()):
                devices = {d.ID: d.health for d in message.devices}
                await self._record(view, devices)
        except grpc.RpcError:
            pass
        if not self.endpoints_per_socket:
            await self._disconnect_newest(view.resource)
            return
        held = self.endpoints.get(view.resource, {})
        if view.orphaned:
            return
        if held.get(view.endpoint) is view:
            del held[view.endpoint]
            if held:  # 1.37: another plugin still serves the resource; it becomes the one called
                self.plugins[view.resource] = next(iter(held.values()))
                async with self._changed:
                    self._changed.notify_all()
                return
        # The stream ended: like the kubelet, count every device of the resource unhealthy.
        await self._record(view, dict.fromkeys(view.devices, "Unhealthy"))

    async def _disconnect_newest(self, resource: str) -> None:
        """Before 1.37: whichever of the resource's streams ended, the kubelet disconnects the plugin it registered
        last and counts every device unhealthy; with none registered (already disconnected), nothing happens."""
        newest = self.plugins.get(resource)
        if newest is None or newest.disconnected:
            return
        newest.disconnected = True
        if newest.stream_task is not asyncio.current_task():
            await self._drop(newest)
        await self._record(newest, dict.fromkeys(newest.devices, "Unhealthy"))

    async def _record(self, view: PluginView, devices: dict[str, str]) -> None:
        async with self._changed:
            event = DeviceListEvent(time.monotonic(), devices)
            view.history.append(event)
            self.resource_history.setdefault(view.resource, []).append(event)
            self._changed.notify_all()

    # -- what tests do with it ---------------------------------------------------------------------

    async def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
    ) -> None:
        async def waiter() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)

        try:
            await asyncio.wait_for(waiter(), timeout)
        except TimeoutError:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}") from None

    async def wait_registered(self, resource: str, times: int = 1, timeout: float = 10.0) -> PluginView:
        def done() -> bool:
            return sum(1 for _, r in self.registrations if r == resource) >= times and bool(
                self.plugins.get(resource) and self.plugins[resource].history
            )

        await self.wait_for(done, timeout, f"{resource} registered {times} time(s) with a device list")
        return self.plugins[resource]

    async def wait_devices(
        self, resource: str, predicate: Callable[[dict[str, str]], bool], timeout: float = 10.0
    ) -> dict[str, str]:
        await self.wait_for(
            lambda: resource in self.plugins and predicate(self.plugins[resource].devices),
            timeout,
            f"a matching device list for {resource}",
        )
        return self.plugins[resource].devices

    def view(self, resource: str) -> PluginView:
        try:
            return self.plugins[resource]
        except KeyError:
            raise LookupError(f"{resource} is not registered") from None

    async def allocate(
        self, resource: str, *containers: Sequence[str], pod: tuple[str, str] | None = None
    ) -> pb.AllocateResponse:
        """Allocate for one pod's containers; with ``pod`` = (namespace, name), remember the
        assignment (containers named c0, c1, …) for the PodResources API, as the kubelet does."""
        request = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=list(ids)) for ids in containers]
        )
        response: pb.AllocateResponse = await self.view(resource).stub.Allocate(request, timeout=10)
        if not response.container_responses:
            raise ValueError(
                "Allocate answered with no container responses (the kubelet treats it as an error)"
            )
        if pod is not None:
            self.pod_uids.setdefault(pod, str(uuid.uuid4()))
            for n, ids in enumerate(containers):
                self.assignments.setdefault((*pod, f"c{n}"), []).append((resource, list(ids)))
                self.responses[(*pod, f"c{n}", resource)] = response.container_responses[
                    n
                ].SerializeToString()
            self.write_checkpoint()
        return response

    def use_claim(self, pod: tuple[str, str], container: str, claim: ClaimUse) -> None:
        """A running container of ``pod`` uses a prepared DRA claim: PodResources lists it."""
        self.pod_uids.setdefault(pod, str(uuid.uuid4()))
        self.claim_uses.setdefault((*pod, container), []).append(claim)

    def remove_pod(self, namespace: str, name: str) -> None:
        """The pod is gone: its devices leave PodResources and the checkpoints."""
        for used in [k for k in self.claim_uses if k[:2] == (namespace, name)]:
            del self.claim_uses[used]
        for held in [k for k in self.assignments if k[:2] == (namespace, name)]:
            del self.assignments[held]
        for answered in [k for k in self.responses if k[:2] == (namespace, name)]:
            del self.responses[answered]
        self.pod_uids.pop((namespace, name), None)
        self.write_checkpoint()

    def write_checkpoint(self) -> None:
        entries = []
        for (namespace, pod, container), held in self.assignments.items():
            for resource, ids in held:
                entries.append(
                    {
                        "PodUID": self.pod_uids.get((namespace, pod), ""),
                        "ContainerName": container,
                        "ResourceName": resource,
                        "DeviceIDs": {"-1": list(ids)},
                        "AllocResp": base64.b64encode(
                            self.responses.get((namespace, pod, container, resource), b"")
                        ).decode(),
                    }
                )
        registered = {name: list(view.devices) for name, view in self.plugins.items()}
        doc = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": registered}, "Checksum": 0}
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.checkpoint)

    async def preferred(
        self, resource: str, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> list[str]:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=list(available),
                    must_include_deviceIDs=list(must_include),
                    allocation_size=size,
                )
            ]
        )
        response = await self.view(resource).stub.GetPreferredAllocation(request, timeout=10)
        chosen = list(response.container_responses[0].deviceIDs)
        # The kubelet keeps only what it offered.
        return [i for i in chosen if i in set(available) | set(must_include)]

    async def pre_start(self, resource: str, ids: Sequence[str]) -> None:
        await self.view(resource).stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=list(ids)), timeout=30
        )


def sockets_in(directory: Path) -> list[str]:
    """The unix sockets in ``directory`` now; an entry gone between the listing and its stat (a temp file
    renamed into place, a socket removed) is not one."""
    names = []
    for entry in os.scandir(directory):
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                names.append(entry.name)
        except FileNotFoundError:
            continue
    return sorted(names)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

"""Stand-ins for testing a DRA driver without a cluster: the kubelet's DRA side over real sockets, and an
in-memory API server for ResourceSlices and ResourceClaims.

``DraKubeletStandIn`` behaves as the kubelet's plugin manager and DRA manager do: it finds
registration sockets in a ``plugins_registry`` directory (inotify, and a scan at start as the
kubelet does after a restart), calls ``GetInfo``, refuses a plugin that is not of type
``DRAPlugin`` or offers no DRA service version it speaks (answering ``NotifyRegistrationStatus``
with the reason, as the kubelet does), picks the newest service the plugin offers (v1, else
v1beta1), and then calls ``NodePrepareResources`` / ``NodeUnprepareResources`` on the endpoint and
follows ``NodeWatchResources``.

``FakeDraApi`` keeps ResourceSlices and ResourceClaims as dicts with the API server's checks that
matter to a driver: names and sizes, the device limits per slice, resourceVersion on update,
field selectors; ``taints=False`` drops device taints as an API server without device taints does.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kxpu.api.dra.v1 import api_pb2 as dra
from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
from kxpu.api.dra.v1beta1 import api_pb2 as dra_beta
from kxpu.api.dra.v1beta1 import api_pb2_grpc as dra_beta_grpc
from kxpu.api.drahealth.v1 import api_pb2 as health
from kxpu.api.drahealth.v1 import api_pb2_grpc as health_grpc
from kxpu.api.pluginregistration.v1 import api_pb2 as reg
from kxpu.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from kxpu.daemon.registration import FileIdentity, file_identity
from kxpu.dra.names import is_dns_label
from kxpu.dra.prepare import ClaimRef
from kxpu.dra.quantity import parse_quantity
from kxpu.dra.slices import MAX_DEVICES_PER_SLICE, MAX_DEVICES_PER_SLICE_WITH_TAINTS
from kxpu.fswatch import directory_changes

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


_SUFFIX_BYTES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "": 1}


def canonical_quantity(text: str) -> str:
    """As the API server stores a binary-suffixed or plain integer quantity: the largest exact suffix."""
    number = text.rstrip("KMGTPi")
    suffix = text[len(number) :]
    value = int(number) * _SUFFIX_BYTES[suffix]
    if not suffix:  # a plain number stays a plain (decimal) number
        return str(value)
    for largest in ("Pi", "Ti", "Gi", "Mi", "Ki"):
        if value and value % _SUFFIX_BYTES[largest] == 0:
            return f"{value // _SUFFIX_BYTES[largest]}{largest}"
    return str(value)


def _check_request_policy(capacity: Mapping[str, Any], where: str) -> None:
    """The API server's rules for a consumable capacity's request policy (``validateRequestPolicy`` in
    pkg/apis/resource/validation, integer quantities)."""
    policy = capacity.get("requestPolicy")
    if policy is None:
        return
    value = parse_quantity(capacity["value"])
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range is not None and valid_values:
        raise ApiRefused(
            422,
            f'{where}: Forbidden: exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time',
        )
    if valid_range is None and not valid_values:
        return
    if policy.get("default") is None:
        raise ApiRefused(422, f"{where}.default: Required value")
    default = parse_quantity(policy["default"])
    if valid_values:
        options = [parse_quantity(v) for v in valid_values]
        if options != sorted(options) or any(o > value for o in options) or default not in options:
            raise ApiRefused(422, f"{where}.validValues: Invalid value: {valid_values}")
        return
    if valid_range.get("min") is None:
        raise ApiRefused(422, f"{where}.validRange.min: Required value: required when validRange is defined")
    low = parse_quantity(valid_range["min"])
    high = parse_quantity(valid_range["max"]) if valid_range.get("max") is not None else None
    step = parse_quantity(valid_range["step"]) if valid_range.get("step") is not None else None
    problems = []
    if low > value:
        problems.append(f"validRange.min: min is larger than capacity value: {capacity['value']}")
    if default < low:
        problems.append(f"validRange.default: default is less than min: {valid_range['min']}")
    if high is not None and (low > high or high > value or default > high):
        problems.append(f"validRange.max: Invalid value: {valid_range['max']}")
    if step is not None:
        if step <= 0:
            problems.append("validRange.step: must be greater than zero")
        else:
            if low + step > value:
                problems.append(
                    f"validRange.step: one step is larger than capacity value: {capacity['value']}"
                )
            for checked in (default, high):
                if checked is not None and (checked - low) % step:
                    problems.append(
                        f"validRange.step: Invalid value: {checked}: value is not a multiple of a given step "
                        f"({valid_range['step']}) from ({valid_range['min']})"
                    )
    if problems:
        raise ApiRefused(422, f"{where}: " + "; ".join(problems))


_TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _check_taints(taints: Sequence[Mapping[str, Any]], where: str) -> None:
    """The API server's checks on a device's taints (validateDeviceTaint): at most 16, a label-name key, a
    label-value value, one of the three effects."""
    if len(taints) > 16:
        raise ApiRefused(422, f"{where}: Too many: {len(taints)}: must have at most 16 items")
    for n, taint in enumerate(taints):
        key, value, effect = taint.get("key") or "", taint.get("value") or "", taint.get("effect")
        prefix, _, name = key.rpartition("/")
        if (
            not name
            or len(name) > 63
            or not _LABEL_VALUE.match(name)
            or (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)))
        ):
            raise ApiRefused(422, f"{where}[{n}].key: Invalid value: {key!r}: must be a label name")
        if len(value) > 63 or not _LABEL_VALUE.match(value):
            raise ApiRefused(422, f"{where}[{n}].value: Invalid value: {value!r}: must be a label value")
        if effect not in _TAINT_EFFECTS:
            raise ApiRefused(
                422,
                f'{where}[{n}].effect: Unsupported value: "{effect}": supported values: "NoExecute", "NoSchedule", '
                '"None"',
            )


class ApiRefused(Exception):
    """What the fake API server refuses (status code and message, as lightkube's ApiError carries)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class FakeDraApi:
    def __init__(self, nodes: Mapping[str, str] | None = None, taints: bool = True) -> None:
        self.nodes = dict(nodes or {"node-a": "uid-node-a"})  # name → UID
        self.taints = taints
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[ClaimRef, str, str]] = []
        self.writes = 0
        self.fail_next: Exception | None = None
        self._versions = itertools.count(1)
        self._watchers: list[tuple[str, str, asyncio.Queue[tuple[str, dict[str, Any]]]]] = []

    def _notify(self, kind: str, obj: Mapping[str, Any]) -> None:
        for driver, node, queue in self._watchers:
            if obj["spec"]["driver"] == driver and obj["spec"].get("nodeName") == node:
                queue.put_nowait((kind, copy.deepcopy(dict(obj))))

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    # -- SliceApi ---------------------------------------------------------------------------------------
    async def node_uid(self, node: str) -> str:
        self._maybe_fail()
        if node not in self.nodes:
            raise ApiRefused(404, f'nodes "{node}" not found')
        return self.nodes[node]

    async def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        self._maybe_fail()
        return [
            copy.deepcopy(s)
            for s in self.slices.values()
            if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == node
        ]

    async def watch_slices(self, driver: str, node: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """As a watch without a resourceVersion: ADDED for each slice there now, then every change."""
        self._maybe_fail()
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        entry = (driver, node, queue)
        self._watchers.append(entry)
        try:
            for obj in await self.list_slices(driver, node):
                yield "ADDED", obj
            while True:
                yield await queue.get()
        finally:
            self._watchers.remove(entry)

    def delete_node_slices(self, node: str, driver: str | None = None) -> list[str]:
        """What the kubelet does at its start (every driver's slices of its node) and 30 s after losing a
        driver's connection (that driver's): the names deleted."""
        gone = [
            name
            for name, s in self.slices.items()
            if s["spec"].get("nodeName") == node and driver in (None, s["spec"]["driver"])
        ]
        for name in gone:
            self._notify("DELETED", self.slices.pop(name))
            self.writes += 1
        return gone

    def _check(self, body: Mapping[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(dict(body))
        devices = stored["spec"].get("devices", [])
        for n, device in enumerate(devices):
            for capacity_name, capacity in (device.get("capacity") or {}).items():
                where = f"spec.devices[{n}].capacity[{capacity_name}].requestPolicy"
                _check_request_policy(capacity, where)
            if not self.taints:
                device.pop("taints", None)
            _check_taints(device.get("taints") or [], f"spec.devices[{n}].taints")
            for taint in device.get("taints", []):  # the server stamps a taint when it first sees it
                taint.setdefault("timeAdded", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            for capacity in device.get("capacity", {}).values():
                capacity["value"] = canonical_quantity(capacity["value"])
        counters = stored["spec"].get("sharedCounters") or []
        if counters and devices:
            raise ApiRefused(422, "spec: Only one of devices and sharedCounters can be set")
        if len(counters) > 8:
            raise ApiRefused(
                422, f"spec.sharedCounters: Too many: {len(counters)}: must have at most 8 items"
            )
        limit = (
            MAX_DEVICES_PER_SLICE_WITH_TAINTS
            if any(d.get("taints") or d.get("consumesCounters") for d in devices)
            else MAX_DEVICES_PER_SLICE
        )
        if len(devices) > limit:
            raise ApiRefused(422, f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
        names = [d["name"] for d in devices]
        bad = [n for n in names if not is_dns_label(n)]
        if bad or len(set(names)) != len(names):
            raise ApiRefused(422, f"spec.devices: invalid or repeated device names: {bad or names}")
        stored["metadata"]["resourceVersion"] = str(next(self._versions))
        return stored

    async def create_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail()
        name = body["metadata"]["name"]
        if name in self.slices:
            raise ApiRefused(409, f'resourceslices.resource.k8s.io "{name}" already exists')
        stored = self._check(body)
        stored["metadata"]["uid"] = str(uuid.uuid4())
        self.slices[name] = stored
        self.writes += 1
        self._notify("ADDED", stored)
        return copy.deepcopy(stored)

    async def replace_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self._maybe_fail()
        name = body["metadata"]["name"]
        old = self.slices.get(name)
        if old is None:
            raise ApiRefused(404, f'resourceslices.resource.k8s.io "{name}" not found')
        if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise ApiRefused(
                409, "the object has been modified; please apply your changes to the latest version"
            )
        stored = self._check(body)
        stored["metadata"]["uid"] = old["metadata"]["uid"]
        self.slices[name] = stored
        self.writes += 1
        self._notify("MODIFIED", stored)
        return copy.deepcopy(stored)

    async def delete_slice(self, name: str) -> None:
        self._maybe_fail()
        old = self.slices.pop(name, None)
        if old is not None:
            self.writes += 1
            self._notify("DELETED", old)

    def pool(self, driver: str, node: str) -> list[dict[str, Any]]:
        """The devices the scheduler would see: the newest generation, only when the pool is complete."""
        mine = [
            s["spec"]
            for s in self.slices.values()
            if s["spec"]["driver"] == driver and s["spec"]["nodeName"] == node
        ]
        if not mine:
            return []
        newest = max(s["pool"]["generation"] for s in mine)
        current = [s for s in mine if s["pool"]["generation"] == newest]
        if len(current) != current[0]["pool"]["resourceSliceCount"]:
            return []
        return [d for s in current for d in s.get("devices", [])]

    # -- ClaimSource ------------------------------------------------------------------------------------
    def add_claim(
        self,
        name: str,
        results: list[dict[str, Any]],
        namespace: str = "default",
        config: list[dict[str, Any]] | None = None,
    ) -> ClaimRef:
        uid = str(uuid.uuid4())
        self.claims[(namespace, name)] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": results, "config": config or []}}},
        }
        return ClaimRef(namespace, uid, name)

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self._maybe_fail()
        claim = self.claims.get((namespace, name))
        return copy.deepcopy(claim) if claim is not None else None

    async def claim_event(self, claim: ClaimRef, reason: str, message: str) -> None:
        self.events.append((claim, reason, message))


@dataclass
class RegisteredDriver:
    name: str
    endpoint: str
    service: str
    channel: grpc.aio.Channel
    registered_at: float
    health: list[health.NodeWatchResourcesResponse] = field(default_factory=list)
    health_task: asyncio.Task[None] | None = None


class DraKubeletStandIn:
    def __init__(self, registry_dir: Path, api: FakeDraApi | None = None, node: str = "node-a") -> None:
        self.registry_dir = registry_dir
        self.api = api  # where its node's ResourceSlices live (the kubelet wipes them when it starts)
        self.node = node
        self.drivers: dict[str, RegisteredDriver] = {}
        self.refused: list[tuple[str, str]] = []  # (socket, reason)
        self.registrations = 0
        self._seen: dict[str, FileIdentity | None] = {}  # socket path → the file registered
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for driver in list(self.drivers.values()):
            await self._drop(driver)

    async def restart(self) -> None:
        """A kubelet restart: connections and registrations forgotten, then the directory scanned again, and
        every ResourceSlice of the node deleted as the kubelet's DRA plugin manager does when it starts
        (``wipeResourceSlices`` for all drivers, in the background: here after the scan began, so a driver
        may well have registered again before its slices go)."""
        await self.stop()
        self.drivers.clear()
        self._seen.clear()
        await self.start()
        if self.api is not None:
            await asyncio.sleep(0)  # the scan first: the worst order for a driver
            self.api.delete_node_slices(self.node)

    async def _drop(self, driver: RegisteredDriver) -> None:
        if driver.health_task is not None:
            driver.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await driver.health_task
        await driver.channel.close(None)

    async def _watch(self) -> None:
        async for _ in directory_changes(
            lambda: [self.registry_dir], lambda p: p.parent == self.registry_dir
        ):
            for path in sorted(self.registry_dir.glob("*.sock")):
                identity = file_identity(path)
                if identity is not None and self._seen.get(str(path)) != identity:
                    self._seen[str(path)] = identity
                    await self._register(path)

    async def _register(self, path: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                self.refused.append((str(path), f"GetInfo failed: {exc.details()}"))
                return
            reason = ""
            service = next((s for s in info.supported_versions if s in KUBELET_SERVICES), "")
            if info.type != "DRAPlugin":
                reason = f"plugin type {info.type!r} is not DRAPlugin"
            elif not service:
                reason = f"none of {list(info.supported_versions)} are supported by the kubelet"
            elif not await asyncio.to_thread(Path(info.endpoint).is_socket):
                reason = f"endpoint {info.endpoint} is not a socket"
            try:
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=not reason, error=reason), timeout=5
                )
            except grpc.aio.AioRpcError as exc:  # the socket went meanwhile: the next change retries
                self.refused.append((str(path), f"NotifyRegistrationStatus failed: {exc.details()}"))
                return
        if reason:
            self.refused.append((str(path), reason))
            return
        old = self.drivers.pop(info.name, None)
        if old is not None:
            await self._drop(old)
        driver = RegisteredDriver(
            info.name,
            info.endpoint,
            service,
            grpc.aio.insecure_channel(f"unix://{info.endpoint}"),
            asyncio.get_running_loop().time(),
        )
        if "v1.DRAResourceHealth" in info.supported_versions:
            driver.health_task = asyncio.create_task(self._follow_health(driver))
        self.drivers[info.name] = driver
        async with self._changed:
            self.registrations += 1
            self._changed.notify_all()

    async def _follow_health(self, driver: RegisteredDriver) -> None:
        stub = health_grpc.DRAResourceHealthStub(driver.channel)
        async for report in stub.NodeWatchResources(health.NodeWatchResourcesRequest()):
            async with self._changed:
                driver.health.append(report)
                self._changed.notify_all()

    async def wait_registered(self, driver: str, times: int = 1, timeout: float = 10.0) -> RegisteredDriver:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: driver in self.drivers and self.registrations >= times)
        return self.drivers[driver]

    async def wait_health(
        self, driver: str, check: Any, timeout: float = 10.0
    ) -> health.NodeWatchResourcesResponse:
        """The first health report (newest first) that satisfies ``check``."""

        def found() -> bool:
            d = self.drivers.get(driver)
            return d is not None and bool(d.health) and bool(check(d.health[-1]))

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(found)
        return self.drivers[driver].health[-1]

    async def prepare(self, driver: str, *claims: ClaimRef) -> dra.NodePrepareResourcesResponse:
        d = self.drivers[driver]
        request = dra.NodePrepareResourcesRequest(
            claims=[dra.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        if d.service == "v1beta1.DRAPlugin":
            beta = dra_beta_grpc.DRAPluginStub(d.channel)
            answer = await beta.NodePrepareResources(
                dra_beta.NodePrepareResourcesRequest.FromString(request.SerializeToString()), timeout=45
            )
            return dra.NodePrepareResourcesResponse.FromString(answer.SerializeToString())
        return await dra_grpc.DRAPluginStub(d.channel).NodePrepareResources(request, timeout=45)

    async def unprepare(self, driver: str, *claims: ClaimRef) -> dra.NodeUnprepareResourcesResponse:
        d = self.drivers[driver]
        request = dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        if d.service == "v1beta1.DRAPlugin":
            beta = dra_beta_grpc.DRAPluginStub(d.channel)
            answer = await beta.NodeUnprepareResources(
                dra_beta.NodeUnprepareResourcesRequest.FromString(request.SerializeToString()), timeout=45
            )
            return dra.NodeUnprepareResourcesResponse.FromString(answer.SerializeToString())
        return await dra_grpc.DRAPluginStub(d.channel).NodeUnprepareResources(request, timeout=45)

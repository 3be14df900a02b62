"""`kxpu status`: which pod holds which device on this node, or (``--cluster``) on every node.

Node mode joins two views: the kubelet's PodResources API (the authority on who holds what, kept
in its checkpoint) and the node daemon's /status (what kxpu serves and each device's health).
Either may be unreachable; what the other says is still shown, with the error.

Cluster mode asks the API server: each node's extended resources (capacity, allocatable, and
what its pods request), and for shared devices the published inventory joined with the
assignments the extender wrote on pods (how much memory and compute each pod got on which
device). The API server is reached through ``kxpu.kube`` (lightkube), loaded only there and to read a
kubeconfig's token for /status, so the node daemon never loads it through this module.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kxpu.api.podresources.v1 import api_pb2 as podres
from kxpu.api.podresources.v1 import api_pb2_grpc as podres_grpc
from kxpu.config import DEFAULT_POD_RESOURCES_SOCKET as DEFAULT_POD_RESOURCES_SOCKET  # the CLI's default
from kxpu.dra.names import device_name

if TYPE_CHECKING:
    from lightkube import AsyncClient


@dataclass
class HolderUse:
    """What one holder's processes use of the device, from the daemon's telemetry."""

    holder: str  # namespace/pod/container
    pids: list[int]
    memory_used_bytes: int | None
    memory_granted_bytes: int | None
    compute_utilization: float | None
    over_grant: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "pids": self.pids,
            "memoryUsedBytes": self.memory_used_bytes,
            "memoryGrantedBytes": self.memory_granted_bytes,
            "computeUtilization": self.compute_utilization,
            "overGrant": self.over_grant,
        }


@dataclass
class DeviceStatus:
    resource: str
    id: str
    health: str  # "unknown" when kxpu does not serve it (another plugin's, or already gone)
    reason: str | None = None
    numa_nodes: list[int] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)  # namespace/pod/container
    uuid: str | None = None
    # from the daemon's telemetry, when it is on and the backend measures its devices
    compute_utilization: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    use: list[HolderUse] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "id": self.id,
            "health": self.health,
            "reason": self.reason,
            "numa_nodes": self.numa_nodes,
            "holders": self.holders,
            "uuid": self.uuid,
            "computeUtilization": self.compute_utilization,
            "memoryUsedBytes": self.memory_used_bytes,
            "memoryTotalBytes": self.memory_total_bytes,
            "use": [u.as_json() for u in self.use],
        }


@dataclass
class NodeStatus:
    devices: list[DeviceStatus]
    phases: dict[str, str]  # resource → daemon phase
    errors: list[str]
    warnings: list[str] = field(default_factory=list)  # "<resource>: <setting doing nothing now>"

    def as_json(self) -> dict[str, Any]:
        return {
            "resources": self.phases,
            "devices": [d.as_json() for d in self.devices],
            "errors": self.errors,
            "warnings": self.warnings,
        }


ClaimUsers = dict[tuple[str, str], list[tuple[str, str, str, str]]]


async def kubelet_assignments(socket: Path) -> tuple[dict[tuple[str, str], list[str]], ClaimUsers]:
    """From the kubelet's PodResources List: (resource, device ID) → holders through the device plugin, and
    (driver, claim namespace/name) → (holder, pool, DRA device, share ID) through DRA claims."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub: podres_grpc.PodResourcesListerAsyncStub = podres_grpc.PodResourcesListerStub(channel)
        response = await stub.List(podres.ListPodResourcesRequest(), timeout=10)
    held: dict[tuple[str, str], list[str]] = {}
    claims: ClaimUsers = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = f"{pod.namespace}/{pod.name}/{container.name}"
            for devices in container.devices:
                for device_id in devices.device_ids:
                    held.setdefault((devices.resource_name, device_id), []).append(holder)
            for dynamic in container.dynamic_resources:
                ref = f"{dynamic.claim_namespace}/{dynamic.claim_name}"
                for res in dynamic.claim_resources:
                    claims.setdefault((res.driver_name, ref), []).append(
                        (holder, res.pool_name, res.device_name, res.share_id)
                    )
    return held, claims


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """The daemon never redirects: a redirect is an error, not a hop to another host."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


class DaemonRefused(Exception):
    """The daemon answered /status with an error (401, 403, 503): its reason, and what to do."""


def daemon_status(base_url: str, token: str | None = None) -> dict[str, Any]:
    """GET /status, sending ``token`` as a bearer token when given (the daemon's --http-auth=kubernetes)."""
    request = urllib.request.Request(f"{base_url.rstrip('/')}/status")
    if token:  # never re-sent to wherever a redirect points
        request.add_unredirected_header("Authorization", f"Bearer {token}")
    try:
        with _NO_REDIRECTS.open(request, timeout=10) as response:
            doc: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            reason = str(json.loads(exc.read(4096)).get("error", ""))
        except ValueError:
            reason = ""
        hint = {
            401: "; pass a token with --token-file (by default the pod's service account token is sent)"
            if not token
            else "",
            403: "; that user needs RBAC `get` on the non-resource URL /status",
        }.get(exc.code, "")
        raise DaemonRefused(f"{exc.code} {exc.reason}: {reason or 'no reason given'}{hint}") from None
    return doc


async def node_status(
    pod_resources_socket: Path, daemon_url: str, all_resources: bool = False, token: str | None = None
) -> NodeStatus:
    errors: list[str] = []
    held: dict[tuple[str, str], list[str]] = {}
    claim_users: ClaimUsers = {}
    served: dict[str, Any] = {}
    try:
        held, claim_users = await kubelet_assignments(pod_resources_socket)
    except grpc.RpcError as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        errors.append(f"kubelet PodResources API at {pod_resources_socket}: {detail}")
    telemetry: dict[str, Any] = {}
    draining: dict[str, Any] = {}
    try:
        doc = await asyncio.to_thread(daemon_status, daemon_url, token)
        served = doc.get("resources", {})
        telemetry = doc.get("telemetry") or {}
        draining = doc.get("drainingDrivers") or {}
    except (OSError, urllib.error.URLError, ValueError, DaemonRefused) as exc:
        errors.append(f"kxpu daemon at {daemon_url}: {exc}")
    figures = {(d["resource"], d["uuid"]): d for d in telemetry.get("devices", [])}
    uses: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, uuid, holder) → container use
    for c in telemetry.get("containers", []):
        if c.get("pod"):
            uses[(c["resource"], c["uuid"], f"{c['namespace']}/{c['pod']}/{c['container']}")] = c
    errors += [f"telemetry: {e}" for e in telemetry.get("errors", [])]

    # DRA drivers the config no longer serves, still holding devices for claims prepared before it changed.
    kept: set[tuple[str, str]] = set()
    for driver, info in draining.items():
        resource = info.get("resource") or driver
        for claim in (info.get("claims") or {}).values():
            for device_id in claim.get("devices", []):
                held.setdefault((resource, device_id), []).append(f"claim {claim.get('claim')} (draining)")
                kept.add((resource, device_id))
    devices: list[DeviceStatus] = []
    for resource, info in sorted(served.items()):
        # DRA: the driver's prepared claims hold its devices; the containers using each claim come from the
        # kubelet's PodResources (dynamic_resources, Kubernetes 1.34+): "ns/pod/ctr [claim ns/name]", or
        # "claim ns/name" while no running container uses it.
        dra = info.get("dra") or {}
        for claim in dra.get("claims", {}).values():
            shares = claim.get("shares") or {}
            users = claim_users.get((str(dra.get("driver", "")), str(claim.get("claim", ""))), [])
            for device_id in claim.get("devices", []):
                share = shares.get(device_id)
                what = f", {share.get('memoryMiB')} MiB, {share.get('cores')}%" if share else ""
                name = device_name(device_id)
                on_device = sorted(
                    {h for h, pool, device, _ in users if (pool, device) == (dra.get("pool"), name)}
                )
                held.setdefault((resource, device_id), []).extend(
                    [f"{h} [claim {claim.get('claim')}{what}]" for h in on_device]
                    or [f"claim {claim.get('claim')}{' (' + what[2:] + ')' if what else ''}"]
                )
        for d in info.get("devices", []):
            uuid = d.get("uuid") or d["id"]
            figure = figures.get((resource, uuid), {})
            holders = held.pop((resource, d["id"]), [])
            devices.append(
                DeviceStatus(
                    resource=resource,
                    id=d["id"],
                    health=d["health"],
                    reason=d.get("reason"),
                    numa_nodes=d.get("numa_nodes", []),
                    holders=holders,
                    uuid=d.get("uuid"),
                    compute_utilization=figure.get("computeUtilization"),
                    memory_used_bytes=figure.get("memoryUsedBytes"),
                    memory_total_bytes=figure.get("memoryTotalBytes"),
                    use=[
                        HolderUse(
                            h,
                            list(u.get("pids", [])),
                            u.get("memoryUsedBytes"),
                            u.get("memoryGrantedBytes"),
                            u.get("computeUtilization"),
                            bool(u.get("overGrant")),
                        )
                        for h in holders
                        if (u := uses.get((resource, uuid, h.split(" ", 1)[0]))) is not None
                    ],
                )
            )
    # Held devices kxpu does not (or no longer) serve: gone devices still in use, or, with
    # all_resources, other plugins' devices.
    for (resource, device_id), holders in sorted(held.items()):
        if resource in served or all_resources or (resource, device_id) in kept:
            devices.append(DeviceStatus(resource, device_id, "unknown", holders=holders))
    phases = {name: info.get("phase", "?") for name, info in served.items()}
    for driver, info in draining.items():
        count = len(info.get("claims") or {})
        phases[f"DRA driver {driver}"] = (
            f"draining ({count} claims prepared before the config stopped serving it through DRA: unprepare only)"
        )
    warnings = [f"{name}: {w}" for name, info in sorted(served.items()) for w in info.get("warnings", [])]
    return NodeStatus(devices, phases, errors, warnings)


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f}"


def _holder_text(holder: str, use: HolderUse | None) -> str:
    """``ns/pod/ctr`` and, with telemetry, ``(3.1 of 8.0 GiB, 20%)``; ``OVER GRANT`` when above it."""
    if use is None:
        return holder
    parts = [
        f"{_gib(use.memory_used_bytes)}"
        + (f" of {_gib(use.memory_granted_bytes)}" if use.memory_granted_bytes else "")
        + " GiB"
    ]
    if use.compute_utilization is not None:
        parts.append(f"{round(use.compute_utilization * 100)}%")
    return f"{holder} ({', '.join(parts)}{', OVER GRANT' if use.over_grant else ''})"


def format_table(status: NodeStatus) -> str:
    measured = any(
        d.memory_total_bytes is not None or d.compute_utilization is not None for d in status.devices
    )
    head = ("RESOURCE", "DEVICE", "HEALTH", "NUMA", *(("UTIL", "MEMORY GiB") if measured else ()), "HELD BY")
    rows: list[tuple[str, ...]] = [head]
    for d in status.devices:
        health = d.health + (f" ({d.reason})" if d.reason else "")
        numa = ",".join(map(str, d.numa_nodes)) or "-"
        figures: tuple[str, ...] = ()
        if measured:
            util = "-" if d.compute_utilization is None else f"{round(d.compute_utilization * 100)}%"
            memory = (
                "-"
                if d.memory_total_bytes is None
                else f"{_gib(d.memory_used_bytes)}/{_gib(d.memory_total_bytes)}"
            )
            figures = (util, memory)
        by_holder = {u.holder: u for u in d.use}
        held = ", ".join(_holder_text(h, by_holder.get(h)) for h in d.holders) or "-"
        rows.append((d.resource, d.id, health, numa, *figures, held))
    lines = _table(rows)
    for name, phase in sorted(status.phases.items()):
        if phase != "registered":
            lines.append(f"note: {name} is {phase}")
    lines += [f"warning: {w}" for w in status.warnings]
    lines += [f"error: {e}" for e in status.errors]
    return "\n".join(lines)


# -- cluster mode ---------------------------------------------------------------------------------------------


@dataclass
class PodHolding:
    namespace: str
    name: str
    phase: str
    resources: dict[str, int]  # extended resource → amount the pod requests (its effective request)

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    def as_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "phase": self.phase,
            "resources": self.resources,
        }


@dataclass
class Share:
    """What one container of a pod was assigned on one shared device (from the pod's annotation)."""

    pod: str  # namespace/name
    container: str
    memory_mib: int
    cores: int

    def as_json(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "container": self.container,
            "memoryMiB": self.memory_mib,
            "cores": self.cores,
        }


@dataclass
class SharedDeviceStatus:
    resource: str
    id: str
    uuid: str
    model: str
    healthy: bool
    memory_capacity_mib: int
    core_capacity: int
    split_count: int
    shares: list[Share] = field(default_factory=list)

    @property
    def memory_mib(self) -> int:
        return sum(s.memory_mib for s in self.shares)

    @property
    def cores(self) -> int:
        return sum(s.cores for s in self.shares)

    def as_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "id": self.id,
            "uuid": self.uuid,
            "model": self.model,
            "healthy": self.healthy,
            "memoryCapacityMiB": self.memory_capacity_mib,
            "coreCapacity": self.core_capacity,
            "splitCount": self.split_count,
            "memoryAllocatedMiB": self.memory_mib,
            "coresAllocated": self.cores,
            "shares": [s.as_json() for s in self.shares],
        }


@dataclass
class ClusterNodeStatus:
    name: str
    capacity: dict[str, int]
    allocatable: dict[str, int]
    pods: list[PodHolding] = field(default_factory=list)
    devices: list[SharedDeviceStatus] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def allocated(self, resource: str) -> int:
        return sum(p.resources.get(resource, 0) for p in self.pods)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "resources": {
                r: {"capacity": self.capacity.get(r, 0), "allocatable": a, "allocated": self.allocated(r)}
                for r, a in sorted(self.allocatable.items())
            },
            "pods": [p.as_json() for p in self.pods],
            "devices": [d.as_json() for d in self.devices],
            "errors": self.errors,
        }


@dataclass
class ClusterStatus:
    nodes: list[ClusterNodeStatus]
    errors: list[str]

    def as_json(self) -> dict[str, Any]:
        return {"nodes": [n.as_json() for n in self.nodes], "errors": self.errors}


def is_extended(resource: str, only: frozenset[str] = frozenset()) -> bool:
    """An extended resource (``domain/name``, not Kubernetes' own), or one of ``only`` when given."""
    if only:
        return resource in only
    domain, sep, _ = resource.partition("/")
    return bool(sep) and not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def _quantity(value: Any) -> int | None:
    """A whole-number quantity; the API server writes them canonically ("3000" comes back as "3k").
    Anything fractional ("500m") is not an extended resource's."""
    from lightkube.utils.quantity import parse_quantity

    try:
        amount = parse_quantity(str(value))
    except ValueError:
        return None
    return int(amount) if amount is not None and amount == amount.to_integral_value() else None


def _amounts(resources: dict[str, Any] | None, only: frozenset[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    limits = (resources or {}).get("limits") or {}
    requests = (resources or {}).get("requests") or {}
    for name in {*limits, *requests}:
        amount = _quantity(limits.get(name, requests.get(name)))
        if amount is not None and is_extended(name, only):
            out[name] = amount
    return out


def pod_requests(pod: dict[str, Any], only: frozenset[str] = frozenset()) -> dict[str, int]:
    """The pod's effective request of each extended resource, as the scheduler counts it: the sum over
    its containers, or the largest init container's if that is more (init containers run one at a time)."""
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for c in spec.get("containers") or []:
        for name, amount in _amounts(c.get("resources"), only).items():
            total[name] = total.get(name, 0) + amount
    for c in spec.get("initContainers") or []:
        for name, amount in _amounts(c.get("resources"), only).items():
            total[name] = max(total.get(name, 0), amount)
    return {k: v for k, v in sorted(total.items()) if v}


def build_cluster_status(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]], only: frozenset[str] = frozenset()
) -> ClusterStatus:
    """Join nodes and pods as the API serves them (``to_dict()`` of lightkube's objects)."""
    from kxpu.sharing import inventory, signing

    by_name: dict[str, ClusterNodeStatus] = {}
    device_index: dict[tuple[str, str, str], SharedDeviceStatus] = {}  # (node, resource, device id)
    for node in sorted(nodes, key=lambda n: str((n.get("metadata") or {}).get("name", ""))):
        meta = node.get("metadata") or {}
        status = node.get("status") or {}
        name = str(meta.get("name", ""))

        def extended(values: dict[str, Any] | None) -> dict[str, int]:
            return {
                k: q
                for k, v in sorted((values or {}).items())
                if is_extended(k, only) and (q := _quantity(v)) is not None
            }

        entry = by_name[name] = ClusterNodeStatus(
            name, extended(status.get("capacity")), extended(status.get("allocatable"))
        )
        for key, text in sorted((meta.get("annotations") or {}).items()):
            if not key.startswith(inventory.ANNOTATION_PREFIX):
                continue
            try:
                inv = inventory.decode(text)
            except inventory.InventoryError as exc:
                entry.errors.append(f"{key}: {exc}")
                continue
            if only and inv.resource not in only:
                continue
            for d in inv.devices:
                device = SharedDeviceStatus(
                    inv.resource,
                    d.id,
                    d.uuid,
                    d.model,
                    d.healthy,
                    d.memory_capacity_mib,
                    d.core_capacity,
                    d.split_count,
                )
                entry.devices.append(device)
                device_index[(name, inv.resource, d.id)] = device
    errors: list[str] = []
    for pod in sorted(
        pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"].get("name", ""))
    ):
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        phase = str((pod.get("status") or {}).get("phase", ""))
        placed = by_name.get(str(spec.get("nodeName") or ""))
        if placed is None or phase in ("Succeeded", "Failed"):
            continue  # not placed yet, on a node not shown, or finished (its devices are free again)
        holding = PodHolding(
            str(meta.get("namespace", "")), str(meta.get("name", "")), phase, pod_requests(pod, only)
        )
        text = (meta.get("annotations") or {}).get(signing.ASSIGNMENT_ANNOTATION)
        shares = 0
        if text is not None:
            try:
                assignment = signing.decode_assignment(text)
            except signing.SignatureError as exc:
                errors.append(f"pod {holding.ref}: unreadable assignment: {exc}")
                shares = 1  # show the pod: something of kxpu's is wrong with it
            else:
                for c in assignment.containers:
                    if only and c.resource not in only:
                        continue
                    for grant in c.devices:
                        shares += 1
                        held = device_index.get((placed.name, c.resource, grant.device))
                        if held is None:
                            placed.errors.append(
                                f"pod {holding.ref} holds {grant.device} of {c.resource}, not in the inventory"
                            )
                            continue
                        held.shares.append(Share(holding.ref, c.container, grant.memory_mib, grant.cores))
        if holding.resources or shares:
            placed.pods.append(holding)
    # Nodes with nothing of kxpu's are left out (a large cluster's other nodes are noise here).
    shown = [n for n in by_name.values() if n.capacity or n.allocatable or n.devices or n.pods or n.errors]
    return ClusterStatus(shown, errors)


async def fetch_cluster_status(
    client: AsyncClient | None = None, only: frozenset[str] = frozenset()
) -> ClusterStatus:
    """List nodes and pods through the API server (``client``: default, the project's lightkube client)."""
    from kxpu.kube.client import make_client, nodes_and_placed_pods

    nodes, pods = await nodes_and_placed_pods(client if client is not None else make_client())
    return build_cluster_status(nodes, pods, only)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]


def format_cluster_table(status: ClusterStatus) -> str:
    rows: list[tuple[str, ...]] = [("NODE", "RESOURCE", "CAPACITY", "ALLOCATABLE", "REQUESTED", "PODS")]
    for node in status.nodes:
        for resource in sorted({*node.capacity, *node.allocatable}):
            holders = [f"{p.ref} ({p.resources[resource]})" for p in node.pods if resource in p.resources]
            rows.append(
                (
                    node.name,
                    resource,
                    str(node.capacity.get(resource, 0)),
                    str(node.allocatable.get(resource, 0)),
                    str(node.allocated(resource)),
                    ", ".join(holders) or "-",
                )
            )
    lines = _table(rows) if len(rows) > 1 else ["no node has kxpu's extended resources"]
    shared: list[tuple[str, ...]] = [("NODE", "DEVICE", "RESOURCE", "MEMORY MiB", "CORES %", "SHARES")]
    for node in status.nodes:
        for d in node.devices:
            shares = ", ".join(f"{s.pod}/{s.container} ({s.memory_mib} MiB, {s.cores}%)" for s in d.shares)
            shared.append(
                (
                    node.name,
                    d.id + ("" if d.healthy else " (unhealthy)"),
                    d.resource,
                    f"{d.memory_mib}/{d.memory_capacity_mib}",
                    f"{d.cores}/{d.core_capacity}",
                    shares or "-",
                )
            )
    if len(shared) > 1:
        lines += ["", *_table(shared)]
    lines += [f"error: {node.name}: {e}" for node in status.nodes for e in node.errors]
    lines += [f"error: {e}" for e in status.errors]
    return "\n".join(lines)


SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class TokenError(Exception):
    """A token was asked for and cannot be read; the message says which and why."""


def _loopback(url: str) -> bool:
    import ipaddress
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def status_token(daemon_url: str, token_file: Path | None, kubeconfig: Path | None) -> str | None:
    """The bearer token `kxpu status` sends the daemon: ``--token-file``; else, to a daemon on this host only
    (a token is a credential, and /status is plain HTTP), the pod's service-account token, or the token of the
    user of a kubeconfig named with ``--kubeconfig`` — never one picked up from ``$KUBECONFIG`` or
    ``~/.kube/config`` unasked (an operator's token would go to whatever answers on that port, a node root
    controls it). None when there is none (a daemon with --http-auth=none needs none)."""
    if token_file is not None:
        try:
            return token_file.read_text().strip() or None
        except OSError as exc:
            raise TokenError(f"--token-file {token_file}: {exc.strerror or exc}") from None
    if not _loopback(daemon_url):
        return None
    if kubeconfig is None:
        try:
            return SERVICE_ACCOUNT_TOKEN.read_text().strip() or None
        except OSError:
            return None
    from kxpu.kube.client import kubeconfig_token

    try:
        return kubeconfig_token(kubeconfig)
    except ValueError:
        raise TokenError(f"--kubeconfig {kubeconfig}: cannot read it") from None

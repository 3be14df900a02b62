"""`kxpu status`: which pod holds which device on this node.

Joins two views: the kubelet's PodResources API (the authority on who holds what, kept in its
checkpoint) and the node daemon's /status (what kxpu serves and each device's health). Either
may be unreachable; what the other says is still shown, with the error.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kxpu.api.podresources.v1 import api_pb2 as podres
from kxpu.api.podresources.v1 import api_pb2_grpc as podres_grpc

DEFAULT_POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass
class DeviceStatus:
    resource: str
    id: str
    health: str  # "unknown" when kxpu does not serve it (another plugin's, or already gone)
    reason: str | None = None
    numa_nodes: list[int] = field(default_factory=list)
    holders: list[str] = field(default_factory=list)  # namespace/pod/container

    def as_json(self) -> dict[str, Any]:
        return {
            "resource": self.resource,
            "id": self.id,
            "health": self.health,
            "reason": self.reason,
            "numa_nodes": self.numa_nodes,
            "holders": self.holders,
        }


@dataclass
class NodeStatus:
    devices: list[DeviceStatus]
    phases: dict[str, str]  # resource → daemon phase
    errors: list[str]

    def as_json(self) -> dict[str, Any]:
        return {
            "resources": self.phases,
            "devices": [d.as_json() for d in self.devices],
            "errors": self.errors,
        }


async def kubelet_assignments(socket: Path) -> dict[tuple[str, str], list[str]]:
    """(resource, device ID) → holders, from the kubelet's PodResources List."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub: podres_grpc.PodResourcesListerAsyncStub = podres_grpc.PodResourcesListerStub(channel)
        response = await stub.List(podres.ListPodResourcesRequest(), timeout=10)
    held: dict[tuple[str, str], list[str]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    holder = f"{pod.namespace}/{pod.name}/{container.name}"
                    held.setdefault((devices.resource_name, device_id), []).append(holder)
    return held


def daemon_status(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/status", timeout=10) as response:
        doc: dict[str, Any] = json.load(response)
    return doc


async def node_status(pod_resources_socket: Path, daemon_url: str, all_resources: bool = False) -> NodeStatus:
    errors: list[str] = []
    held: dict[tuple[str, str], list[str]] = {}
    served: dict[str, Any] = {}
    try:
        held = await kubelet_assignments(pod_resources_socket)
    except grpc.RpcError as exc:
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        errors.append(f"kubelet PodResources API at {pod_resources_socket}: {detail}")
    try:
        served = (await asyncio.to_thread(daemon_status, daemon_url)).get("resources", {})
    except (OSError, urllib.error.URLError, ValueError) as exc:
        errors.append(f"kxpu daemon at {daemon_url}: {exc}")

    devices: list[DeviceStatus] = []
    for resource, info in sorted(served.items()):
        for d in info.get("devices", []):
            devices.append(
                DeviceStatus(
                    resource=resource,
                    id=d["id"],
                    health=d["health"],
                    reason=d.get("reason"),
                    numa_nodes=d.get("numa_nodes", []),
                    holders=held.pop((resource, d["id"]), []),
                )
            )
    # Held devices kxpu does not (or no longer) serve: gone devices still in use, or, with
    # all_resources, other plugins' devices.
    for (resource, device_id), holders in sorted(held.items()):
        if resource in served or all_resources:
            devices.append(DeviceStatus(resource, device_id, "unknown", holders=holders))
    phases = {name: info.get("phase", "?") for name, info in served.items()}
    return NodeStatus(devices, phases, errors)


def format_table(status: NodeStatus) -> str:
    rows = [("RESOURCE", "DEVICE", "HEALTH", "NUMA", "HELD BY")]
    for d in status.devices:
        health = d.health + (f" ({d.reason})" if d.reason else "")
        numa = ",".join(map(str, d.numa_nodes)) or "-"
        rows.append((d.resource, d.id, health, numa, ", ".join(d.holders) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
    for name, phase in sorted(status.phases.items()):
        if phase != "registered":
            lines.append(f"note: {name} is {phase}")
    lines += [f"error: {e}" for e in status.errors]
    return "\n".join(lines)

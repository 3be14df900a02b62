"""Conversions between the device model and the Device Plugin API messages."""

from __future__ import annotations

from collections.abc import Iterable

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.model import ContainerEdits, Device

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"

# What the kubelet sees of a device; equal keys mean nothing worth re-sending.
WireKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def wire_key(devices: Iterable[Device]) -> WireKey:
    return tuple((d.id, d.health.value, d.numa_nodes) for d in devices)


def device_to_pb(device: Device) -> pb.Device:
    message = pb.Device(ID=device.id, health=device.health.value)
    if device.numa_nodes:
        message.topology.nodes.extend(pb.NUMANode(ID=n) for n in device.numa_nodes)
    return message


def list_and_watch_response(devices: Iterable[Device]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(devices=[device_to_pb(d) for d in devices])


def edits_to_pb(edits: ContainerEdits) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=edits.env,
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in edits.mounts
        ],
        devices=[
            pb.DeviceSpec(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in edits.device_nodes
        ],
        annotations=edits.annotations,
        cdi_devices=[pb.CDIDevice(name=name) for name in edits.cdi_devices],
    )

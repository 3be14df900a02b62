"""Conversions between the device model and the Device Plugin API messages."""

from __future__ import annotations

from collections.abc import Iterable

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.model import ContainerEdits, Device, InvalidDeviceError

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"

# Message size limits, explicit on every channel (gRPC's defaults are 4 MiB in and unlimited out).
# The kubelet's Go client receives at most 4 MiB per message: a device list or Allocate answer beyond that
# would only fail in the kubelet, so the daemon refuses to send it and says why.
KUBELET_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# What the kubelet sends is device IDs, at most the advertised ones twice over (GetPreferredAllocation's
# available and must-include lists): twice what we may send bounds every honest request.
MAX_REQUEST_BYTES = 2 * KUBELET_MAX_MESSAGE_BYTES
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_send_message_length", KUBELET_MAX_MESSAGE_BYTES),
)
# Registration: our RegisterRequest is a few hundred bytes and the kubelet answers Empty.
REGISTRATION_MAX_MESSAGE_BYTES = 64 * 1024
REGISTRATION_OPTIONS = (
    ("grpc.max_receive_message_length", REGISTRATION_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", REGISTRATION_MAX_MESSAGE_BYTES),
)

# What the kubelet sees of a device; equal keys mean nothing worth re-sending.
WireKey = tuple[tuple[str, str, tuple[int, ...]], ...]


def wire_key(devices: Iterable[Device]) -> WireKey:
    return tuple((d.id, d.health.value, d.numa_nodes) for d in devices)


def device_to_pb(device: Device) -> pb.Device:
    """Raises InvalidDeviceError for what the wire cannot carry (a NUMA node past int64)."""
    message = pb.Device(ID=device.id, health=device.health.value)
    if device.numa_nodes:
        try:
            message.topology.nodes.extend(pb.NUMANode(ID=n) for n in device.numa_nodes)
        except (TypeError, ValueError) as exc:
            raise InvalidDeviceError(
                f"device {device.id}: NUMA nodes {list(device.numa_nodes)} cannot be sent to the kubelet "
                f"(int64 IDs): {exc}"
            ) from None
    return message


def list_and_watch_response(devices: Iterable[Device]) -> pb.ListAndWatchResponse:
    """The message every ListAndWatch stream sends; raises InvalidDeviceError if the kubelet could not
    take it (a device the wire cannot carry, a list past the kubelet's message size)."""
    message = pb.ListAndWatchResponse(devices=[device_to_pb(d) for d in devices])
    size = message.ByteSize()
    if size > KUBELET_MAX_MESSAGE_BYTES:
        raise InvalidDeviceError(
            f"the device list of {len(message.devices)} devices is {size} bytes; the kubelet accepts at most "
            f"{KUBELET_MAX_MESSAGE_BYTES} per message: split the devices over more resources"
        )
    return message


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

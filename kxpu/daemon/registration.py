"""Talking to the kubelet's Registration service, and knowing when the kubelet changed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.daemon.wire import API_VERSION, REGISTRATION_OPTIONS

# The kubelet dials back (10 s timeout) and calls GetDevicePluginOptions before it answers.
REGISTER_TIMEOUT_SECONDS = 15.0


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """Tells a re-created file from the old one (inode numbers alone can be reused)."""

    inode: int
    ctime_ns: int


def file_identity(path: Path) -> FileIdentity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileIdentity(st.st_ino, st.st_ctime_ns)


async def register(
    kubelet_socket: Path, endpoint: str, resource: str, options: pb.DevicePluginOptions
) -> None:
    """One registration attempt; raises grpc.aio.AioRpcError with the kubelet's reason on failure."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}", options=REGISTRATION_OPTIONS) as channel:
        stub = pb_grpc.RegistrationStub(channel)
        await stub.Register(
            pb.RegisterRequest(
                version=API_VERSION, endpoint=endpoint, resource_name=resource, options=options
            ),
            timeout=REGISTER_TIMEOUT_SECONDS,
        )

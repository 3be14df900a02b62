"""The floor for exec → registered on the device-plugin path: a bare Python grpc.aio device plugin.

Nothing but grpc: the DevicePlugin service's two calls the kubelet makes first (GetDevicePluginOptions, then
ListAndWatch with one message of ``COUNT`` healthy devices), answered with hand-encoded protobuf (no kxpu, no
generated modules), on ``<plugin dir>/bare.sock``; then ``Register`` on ``<plugin dir>/kubelet.sock``.
Serves until SIGTERM; ``Allocate`` (``bench/bench_allocate.py``) decodes with the generated messages, loaded at its
first call, so with kxpu on the path.

``python bench/bare_dp_registrar.py RESOURCE PLUGIN_DIR COUNT``
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import kept_libraries


def _field(number: int, data: bytes) -> bytes:
    return bytes([number << 3 | 2, len(data)]) + data  # short fields: one-byte lengths


async def main(resource: str, plugin_dir: str, count: int) -> None:
    endpoint = "bare.sock"
    # $BARE_DEVICE_IDS (comma-separated) names the devices instead, $BARE_VISIBLE_ENV the answer's env var:
    # bench/bench_nvidia_vs_go.py lists the GPUs' UUIDs and answers NVIDIA_VISIBLE_DEVICES, as the plugins do.
    ids = os.environ.get("BARE_DEVICE_IDS", "").split(",") if os.environ.get("BARE_DEVICE_IDS") else None
    names = ids or [f"dev-{i}" for i in range(count)]
    visible_env = os.environ.get("BARE_VISIBLE_ENV", "BARE_VISIBLE_DEVICES")
    devices = b"".join(_field(1, _field(1, name.encode()) + _field(2, b"Healthy")) for name in names)
    stop = asyncio.Event()

    async def list_and_watch(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield devices
        await stop.wait()

    async def options(request: bytes, context: Any) -> bytes:
        return b""  # a coroutine, as every handler here: grpc.aio runs a plain function in a thread

    async def allocate(request: bytes, context: Any) -> bytes:
        # The generated messages, loaded at the first call (start-up measures nothing of them): the request decoded,
        # the answer an env var naming the devices of each container.
        from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb

        containers = pb.AllocateRequest.FromString(request).container_requests
        response = pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(envs={visible_env: ",".join(c.devices_ids)}) for c in containers
            ]
        )
        return response.SerializeToString()

    handler = grpc.method_handlers_generic_handler(
        "v1beta1.DevicePlugin",
        {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(options),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(list_and_watch),
            "Allocate": grpc.unary_unary_rpc_method_handler(allocate),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    path = os.path.join(plugin_dir, endpoint)
    if os.path.exists(path):
        os.unlink(path)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    request = b"".join([_field(1, b"v1beta1"), _field(2, endpoint.encode()), _field(3, resource.encode())])
    async with grpc.aio.insecure_channel(f"unix://{os.path.join(plugin_dir, 'kubelet.sock')}") as channel:
        register = channel.unary_unary("/v1beta1.Registration/Register", None, None)  # bytes as they are
        await register(request, timeout=10)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    if kept_libraries.wanted():  # bench_startup.py --libs-floor
        kept_libraries.load(dra=False)
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))

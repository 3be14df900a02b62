"""The floor for exec → registered on the device-plugin path: a bare Python grpc.aio device plugin.

Nothing but grpc: the DevicePlugin service's two calls the kubelet makes first (GetDevicePluginOptions, then
ListAndWatch with one message of ``COUNT`` healthy devices), answered with hand-encoded protobuf (no kxpu, no
generated modules), on ``<plugin dir>/bare.sock``; then ``Register`` on ``<plugin dir>/kubelet.sock``.
Serves until SIGTERM.

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


def _field(number: int, data: bytes) -> bytes:
    return bytes([number << 3 | 2, len(data)]) + data  # short fields: one-byte lengths


async def main(resource: str, plugin_dir: str, count: int) -> None:
    endpoint = "bare.sock"
    devices = b"".join(
        _field(1, _field(1, f"dev-{i}".encode()) + _field(2, b"Healthy")) for i in range(count)
    )
    stop = asyncio.Event()

    async def list_and_watch(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield devices
        await stop.wait()

    handler = grpc.method_handlers_generic_handler(
        "v1beta1.DevicePlugin",
        {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(lambda request, context: b""),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(list_and_watch),
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
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))

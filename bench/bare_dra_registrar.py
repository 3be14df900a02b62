"""The floor for exec → registered: a bare Python grpc.aio server that registers a DRA driver with the kubelet.

Nothing but grpc: the plugin-registration service's two calls, answered with hand-encoded protobuf (no kxpu,
no generated modules), on ``<registry>/<driver>-reg.sock``, and an empty server on ``<plugins>/<driver>/dra.sock``
(the kubelet checks it is a socket). Serves until SIGTERM.

``python bench/bare_dra_registrar.py DRIVER REGISTRY_DIR PLUGINS_DIR``
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import kept_libraries


def _field(number: int, value: str) -> bytes:
    data = value.encode()
    return bytes([number << 3 | 2, len(data)]) + data  # short strings: one-byte lengths


async def main(driver: str, registry: str, plugins: str) -> None:
    endpoint = os.path.join(plugins, driver, "dra.sock")
    os.makedirs(os.path.dirname(endpoint), exist_ok=True)
    info = b"".join(
        [_field(1, "DRAPlugin"), _field(2, driver), _field(3, endpoint), _field(4, "v1.DRAPlugin")]
    )
    handler = grpc.method_handlers_generic_handler(
        "pluginregistration.Registration",
        {
            "GetInfo": grpc.unary_unary_rpc_method_handler(lambda request, context: info),
            "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(lambda request, context: b""),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    reg = os.path.join(registry, f"{driver}-reg.sock")
    for path in (endpoint, reg):
        if os.path.exists(path):
            os.unlink(path)
    server.add_insecure_port(f"unix://{endpoint}")
    server.add_insecure_port(f"unix://{reg}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    if kept_libraries.wanted():  # bench_startup.py --libs-floor
        kept_libraries.load(dra=True)
    asyncio.run(main(*sys.argv[1:4]))

"""What both node servers (device plugin and DRA) need of a gRPC server's life."""

from __future__ import annotations

import asyncio

import grpc


async def stop_server(server: grpc.aio.Server, grace: float | None) -> None:
    """Stop a server to the end even when cancelled meanwhile: a grpc.aio shutdown cut short leaves the
    server half stopped (an InvalidStateError traceback, the socket still bound). Bounded by ``grace``."""
    stopping = asyncio.ensure_future(server.stop(grace))
    try:
        await asyncio.shield(stopping)
    except asyncio.CancelledError:
        await stopping
        raise

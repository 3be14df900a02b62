"""Shared helpers for the NVIDIA backend tests: a backend over a fake machine, and waiting on watch()."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from kxpu.backends.nvidia import NvidiaBackend, NvidiaConfig
from kxpu.backends.nvidia.nvml import NvmlSource
from kxpu.model import Device
from kxpu.testing.fake_nvml import FakeNvml


def make(
    profile: str | FakeNvml = "a100-8x",
    environ: dict[str, str] | None = None,
    event_wait_ms: int = 5000,
    **config: Any,
) -> tuple[NvidiaBackend, FakeNvml]:
    fake = FakeNvml(profile) if isinstance(profile, str) else profile
    backend = NvidiaBackend(
        NvidiaConfig.model_validate(config),
        NvmlSource(fake, fake.host_root, fake=True),
        environ={} if environ is None else environ,
        event_wait_ms=event_wait_ms,
    )
    return backend, fake


async def next_list(
    updates: AsyncIterator[list[Device]],
    predicate: Callable[[list[Device]], bool] = lambda _: True,
    timeout: float = 5.0,
) -> list[Device]:
    """The next device list from ``watch()`` that satisfies ``predicate``, within ``timeout`` seconds."""

    async def find() -> list[Device]:
        while True:
            devices = await anext(updates)
            if predicate(devices):
                return devices

    return await asyncio.wait_for(find(), timeout)


def unhealthy(devices: list[Device]) -> set[str]:
    return {d.id for d in devices if not d.healthy}

"""The latest device list of one resource, shared by its node servers (the device plugin's ListAndWatch and
the DRA driver's slices and health) and kept by the resource runner."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.daemon.wire import WireKey, list_and_watch_response, wire_key
from kxpu.model import Device, index_by_id


class DeviceSnapshot:
    """The latest device list, with two counters: ``version`` moves only when the device plugin's kubelet
    would see a difference (ID, health, NUMA), ``revision`` on any change at all (a DRA ResourceSlice also
    publishes memory, model and vendor attributes).

    The ListAndWatch message is built here, once per version, so that a list the kubelet could not take
    fails the update (the resource fails, is logged and retried) instead of every stream, silently."""

    def __init__(self) -> None:
        self.devices: dict[str, Device] = {}
        self.version = 0
        self.revision = 0
        self.message = pb.ListAndWatchResponse()
        self._key: WireKey = ()
        self._changed = asyncio.Condition()

    async def update(self, devices: Sequence[Device]) -> bool:
        """Replace the list; True if the kubelet's view (``version``) changed. Raises InvalidDeviceError
        (duplicate IDs, a list the wire cannot carry); nothing changes then."""
        by_id = index_by_id(list(devices))
        key = wire_key(by_id.values())
        message = list_and_watch_response(by_id.values()) if key != self._key else self.message
        async with self._changed:
            if by_id == self.devices and self.revision:
                return False
            self.devices = by_id
            self.revision += 1
            wire_changed = key != self._key
            if wire_changed:
                self._key = key
                self.message = message
                self.version += 1
            self._changed.notify_all()
            return wire_changed

    async def wait_newer_than(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version > version)

    async def wait_revision_newer_than(self, revision: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.revision > revision)

"""Stands in for NVIDIA's ``nvidia-device-plugin`` in tests of bench/bench_nvidia_vs_go.py, where no driver is.

What the bench relies on, as NVIDIA's plugin (v0.19) does it: it takes the bench's flags, serves
``nvidia.com/gpu`` on ``nvidia-gpu.sock`` (NVIDIA's is always in /var/lib/kubelet/device-plugins; this one in the
directory of ``--kubelet-socket``, the only place a test can give), registers with the kubelet there, lists the
GPUs of the fake NVML profile ``$KXPU_FAKE_NVML`` by UUID, Healthy, and answers Allocate with
``NVIDIA_VISIBLE_DEVICES`` (and the device nodes with ``--pass-device-specs=true``). SIGTERM stops it.

``python tests/fake_nvidia_device_plugin.py --kubelet-socket=DIR/kubelet.sock [NVIDIA's other flags]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.testing.fake_nvml import FakeNvml

RESOURCE = "nvidia.com/gpu"


class Plugin(pb_grpc.DevicePluginServicer):
    def __init__(self, uuids: dict[str, int], pass_specs: bool, stop: asyncio.Event) -> None:
        self.uuids = uuids  # UUID → minor number
        self.pass_specs = pass_specs
        self.stop = stop

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=u, health="Healthy") for u in self.uuids])
        await self.stop.wait()

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for ask in request.container_requests:
            must = list(ask.must_include_deviceIDs)
            rest = [i for i in ask.available_deviceIDs if i not in must]
            responses.append(
                pb.ContainerPreferredAllocationResponse(deviceIDs=(must + rest)[: ask.allocation_size])
            )
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()  # NVIDIA's does nothing here either

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        responses = []
        for ask in request.container_requests:
            ids = list(ask.devices_ids)
            unknown = [i for i in ids if i not in self.uuids]
            if unknown:
                await context.abort(grpc.StatusCode.UNKNOWN, f"invalid allocation request: unknown {unknown}")
            specs = [
                pb.DeviceSpec(container_path=p, host_path=p, permissions="rw")
                for p in [f"/dev/nvidia{self.uuids[i]}" for i in ids]
            ]
            responses.append(
                pb.ContainerAllocateResponse(
                    envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}, devices=specs if self.pass_specs else []
                )
            )
        return pb.AllocateResponse(container_responses=responses)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubelet-socket", type=Path, required=True)
    parser.add_argument("--pass-device-specs", default="false")
    args, _ = parser.parse_known_args()  # NVIDIA's other flags: their defaults are what is played
    gpus = FakeNvml(os.environ["KXPU_FAKE_NVML"]).gpus
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    plugin = Plugin({g.uuid: i for i, g in enumerate(gpus)}, args.pass_device_specs == "true", stop)
    socket = args.kubelet_socket.parent / "nvidia-gpu.sock"
    socket.unlink(missing_ok=True)
    server = grpc.aio.server()
    pb_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{args.kubelet_socket}") as channel:
        await pb_grpc.RegistrationStub(channel).Register(
            pb.RegisterRequest(version="v1beta1", endpoint=socket.name, resource_name=RESOURCE), timeout=10
        )
    await stop.wait()
    await server.stop(0)
    socket.unlink(missing_ok=True)


if __name__ == "__main__":
    asyncio.run(main())

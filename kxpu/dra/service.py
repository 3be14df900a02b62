"""The gRPC services a kxpu DRA driver serves to the kubelet, over the ``Preparer`` and the device snapshot.

- ``DRAPlugin`` v1 (kubelets 1.34+) and v1beta1 (older kubelets; the same messages without
  ``share_id``, converted through the wire format);
- ``DRAResourceHealth`` v1 (1.37+) and v1alpha1: the health of every device, sent at once, on every
  change and at least every ``HEALTH_RESEND_SECONDS`` (the kubelet shows a device as Unknown when it
  hears nothing about it for its timeout);
- ``Registration`` (plugin registration v1) on the socket in ``plugins_registry``: the kubelet finds
  it, asks ``GetInfo`` (type ``DRAPlugin``, the driver name, the DRA socket, the services above)
  and reports the outcome in ``NotifyRegistrationStatus``.

Requests are bounded: at most ``MAX_CLAIMS_PER_CALL`` claims per call (the kubelet sends one pod's
claims for one driver), each field checked before anything is read from the API server.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from kxpu.api.dra.v1 import api_pb2 as dra
from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
from kxpu.api.dra.v1beta1 import api_pb2 as dra_beta
from kxpu.api.dra.v1beta1 import api_pb2_grpc as dra_beta_grpc
from kxpu.api.drahealth.v1 import api_pb2 as health
from kxpu.api.drahealth.v1 import api_pb2_grpc as health_grpc
from kxpu.api.drahealth.v1alpha1 import api_pb2 as health_alpha
from kxpu.api.drahealth.v1alpha1 import api_pb2_grpc as health_alpha_grpc
from kxpu.api.pluginregistration.v1 import api_pb2 as reg
from kxpu.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.names import device_name
from kxpu.dra.prepare import ClaimRef, Preparer
from kxpu.logs import get_logger
from kxpu.timeouts import within

log = get_logger("kxpu.dra.service")

DRA_PLUGIN_V1 = "v1.DRAPlugin"
DRA_PLUGIN_V1BETA1 = "v1beta1.DRAPlugin"
HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
SUPPORTED_SERVICES = (DRA_PLUGIN_V1, DRA_PLUGIN_V1BETA1, HEALTH_V1, HEALTH_V1ALPHA1)
PLUGIN_TYPE = "DRAPlugin"

MAX_CLAIMS_PER_CALL = 256  # a pod has at most 128 claims (the API's limit); with some room
MAX_FIELD = 253  # a name: a DNS subdomain
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")
HEALTH_RESEND_SECONDS = 20.0
HEALTH_TIMEOUT_SECONDS = 60  # what kxpu asks the kubelet to wait before showing Unknown


def _refs(claims: Sequence[Any]) -> list[ClaimRef]:
    """The claims of a request, each checked to be what the API allows: a namespace is a DNS label, a name a
    DNS subdomain, a UID letters, digits and '-' (it becomes part of a file name: nothing else gets near a
    path)."""
    if len(claims) > MAX_CLAIMS_PER_CALL:
        raise ValueError(f"{len(claims)} claims in one call; at most {MAX_CLAIMS_PER_CALL}")
    refs = []
    for n, claim in enumerate(claims):
        if not (
            _NAMESPACE.match(claim.namespace)
            and len(claim.name) <= MAX_FIELD
            and _NAME.match(claim.name)
            and _UID.match(claim.uid)
        ):
            raise ValueError(
                f"claims[{n}] ({claim.namespace!r}/{claim.name!r}, UID {claim.uid!r}) is not a ResourceClaim "
                "reference: a namespace, name and UID as the API server makes them"
            )
        refs.append(ClaimRef(claim.namespace, claim.uid, claim.name))
    return refs


class DraPluginServicer(dra_grpc.DRAPluginServicer):
    """DRAPlugin v1."""

    def __init__(self, preparer: Preparer, pool: str) -> None:
        self.preparer = preparer
        self.pool = pool

    async def NodePrepareResources(
        self,
        request: dra.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[dra.NodePrepareResourcesRequest, dra.NodePrepareResourcesResponse],
    ) -> dra.NodePrepareResourcesResponse:
        try:
            refs = _refs(request.claims)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        results = await self.preparer.prepare(refs)
        response = dra.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if result.error is not None:
                entry.error = result.error
                continue
            for device in result.devices:
                out = entry.devices.add(
                    request_names=list(device.requests),
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=list(device.cdi_device_ids),
                )
                if device.share_id:
                    out.share_id = device.share_id
        return response

    async def NodeUnprepareResources(
        self,
        request: dra.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra.NodeUnprepareResourcesRequest, dra.NodeUnprepareResourcesResponse
        ],
    ) -> dra.NodeUnprepareResourcesResponse:
        try:
            refs = _refs(request.claims)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        results = await self.preparer.unprepare(refs)
        response = dra.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            response.claims[uid].error = error or ""
        return response


class DraPluginV1Beta1Servicer(dra_beta_grpc.DRAPluginServicer):
    """DRAPlugin v1beta1: the same calls, converted to and from v1 through the wire format (the messages
    are field-for-field identical but for v1's ``share_id``, which v1beta1 kubelets never use)."""

    def __init__(self, v1: DraPluginServicer) -> None:
        self.v1 = v1

    async def NodePrepareResources(
        self,
        request: dra_beta.NodePrepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_beta.NodePrepareResourcesRequest, dra_beta.NodePrepareResourcesResponse
        ],
    ) -> dra_beta.NodePrepareResourcesResponse:
        converted = dra.NodePrepareResourcesRequest.FromString(request.SerializeToString())
        answer = await self.v1.NodePrepareResources(converted, context)  # type: ignore[arg-type]
        return dra_beta.NodePrepareResourcesResponse.FromString(answer.SerializeToString())

    async def NodeUnprepareResources(
        self,
        request: dra_beta.NodeUnprepareResourcesRequest,
        context: grpc.aio.ServicerContext[
            dra_beta.NodeUnprepareResourcesRequest, dra_beta.NodeUnprepareResourcesResponse
        ],
    ) -> dra_beta.NodeUnprepareResourcesResponse:
        converted = dra.NodeUnprepareResourcesRequest.FromString(request.SerializeToString())
        answer = await self.v1.NodeUnprepareResources(converted, context)  # type: ignore[arg-type]
        return dra_beta.NodeUnprepareResourcesResponse.FromString(answer.SerializeToString())


def health_report(snapshot: DeviceSnapshot, pool: str) -> health.NodeWatchResourcesResponse:
    now = int(time.time())
    response = health.NodeWatchResourcesResponse()
    for device in snapshot.devices.values():
        response.devices.add(
            device=health.DeviceIdentifier(pool_name=pool, device_name=device_name(device.id)),
            health=health.HEALTHY if device.healthy else health.UNHEALTHY,
            last_updated_time=now,
            health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS,
            message="" if device.healthy else (device.health_reason or "unhealthy")[:1024],
        )
    return response


async def health_stream(
    snapshot: DeviceSnapshot, pool: str, resend_s: float = HEALTH_RESEND_SECONDS
) -> AsyncIterator[health.NodeWatchResourcesResponse]:
    """The full report now, then on every change and every ``resend_s`` seconds."""
    while True:
        version = snapshot.version
        yield health_report(snapshot, pool)
        await within(snapshot.wait_newer_than(version), resend_s)


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(self, snapshot: DeviceSnapshot, pool: str) -> None:
        self.snapshot = snapshot
        self.pool = pool

    async def NodeWatchResources(
        self,
        request: health.NodeWatchResourcesRequest,
        context: grpc.aio.ServicerContext[
            health.NodeWatchResourcesRequest, health.NodeWatchResourcesResponse
        ],
    ) -> AsyncIterator[health.NodeWatchResourcesResponse]:
        async for report in health_stream(self.snapshot, self.pool):
            yield report


class HealthV1Alpha1Servicer(health_alpha_grpc.DRAResourceHealthServicer):
    def __init__(self, snapshot: DeviceSnapshot, pool: str) -> None:
        self.snapshot = snapshot
        self.pool = pool

    async def NodeWatchResources(
        self,
        request: health_alpha.NodeWatchResourcesRequest,
        context: grpc.aio.ServicerContext[
            health_alpha.NodeWatchResourcesRequest, health_alpha.NodeWatchResourcesResponse
        ],
    ) -> AsyncIterator[health_alpha.NodeWatchResourcesResponse]:
        async for report in health_stream(self.snapshot, self.pool):
            yield health_alpha.NodeWatchResourcesResponse.FromString(report.SerializeToString())


def add_dra_services(
    server: grpc.aio.Server, preparer: Preparer, snapshot: DeviceSnapshot, pool: str
) -> None:
    v1 = DraPluginServicer(preparer, pool)
    dra_grpc.add_DRAPluginServicer_to_server(v1, server)
    dra_beta_grpc.add_DRAPluginServicer_to_server(DraPluginV1Beta1Servicer(v1), server)
    health_grpc.add_DRAResourceHealthServicer_to_server(HealthServicer(snapshot, pool), server)
    health_alpha_grpc.add_DRAResourceHealthServicer_to_server(HealthV1Alpha1Servicer(snapshot, pool), server)


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """Plugin registration v1, as the kubelet's plugin manager expects from a DRA driver."""

    def __init__(self, driver: str, endpoint: str, on_status: Callable[[bool, str], None]) -> None:
        self.info = reg.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(SUPPORTED_SERVICES)
        )
        self.on_status = on_status

    async def GetInfo(
        self, request: reg.InfoRequest, context: grpc.aio.ServicerContext[reg.InfoRequest, reg.PluginInfo]
    ) -> reg.PluginInfo:
        return self.info

    async def NotifyRegistrationStatus(
        self,
        request: reg.RegistrationStatus,
        context: grpc.aio.ServicerContext[reg.RegistrationStatus, reg.RegistrationStatusResponse],
    ) -> reg.RegistrationStatusResponse:
        self.on_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()

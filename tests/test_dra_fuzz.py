"""Fuzzing the DRA driver with what a kubelet and an API server could send: a clear error or a correct
answer, never an unhandled exception, never a device the claim does not justify."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kxpu.api.dra.v1 import api_pb2 as dra
from kxpu.api.dra.v1 import api_pb2_grpc as dra_grpc
from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.daemon.snapshot import DeviceSnapshot
from kxpu.dra.claims import ClaimError, allocation_for
from kxpu.dra.config import DraConfig
from kxpu.dra.plugin import MAX_MESSAGE_BYTES, DraPlugin
from kxpu.dra.prepare import ClaimRef
from kxpu.testing.dra import DraKubeletStandIn, FakeDraApi

DRIVER, NODE = "npu.example.com", "node-a"
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=25,
)
result = st.fixed_dictionaries(
    {
        "request": st.sampled_from(["npu", "", "a/b", 7]),
        "driver": st.sampled_from([DRIVER, "other.example.com", None]),
        "pool": st.sampled_from([NODE, "node-b", ""]),
        "device": st.sampled_from(["sim-0", "sim-1", "sim-9", "", None, ["x"]]),
    },
    optional={"shareID": json_value, "adminAccess": json_value, "consumedCapacity": json_value},
)
claim = st.fixed_dictionaries(
    {
        "metadata": st.fixed_dictionaries(
            {"uid": st.sampled_from(["u1", "u2"]), "namespace": st.just("ns"), "name": st.just("c")}
        ),
        "status": st.one_of(
            json_value,
            st.fixed_dictionaries(
                {
                    "allocation": st.fixed_dictionaries(
                        {
                            "devices": st.fixed_dictionaries(
                                {"results": st.lists(result, max_size=4), "config": json_value}
                            )
                        }
                    )
                }
            ),
        ),
    }
)


@settings(max_examples=400, deadline=None)
@given(claim)
def test_allocation_parsing_never_grants_what_the_claim_does_not(raw: dict[str, Any]) -> None:
    try:
        allocation = allocation_for(raw, "u1", DRIVER, NODE)
    except ClaimError as exc:
        assert str(exc)  # a reason, always
        return
    results = raw["status"]["allocation"]["devices"]["results"]
    justified = {(r["request"], r["device"]) for r in results if r["driver"] == DRIVER and r["pool"] == NODE}
    assert {(d.request, d.device) for d in allocation.devices} <= justified
    assert allocation.devices and raw["metadata"]["uid"] == "u1"


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[tuple[DraKubeletStandIn, FakeDraApi, DraPlugin]]:
    """A DRA plugin serving 4 simulated devices, and a kubelet stand-in registered with it."""
    root = Path(tempfile.mkdtemp(prefix="kx-", dir="/tmp"))
    backend = SimulatedBackend(SimulatedConfig(count=4, model="sim"))
    snapshot = DeviceSnapshot()
    await snapshot.update(backend.discover())
    api = FakeDraApi({NODE: "uid-a"})
    settings = DraConfig(cdi_spec_dir=root / "cdi")
    plugin = DraPlugin(
        "example.com/npu", DRIVER, NODE, backend, snapshot, root / "p", root / "r", api, api, settings
    )
    task = asyncio.create_task(plugin.run())
    kubelet = DraKubeletStandIn(root / "r")
    await kubelet.start()
    await kubelet.wait_registered(DRIVER)
    try:
        yield kubelet, api, plugin
    finally:
        await kubelet.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
async def served() -> AsyncIterator[tuple[DraKubeletStandIn, FakeDraApi, DraPlugin]]:
    async with serving() as parts:
        yield parts


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.builds(ClaimRef, st.text(max_size=300), st.text(max_size=300), st.text(max_size=300)), max_size=8
    )
)
def test_fuzzed_prepare_requests_get_an_answer_per_claim(claims: list[ClaimRef]) -> None:
    """Arbitrary claim references over the real socket: INVALID_ARGUMENT with a reason, or one answer per
    claim, each a refusal with its reason (none of them exists), and nothing prepared."""

    async def run() -> None:
        async with serving() as (kubelet, _, plugin):
            try:
                answer = await kubelet.prepare(DRIVER, *claims)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.details()
                return
            assert set(answer.claims) == {c.uid for c in claims}
            assert all(entry.error and not entry.devices for entry in answer.claims.values())
            assert not plugin.checkpoint.claims

    asyncio.run(run())


async def test_oversized_messages_are_refused(served: Any) -> None:
    kubelet, _, _ = served
    channel = kubelet.drivers[DRIVER].channel
    huge = dra.NodePrepareResourcesRequest(
        claims=[
            dra.Claim(namespace="n", uid=f"{i}", name="x" * 4096)
            for i in range(MAX_MESSAGE_BYTES // 4096 + 8)
        ]
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await dra_grpc.DRAPluginStub(channel).NodePrepareResources(huge, timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    too_many = dra.NodePrepareResourcesRequest(
        claims=[dra.Claim(namespace="n", uid=f"{i}", name="c") for i in range(300)]
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await dra_grpc.DRAPluginStub(channel).NodePrepareResources(too_many, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in (
        caught.value.details() or ""
    )


async def test_claim_references_must_be_what_the_api_makes(served: Any) -> None:
    """A UID becomes part of a file name: only letters, digits and '-' get near a path."""
    kubelet, _, _ = served
    for bad in (ClaimRef("ns", "../../etc/x", "c"), ClaimRef("NS", "u1", "c"), ClaimRef("ns", "u1", "c/d")):
        for call in (kubelet.prepare, kubelet.unprepare):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(DRIVER, bad)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not a ResourceClaim reference" in (caught.value.details() or "")

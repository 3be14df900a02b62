"""DRA consumable capacity: devices published for several allocations, and the limits each share's
containers get; the driver's defence never lets prepared shares add up past a device."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kxpu.backends.simulated import SimulatedBackend, SimulatedConfig
from kxpu.dra.checkpoint import Checkpoint
from kxpu.dra.config import DraSharesConfig
from kxpu.dra.prepare import ClaimRef, Preparer
from kxpu.dra.slices import SharePolicy, device_entry
from kxpu.model import Device, index_by_id
from kxpu.testing.dra import FakeDraApi

DRIVER, NODE = "npu.example.com", "node-a"
SHARES = DraSharesConfig()


def test_shared_devices_allow_several_allocations_with_request_policies() -> None:
    entry = device_entry(Device(id="gpu-0", memory_mib=81559), "taint", SharePolicy(memory_step_mib=256))
    assert entry["allowMultipleAllocations"] is True
    memory = entry["capacity"]["memory"]
    assert memory["value"] == "81559Mi"
    # The default (a claim naming no amount: the whole device) must be a multiple of the step.
    assert memory["requestPolicy"] == {"default": "81408Mi", "validRange": {"min": "256Mi", "step": "256Mi"}}
    cores = entry["capacity"]["cores"]
    assert cores == {
        "value": "100",
        # min 0: a share may ask no compute (best-effort time-sharing, as the extender path's default)
        "requestPolicy": {"default": "100", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }
    scaled = device_entry(
        Device(id="g", memory_mib=1024), "taint", SharePolicy(memory_scaling=2, core_scaling=1.5)
    )
    assert scaled["capacity"]["memory"]["value"] == "2Gi" and scaled["capacity"]["cores"]["value"] == "150"


def share(device: str, memory: str | None, cores: str | None, request: str = "npu") -> dict[str, Any]:
    consumed = {k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None}
    return {
        "request": request,
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": consumed,
    }


def whole(device: str) -> dict[str, Any]:
    return {"request": "npu", "driver": DRIVER, "pool": NODE, "device": device}


def make(tmp: Path, shares: DraSharesConfig | None = SHARES) -> tuple[Preparer, FakeDraApi]:
    backend = SimulatedBackend(SimulatedConfig(count=2, model="sim", memory_mib=16384))
    checkpoint = Checkpoint(tmp / "checkpoint.json", DRIVER)
    checkpoint.load()
    api = FakeDraApi()
    devices = index_by_id(backend.discover())
    return Preparer(DRIVER, NODE, backend, devices, checkpoint, tmp / "cdi", api, shares), api


async def test_each_share_gets_its_limits(tmp_path: Path) -> None:
    preparer, api = make(tmp_path)
    a = api.add_claim("a", [share("sim-0", "4Gi", "25")])
    b = api.add_claim("b", [share("sim-0", "6Gi", "50")])
    answers = await preparer.prepare([a, b])
    assert all(answers[c.uid].error is None for c in (a, b))
    assert all(answers[c.uid].devices[0].share_id for c in (a, b))
    for claim, memory, cores in ((a, "4096m", "25"), (b, "6144m", "50")):
        spec = json.loads(preparer.spec_path(claim.uid).read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == memory and env["CUDA_DEVICE_SM_LIMIT"] == cores
        assert env["KXPU_VISIBLE_DEVICES"] == "sim-0"
    # No amounts named: the scheduler consumes the published defaults (the whole device): no limits.
    full = api.add_claim("full", [share("sim-1", "16Gi", "100")])
    assert (await preparer.prepare([full]))[full.uid].error is None
    spec_env = json.loads(preparer.spec_path(full.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert not any(e.startswith("CUDA_DEVICE_") for e in spec_env)


async def test_a_share_of_no_cores_gets_its_memory_limit_and_no_compute_limit(tmp_path: Path) -> None:
    """``cores: "0"`` (a HAMi pod naming only memory, converted at admission): limited in memory, time-shared."""
    preparer, api = make(tmp_path)
    a = api.add_claim("a", [share("sim-0", "3000Mi", "0")])
    assert (await preparer.prepare([a]))[a.uid].error is None
    env = dict(
        e.split("=", 1)
        for e in json.loads(preparer.spec_path(a.uid).read_text())["devices"][0]["containerEdits"]["env"]
    )
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3000m" and "CUDA_DEVICE_SM_LIMIT" not in env


async def test_shares_never_add_up_past_the_device(tmp_path: Path) -> None:
    preparer, api = make(tmp_path)
    a = api.add_claim("a", [share("sim-0", "12Gi", "60")])
    assert (await preparer.prepare([a]))[a.uid].error is None
    too_much = api.add_claim("b", [share("sim-0", "8Gi", "10")])
    error = (await preparer.prepare([too_much]))[too_much.uid].error or ""
    assert "20480 MiB of 16384" in error and "over-commit" in error
    exclusive = api.add_claim("c", [whole("sim-0")])
    assert "already prepared for ResourceClaim default/a" in (
        (await preparer.prepare([exclusive]))[exclusive.uid].error or ""
    )
    await preparer.unprepare([a])
    assert (await preparer.prepare([too_much]))[too_much.uid].error is None


async def test_a_share_needs_a_sharing_driver(tmp_path: Path) -> None:
    preparer, api = make(tmp_path, shares=None)
    claim = api.add_claim("a", [share("sim-0", "4Gi", "25")])
    assert "does not publish shares (dra.shares)" in (
        (await preparer.prepare([claim]))[claim.uid].error or ""
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["prepare", "unprepare"]),
            st.integers(0, 5),  # which claim
            st.sampled_from(["sim-0", "sim-1"]),
            st.integers(0, 20),  # GiB
            st.integers(0, 100),  # percent
            st.booleans(),  # whole device instead of a share
        ),
        max_size=25,
    )
)
def test_no_sequence_of_prepares_and_unprepares_over_commits(
    ops: list[tuple[str, int, str, int, int, bool]],
) -> None:
    import asyncio
    import tempfile

    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            preparer, api = make(Path(tmp))
            refs: dict[int, ClaimRef] = {}
            for op, n, device, gib, cores, exclusive in ops:
                if op == "unprepare":
                    if n in refs:
                        await preparer.unprepare([refs.pop(n)])
                    continue
                if n in refs:
                    continue
                result = whole(device) if exclusive else share(device, f"{gib}Gi", str(cores))
                refs[n] = api.add_claim(f"c{n}-{uuid.uuid4().hex[:4]}", [result])
                await preparer.prepare([refs[n]])
                for name in ("sim-0", "sim-1"):
                    held = preparer.checkpoint.holders_of(name)
                    wholes = [h for h in held if h[2].share_id is None]
                    assert len(wholes) <= 1 and (not wholes or len(held) == 1)
                    assert sum(h[2].memory_mib or 0 for h in held) <= 16384
                    assert sum(h[2].cores or 0 for h in held) <= 100

    asyncio.run(run())


@pytest.mark.parametrize("bad", ["{x}", "NO_INDEX"])
def test_share_env_names_are_checked(bad: str) -> None:
    with pytest.raises(ValueError, match="needs \\{i\\}"):
        DraSharesConfig(memory_limit_env=bad)


async def test_sharing_strategy_in_the_opaque_config(tmp_path: Path) -> None:
    preparer, api = make(tmp_path)
    mps = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": "kxpu.io/v1alpha1",
                "kind": "DeviceConfig",
                "sharing": {"strategy": "MPS"},
            },
        }
    }
    claim = api.add_claim("a", [share("sim-0", "4Gi", "25")], config=[mps])
    error = (await preparer.prepare([claim]))[claim.uid].error or ""
    assert "sharing strategy MPS asked, but driver npu.example.com's backend cannot enforce shares" in error
    typo = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": "kxpu.io/v1alpha1",
                "kind": "DeviceConfig",
                "sharing": {"strategy": "Mps"},
            },
        }
    }
    claim = api.add_claim("b", [share("sim-0", "4Gi", "25")], config=[typo])
    assert "Input should be 'TimeSlicing' or 'MPS'" in (
        (await preparer.prepare([claim]))[claim.uid].error or ""
    )
    sliced = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": "kxpu.io/v1alpha1",
                "kind": "DeviceConfig",
                "sharing": {"strategy": "TimeSlicing"},
            },
        }
    }
    claim = api.add_claim("c", [share("sim-0", "4Gi", "25")], config=[sliced])
    assert (await preparer.prepare([claim]))[claim.uid].error is None


async def test_a_backend_that_enforces_shares_gets_them(tmp_path: Path) -> None:
    from collections.abc import Sequence

    from kxpu.model import ContainerEdits, DeviceShare

    class Enforcing(SimulatedBackend):
        def allocate_shares(self, shares: Sequence[DeviceShare]) -> ContainerEdits:
            edits = self.allocate([s.device for s in shares])
            edits.env["ENFORCED"] = ",".join(f"{s.device.id}:{s.memory_mib}:{s.cores}" for s in shares)
            return edits

    backend = Enforcing(SimulatedConfig(count=1, model="sim", memory_mib=16384))
    checkpoint = Checkpoint(tmp_path / "checkpoint.json", DRIVER)
    api = FakeDraApi()
    preparer = Preparer(
        DRIVER, NODE, backend, index_by_id(backend.discover()), checkpoint, tmp_path / "cdi", api, SHARES
    )
    claim = api.add_claim("a", [share("sim-0", "4Gi", "25")])
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    env = json.loads(preparer.spec_path(claim.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert "ENFORCED=sim-0:4096:25" in env and "CUDA_DEVICE_MEMORY_LIMIT_0=4096m" in env


async def test_one_requests_opaque_env_cannot_override_anothers_driver_env(tmp_path: Path) -> None:
    """A container using both requests of a claim gets both CDI devices: request b's config must not override
    the share limit the driver set for request a's device."""
    preparer, api = make(tmp_path)
    params = {
        "apiVersion": "kxpu.io/v1alpha1",
        "kind": "DeviceConfig",
        "env": {"CUDA_DEVICE_MEMORY_LIMIT_0": "80g"},
    }
    claim = api.add_claim(
        "c",
        [share("sim-0", "4Gi", "25", request="a"), {**whole("sim-1"), "request": "b"}],
        config=[{"requests": ["b"], "opaque": {"driver": DRIVER, "parameters": params}}],
    )
    error = (await preparer.prepare([claim]))[claim.uid].error or ""
    assert "opaque config of request b sets CUDA_DEVICE_MEMORY_LIMIT_0" in error


async def test_a_claim_naming_no_amount_gets_the_whole_device(tmp_path: Path) -> None:
    """The scheduler fills consumedCapacity with the published default when a claim names no amount; with
    memory that is not a multiple of the step the default is rounded down, and is still the whole device."""
    backend = SimulatedBackend(SimulatedConfig(count=1, model="sim", memory_mib=16000))
    entry = device_entry(backend.discover()[0], "taint", SharePolicy())
    default = entry["capacity"]["memory"]["requestPolicy"]["default"]
    assert default == "15872Mi"
    api = FakeDraApi()
    preparer = Preparer(
        DRIVER,
        NODE,
        backend,
        index_by_id(backend.discover()),
        Checkpoint(tmp_path / "c.json", DRIVER),
        tmp_path / "cdi",
        api,
        SHARES,
    )
    claim = api.add_claim("full", [share("sim-0", default, "100")])
    assert (await preparer.prepare([claim]))[claim.uid].error is None
    env = json.loads(preparer.spec_path(claim.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert not any(e.startswith("CUDA_DEVICE_") for e in env), env
    assert preparer.checkpoint.claims[claim.uid].devices[0].memory_mib == 16000


def test_min_memory_must_be_a_whole_number_of_steps() -> None:
    """The API server refuses a request policy whose default is not a whole number of steps from its min:
    such a config would have every slice refused, so it is refused at load, naming the fields."""
    from kxpu.config import ConfigError, parse_config
    from kxpu.testing.dra import ApiRefused, FakeDraApi

    entry = device_entry(Device(id="gpu-0", memory_mib=16384), "taint", SharePolicy(256, 100))
    body = {"metadata": {"name": "s"}, "spec": {"driver": DRIVER, "nodeName": NODE, "devices": [entry]}}
    with pytest.raises(ApiRefused, match="not a multiple of a given step"):
        asyncio.run(FakeDraApi().create_slice(body))
    resource = {"name": "example.com/npu", "simulated": {"count": 1}, "serve": "dra"}
    with pytest.raises(
        ConfigError, match=r"dra\.shares.*minMemoryMiB 100 must be a multiple of memoryStepMiB 256"
    ):
        parse_config({"version": "v1", "resources": [{**resource, "dra": {"shares": {"minMemoryMiB": 100}}}]})
    parse_config({"version": "v1", "resources": [{**resource, "dra": {"shares": {"minMemoryMiB": 512}}}]})

"""Fuzzing what the kubelet can send to the device plugin, over the real sockets of a daemon process.

Properties: every request gets a correct answer or a clear gRPC error (never UNKNOWN from our code, never
INTERNAL), a grant only for what the request justifies (known, healthy, each device once), and the
daemon keeps serving with nothing above debug level that is not one line. Message size limits are checked
at their edges. The example budget comes from the hypothesis profile (``ci`` in ``make test``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from kxpu.api.deviceplugin.v1beta1 import api_pb2 as pb
from kxpu.api.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from kxpu.daemon import socket_name
from kxpu.daemon.wire import KUBELET_MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES
from tests.test_daemon_robustness import assert_one_line_errors

ROOT = Path(__file__).parent.parent
NPU = "example.com/npu"
PS = "example.com/ps"
NUMA = [0, 0, 1, 1, 2, 2, 3, 3]
UNHEALTHY = {"sim-npu-2"}
ABSENT = {"sim-npu-5"}
PRESENT = {f"sim-npu-{i}" for i in range(8)} - ABSENT
HEALTHY = PRESENT - UNHEALTHY
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class FuzzDaemon:
    process: subprocess.Popen[bytes]
    log: Path
    npu: grpc.Channel
    ps: grpc.Channel

    def check(self) -> None:
        assert self.process.poll() is None, f"the daemon died:\n{self.log.read_text()[-3000:]}"
        assert_one_line_errors(self.log.read_text())


@pytest.fixture(scope="module")
def daemon() -> Iterator[FuzzDaemon]:
    workdir = Path(tempfile.mkdtemp(prefix="kxf-", dir="/tmp"))
    plugin_dir = workdir / "dp"
    plugin_dir.mkdir()
    state = workdir / "state.json"
    state.write_text(json.dumps({**dict.fromkeys(UNHEALTHY, "Unhealthy"), **dict.fromkeys(ABSENT, "Absent")}))
    config = workdir / "c.yaml"
    resources = [
        {
            "name": NPU,
            "simulated": {"count": 8, "model": "sim-npu", "numaNodes": NUMA, "stateFile": str(state)},
        },
        {"name": PS, "prestart": {"record": str(workdir / "prestarted")}},
    ]
    config.write_text(
        yaml.safe_dump({"version": "v1", "devicePluginDir": str(plugin_dir), "resources": resources})
    )
    log = workdir / "daemon.log"
    with log.open("wb") as out:  # no kubelet: the daemon serves its sockets and waits to register
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "kxpu", "plugin", "--config", str(config), "--http-address", ""),
                *("--log-level", "debug", "--import", "tests.flaky_backend"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    deadline = time.monotonic() + 20
    while log.read_text().count("waiting for the kubelet") < 2:
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    npu = grpc.insecure_channel(f"unix://{plugin_dir / socket_name(NPU)}")
    ps = grpc.insecure_channel(f"unix://{plugin_dir / socket_name(PS)}")
    yield FuzzDaemon(process, log, npu, ps)
    npu.close()
    ps.close()
    process.send_signal(signal.SIGTERM)
    process.wait(10)
    for path in sorted(workdir.rglob("*"), reverse=True):
        path.unlink() if not path.is_dir() else path.rmdir()
    workdir.rmdir()


# IDs the kubelet could send: ours (healthy, unhealthy, absent), near misses, and anything at all.
near_misses = ["sim-npu-8", "SIM-NPU-0", "sim-npu-0 ", " sim-npu-1", "sim-npu-01", "sim-npu", "", "ps-0"]
device_ids = st.one_of(
    st.sampled_from(sorted(PRESENT | ABSENT) + near_misses),
    st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=80),
)
id_lists = st.lists(device_ids, max_size=6)


def expected_allocate(containers: Sequence[Sequence[str]]) -> grpc.StatusCode:
    """What the daemon must answer: the first container request that is wrong decides the code."""
    if not containers:
        return INVALID
    granted: set[str] = set()
    for ids in containers:
        if not ids or len(set(ids)) != len(ids):
            return INVALID
        if any(i not in PRESENT for i in ids):
            return grpc.StatusCode.NOT_FOUND
        if any(i in UNHEALTHY for i in ids):
            return grpc.StatusCode.FAILED_PRECONDITION
        if granted & set(ids):
            return INVALID  # one device for two containers of one call
        granted |= set(ids)
    return OK


@given(st.lists(id_lists, max_size=4))
@example([["sim-npu-0"], ["sim-npu-1", "sim-npu-0"]])  # one device for two containers
@example([["sim-npu-2"]])  # unhealthy
@example([["sim-npu-5"]])  # absent
def test_allocate_grants_exactly_what_the_request_justifies(
    daemon: FuzzDaemon, containers: list[list[str]]
) -> None:
    stub = pb_grpc.DevicePluginStub(daemon.npu)
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    try:
        response = stub.Allocate(request, timeout=10)
    except grpc.RpcError as err:
        assert err.code() == expected_allocate(containers), (err.code(), err.details(), containers)
        assert err.details(), "a refusal says why"
        return
    assert expected_allocate(containers) == OK, containers
    assert len(response.container_responses) == len(containers)
    for ids, answer in zip(containers, response.container_responses, strict=True):
        assert answer.envs["KXPU_VISIBLE_DEVICES"] == ",".join(ids)


@given(
    st.lists(
        st.tuples(
            id_lists,
            st.lists(
                st.sampled_from(sorted(PRESENT)) | device_ids, max_size=3
            ),  # mostly ours, as the kubelet
            st.integers(-1, 4) | st.integers(-(2**31), 2**31 - 1),
        ),
        max_size=3,
    )
)
@example([(["sim-npu-0"], ["sim-npu-0", "sim-npu-1"], 1)])  # more must-include devices than the size
@example([(["sim-npu-0", "sim-npu-0", "sim-npu-1"], [], 3)])  # an ID offered twice
def test_preferred_allocation_answers_only_from_what_was_offered(
    daemon: FuzzDaemon, containers: list[tuple[list[str], list[str], int]]
) -> None:
    stub = pb_grpc.DevicePluginStub(daemon.npu)
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
            for available, must, size in containers
        ]
    )
    expected = OK
    for _, must, size in containers:
        known_must = {i for i in must if i in PRESENT}
        if size <= 0 or len(known_must) > size:
            expected = INVALID
            break
    try:
        response = stub.GetPreferredAllocation(request, timeout=10)
    except grpc.RpcError as err:
        assert err.code() == expected == INVALID, (err.code(), err.details(), containers)
        return
    assert expected == OK, containers
    assert len(response.container_responses) == len(containers)
    for (available, must, size), answer in zip(containers, response.container_responses, strict=True):
        chosen = list(answer.deviceIDs)
        allowed = {i for i in [*available, *must] if i in PRESENT}
        assert len(chosen) == len(set(chosen)), chosen
        assert set(chosen) <= allowed, (chosen, allowed)
        assert {i for i in must if i in PRESENT} <= set(chosen)
        assert len(chosen) == min(size, len(allowed))


@given(st.lists(st.sampled_from(["ps-0", "ps-1", "ps-2", "sim-npu-0", ""]) | device_ids, max_size=4))
def test_pre_start_runs_only_for_known_devices(daemon: FuzzDaemon, ids: list[str]) -> None:
    stub = pb_grpc.DevicePluginStub(daemon.ps)
    try:
        stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=30)
    except grpc.RpcError as err:
        expected = INVALID if not ids else grpc.StatusCode.NOT_FOUND
        assert err.code() == expected, (err.code(), err.details(), ids)
        assert not ids or any(i not in ("ps-0", "ps-1") for i in ids), ids
        return
    assert ids and set(ids) <= {"ps-0", "ps-1"}, ids
    # A plugin that does not ask for pre-start answers anyway, with nothing done.
    pb_grpc.DevicePluginStub(daemon.npu).PreStartContainer(
        pb.PreStartContainerRequest(devices_ids=ids), timeout=5
    )


@given(st.lists(st.booleans(), min_size=1, max_size=4))
def test_every_list_and_watch_stream_starts_with_the_whole_list(
    daemon: FuzzDaemon, reads: list[bool]
) -> None:
    stub = pb_grpc.DevicePluginStub(daemon.npu)
    streams: list[Any] = [stub.ListAndWatch(pb.Empty(), timeout=10) for _ in reads]
    try:
        for stream, read in zip(streams, reads, strict=True):
            if not read:
                continue  # opened and dropped unread
            first = next(stream)
            devices = {d.ID: (d.health, [n.ID for n in d.topology.nodes]) for d in first.devices}
            assert devices == {
                f"sim-npu-{i}": ("Unhealthy" if f"sim-npu-{i}" in UNHEALTHY else "Healthy", [NUMA[i]])
                for i in range(8)
                if f"sim-npu-{i}" in PRESENT
            }
    finally:
        for stream in streams:
            stream.cancel()


METHODS = ["GetDevicePluginOptions", "Allocate", "GetPreferredAllocation", "PreStartContainer"]


@given(st.sampled_from([*METHODS, "ListAndWatch"]), st.binary(max_size=64))
def test_corrupt_requests_get_a_clear_error(daemon: FuzzDaemon, method: str, payload: bytes) -> None:
    """Bytes that are no message: gRPC refuses them itself ("Error parsing message"); anything that does
    parse must be answered as any request is."""
    path = f"/v1beta1.DevicePlugin/{method}"
    try:
        if method == "ListAndWatch":
            stream: Any = daemon.npu.unary_stream(path, None, None)(payload, timeout=5)
            next(stream)
            stream.cancel()
        else:
            daemon.npu.unary_unary(path, None, None)(payload, timeout=5)
    except grpc.RpcError as err:
        assert err.code() != grpc.StatusCode.INTERNAL, err.details()
        if err.code() == grpc.StatusCode.UNKNOWN:
            assert "Error parsing message" in (err.details() or ""), err.details()
        else:
            assert err.code() in (INVALID, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def _empty_with_unknown_field(size: int) -> bytes:
    """A valid Empty message carrying ``size`` bytes in an unknown field (number 15, length-delimited)."""
    length, varint = size, bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    return b"\x7a" + bytes(varint) + b"x" * size


def test_every_request_past_the_size_limit_is_refused(daemon: FuzzDaemon) -> None:
    huge = _empty_with_unknown_field(MAX_REQUEST_BYTES + 1)
    for method in [*METHODS, "ListAndWatch"]:
        path = f"/v1beta1.DevicePlugin/{method}"
        with pytest.raises(grpc.RpcError) as err:
            if method == "ListAndWatch":
                next(iter(daemon.npu.unary_stream(path, None, None)(huge, timeout=10)))
            else:
                daemon.npu.unary_unary(path, None, None)(huge, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (method, err.value.details())
    # Past gRPC's default 4 MiB but within the limit: answered (every ID of a big device list, offered).
    stub = pb_grpc.DevicePluginStub(daemon.npu)
    offered = [f"{n:060d}" for n in range(KUBELET_MAX_MESSAGE_BYTES // 62 + 1)] + ["sim-npu-0"]
    request = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=offered, allocation_size=1)
        ]
    )
    assert KUBELET_MAX_MESSAGE_BYTES < request.ByteSize() < MAX_REQUEST_BYTES
    assert list(stub.GetPreferredAllocation(request, timeout=30).container_responses[0].deviceIDs) == [
        "sim-npu-0"
    ]
    daemon.check()


def test_the_daemon_survived(daemon: FuzzDaemon) -> None:
    daemon.check()
    stub = pb_grpc.DevicePluginStub(daemon.npu)
    response = stub.Allocate(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["sim-npu-0"])]),
        timeout=5,
    )
    assert response.container_responses[0].envs["KXPU_VISIBLE_DEVICES"] == "sim-npu-0"

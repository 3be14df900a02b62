"""The pure sharing core: request parsing and defaults, fit, scoring, inventory codec, signing, bookkeeping."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kxpu.sharing import inventory as inv
from kxpu.sharing import signing
from kxpu.sharing.fit import Misfit, NodeState, Placement, fit_pod, usage_of
from kxpu.sharing.model import (
    Assignment,
    ContainerAssignment,
    ContainerRequest,
    DeviceGrant,
    NodeInventory,
    PodRequest,
    Policy,
)
from kxpu.sharing.requests import RequestError, ResourceFamily, parse_pod, parse_quantity
from kxpu.sharing.state import ClusterState
from kxpu.testing.sharing import inventory, pod

GPU = ResourceFamily.derived("nvidia.com/gpu")
NPU = ResourceFamily.derived("example.com/npu", default_memory_mib=2048)
KEY = b"k" * 32
OLD_KEY = b"o" * 32


# -- requests --------------------------------------------------------------------------------


def test_family_names_derive_from_the_count_resource() -> None:
    assert GPU.names == (
        "nvidia.com/gpu",
        "nvidia.com/gpumem",
        "nvidia.com/gpumem-percentage",
        "nvidia.com/gpucores",
    )
    assert NPU.memory == "example.com/npumem" and NPU.cores == "example.com/npucores"
    assert GPU.hami_annotation("use-type") == "nvidia.com/use-gputype"
    assert GPU.hami_annotation("nouse-uuid") == "nvidia.com/nouse-gpuuuid"
    assert NPU.hami_annotation("numa-bind") == "example.com/numa-bind"


def _one(p: dict[str, Any], families: list[ResourceFamily] | None = None) -> ContainerRequest:
    (request,) = parse_pod(p, families or [GPU])
    (container,) = request.containers
    return container


def test_count_only_means_whole_exclusive_devices() -> None:
    c = _one(pod(containers=[{"nvidia.com/gpu": 2}]))
    assert (c.count, c.memory_mib, c.memory_percentage, c.cores) == (2, None, 100, 100)
    assert c.exclusive


def test_count_only_without_exclusivity_uses_default_cores() -> None:
    family = dataclasses.replace(GPU, exclusive_when_count_only=False, default_cores=10)
    c = _one(pod(containers=[{"nvidia.com/gpu": 1}]), [family])
    assert (c.cores, c.memory_percentage) == (10, 100)


def test_memory_only_gets_the_default_count_and_cores() -> None:
    c = _one(pod(containers=[{"nvidia.com/gpumem": 3000}]))
    assert (c.count, c.memory_mib, c.cores) == (1, 3000, 0)


def test_default_memory_mib_applies_when_memory_is_missing() -> None:
    c = _one(pod(containers=[{"example.com/npu": 1, "example.com/npucores": 30}]), [NPU])
    assert (c.memory_mib, c.cores) == (2048, 30)


def test_percentage_and_containers_without_requests() -> None:
    (request,) = parse_pod(
        pod(containers=[{"nvidia.com/gpumem-percentage": 25, "nvidia.com/gpucores": 50}, {}]), [GPU]
    )
    assert [c.container for c in request.containers] == ["c0"]
    assert request.containers[0].memory_percentage == 25


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 101}, "0-100"),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10, "nvidia.com/gpumem-percentage": 5}, "not both"),
        ({"nvidia.com/gpu": 0, "nvidia.com/gpumem": 10}, "at least 1"),
        ({"nvidia.com/gpumem-percentage": 150}, "1-100"),
        ({"nvidia.com/gpumem": "1.5"}, "whole number"),
        ({"nvidia.com/gpumem": "lots"}, "not a quantity"),
    ],
)
def test_impossible_requests_are_refused(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_pod(pod(containers=[limits]), [GPU])


def test_requests_must_equal_limits_and_init_containers_are_refused() -> None:
    p = pod(containers=[{"nvidia.com/gpumem": 100}])
    p["spec"]["containers"][0]["resources"]["requests"] = {"nvidia.com/gpumem": "200"}
    with pytest.raises(RequestError, match="request and limit"):
        parse_pod(p, [GPU])
    p = pod(containers=[{}])
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
    with pytest.raises(RequestError, match="init container"):
        parse_pod(p, [GPU])


def test_quantities() -> None:
    assert parse_quantity("3k", "x") == 3000
    assert parse_quantity("1Ki", "x") == 1024
    assert parse_quantity(7, "x") == 7
    assert parse_quantity("2000m", "x") == 2


def test_annotations_kxpu_and_hami_names() -> None:
    p = pod(
        containers=[{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10}],
        annotations={
            "nvidia.com/use-gputype": "A100,H100",
            "kxpu.io/nouse-uuid": "GPU-1",
            "nvidia.com/nouse-gpuuuid": "ignored-because-kxpu-wins",
            "nvidia.com/numa-bind": "true",
            "hami.io/node-scheduler-policy": "spread",
            "kxpu.io/device-policy": "binpack",
        },
    )
    (request,) = parse_pod(p, [GPU])
    assert request.device_filter.use_types == {"a100", "h100"}
    assert request.device_filter.nouse_uuids == {"GPU-1"}
    assert request.numa_bind
    assert request.node_policy is Policy.SPREAD and request.device_policy is Policy.BINPACK
    with pytest.raises(RequestError, match="binpack, spread"):
        parse_pod(pod(annotations={"kxpu.io/node-policy": "random"}), [GPU])


def test_pods_without_shared_requests_are_not_ours() -> None:
    assert parse_pod(pod(containers=[{"cpu": 1}]), [GPU]) == []


# -- fit and scoring -------------------------------------------------------------------------


def _node(*inventories: NodeInventory, assignments: tuple[Assignment, ...] = ()) -> NodeState:
    return usage_of(assignments, {i.resource: i for i in inventories})


def _req(
    count: int = 1, memory: int | None = 1000, cores: int = 10, pct: int | None = None, **kw: Any
) -> PodRequest:
    return PodRequest("nvidia.com/gpu", (ContainerRequest("c0", count, memory, pct, cores),), **kw)


def _assign(placement: Placement | Misfit, uid: str = "u", node: str = "n") -> Assignment:
    assert isinstance(placement, Placement), placement
    return Assignment(uid, "default", uid, node, placement.containers, 0)


def test_fit_grants_memory_cores_and_distinct_devices() -> None:
    node = _node(inventory(count=4))
    result = fit_pod([_req(count=3, memory=4000, cores=25)], node)
    assert isinstance(result, Placement)
    (container,) = result.containers
    assert len({g.device for g in container.devices}) == 3
    assert all(g.memory_mib == 4000 and g.cores == 25 for g in container.devices)


def test_percentage_is_of_physical_memory() -> None:
    node = _node(inventory(count=1, memory_mib=16000, memory_scaling=2.0))
    result = fit_pod([_req(memory=None, pct=50)], node)
    assert isinstance(result, Placement) and result.containers[0].devices[0].memory_mib == 8000


def test_memory_cores_and_split_limits() -> None:
    node = _node(inventory(count=1, memory_mib=10000, split=2))
    a = _assign(fit_pod([_req(memory=6000, cores=60)], node), "a")
    node.apply(a)
    assert "not enough memory" in _misfit(fit_pod([_req(memory=5000, cores=10)], node))
    assert "not enough cores" in _misfit(fit_pod([_req(memory=1000, cores=50)], node))
    node.apply(_assign(fit_pod([_req(memory=1000, cores=10)], node), "b"))
    assert "split count reached" in _misfit(fit_pod([_req(memory=1, cores=0)], node))


def _misfit(result: Placement | Misfit) -> str:
    assert isinstance(result, Misfit), result
    return result.reason


def test_exclusive_needs_an_unused_device_and_blocks_others() -> None:
    node = _node(inventory(count=2))
    node.apply(_assign(fit_pod([_req(memory=100, cores=0)], node), "shared"))
    exclusive = fit_pod([_req(memory=100, cores=100)], node)
    assert isinstance(exclusive, Placement)
    shared_dev = next(iter(node.families["nvidia.com/gpu"]))
    assert exclusive.containers[0].devices[0].device != ("gpu-0" if shared_dev.slots else "gpu-1")
    node.apply(_assign(exclusive, "excl"))
    assert "exclusive" in _misfit(fit_pod([_req(memory=100, cores=100)], node))
    # the exclusively held device takes nothing more, even a zero-core share
    held = [s for s in node.families["nvidia.com/gpu"] if s.exclusive]
    assert len(held) == 1
    result = fit_pod([_req(memory=1, cores=0)], node)
    assert isinstance(result, Placement) and result.containers[0].devices[0].device != held[0].device.id


def test_core_overcommit_does_not_make_100_shareable() -> None:
    node = _node(inventory(count=1, core_scaling=2.0))
    node.apply(_assign(fit_pod([_req(cores=100)], node), "a"))
    assert isinstance(fit_pod([_req(cores=100)], node), Misfit)


def test_type_and_uuid_filters_and_unhealthy_devices() -> None:
    a100 = inventory(count=2, model="NVIDIA A100")
    t4 = inventory(count=2, model="Tesla T4")
    t4_devices = tuple(dataclasses.replace(d, id=f"t4-{d.index}", uuid=f"T4-{d.index}") for d in t4.devices)
    mixed = NodeInventory("nvidia.com/gpu", a100.devices + t4_devices)
    node = _node(mixed)
    only_t4 = parse_pod(
        pod(containers=[{"nvidia.com/gpumem": 10}], annotations={"nvidia.com/use-gputype": "t4"}), [GPU]
    )
    result = fit_pod(only_t4, node)
    assert isinstance(result, Placement) and result.containers[0].devices[0].device.startswith("t4-")
    not_uuid = parse_pod(
        pod(
            containers=[{"nvidia.com/gpu": 3, "nvidia.com/gpumem": 10}],
            annotations={"kxpu.io/nouse-uuid": "T4-0,GPU-00000000"},
        ),
        [GPU],
    )
    assert "excluded by type/uuid" in _misfit(fit_pod(not_uuid, node))
    sick = NodeInventory("nvidia.com/gpu", tuple(dataclasses.replace(d, healthy=False) for d in a100.devices))
    assert "2 unhealthy" in _misfit(fit_pod([_req()], _node(sick)))


def test_numa_bind_keeps_a_container_on_one_node() -> None:
    node = _node(inventory(count=4, numa=[0, 1, 1, 0]))
    node.apply(_assign(fit_pod([_req(count=1, memory=16384, cores=0)], node), "fill"))  # one device now full
    result = fit_pod([_req(count=2, numa_bind=True)], node)
    assert isinstance(result, Placement)
    numa = {d.device.id: d.device.numa for d in node.families["nvidia.com/gpu"]}
    assert len({numa[g.device] for g in result.containers[0].devices}) == 1
    assert isinstance(fit_pod([_req(count=3, numa_bind=True)], node), Misfit)
    assert isinstance(fit_pod([_req(count=3)], node), Placement)


def test_device_policies_binpack_and_spread() -> None:
    node = _node(inventory(count=2))
    node.apply(_assign(fit_pod([_req(memory=1000)], node), "first"))
    used = next(s.device.id for s in node.families["nvidia.com/gpu"] if s.slots)
    packed = fit_pod([_req(device_policy=Policy.BINPACK)], node)
    spread = fit_pod([_req(device_policy=Policy.SPREAD)], node)
    assert isinstance(packed, Placement) and isinstance(spread, Placement)
    assert packed.containers[0].devices[0].device == used
    assert spread.containers[0].devices[0].device != used


def test_node_scores_order_busy_and_idle_nodes_by_policy() -> None:
    idle, busy = _node(inventory(count=2)), _node(inventory(count=2))
    busy.apply(_assign(fit_pod([_req(count=2, memory=8000, cores=50)], busy), "x"))
    for policy, better in ((Policy.BINPACK, busy), (Policy.SPREAD, idle)):
        scores = {}
        for name, node in (("idle", idle), ("busy", busy)):
            result = fit_pod([_req(memory=1000)], node, node_policy=policy)
            assert isinstance(result, Placement) and 0 <= result.score <= 10
            scores[name] = result.score
        best = max(scores, key=lambda k: scores[k])
        assert (idle if best == "idle" else busy) is better


def test_containers_of_one_pod_see_each_other() -> None:
    node = _node(inventory(count=1, memory_mib=10000))
    two = PodRequest(
        "nvidia.com/gpu",
        (ContainerRequest("a", 1, 6000, None, 10), ContainerRequest("b", 1, 6000, None, 10)),
    )
    assert "not enough memory" in _misfit(fit_pod([two], node))


def test_two_families_on_one_node() -> None:
    node = _node(inventory(count=1), inventory(resource="example.com/npu", count=1, prefix="npu"))
    requests = parse_pod(pod(containers=[{"nvidia.com/gpumem": 10, "example.com/npumem": 20}]), [GPU, NPU])
    result = fit_pod(requests, node)
    assert isinstance(result, Placement)
    assert {(c.resource, c.devices[0].device) for c in result.containers} == {
        ("nvidia.com/gpu", "gpu-0"),
        ("example.com/npu", "npu-0"),
    }
    assert "no example.com/npu devices" in _misfit(fit_pod(requests, _node(inventory(count=1))))


# -- inventory codec -------------------------------------------------------------------------


def test_inventory_round_trip_and_key() -> None:
    original = inventory(count=3, numa=[0, None, 1])
    assert inv.decode(inv.encode(original), "nvidia.com/gpu") == original
    assert inv.annotation_key("nvidia.com/gpu") == "kxpu.io/devices.nvidia.com_gpu"
    long_key = inv.annotation_key("a" * 60 + ".com/" + "b" * 60)
    assert len(long_key.split("/", 1)[1]) <= 63


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version="v9"), "not supported"),
        (lambda d: d.update(extra=1), "unknown keys"),
        (lambda d: d["devices"][0].update(splitCount=0), "splitCount"),
        (lambda d: d["devices"][0].update(memoryMiB="16"), "memoryMiB: expected int"),
        (lambda d: d["devices"][0].update(healthy=1), "healthy: expected bool"),
        (lambda d: d["devices"][0].update(index=True), "boolean"),
        (lambda d: d["devices"][0].pop("uuid"), "uuid: missing"),
        (lambda d: d["devices"].append(dict(d["devices"][0])), "duplicate"),
        (lambda d: d.update(resource="other.com/x"), "expected 'nvidia.com/gpu'"),
        (lambda d: d["devices"][0].update(coreCapacity=-1), "negative"),
    ],
)
def test_inventory_decoding_is_strict(mutate: Any, message: str) -> None:
    doc = json.loads(inv.encode(inventory(count=2)))
    mutate(doc)
    with pytest.raises(inv.InventoryError, match=message):
        inv.decode(json.dumps(doc), "nvidia.com/gpu")
    with pytest.raises(inv.InventoryError, match="not JSON"):
        inv.decode("{", None)


# -- signing ---------------------------------------------------------------------------------


ASSIGNMENT = Assignment(
    "uid-1",
    "ns",
    "p",
    "node-a",
    (ContainerAssignment("c0", "nvidia.com/gpu", (DeviceGrant("gpu-0", "GPU-0", 3000, 30),)),),
    1_000_000,
)


def _verify(assignment: str, signature: str, keys: list[bytes] | None = None, **kw: Any) -> Assignment:
    args: dict[str, Any] = dict(
        pod_uid="uid-1", namespace="ns", name="p", node="node-a", now=1_000_010, max_age_s=600
    )
    args.update(kw)
    return signing.verify(assignment, signature, keys or [KEY], **args)


def test_sign_and_verify_round_trip_with_rotation() -> None:
    text = signing.encode_assignment(ASSIGNMENT)
    assert signing.decode_assignment(text) == ASSIGNMENT
    sig = signing.sign(ASSIGNMENT, [OLD_KEY])
    assert _verify(text, sig, [KEY, OLD_KEY]) == ASSIGNMENT  # old key still verifies after rotation
    assert signing.sign(ASSIGNMENT, [KEY, OLD_KEY]).split(".")[1] == signing.key_id(KEY)  # first signs
    with pytest.raises(signing.SignatureError, match="unknown HMAC key"):
        _verify(text, sig, [KEY])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pod_uid": "uid-2"}, "UID"),
        ({"node": "node-b"}, "node"),
        ({"name": "q"}, "pod ns/p"),
        ({"now": 1_000_000 + 601}, "stale"),
        ({"now": 1_000_000 - 120}, "future"),
    ],
)
def test_verify_refuses_the_wrong_pod_node_or_time(change: dict[str, Any], message: str) -> None:
    text = signing.encode_assignment(ASSIGNMENT)
    with pytest.raises(signing.SignatureError, match=message):
        _verify(text, signing.sign(ASSIGNMENT, [KEY]), **change)


def test_verify_refuses_tampering_and_garbage() -> None:
    sig = signing.sign(ASSIGNMENT, [KEY])
    more = dataclasses.replace(
        ASSIGNMENT,
        containers=(ContainerAssignment("c0", "nvidia.com/gpu", (DeviceGrant("gpu-0", "GPU-0", 9000, 30),)),),
    )
    with pytest.raises(signing.SignatureError, match="forged or altered"):
        _verify(signing.encode_assignment(more), sig)
    with pytest.raises(signing.SignatureError, match="forged or altered"):
        _verify(
            signing.encode_assignment(ASSIGNMENT),
            signing.sign(ASSIGNMENT, [b"x" * 32]).replace(signing.key_id(b"x" * 32), signing.key_id(KEY)),
        )
    with pytest.raises(signing.SignatureError, match=r"no kxpu\.io/assignment"):
        _verify("", sig)
    with pytest.raises(signing.SignatureError, match="expected keys"):
        _verify('{"uid": "uid-1"}', sig)
    with pytest.raises(signing.SignatureError, match="form"):
        _verify(signing.encode_assignment(ASSIGNMENT), "v9.abc.def")
    with pytest.raises(ValueError, match="at least 32"):
        signing.sign(ASSIGNMENT, [b"short"])


def test_parse_keys() -> None:
    keys = signing.parse_keys("# current first\n" + "a" * 32 + "\n\n" + "b" * 40 + "\n")
    assert keys == [b"a" * 32, b"b" * 40]
    with pytest.raises(ValueError):
        signing.parse_keys("\n")


# -- bookkeeping -----------------------------------------------------------------------------


def test_state_counts_assumed_then_watched_assignments_once() -> None:
    state = ClusterState(["nvidia.com/gpu"])
    state.set_node("n", {inv.annotation_key("nvidia.com/gpu"): inv.encode(inventory(count=1))})
    node = state.node("n")
    assert node is not None
    a = _assign(fit_pod([_req(memory=4000, cores=40)], node), "a")
    state.assume(a)
    assert node.families["nvidia.com/gpu"][0].memory == 4000
    state.set_pod("a", a)  # the watch shows our own bind
    assert node.families["nvidia.com/gpu"][0].memory == 4000
    state.remove_pod("a")
    assert node.families["nvidia.com/gpu"][0].memory == 0
    state.assume(a)
    state.forget("a")
    assert node.families["nvidia.com/gpu"][0].memory == 0


def test_state_recounts_when_the_inventory_changes_and_ignores_heartbeats() -> None:
    state = ClusterState(["nvidia.com/gpu"])
    key = inv.annotation_key("nvidia.com/gpu")
    state.set_pod(
        "a",
        Assignment(
            "a",
            "d",
            "a",
            "n",
            (ContainerAssignment("c", "nvidia.com/gpu", (DeviceGrant("gpu-0", "GPU-0", 100, 10),)),),
            0,
        ),
    )  # pod seen before its node
    state.set_node("n", {key: inv.encode(inventory(count=2))})
    node = state.node("n")
    assert node is not None and node.families["nvidia.com/gpu"][0].memory == 100
    version = node.version
    state.set_node("n", {key: inv.encode(dataclasses.replace(inventory(count=2), published_at=1.0))})
    assert node.version == version
    state.set_node("n", {key: "garbage"})
    assert "nvidia.com/gpu" not in node.families


def test_a_re_created_node_never_shows_a_version_of_its_predecessor() -> None:
    from kxpu.sharing.scheduler import Scheduler

    state = ClusterState(["nvidia.com/gpu"])
    key = inv.annotation_key("nvidia.com/gpu")
    scheduler = Scheduler(state, [GPU], keys=lambda: [KEY])
    big = pod("p", [{"nvidia.com/gpumem": 8000}])
    seen: set[int] = set()
    for memory in (16384, 2000, 16384, 2000):
        state.set_node("n", {key: inv.encode(inventory(count=1, memory_mib=memory))})
        node = state.node("n")
        assert node is not None and node.version not in seen
        seen.add(node.version)
        # the fit memo is keyed by (node, version): a fit of the old node must not be reused
        assert (scheduler.filter(big, ["n"]).passed == ["n"]) == (memory == 16384)
        state.remove_node("n")
    state.set_node("n", {})  # re-created without an inventory yet
    node = state.node("n")
    assert node is not None and node.version not in seen


def test_state_drops_stale_inventories() -> None:
    now = [0.0]
    state = ClusterState(["nvidia.com/gpu"], stale_after_s=120, clock=lambda: now[0])
    state.set_node("n", {inv.annotation_key("nvidia.com/gpu"): inv.encode(inventory(count=1))})
    now[0] = 121
    node = state.node("n")
    assert node is not None and not node.families


def test_nodes_answers_what_node_answers_family_by_family() -> None:
    """``nodes`` (filter's lookup for every node) settles fresh nodes by their oldest refresh only."""
    now = [0.0]
    state = ClusterState(["nvidia.com/gpu", "example.com/npu"], stale_after_s=120, clock=lambda: now[0])
    gpu, npu = inv.annotation_key("nvidia.com/gpu"), inv.annotation_key("example.com/npu")
    gpus = inv.encode(inventory(count=1))
    npus = inv.encode(inventory("example.com/npu", count=1, prefix="npu"))
    state.set_node("n", {gpu: gpus})
    now[0] = 100
    state.set_node("n", {gpu: gpus, npu: npus})  # the NPUs appear later: the GPUs' refresh is the oldest
    state.set_node("m", {})

    def families() -> list[set[str] | None]:
        views = state.nodes(["n", "m", "gone"])
        assert [v and (v.version, set(v.families)) for v in views] == [
            v and (v.version, set(v.families)) for v in (state.node("n"), state.node("m"), state.node("gone"))
        ]
        return [None if v is None else set(v.families) for v in views]

    assert families() == [{"nvidia.com/gpu", "example.com/npu"}, set(), None]
    now[0] = 121  # the GPUs' inventory is stale, the NPUs' is not
    assert families() == [{"example.com/npu"}, set(), None]
    assert (view := state.nodes(["n"])[0]) is not None and view.version == -1  # a copy: never memoized
    state.set_node(
        "n", {gpu: inv.encode(dataclasses.replace(inventory(count=1), published_at=5.0)), npu: npus}
    )
    assert families() == [{"nvidia.com/gpu", "example.com/npu"}, set(), None]  # a heartbeat refreshed them
    now[0] = 221
    assert families() == [{"nvidia.com/gpu"}, set(), None]


# -- the property: nothing is ever over-committed -------------------------------------------


container_st = st.builds(
    lambda count, memory, pct, cores: (count, memory, pct, cores),
    st.integers(1, 3),
    st.one_of(st.none(), st.integers(1, 20000)),
    st.one_of(st.none(), st.integers(1, 100)),
    st.sampled_from([0, 1, 10, 30, 50, 99, 100]),
)
op_st = st.one_of(
    st.tuples(
        st.just("add"),
        st.lists(container_st, min_size=1, max_size=3),
        st.sampled_from(list(Policy)),
        st.sampled_from(list(Policy)),
        st.booleans(),
    ),
    st.tuples(st.just("remove"), st.integers(0, 50)),
    st.tuples(st.just("forget"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(
        st.tuples(
            st.integers(1, 4),
            st.integers(1, 4),
            st.sampled_from([1.0, 1.5, 2.0]),
            st.sampled_from([1.0, 2.0]),
        ),
        min_size=1,
        max_size=3,
    ),
    ops=st.lists(op_st, max_size=40),
)
def test_no_device_is_ever_overcommitted(
    nodes: list[tuple[int, int, float, float]], ops: list[tuple[Any, ...]]
) -> None:
    state = ClusterState(["nvidia.com/gpu"])
    for n, (count, split, mem_scale, core_scale) in enumerate(nodes):
        state.set_inventory(
            f"n{n}",
            inventory(
                count=count, split=split, memory_mib=16000, memory_scaling=mem_scale, core_scaling=core_scale
            ),
        )
    live: list[Assignment] = []
    serial = 0
    for op in ops:
        if op[0] == "add":
            _, containers, node_policy, device_policy, numa = op
            limits = []
            for count, memory, pct, cores in containers:
                c: dict[str, int] = {"nvidia.com/gpu": count, "nvidia.com/gpucores": cores}
                if memory is not None:
                    c["nvidia.com/gpumem"] = memory
                elif pct is not None:
                    c["nvidia.com/gpumem-percentage"] = pct
                limits.append(c)
            annotations = {"kxpu.io/device-policy": device_policy.value}
            if numa:
                annotations["kxpu.io/numa-bind"] = "true"
            requests = parse_pod(pod(containers=limits, annotations=annotations), [GPU])
            # like the extender: every node that fits, then the best by score, then bind's re-check
            fits = []
            for name in state.node_names:
                node = state.node(name)
                assert node is not None
                result = fit_pod(requests, node, node_policy=node_policy)
                if isinstance(result, Placement):
                    fits.append((result.score, name, result))
            if fits:
                _, name, placement = max(fits, key=lambda f: (f[0], f[1]))
                serial += 1
                a = Assignment(f"p{serial}", "d", f"p{serial}", name, placement.containers, 0)
                state.assume(a)
                if serial % 2:
                    state.set_pod(a.pod_uid, a)  # the watch delivers it for half of them
                live.append(a)
        elif live:
            victim = live.pop(op[1] % len(live))
            if op[0] == "remove":
                state.remove_pod(victim.pod_uid)
            else:  # a failed bind: forget the assumption, and the pod never shows up
                state.forget(victim.pod_uid)
                state.remove_pod(victim.pod_uid)
        _check_invariants(state, live)


def _check_invariants(state: ClusterState, live: list[Assignment]) -> None:
    expected: dict[tuple[str, str], list[int]] = {}
    for a in live:
        for c in a.containers:
            assert len({g.device for g in c.devices}) == len(c.devices)
            for g in c.devices:
                e = expected.setdefault((a.node, g.device), [0, 0, 0, 0])
                e[0] += g.memory_mib
                e[1] += g.cores
                e[2] += 1
                e[3] += g.cores >= 100
    for name in state.node_names:
        node = state.node(name)
        assert node is not None
        for s in node.families["nvidia.com/gpu"]:
            d = s.device
            assert [s.memory, s.cores, s.slots, s.exclusive] == expected.get((name, d.id), [0, 0, 0, 0])
            assert s.memory <= d.memory_capacity_mib
            assert s.cores <= d.core_capacity
            assert s.slots <= d.split_count
            assert s.exclusive == 0 or s.slots == 1


@settings(max_examples=200, deadline=None)
@given(
    usage=st.lists(
        st.tuples(st.integers(0, 16000), st.integers(0, 100), st.integers(0, 4), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    count=st.integers(1, 3),
    memory=st.integers(1, 16000),
    cores=st.sampled_from([0, 10, 50, 100]),
    policy=st.sampled_from(list(Policy)),
)
def test_the_fast_path_chooses_what_the_full_scan_chooses(
    usage: list[tuple[int, int, int, bool]], count: int, memory: int, cores: int, policy: Policy
) -> None:
    from kxpu.sharing.fit import fit_container

    node = _node(inventory(count=len(usage), memory_mib=16000, split=4))
    for state, (mem, cor, slots, healthy) in zip(node.families["nvidia.com/gpu"], usage, strict=True):
        state.memory, state.cores, state.slots = mem, cor, slots
        state.usable = healthy
    node.version += 1
    request = _req(count=count, memory=memory, cores=cores, device_policy=policy)
    fast = fit_pod([request], node)
    full = fit_container(
        node.families["nvidia.com/gpu"], request.containers[0], request.device_filter, False, policy, {}
    )
    if isinstance(full, str):
        assert isinstance(fast, Misfit)
        return
    assert isinstance(fast, Placement)

    def utils(ids: list[str]) -> list[float]:
        by_id = {s.device.id: s for s in node.families["nvidia.com/gpu"]}
        return sorted(round(by_id[i].utilization(), 9) for i in ids)

    assert utils([g.device for g in fast.containers[0].devices]) == utils([s.device.id for s, _ in full])


mostly = st.sampled_from([True, True, True, False])


@settings(max_examples=1000, deadline=None)
@given(
    usage=st.lists(  # per device: memory, cores, containers, held exclusively, healthy
        st.tuples(
            st.integers(0, 20000), st.integers(0, 110), st.integers(0, 4), mostly.map(lambda b: not b), mostly
        ),
        max_size=5,
    ),
    split=st.integers(1, 4),
    memory_scaling=st.sampled_from([1.0, 1.5]),
    core_scaling=st.sampled_from([1.0, 2.0]),
    # mostly pods that the summary answers; the others must reach fit_pod
    variant=st.sampled_from(
        ["plain"] * 5 + ["numa", "two containers", "uuid filter", "mixed", "two families"]
    ),
    pod_policy=st.one_of(st.none(), st.sampled_from(list(Policy))),
    node_policy=st.sampled_from(list(Policy)),
    device_policy=st.sampled_from(list(Policy)),
    data=st.data(),
)
def test_the_quick_scorer_never_rejects_what_fit_pod_accepts_and_scores_it_the_same(
    usage: list[tuple[int, int, int, bool, bool]],
    split: int,
    memory_scaling: float,
    core_scaling: float,
    variant: str,
    pod_policy: Policy | None,
    node_policy: Policy,
    device_policy: Policy,
    data: st.DataObject,
) -> None:
    """Filter and prioritize answer from a node's summary (fit_scorer); bind places with fit_pod.

    Whatever the usage, a node the summary rejects fit_pod rejects too, with the same reason,
    and one it accepts gets fit_pod's score to the bit; again after grants move its version.
    Requests are drawn around what the devices have left, so that they meet the limits exactly.
    """
    from kxpu.sharing.fit import fit_scorer
    from kxpu.sharing.model import DeviceFilter

    family = inventory(
        count=len(usage),
        memory_mib=16000,
        split=split,
        memory_scaling=memory_scaling,
        core_scaling=core_scaling,
    )
    devices = [dataclasses.replace(d, healthy=u[4]) for d, u in zip(family.devices, usage, strict=True)]
    if variant == "mixed" and devices:  # one device unlike the others: the family takes the full scan
        devices[0] = dataclasses.replace(devices[0], memory_mib=8000, memory_capacity_mib=8000)
    node = _node(NodeInventory("nvidia.com/gpu", tuple(devices)))
    states = node.families["nvidia.com/gpu"]
    for state, (memory, cores, slots, exclusive, _) in zip(states, usage, strict=True):
        state.memory, state.cores, state.slots, state.exclusive = memory, cores, slots, int(exclusive)
    node.version += 1

    left = [
        (s.memory_capacity - s.memory + d, s.core_capacity - s.cores + d) for s in states for d in (-1, 0, 1)
    ]
    memory_st = st.integers(1, 20000) | st.sampled_from([m for m, _ in left if m > 0] or [1])
    cores_st = st.sampled_from([0, 10, 50, 100]) | st.sampled_from(
        [c for _, c in left if 0 <= c <= 100] or [0]
    )
    container_st = st.tuples(
        st.integers(1, 3),
        st.none() | memory_st,
        st.sampled_from([25, 50, 100]) | st.integers(1, 100),
        cores_st,
    )
    containers = data.draw(
        st.lists(container_st, min_size=1, max_size=2 if variant == "two containers" else 1)
    )
    avoid = {devices[0].uuid} if variant == "uuid filter" and devices else set()
    requests = [
        PodRequest(
            "nvidia.com/gpu",
            tuple(
                ContainerRequest(f"c{i}", count, memory, None if memory is not None else pct, cores)
                for i, (count, memory, pct, cores) in enumerate(containers)
            ),
            device_filter=DeviceFilter(nouse_uuids=frozenset(avoid)),
            numa_bind=variant == "numa",
            node_policy=pod_policy,
        )
    ]
    if variant == "two families":
        requests.append(PodRequest("example.com/npu", (ContainerRequest("c9", 1, 100, None, 0),)))
    score = fit_scorer(requests, node_policy, device_policy)
    for _ in range(3):
        expected = fit_pod(requests, node, node_policy, device_policy)
        answer = score(node)
        if isinstance(expected, Misfit):
            assert answer == expected
            return
        assert answer == expected.score
        node.apply(expected.containers)  # the node changes: its summary must follow


def _assigned_pod(
    assignment: Assignment,
    keys: signing.Keys,
    phase: str = "Running",
    node: str | None = "node-a",
    limits: dict[str, str] | None = None,
) -> Any:
    from lightkube.models.core_v1 import Container, PodSpec, PodStatus, ResourceRequirements
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Pod

    annotations = {
        signing.ASSIGNMENT_ANNOTATION: signing.encode_assignment(assignment),
        signing.SIGNATURE_ANNOTATION: signing.sign(assignment, keys),
    }
    container = Container(name="c0", resources=ResourceRequirements(limits=limits or {"nvidia.com/gpu": "1"}))
    return Pod(
        metadata=ObjectMeta(name=assignment.name, namespace=assignment.namespace, uid=assignment.pod_uid,
                            annotations=annotations),
        spec=PodSpec(containers=[container], nodeName=node),
        status=PodStatus(phase=phase),
    )  # fmt: skip


def test_the_informer_counts_only_live_verified_assignments() -> None:
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Pod

    from kxpu.kube.sharing.informer import live_assignment

    def make(phase: str = "Running", node: str | None = "node-a", keys: list[bytes] | None = None) -> Any:
        a = dataclasses.replace(ASSIGNMENT, pod_uid="uid-1", namespace="ns", name="p")
        return _assigned_pod(a, keys or [KEY], phase, node)

    assert live_assignment(make(), [KEY]) == ASSIGNMENT  # old assignments still count: no age limit
    assert live_assignment(make(phase="Succeeded"), [KEY]) is None
    assert live_assignment(make(node="node-b"), [KEY]) is None
    assert live_assignment(make(node=None), [KEY]) is None  # annotated, never bound: holds nothing
    assert live_assignment(make(keys=[OLD_KEY]), [KEY]) is None
    assert live_assignment(Pod(metadata=ObjectMeta(name="q", namespace="ns", uid="u")), [KEY]) is None


def test_an_assignment_beyond_what_the_pod_asks_is_not_counted() -> None:
    """The HMAC → Ed25519 window: nodes already refuse HMAC, the extender still verifies it (for pods bound
    before). An HMAC key a node read earlier mints 8 whole GPUs on a pod that asks for none (no Allocate ever
    comes, so no node refuses it) or for one: the extender must not pin them as used."""
    from kxpu.kube.sharing.informer import live_assignment

    hmac_key = b"h" * 32
    extender = signing.parse_keyring(
        signing.generate_private_pem().encode() + b"\n" + hmac_key + b"\n"
    )  # ed25519+hmac: signs Ed25519, still verifies HMAC
    eight = tuple(DeviceGrant(f"gpu-{i}", f"GPU-{i}", 16384, 100) for i in range(8))
    forged = Assignment(
        "uid-x", "ns", "x", "node-a", (ContainerAssignment("c0", "nvidia.com/gpu", eight),), 1
    )
    for limits in ({"cpu": "1"}, {"nvidia.com/gpu": "1"}):
        pod = _assigned_pod(forged, [hmac_key], limits=limits)
        assert live_assignment(pod, extender) is None, limits
    other_container = dataclasses.replace(
        forged, containers=(ContainerAssignment("c9", "nvidia.com/gpu", eight[:1]),)
    )
    assert live_assignment(_assigned_pod(other_container, [hmac_key]), extender) is None
    # what the extender grants (one device for a container asking one) counts, HMAC-signed or Ed25519
    honest = dataclasses.replace(forged, containers=(ContainerAssignment("c0", "nvidia.com/gpu", eight[:1]),))
    assert live_assignment(_assigned_pod(honest, [hmac_key]), extender) == honest
    assert live_assignment(_assigned_pod(honest, extender), extender) == honest
    state = ClusterState(["nvidia.com/gpu"])
    state.set_inventory("node-a", inventory(count=8))
    state.set_pod("uid-x", live_assignment(_assigned_pod(forged, [hmac_key], limits={"cpu": "1"}), extender))
    node = state.node("node-a")
    assert node is not None and all(s.memory == 0 for s in node.families["nvidia.com/gpu"])

"""The extender's HTTP API as kube-scheduler calls it (extender/v1 JSON), over an in-memory cluster."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kxpu.sharing import inventory as inv
from kxpu.sharing import signing
from kxpu.sharing.extender import make_app
from kxpu.sharing.placement import NodeFacts
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import Scheduler
from kxpu.sharing.state import ClusterState
from kxpu.testing.sharing import FakeCluster, inventory, pod

GPU = ResourceFamily.derived("nvidia.com/gpu")
NODES = ["idle", "busy", "small", "bare"]


@pytest.fixture
async def setup() -> AsyncIterator[tuple[TestClient[Any, Any], Scheduler, FakeCluster]]:
    cluster = FakeCluster()
    state = ClusterState(["nvidia.com/gpu"])
    key = inv.annotation_key("nvidia.com/gpu")
    state.set_node("idle", {key: inv.encode(inventory(count=2))})
    state.set_node("busy", {key: inv.encode(inventory(count=2))})
    state.set_node("small", {key: inv.encode(inventory(count=1, memory_mib=2000))})
    state.set_node("bare", {})
    scheduler = Scheduler(state, [GPU], keys=lambda: cluster.keyring, api=cluster)
    # make "busy" busy
    cluster.add_pod(pod("filler", [{"nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 50}]))
    assert await scheduler.bind("default", "filler", "uid-default-filler", "busy") == ""
    await cluster.release_lock("busy", "nvidia.com/gpu", _ref("filler"))
    state.set_node("busy", {key: inv.encode(inventory(count=2))})  # the node watch: the lock is gone
    ready = {"synced": False}
    client = TestClient(TestServer(make_app(scheduler, lambda: ready["synced"])))
    await client.start_server()
    ready["synced"] = True
    yield client, scheduler, cluster
    await client.close()


def _ref(name: str) -> Any:
    from kxpu.sharing.scheduler import PodRef

    return PodRef("default", name, f"uid-default-{name}")


async def test_filter_returns_every_fitting_node_and_says_why_others_fail(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    p = pod("p", [{"nvidia.com/gpumem": 4000, "nvidia.com/gpucores": 30}])
    response = await client.post("/filter", json={"Pod": p, "NodeNames": [*NODES, "unknown"]})
    assert response.status == 200
    body = await response.json()
    assert body["NodeNames"] == ["idle", "busy"]
    assert "not enough memory" in body["FailedNodes"]["small"]
    assert set(body["FailedAndUnresolvableNodes"]) == {"bare", "unknown"}
    assert body["Error"] == ""


async def test_filter_with_full_node_objects(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    items = [{"metadata": {"name": n, "labels": {"x": n}}} for n in NODES]
    p = pod("p", [{"nvidia.com/gpumem": 100}])
    body = await (await client.post("/filter", json={"pod": p, "nodes": {"items": items}})).json()
    assert [i["metadata"]["name"] for i in body["Nodes"]["items"]] == ["idle", "busy", "small"]
    assert body["Nodes"]["items"][0]["metadata"]["labels"] == {"x": "idle"}  # objects returned as sent


async def test_prioritize_scores_by_policy_and_annotation(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    p = pod("p", [{"nvidia.com/gpumem": 1000}])
    scores = await (await client.post("/prioritize", json={"Pod": p, "NodeNames": ["idle", "busy"]})).json()
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["busy"] > by_host["idle"]  # binpack by default
    assert all(0 <= s <= 10 for s in by_host.values())
    spread = pod("q", [{"nvidia.com/gpumem": 1000}], annotations={"kxpu.io/node-policy": "spread"})
    scores = await (
        await client.post("/prioritize", json={"Pod": spread, "NodeNames": ["idle", "busy"]})
    ).json()
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["idle"] > by_host["busy"]


async def test_a_locked_node_scores_zero_until_its_lock_is_released(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    """A bind there would wait for the lock holder's Allocate: kube-scheduler should prefer another node."""
    client, scheduler, cluster = setup
    p = pod("p", [{"nvidia.com/gpumem": 1000}])
    before = await (await client.post("/prioritize", json={"Pod": p, "NodeNames": ["busy"]})).json()
    assert before[0]["Score"] > 0
    cluster.add_pod(pod("next", [{"nvidia.com/gpumem": 1000}]))
    assert await scheduler.bind("default", "next", "uid-default-next", "busy") == ""
    after = await (await client.post("/prioritize", json={"Pod": p, "NodeNames": ["busy"]})).json()
    assert after[0]["Score"] == 0  # locked by "next" until its Allocate
    key = inv.annotation_key("nvidia.com/gpu")
    scheduler.state.set_node("busy", {key: inv.encode(inventory(count=2))})  # the watch: lock released
    released = await (await client.post("/prioritize", json={"Pod": p, "NodeNames": ["busy"]})).json()
    assert released[0]["Score"] > 0


async def test_pods_not_asking_for_shared_devices_pass_untouched(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    p = pod("plain", [{"cpu": 1}])
    body = await (await client.post("/filter", json={"Pod": p, "NodeNames": NODES})).json()
    assert body["NodeNames"] == NODES
    scores = await (await client.post("/prioritize", json={"Pod": p, "NodeNames": NODES})).json()
    assert {s["Score"] for s in scores} == {0}


def test_prioritize_writes_the_json_that_json_dumps_would() -> None:
    import json

    from kxpu.sharing.extender import _scores_json

    scores = [("node-a", 10), ('o"dd\\name', 0), ("nöde-☃", 7)]
    response = _scores_json(scores)
    assert response.content_type == "application/json" and isinstance(response.body, bytes)
    assert (
        response.body
        == json.dumps([{"Host": h, "Score": s} for h, s in scores], separators=(",", ":")).encode()
    )
    assert _scores_json([]).body == b"[]"


async def test_impossible_requests_fail_every_node(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    p = pod("p", [{"nvidia.com/gpu": 1, "nvidia.com/gpucores": 300}])
    body = await (await client.post("/filter", json={"Pod": p, "NodeNames": NODES})).json()
    assert body["NodeNames"] == [] and all("0-100" in r for r in body["FailedAndUnresolvableNodes"].values())


async def test_bind_writes_a_signed_assignment_and_binds(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, cluster = setup
    cluster.add_pod(pod("p", [{"nvidia.com/gpumem": 1000}]))
    args = {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "idle"}
    body = await (await client.post("/bind", json=args)).json()
    assert body == {"Error": ""}
    stored = cluster.pods[("default", "p")]
    assert stored["spec"]["nodeName"] == "idle"
    annotations = stored["metadata"]["annotations"]
    assignment = signing.verify(
        annotations[signing.ASSIGNMENT_ANNOTATION],
        annotations[signing.SIGNATURE_ANNOTATION],
        cluster.keyring,
        pod_uid="uid-default-p",
        namespace="default",
        name="p",
        node="idle",
        now=assignment_time(annotations),
        max_age_s=60,
    )
    assert assignment.containers[0].devices[0].memory_mib == 1000
    wrong_uid = dict(args, PodUID="other")
    body = await (await client.post("/bind", json=wrong_uid)).json()
    assert "replaced" in body["Error"]


def assignment_time(annotations: dict[str, str]) -> float:
    return float(signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).issued_at)


async def test_bad_requests_and_probes(setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster]) -> None:
    client, _, _ = setup
    assert (await client.post("/filter", data=b"{nope")).status == 400
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200


async def test_reused_fits_see_binds_between_pods_of_one_shape(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, scheduler, cluster = setup
    limits = [{"nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 60}]
    for n in range(2):  # the two devices of "idle" take one each; the same shape then no longer fits there
        p = pod(f"r{n}", limits)
        body = await (await client.post("/filter", json={"Pod": p, "NodeNames": NODES})).json()
        assert "idle" in body["NodeNames"]
        cluster.add_pod(p)
        assert await scheduler.bind("default", f"r{n}", f"uid-default-r{n}", "idle") == ""
        await cluster.release_lock("idle", "nvidia.com/gpu", _ref(f"r{n}"))
    body = await (await client.post("/filter", json={"Pod": pod("r2", limits), "NodeNames": NODES})).json()
    assert "idle" not in body["NodeNames"]
    assert "2 not enough cores" in body["FailedNodes"]["idle"]


async def test_a_bind_records_what_was_assigned(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    _, scheduler, cluster = setup
    cluster.add_pod(pod("e", [{"nvidia.com/gpumem": 1234, "nvidia.com/gpucores": 5}]))
    assert await scheduler.bind("default", "e", "uid-default-e", "idle") == ""
    await scheduler.settled()  # the event is posted off the bind's path
    (event,) = [e for e in cluster.events if e[0] == "default/e"]
    assert event[1] == "KxpuAssigned" and "1234 MiB, 5% cores" in event[2]


async def test_bind_grants_what_the_api_servers_pod_asks_not_what_filter_was_sent(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    """A forged /filter body (same name and UID, asking a whole device) must not become the signed grant."""
    client, scheduler, cluster = setup
    reads: list[str] = []
    real_get = cluster.get_pod

    async def counting_get(namespace: str, name: str) -> Any:
        reads.append(name)
        return await real_get(namespace, name)

    cluster.get_pod = counting_get  # type: ignore[method-assign]
    honest = pod("f", [{"nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 10}])
    cluster.add_pod(honest)
    forged = pod("f", [{"nvidia.com/gpumem": 16384, "nvidia.com/gpucores": 100}])
    body = await (await client.post("/filter", json={"Pod": forged, "NodeNames": ["idle"]})).json()
    assert body["NodeNames"] == ["idle"]
    args = {"PodName": "f", "PodNamespace": "default", "PodUID": "uid-default-f", "Node": "idle"}
    assert (await (await client.post("/bind", json=args)).json()) == {"Error": ""}
    assert reads == ["f"]
    annotations = cluster.pods[("default", "f")]["metadata"]["annotations"]
    (grant,) = signing.decode_assignment(annotations[signing.ASSIGNMENT_ANNOTATION]).containers[0].devices
    assert (grant.memory_mib, grant.cores) == (1000, 10)
    # a re-created pod (another UID) is told apart by the API server's copy
    cluster.add_pod(pod("h", [{"nvidia.com/gpumem": 1000}], uid="uid-h-2"))
    assert "replaced" in await scheduler.bind("default", "h", "uid-h-3", "idle")


@pytest.mark.parametrize(
    ("spec", "facts", "why"),
    [
        ({"nodeSelector": {"zone": "a"}}, NodeFacts({"zone": "b"}), "nodeSelector zone=a"),
        ({"nodeSelector": {"zone": "a"}}, NodeFacts(), "nodeSelector zone=a"),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]},
                                {
                                    "matchFields": [
                                        {"key": "metadata.name", "operator": "In", "values": ["busy"]}
                                    ]
                                },
                            ]
                        }
                    }
                }
            },
            NodeFacts({"gpu": "h100"}),
            "required node affinity",
        ),
        (
            {},
            NodeFacts(taints=({"key": "dedicated", "value": "x", "effect": "NoSchedule"},)),
            "taint dedicated",
        ),
        ({}, NodeFacts(unschedulable=True), "cordoned"),
    ],
)
async def test_bind_refuses_a_node_the_pod_may_not_run_on(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
    spec: dict[str, Any],
    facts: NodeFacts,
    why: str,
) -> None:
    """Another namespace's pending pod, sent to /bind for a node kube-scheduler would never pick, stays unbound."""
    client, scheduler, cluster = setup
    cluster.writes.clear()
    scheduler.state.set_node_facts("idle", facts)
    cluster.add_pod(pod("x", [{"nvidia.com/gpumem": 1000}], namespace="team-b", **spec))
    args = {"PodName": "x", "PodNamespace": "team-b", "PodUID": "uid-team-b-x", "Node": "idle"}
    error = (await (await client.post("/bind", json=args)).json())["Error"]
    assert error.startswith("bind refused: pod team-b/x") and why in error, error
    assert "\n" not in error and "nodeName" not in cluster.pods[("team-b", "x")]["spec"]
    assert cluster.writes == [] and cluster.lock_holder("idle", "nvidia.com/gpu") is None


async def test_bind_places_a_pod_on_a_node_it_selects_and_tolerates(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    _, scheduler, cluster = setup
    taint = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
    scheduler.state.set_node_facts("idle", NodeFacts({"zone": "a", "gpu": "a100"}, (taint,)))
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]},
                              {"key": "gone", "operator": "DoesNotExist"}]}]}}}  # fmt: skip
    tolerations = [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]
    ok = pod("ok", [{"nvidia.com/gpumem": 1000}], nodeSelector={"zone": "a"}, affinity=affinity,
             tolerations=tolerations)  # fmt: skip
    cluster.add_pod(ok)
    assert await scheduler.bind("default", "ok", "uid-default-ok", "idle") == ""
    assert cluster.pods[("default", "ok")]["spec"]["nodeName"] == "idle"


@pytest.mark.parametrize(
    ("namespace", "name", "uid", "node", "why"),
    [
        ("", "p", "u", "idle", "PodNamespace is empty"),
        ("default", "", "u", "idle", "PodName is empty"),
        ("default", "p", "u", "", "Node is empty"),
        ("default", "..", "u", "idle", "is not a DNS-1123 subdomain"),
        ("default", "../../nodes/idle", "u", "idle", "is not a DNS-1123 subdomain"),
        ("a.b", "p", "u", "idle", "is not a DNS-1123 label"),
        ("default", "P", "u", "idle", "is not a DNS-1123 subdomain"),
        ("default", "p" * 254, "u", "idle", "longer than 253"),
        ("default", "p", "u", "idle/status", "is not a DNS-1123 subdomain"),
        ("default", "p", "", "idle", "PodUID is empty"),
    ],
)
async def test_bind_refuses_names_the_api_server_would_not_hold(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
    namespace: str,
    name: str,
    uid: str,
    node: str,
    why: str,
) -> None:
    """Before any name goes into an API path: an empty name would LIST, ``..`` would reach other paths."""
    _, scheduler, cluster = setup
    reads: list[tuple[str, str]] = []

    async def get_pod(namespace: str, name: str) -> Any:
        reads.append((namespace, name))
        raise LookupError("not found")

    cluster.get_pod = get_pod  # type: ignore[method-assign]
    cluster.writes.clear()
    error = await scheduler.bind(namespace, name, uid, node)
    assert error.startswith("bind refused: ") and why in error, error
    assert reads == [] and cluster.writes == []


async def test_bind_refuses_a_pod_asking_for_no_shared_devices(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    """kube-scheduler sends the extender only pods asking for its managed resources."""
    _, scheduler, cluster = setup
    cluster.add_pod(pod("plain", [{"cpu": 1}]))
    error = await scheduler.bind("default", "plain", "uid-default-plain", "idle")
    assert "asks for no shared devices" in error
    assert "nodeName" not in cluster.pods[("default", "plain")]["spec"]
    assert "unknown to the kxpu scheduler" in await scheduler.bind(
        "default", "plain", "uid-default-plain", "nowhere"
    )


async def test_deeply_nested_json_is_a_400_naming_the_limit(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    for depth in (150, 100_000):  # past the extender's limit; past Python's recursion limit
        deep = '{"Pod":' + "[" * depth + "]" * depth + "}"
        for verb in ("filter", "prioritize", "bind"):
            response = await client.post(f"/{verb}", data=deep)
            text = await response.text()
            assert response.status == 400 and "nested more than 100 levels" in text, (verb, depth, text)
            assert "Traceback" not in text and "\n" not in text.strip()


async def test_concurrent_binds_never_overcommit(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    _, scheduler, cluster = setup

    async def no_lock(node: str, resource: str, pod: Any) -> None:  # lock semantics aside: only the decision
        return None

    cluster.acquire_lock = no_lock  # type: ignore[method-assign]
    names = [f"c{n}" for n in range(12)]
    for name in names:
        cluster.add_pod(pod(name, [{"nvidia.com/gpumem": 5000, "nvidia.com/gpucores": 20}]))
    errors = await asyncio.gather(*(scheduler.bind("default", n, f"uid-default-{n}", "idle") for n in names))
    bound = [n for n, e in zip(names, errors, strict=True) if e == ""]
    assert len(bound) == 6  # 2 devices x 16384 MiB hold three 5000 MiB shares each
    assert all("no longer fits" in e for e in errors if e)
    node = scheduler.state.node("idle")
    assert node is not None
    assert all(s.memory <= s.device.memory_capacity_mib for s in node.families["nvidia.com/gpu"])


async def test_nothing_is_decided_before_the_caches_sync() -> None:
    """An extender that restarted must not see devices as emptier than they are."""
    cluster = FakeCluster()
    state = ClusterState(["nvidia.com/gpu"])
    state.set_node("idle", {inv.annotation_key("nvidia.com/gpu"): inv.encode(inventory(count=2))})
    scheduler = Scheduler(state, [GPU], keys=lambda: cluster.keyring, api=cluster)
    synced = {"yes": False}
    client = TestClient(TestServer(make_app(scheduler, lambda: synced["yes"])))
    await client.start_server()
    try:
        cluster.add_pod(pod("early", [{"nvidia.com/gpumem": 1000}]))
        body = await (await client.post("/filter", json={"Pod": pod("early"), "NodeNames": ["idle"]})).json()
        assert "not synced" in body["Error"]
        bound = {"PodName": "early", "PodNamespace": "default", "PodUID": "uid-default-early", "Node": "idle"}
        assert "not synced" in (await (await client.post("/bind", json=bound)).json())["Error"]
        assert (await client.get("/readyz")).status == 503
        synced["yes"] = True
        body = await (await client.post("/filter", json={"Pod": pod("early"), "NodeNames": ["idle"]})).json()
        assert body["Error"] == "" and body["NodeNames"] == ["idle"]
    finally:
        await client.close()


async def test_bind_writes_the_assignment_with_the_binding(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    _, scheduler, cluster = setup
    labelled = pod("l", [{"nvidia.com/gpumem": 1000}])
    labelled["metadata"]["labels"] = {"kxpu.io/assigned": "true"}  # as the webhook admits it
    cluster.add_pod(labelled)
    scheduler.filter(labelled, ["idle"])  # bind takes the pod from filter, as kube-scheduler calls them
    cluster.writes.clear()
    assert await scheduler.bind("default", "l", "uid-default-l", "idle") == ""
    assert cluster.writes == ["lock", "bind"]  # one write carries nodeName and the signed assignment
    obj = cluster.pods[("default", "l")]
    assert (
        obj["spec"]["nodeName"] == "idle"
        and obj["metadata"]["annotations"]["kxpu.io/bind-phase"] == "allocating"
    )
    assert signing.ASSIGNMENT_ANNOTATION in obj["metadata"]["annotations"]

    await cluster.release_lock("idle", "nvidia.com/gpu", _ref("l"))
    cluster.add_pod(pod("u", [{"nvidia.com/gpumem": 1000}]))  # the webhook did not label it
    cluster.writes.clear()
    assert await scheduler.bind("default", "u", "uid-default-u", "idle") == ""
    assert cluster.writes == ["label", "lock", "bind"]  # or the pod watch would never see its grant
    assert cluster.pods[("default", "u")]["metadata"]["labels"] == {"kxpu.io/assigned": "true"}

    await cluster.release_lock("idle", "nvidia.com/gpu", _ref("u"))
    cluster.add_pod(pod("f", [{"nvidia.com/gpumem": 1000}]))
    cluster.fail_bind = True
    assert "binding refused" in await scheduler.bind("default", "f", "uid-default-f", "idle")
    failed = cluster.pods[("default", "f")]
    assert "nodeName" not in failed["spec"] and not failed["metadata"]["annotations"]  # nothing to clear
    assert (
        cluster.lock_holder("idle", "nvidia.com/gpu") is None
        and scheduler.state.assignment("uid-default-f") is None
    )


async def test_a_retried_bind_after_success_keeps_the_grant_and_the_lock(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    """kube-scheduler retries a bind it timed out on, though the first one went through."""
    _, scheduler, cluster = setup
    cluster.add_pod(pod("r", [{"nvidia.com/gpumem": 1000}]))
    assert await scheduler.bind("default", "r", "uid-default-r", "idle") == ""
    granted = scheduler.state.assignment("uid-default-r")
    # the retry after the first bind returned: the pod is read, seen bound here by us, nothing written
    cluster.writes.clear()
    assert await scheduler.bind("default", "r", "uid-default-r", "idle") == ""
    assert cluster.writes == []
    assert scheduler.state.assignment("uid-default-r") == granted
    holder = cluster.lock_holder("idle", "nvidia.com/gpu")
    assert holder is not None and holder.uid == "uid-default-r"  # still its lock: its Allocate will come
    # bound elsewhere: a clear error
    assert "already bound to idle" in await scheduler.bind("default", "r", "uid-default-r", "busy")

    # the retry racing the bind it retries: it reads the pod unbound, then the Binding answers 409
    cluster.add_pod(pod("s", [{"nvidia.com/gpumem": 1000}]))
    await cluster.release_lock("idle", "nvidia.com/gpu", _ref("r"))
    read = cluster.get_pod

    async def read_then_yield(namespace: str, name: str) -> Any:
        obj = await read(namespace, name)
        await asyncio.sleep(0)  # both binds read the pod before either binds it
        return obj

    cluster.get_pod = read_then_yield  # type: ignore[method-assign]
    cluster.writes.clear()
    first, second = await asyncio.gather(
        scheduler.bind("default", "s", "uid-default-s", "idle"),
        scheduler.bind("default", "s", "uid-default-s", "idle"),
    )
    assert first == second == ""
    assert cluster.writes.count("bind") == 2  # the second Binding was refused, and that was fine
    holder = cluster.lock_holder("idle", "nvidia.com/gpu")
    assert holder is not None and holder.uid == "uid-default-s"
    obj = cluster.pods[("default", "s")]
    assert scheduler.state.assignment("uid-default-s") == signing.decode_assignment(
        obj["metadata"]["annotations"][signing.ASSIGNMENT_ANNOTATION]
    )


GARBAGE_BODIES = [
    ({"Pod": "x", "NodeNames": ["idle"]}, "pod: expected an object, got str"),
    ({"Pod": {"metadata": "x"}, "NodeNames": ["idle"]}, "pod.metadata: expected an object"),
    ({"Pod": {"spec": {"containers": "x"}}, "NodeNames": ["idle"]}, "pod.spec.containers: expected a list"),
    (
        {"Pod": {"spec": {"containers": [1]}}, "NodeNames": ["idle"]},
        "pod.spec.containers[0]: expected an object",
    ),
    (
        {
            "Pod": {"spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": [1]}}}]}},
            "NodeNames": ["a"],
        },
        "pod.spec.containers[0].resources.limits['nvidia.com/gpu']: expected a quantity",
    ),
    (
        {"Pod": {"metadata": {"annotations": {"kxpu.io/use-uuid": 5}}}, "NodeNames": ["idle"]},
        "pod.metadata.annotations['kxpu.io/use-uuid']: expected a string",
    ),
    ({"Pod": {}, "NodeNames": 5}, "NodeNames: expected a list of node names"),
    ({"Pod": {}, "Nodes": {"items": "x"}}, "Nodes: expected a NodeList object with items"),
    ({"Pod": {}, "Nodes": {"items": [1]}}, "Nodes.items[0]: expected a Node object"),
]


@pytest.mark.parametrize(("body", "message"), GARBAGE_BODIES)
async def test_garbage_extender_requests_get_an_answer_naming_what_is_wrong(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster], body: dict[str, Any], message: str
) -> None:
    """No traceback for a malformed pod or node list: filter fails every node (or answers 400) with the field named,
    prioritize scores 0 or answers 400."""
    client, _, _ = setup
    for verb in ("filter", "prioritize"):
        response = await client.post(f"/{verb}", data=json.dumps(body))
        text = await response.text()
        assert response.status in (200, 400), (verb, response.status, text)
        if response.status == 400 or verb == "filter":
            assert message in text, (verb, text)


_KEYS = ["Pod", "NodeNames", "Nodes", "items", "metadata", "spec", "containers", "initContainers", "resources",
         "limits", "requests", "annotations", "name", "nvidia.com/gpu", "nvidia.com/gpumem", "PodName", "PodUID",
         "PodNamespace", "Node", "kxpu.io/use-uuid"]  # fmt: skip


def _garbage(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, biased towards the extender's field names (deterministic: seeded)."""
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-5, 5)
    if kind in (3, 4):
        return rng.choice(["", "1", "abc", "idle", "100Mi", "-1", "\u00e9"])
    if kind == 5:
        return [_garbage(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(_KEYS): _garbage(rng, depth + 1) for _ in range(rng.randrange(4))}


async def test_no_extender_request_body_gets_a_server_error(
    setup: tuple[TestClient[Any, Any], Scheduler, FakeCluster],
) -> None:
    client, _, _ = setup
    rng = random.Random(16)
    for _ in range(300):
        body = _garbage(rng)
        for verb in ("filter", "prioritize", "bind"):
            response = await client.post(f"/{verb}", data=json.dumps(body))
            assert response.status < 500, (verb, body, await response.text())

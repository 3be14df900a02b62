"""`kxpu status --cluster`: nodes and pods as lightkube returns them, joined into who holds what.

The assignments on the pods are written by the real extender code (Scheduler over FakeCluster), so the
view is checked against what kxpu itself publishes and signs, not against hand-made annotations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import CliRunner
from lightkube.resources.core_v1 import Node, Pod

from kxpu import status as status_module
from kxpu.cli import main
from kxpu.sharing import inventory as inv
from kxpu.sharing import signing
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import Scheduler
from kxpu.sharing.state import ClusterState
from kxpu.status import build_cluster_status, fetch_cluster_status, format_cluster_table, pod_requests
from kxpu.testing.sharing import FakeCluster, inventory, pod

GPU = "nvidia.com/gpu"


class FakeClient:
    """lightkube's AsyncClient.list over fixed objects (nodes cluster-wide, pods with namespace="*")."""

    def __init__(self, nodes: list[Any], pods: list[Any]) -> None:
        self.objects: dict[type, list[Any]] = {Node: nodes, Pod: pods}
        self.calls: list[tuple[str, str | None]] = []
        self.fields: dict[str, Any] = {}

    def list(self, resource: type, namespace: str | None = None, fields: Any = None) -> AsyncIterator[Any]:
        """Ignores ``fields`` (recorded): the join must not rely on the server's filtering."""
        self.calls.append((resource.__name__, namespace))
        self.fields[resource.__name__] = fields

        async def items() -> AsyncIterator[Any]:
            for obj in self.objects[resource]:
                yield obj

        return items()


def node(name: str, capacity: dict[str, str], annotations: dict[str, str] | None = None) -> Node:
    return cast(
        Node,
        Node.from_dict(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "annotations": annotations or {}},
                "status": {
                    "capacity": {"cpu": "4", "memory": "8Gi", **capacity},
                    "allocatable": dict(capacity),
                },
            }
        ),
    )


@pytest.fixture
async def cluster() -> FakeClient:
    """n1 shares two GPUs (slots of 10): a and b bound by the extender; n2 has whole FPGAs; n3 nothing."""
    fake = FakeCluster()
    state = ClusterState([GPU])
    published = inventory(count=2)
    state.set_node("n1", {inv.annotation_key(GPU): inv.encode(published)})
    scheduler = Scheduler(state, [ResourceFamily.derived(GPU)], keys=lambda: fake.keyring, api=fake)
    for name, limits in (
        ("a", [{f"{GPU}mem": 3000, f"{GPU}cores": 30, GPU: 1}, {f"{GPU}mem": 1000, GPU: 1}]),
        ("b", [{f"{GPU}mem": 2000, f"{GPU}cores": 50, GPU: 1}]),
    ):
        fake.add_pod(pod(name, limits))
        assert await scheduler.bind("default", name, f"uid-default-{name}", "n1") == ""
        await fake.release_lock("n1", GPU, _ref(name))
    pods = [Pod.from_dict(p) for p in fake.pods.values()]
    pods += [
        Pod.from_dict(pod("fpga", [{"example.com/fpga": 1, "cpu": 1}], namespace="hw", node="n2")),
        Pod.from_dict(pod("done", [{"example.com/fpga": 1}], node="n2") | {"status": {"phase": "Succeeded"}}),
        Pod.from_dict(pod("pending", [{GPU: 1}])),  # not bound: holds nothing
        Pod.from_dict(pod("web", [{"cpu": 1}], node="n1")),  # no extended resources
    ]
    nodes = [
        node("n1", {GPU: "20"}, {inv.annotation_key(GPU): inv.encode(published), "other": "x"}),
        node("n2", {"example.com/fpga": "2", "hugepages-2Mi": "0"}),
        node("n3", {}),
    ]
    return FakeClient(nodes, pods)


def _ref(name: str) -> Any:
    from kxpu.sharing.scheduler import PodRef

    return PodRef("default", name, f"uid-default-{name}")


async def test_cluster_view_joins_capacity_pods_and_shares(cluster: FakeClient) -> None:
    result = await fetch_cluster_status(cluster)  # type: ignore[arg-type]
    assert cluster.calls == [("Node", None), ("Pod", "*")]
    from lightkube.core.selector import build_selector

    assert build_selector(cluster.fields["Pod"], for_fields=True) == (
        "spec.nodeName!=,status.phase!=Failed,status.phase!=Succeeded"
    )
    doc = result.as_json()
    assert [n["name"] for n in doc["nodes"]] == ["n1", "n2"]  # n3 has nothing of kxpu's
    n1, n2 = doc["nodes"]
    assert n1["resources"] == {GPU: {"capacity": 20, "allocatable": 20, "allocated": 3}}
    assert {p["name"]: p["resources"][GPU] for p in n1["pods"]} == {"a": 2, "b": 1}
    assert n1["pods"][0]["resources"][f"{GPU}mem"] == 4000  # companions are listed, not counted
    # Per device: memory and compute each container got, from the assignments the extender signed.
    shares = {
        (d["id"], s["pod"], s["container"]): (s["memoryMiB"], s["cores"])
        for d in n1["devices"]
        for s in d["shares"]
    }
    expected = {}
    for obj in cluster.objects[Pod]:
        text = (obj.metadata.annotations or {}).get(signing.ASSIGNMENT_ANNOTATION)
        for c in signing.decode_assignment(text).containers if text else ():
            for g in c.devices:
                expected[(g.device, f"default/{obj.metadata.name}", c.container)] = (g.memory_mib, g.cores)
    assert shares == expected
    assert sorted(shares.values()) == [(1000, 0), (2000, 50), (3000, 30)]
    for d in n1["devices"]:
        assert d["memoryAllocatedMiB"] == sum(s["memoryMiB"] for s in d["shares"])
        assert d["coresAllocated"] == sum(s["cores"] for s in d["shares"])
        assert (d["memoryCapacityMiB"], d["coreCapacity"], d["splitCount"]) == (16384, 100, 10)
    assert sum(d["memoryAllocatedMiB"] for d in n1["devices"]) == 6000
    # Whole devices: the finished pod holds nothing any more; hugepages are not an extended resource.
    assert n2["resources"] == {"example.com/fpga": {"capacity": 2, "allocatable": 2, "allocated": 1}}
    assert [(p["namespace"], p["name"]) for p in n2["pods"]] == [("hw", "fpga")]
    assert n2["devices"] == [] and doc["errors"] == []


async def test_cluster_table(cluster: FakeClient) -> None:
    text = format_cluster_table(await fetch_cluster_status(cluster))  # type: ignore[arg-type]
    lines = text.splitlines()
    assert lines[0].split() == ["NODE", "RESOURCE", "CAPACITY", "ALLOCATABLE", "REQUESTED", "PODS"]
    assert lines[1].split()[:5] == ["n1", GPU, "20", "20", "3"]
    assert "default/a (2), default/b (1)" in lines[1]
    assert lines[2].split()[:5] == ["n2", "example.com/fpga", "2", "2", "1"]
    devices = [line for line in lines if line.startswith("n1 ") and "gpu-" in line]
    assert len(devices) == 2
    assert any("default/b/c0 (2000 MiB, 50%)" in line for line in devices)


async def test_resource_filter_and_broken_annotations(cluster: FakeClient) -> None:
    only = frozenset({"example.com/fpga"})
    result = await fetch_cluster_status(cluster, only)  # type: ignore[arg-type]
    assert [n.name for n in result.nodes] == ["n2"]
    bad_node = node("n4", {GPU: "10"}, {inv.annotation_key(GPU): "{not json"})
    bad_pod = pod("x", [{GPU: 1}], node="n4", annotations={"kxpu.io/assignment": "nope"})
    broken = build_cluster_status([bad_node.to_dict()], [bad_pod])
    (n4,) = broken.nodes
    assert n4.errors and "kxpu.io/devices.nvidia.com_gpu" in n4.errors[0]
    assert broken.errors and "default/x" in broken.errors[0]
    assert [p.name for p in n4.pods] == ["x"]


def test_quantities_are_read_as_the_api_server_writes_them() -> None:
    p = pod("p", [{"a.io/x": "3k"}, {"a.io/x": "2"}, {"a.io/y": "500m"}])
    assert pod_requests(p) == {"a.io/x": 3002}  # 500m is no whole number: not an extended resource's


def test_effective_request_counts_init_containers_like_the_scheduler() -> None:
    p = pod("p", [{"a.io/x": 1}, {"a.io/x": 1}])
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {"a.io/x": "3"}}}]
    assert pod_requests(p) == {"a.io/x": 3}
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"requests": {"a.io/x": "1"}}}]
    assert pod_requests(p) == {"a.io/x": 2}


def test_cli_cluster_json(cluster: FakeClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )

    async def fake_fetch(client: Any, only: frozenset[str] = frozenset()) -> Any:
        return await fetch_cluster_status(cluster, only)  # type: ignore[arg-type]

    monkeypatch.setattr(status_module, "fetch_cluster_status", fake_fetch)
    result = CliRunner().invoke(main, ["status", "--cluster", "--kubeconfig", str(kubeconfig), "-o", "json"])
    assert result.exit_code == 0, result.output
    assert [n["name"] for n in json.loads(result.output)["nodes"]] == ["n1", "n2"]


def test_cli_cluster_reports_an_unreachable_api_server(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {}}]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kxpu", "status", "--cluster", "--kubeconfig", str(kubeconfig)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "listing nodes and pods" in proc.stderr, proc.stderr


def test_node_side_imports_do_not_load_lightkube() -> None:
    code = "import sys, kxpu.cli, kxpu.status, kxpu.daemon; assert 'lightkube' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

"""Metrics and probes of the scheduler extender and the admission webhook, over real HTTP on 127.0.0.1.

Counters are process-global (one prometheus-client registry), so each test compares a scrape after
its requests with one before them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kxpu.sharing import extender_metrics, probes, webhook
from kxpu.sharing import inventory as inv
from kxpu.sharing.extender import MeteredAPI, make_app
from kxpu.sharing.requests import ResourceFamily
from kxpu.sharing.scheduler import Scheduler
from kxpu.sharing.state import ClusterState
from kxpu.testing.sharing import FakeCluster, inventory, pod

GPU = ResourceFamily.derived("nvidia.com/gpu")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@dataclass
class Extender:
    api_url: str
    probe_url: str
    cluster: FakeCluster
    state: ClusterState
    ready: dict[str, bool]
    session: aiohttp.ClientSession


@pytest.fixture
async def extender() -> AsyncIterator[Extender]:
    cluster = FakeCluster()
    state = ClusterState(["nvidia.com/gpu"])
    state.set_node("n1", {inv.annotation_key("nvidia.com/gpu"): inv.encode(inventory(count=2))})
    scheduler = Scheduler(state, [GPU], keys=lambda: cluster.keyring, api=MeteredAPI(cluster))
    ready = {"synced": False}
    extender_metrics.CACHE.state = state
    extender_metrics.CACHE.ready = lambda: ready["synced"]
    api_runner, api_port = await probes.start(make_app(scheduler), "127.0.0.1:0")
    probe_app = probes.make_probe_app(lambda: ready["synced"], "caches not synced")
    probe_runner, probe_port = await probes.start(probe_app, "127.0.0.1:0")
    async with aiohttp.ClientSession() as session:
        yield Extender(
            f"http://127.0.0.1:{api_port}",
            f"http://127.0.0.1:{probe_port}",
            cluster,
            state,
            ready,
            session,
        )
    extender_metrics.CACHE.state = None
    await api_runner.cleanup()
    await probe_runner.cleanup()


async def test_extender_readiness_follows_the_cache_sync(extender: Extender) -> None:
    session, url = extender.session, extender.probe_url
    async with session.get(f"{url}/healthz") as response:
        assert response.status == 200
    async with session.get(f"{url}/readyz") as response:
        assert response.status == 503
        assert await response.text() == "caches not synced"
    assert value(await scrape(session, url), "kxpu_scheduler_cache_synced") == 0
    extender.ready["synced"] = True
    async with session.get(f"{url}/readyz") as response:
        assert response.status == 200
    assert value(await scrape(session, url), "kxpu_scheduler_cache_synced") == 1


async def test_extender_counts_decisions_and_exports_allocations(extender: Extender) -> None:
    session, cluster = extender.session, extender.cluster
    before = await scrape(session, extender.probe_url)
    p = pod("p", [{"nvidia.com/gpumem": 3000, "nvidia.com/gpucores": 40}])
    cluster.add_pod(p)
    args = {"Pod": p, "NodeNames": ["n1", "nowhere"]}
    async with session.post(f"{extender.api_url}/filter", json=args) as response:
        assert (await response.json())["NodeNames"] == ["n1"]
    async with session.post(f"{extender.api_url}/prioritize", json=args) as response:
        assert response.status == 200
    bind = {"PodName": "p", "PodNamespace": "default", "PodUID": "uid-default-p", "Node": "n1"}
    async with session.post(f"{extender.api_url}/bind", json=bind) as response:
        assert await response.json() == {"Error": ""}
    # n1's lock is still held by p (the node daemon releases it at Allocate): the next bind must wait.
    cluster.add_pod(pod("q", [{"nvidia.com/gpumem": 1000}]))
    bind_q = {"PodName": "q", "PodNamespace": "default", "PodUID": "uid-default-q", "Node": "n1"}
    async with session.post(f"{extender.api_url}/bind", json=bind_q) as response:
        assert "locked" in (await response.json())["Error"]
    after = await scrape(session, extender.probe_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kxpu_scheduler_decisions_total", outcome="fit") == 1
    assert delta("kxpu_scheduler_decisions_total", outcome="no-fit") == 1  # "nowhere"
    assert delta("kxpu_scheduler_decisions_total", outcome="bound") == 1
    assert delta("kxpu_scheduler_decisions_total", outcome="bind-failed") == 1
    assert delta("kxpu_scheduler_lock_busy_total") == 1
    assert delta("kxpu_scheduler_lock_wait_seconds_count") == 2
    for verb, calls in (("filter", 1), ("prioritize", 1), ("bind", 2)):
        assert delta("kxpu_scheduler_request_duration_seconds_count", verb=verb) == calls
    # What p was given, per device and per node, straight from the cache.
    (grant,) = [g for c in extender.state.assignments_on("n1") for cc in c.containers for g in cc.devices]
    device = {"node": "n1", "resource": "nvidia.com/gpu", "device": grant.device}
    assert value(after, "kxpu_scheduler_device_memory_allocated_mib", **device) == 3000
    assert value(after, "kxpu_scheduler_device_cores_allocated", **device) == 40
    assert value(after, "kxpu_scheduler_device_slots_allocated", **device) == 1
    assert value(after, "kxpu_scheduler_device_memory_capacity_mib", **device) == 16384
    assert value(after, "kxpu_scheduler_device_core_capacity", **device) == 100
    node = {"node": "n1", "resource": "nvidia.com/gpu"}
    assert value(after, "kxpu_scheduler_node_memory_allocated_mib", **node) == 3000
    assert value(after, "kxpu_scheduler_node_cores_allocated", **node) == 40


def test_lock_takeover_causes() -> None:
    assert extender_metrics.takeover_cause("it expired before its pod was bound") == "expired"
    assert extender_metrics.takeover_cause("the kubelet never admitted its pod") == "expired"
    assert extender_metrics.takeover_cause("its pod is gone") == "recovered"
    assert extender_metrics.takeover_cause("its pod is bound to n2") == "recovered"


@pytest.fixture
async def webhook_urls() -> AsyncIterator[tuple[str, str, aiohttp.ClientSession]]:
    families = [GPU]
    runner, port = await probes.start(webhook.make_app(families, "kxpu-scheduler"), "127.0.0.1:0")
    probe_runner, probe_port = await probes.start(probes.make_probe_app(lambda: True), "127.0.0.1:0")
    async with aiohttp.ClientSession() as session:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe_port}", session
    await runner.cleanup()
    await probe_runner.cleanup()


def review(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    meta = obj["metadata"]
    request = {
        "uid": "r",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": operation,
        "namespace": meta["namespace"],
        "name": meta["name"],
        "object": obj,
        "userInfo": {"username": "alice"},
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (pod("a", [{"nvidia.com/gpucores": 150}]), "invalid-request"),
        (pod("b", [{"nvidia.com/gpu": 1}], node="n1"), "node-name"),
        (pod("c", [{"nvidia.com/gpu": 1}], annotations={"kxpu.io/assignment": "x"}), "reserved-annotations"),
    ],
)
async def test_webhook_counts_denials_by_reason(
    webhook_urls: tuple[str, str, aiohttp.ClientSession], obj: dict[str, Any], reason: str
) -> None:
    url, probe_url, session = webhook_urls
    before = await scrape(session, probe_url)
    async with session.post(f"{url}/validate", json=review(obj)) as response:
        assert (await response.json())["response"]["allowed"] is False
    after = await scrape(session, probe_url)
    labels = {"webhook": "validate", "verdict": "denied", "reason": reason}
    name = "kxpu_webhook_admissions_total"
    assert value(after, name, **labels) - value(before, name, **labels) == 1


async def test_webhook_counts_patches_and_times_admissions(
    webhook_urls: tuple[str, str, aiohttp.ClientSession],
) -> None:
    url, probe_url, session = webhook_urls
    for path in ("/healthz", "/readyz"):
        async with session.get(f"{probe_url}{path}") as response:
            assert response.status == 200
    before = await scrape(session, probe_url)
    async with session.post(f"{url}/mutate", json=review(pod("m", [{"nvidia.com/gpumem": 100}]))) as response:
        assert (await response.json())["response"]["patchType"] == "JSONPatch"
    async with session.post(f"{url}/mutate", json=review(pod("plain", [{"cpu": 1}]))) as response:
        assert "patch" not in (await response.json())["response"]
    async with session.post(
        f"{url}/validate", json=review(pod("ok", [{"nvidia.com/gpu": 1}], schedulerName="kxpu-scheduler"))
    ) as response:
        assert (await response.json())["response"]["allowed"] is True
    after = await scrape(session, probe_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    admissions = "kxpu_webhook_admissions_total"
    assert delta(admissions, webhook="mutate", verdict="patched", reason="shared-devices") == 1
    assert delta(admissions, webhook="mutate", verdict="allowed", reason="no-change") == 1
    assert delta(admissions, webhook="validate", verdict="allowed", reason="valid") == 1
    assert delta("kxpu_webhook_admission_duration_seconds_count", webhook="mutate") == 2
    assert delta("kxpu_webhook_admission_duration_seconds_count", webhook="validate") == 1


def test_listen_addresses_are_checked() -> None:
    assert probes.parse_listen(":9401") == ("0.0.0.0", 9401)
    assert probes.parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9401", "host:port", ":70000"):
        with pytest.raises(ValueError, match="must be"):
            probes.parse_listen(bad)


@pytest.mark.parametrize("command", [["scheduler"], ["webhook", "--tls-cert-file=c", "--tls-key-file=k"]])
def test_cli_refuses_a_bad_metrics_address(command: list[str]) -> None:
    from click.testing import CliRunner

    from kxpu.cli import main

    result = CliRunner().invoke(main, [*command, "--metrics-address", "nowhere"])
    assert result.exit_code == 2
    assert "--metrics-address" in result.output and "must be [HOST]:PORT" in result.output


def test_the_node_daemon_exports_no_control_plane_metrics() -> None:
    """The node side of sharing shares kube/api.py with the extender but must not register its metrics."""
    code = (
        "import sys, kxpu.daemon, kxpu.sharing.node, kxpu.kube.sharing.node; "
        "assert not {'kxpu.sharing.extender_metrics', 'kxpu.sharing.webhook_metrics'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

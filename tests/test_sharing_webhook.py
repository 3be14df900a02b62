"""The admission webhook over real TLS (certificates from trustme), as the API server calls it."""

from __future__ import annotations

import base64
import json
import os
import random
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme
from aiohttp import web

from kxpu.sharing import bounds, webhook, webhook_metrics
from kxpu.sharing.requests import ResourceFamily
from kxpu.testing.sharing import pod

FAMILIES = [
    ResourceFamily.derived("nvidia.com/gpu"),
    ResourceFamily.derived("example.com/npu", default_count=2),
]
TRUSTED = ["system:serviceaccount:kxpu-system:kxpu-scheduler"]


class Server:
    def __init__(self, url: str, ssl_context: ssl.SSLContext, ca: trustme.CA, cert_dir: Path) -> None:
        self.url, self.ssl, self.ca, self.cert_dir = url, ssl_context, ca, cert_dir

    async def review(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + path, json=body, ssl=self.ssl) as response,
        ):
            assert response.status == 200
            reply: dict[str, Any] = await response.json()
        assert reply["response"]["uid"] == request["uid"]
        answer: dict[str, Any] = reply["response"]
        return answer


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "kxpu-webhook.kxpu-system.svc")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    tls = webhook.ReloadingTLS(tmp_path / "tls.crt", tmp_path / "tls.key")
    runner = web.AppRunner(webhook.make_app(FAMILIES, "kxpu-scheduler", TRUSTED))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    yield Server(f"https://127.0.0.1:{port}", client_ctx, ca, tmp_path)
    await runner.cleanup()


def request(
    obj: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None, user: str = "alice"
) -> dict[str, Any]:
    return {
        "uid": "req-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": operation,
        "namespace": obj["metadata"]["namespace"],
        "name": obj["metadata"]["name"],
        "object": obj,
        "oldObject": old,
        "userInfo": {"username": user},
    }


def apply_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    for op in ops:
        assert op["op"] == "add"
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = obj
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = op["value"]
    return obj


async def test_mutate_sets_the_scheduler_and_the_missing_count(server: Server) -> None:
    p = pod("p", [{"nvidia.com/gpumem": 3000}, {"example.com/npucores": 20, "nvidia.com/gpu": 1}, {"cpu": 1}])
    del p["spec"]["containers"][2]["resources"]
    response = await server.review("/mutate", request(p))
    assert response["allowed"] and response["patchType"] == "JSONPatch"
    patched = apply_patch(p, json.loads(base64.b64decode(response["patch"])))
    assert patched["spec"]["schedulerName"] == "kxpu-scheduler"
    assert patched["metadata"]["labels"] == {
        "kxpu.io/assigned": "true"
    }  # what the scheduler's pod watch selects
    limits = [c.get("resources", {}).get("limits", {}) for c in patched["spec"]["containers"]]
    assert limits[0]["nvidia.com/gpu"] == "1"
    assert limits[1]["example.com/npu"] == "2" and limits[1]["nvidia.com/gpu"] == "1"
    assert limits[2] == {}


async def test_mutate_leaves_other_pods_and_other_schedulers_alone(server: Server) -> None:
    response = await server.review("/mutate", request(pod("plain", [{"cpu": 1}])))
    assert response["allowed"] and "patch" not in response
    custom = pod("c", [{"nvidia.com/gpu": 1}], schedulerName="my-scheduler")
    response = await server.review("/mutate", request(custom))
    assert "patch" not in response


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: pod("a", [{"nvidia.com/gpu": 1}], annotations={"kxpu.io/assignment": "{}"}),
            "kxpu's own annotations",
        ),
        (
            lambda: pod("b", [{"cpu": 1}], annotations={"kxpu.io/allocated.nvidia.com_gpu": "1"}),
            "own annotations",
        ),
        (lambda: pod("c", [{"nvidia.com/gpu": 1, "nvidia.com/gpucores": 150}]), "0-100"),
        (lambda: pod("d", [{"nvidia.com/gpu": 1}], node="n1"), "nodeName preset"),
    ],
)
async def test_validate_denies(server: Server, make: Any, message: str) -> None:
    response = await server.review("/validate", request(make()))
    assert not response["allowed"]
    assert message in response["status"]["message"]


async def test_validate_denies_privileged_containers_asking_for_shared_devices(server: Server) -> None:
    p = pod("priv", [{"nvidia.com/gpumem": 10}])
    p["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    response = await server.review("/validate", request(p))
    assert not response["allowed"] and "privileged" in response["status"]["message"]
    plain = pod("priv2", [{"cpu": 1}])
    plain["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert (await server.review("/validate", request(plain)))["allowed"]


async def test_only_trusted_users_change_kxpu_annotations(server: Server) -> None:
    old = pod("p", [{"nvidia.com/gpu": 1}])
    new = pod("p", [{"nvidia.com/gpu": 1}], annotations={"kxpu.io/assignment": "{}"})
    denied = await server.review("/validate", request(new, "UPDATE", old))
    assert not denied["allowed"] and "only the kxpu scheduler" in denied["status"]["message"]
    allowed = await server.review("/validate", request(new, "UPDATE", old, user=TRUSTED[0]))
    assert allowed["allowed"]
    same = await server.review("/validate", request(new, "UPDATE", new))  # unchanged: fine
    assert same["allowed"]
    ok = pod("ok", [{"nvidia.com/gpumem": 10}], schedulerName="kxpu-scheduler")
    assert (await server.review("/validate", request(ok)))["allowed"]


async def test_shared_pods_must_use_the_kxpu_scheduler(server: Server) -> None:
    other = pod("o", [{"nvidia.com/gpumem": 10}], schedulerName="volcano")
    denied = await server.review("/validate", request(other))
    assert not denied["allowed"] and "schedulerName 'kxpu-scheduler'" in denied["status"]["message"]
    plain = pod("plain", [{"cpu": 1}], schedulerName="volcano")  # not asking for shared devices
    assert (await server.review("/validate", request(plain)))["allowed"]


async def test_only_kxpu_changes_the_assigned_label_once_the_pod_exists(server: Server) -> None:
    held = pod("h", [{"nvidia.com/gpu": 1}], schedulerName="kxpu-scheduler")
    held["metadata"]["labels"] = {"kxpu.io/assigned": "true"}
    freed = pod("h", [{"nvidia.com/gpu": 1}], schedulerName="kxpu-scheduler")
    denied = await server.review("/validate", request(freed, "UPDATE", held))
    assert not denied["allowed"] and "kxpu.io/assigned" in denied["status"]["message"]
    assert (await server.review("/validate", request(freed, "UPDATE", held, user=TRUSTED[0])))["allowed"]
    relabelled = await server.review("/validate", request(held, "UPDATE", freed))
    assert not relabelled["allowed"]
    through_status = {
        **request(freed, "UPDATE", held),
        "subResource": "status",
    }  # metadata changes go through it too
    assert not (await server.review("/validate", through_status))["allowed"]
    # born with it: /mutate sets it on every pod for the kxpu scheduler, and it only makes the pod watched
    assert (await server.review("/validate", request(held)))["allowed"]
    # a labelled pod with a labels map of its own keeps its labels
    mine = pod("m", [{"nvidia.com/gpu": 1}])
    mine["metadata"]["labels"] = {"app": "x"}
    patch = json.loads(base64.b64decode((await server.review("/mutate", request(mine)))["patch"]))
    assert apply_patch(mine, patch)["metadata"]["labels"] == {"app": "x", "kxpu.io/assigned": "true"}


async def test_certificates_rotate_without_a_restart(server: Server) -> None:
    first = await server.review("/validate", request(pod("x", [{"cpu": 1}])))
    assert first["allowed"]
    new_ca = trustme.CA()
    cert = new_ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(server.cert_dir / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(server.cert_dir / "tls.crt"))
    stat = (server.cert_dir / "tls.crt").stat()
    os.utime(server.cert_dir / "tls.crt", (stat.st_atime, stat.st_mtime + 5))  # a visibly newer file
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await server.review("/validate", request(pod("y", [{"cpu": 1}])))
    new_ca.configure_trust(server.ssl)
    assert (await server.review("/validate", request(pod("z", [{"cpu": 1}]))))["allowed"]


def test_cli_commands_refuse_a_bad_control_plane_config(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kxpu.cli import main

    bad = tmp_path / "cp.yaml"
    bad.write_text(
        "version: v1\nnodePolicy: random\nfamilies: [{resource: nvidia.com/gpu, defaultCores: 300}]\n"
    )
    for args in (["scheduler"], ["webhook", "--tls-cert-file", "c", "--tls-key-file", "k"]):
        result = CliRunner().invoke(main, [*args, "--config", str(bad)])
        assert result.exit_code == 2, result.output
        assert "nodePolicy" in result.output and "families.0.defaultCores" in result.output


async def test_shared_containers_may_not_set_kxpus_env(server: Server) -> None:
    p = pod("env", [{"nvidia.com/gpumem": 1000}], schedulerName="kxpu-scheduler")
    p["spec"]["containers"][0]["env"] = [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "80000m"}]
    denied = await server.review("/validate", request(p))
    assert not denied["allowed"] and "CUDA_DEVICE_MEMORY_LIMIT_0" in denied["status"]["message"]
    p["spec"]["containers"][0]["env"] = [{"name": "MY_SETTING", "value": "1"}]
    assert (await server.review("/validate", request(p)))["allowed"]


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"metadata": {"name": "p", "namespace": "ns", "annotations": {"a": 1}}},
            "annotations['a']: expected a string",
        ),
        (
            {"metadata": {"name": "p", "namespace": "ns", "labels": "x"}},
            "pod.metadata.labels: expected an object",
        ),
        (
            {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [{"env": "x"}]}},
            "env: expected a list",
        ),
        (
            {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [{"env": [1]}]}},
            "env[0]: expected",
        ),
        (
            {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [{"securityContext": []}]}},
            "securityContext: expected an object",
        ),
        ({"metadata": {"name": "p", "namespace": "ns"}, "spec": "x"}, "pod.spec: expected an object"),
    ],
)
async def test_a_malformed_pod_is_denied_naming_the_field(
    server: Server, obj: dict[str, Any], message: str
) -> None:
    for path in ("/mutate", "/validate"):
        answer = await server.review(path, request(obj))
        assert answer["allowed"] is False and message in answer["status"]["message"], (path, answer)
        assert answer["status"]["message"].startswith("malformed request.object: ")


async def test_garbage_admission_reviews_never_get_a_server_error(server: Server) -> None:
    rng = random.Random(11)
    keys = ["request", "kind", "object", "oldObject", "metadata", "spec", "containers", "resources", "limits",
            "annotations", "labels", "env", "securityContext", "userInfo", "operation", "uid"]  # fmt: skip

    def garbage(depth: int = 0) -> Any:
        kind = rng.randrange(7 if depth < 4 else 4)
        if kind < 2:
            return rng.choice([None, True, 3, "", "Pod", "CREATE", "UPDATE"])
        if kind < 4:
            return rng.choice(["x", "example.com/npu", "1"])
        if kind == 4:
            return [garbage(depth + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(keys): garbage(depth + 1) for _ in range(rng.randrange(4))}

    async with aiohttp.ClientSession() as session:
        for _ in range(200):
            body = garbage()
            if (
                isinstance(body, dict) and rng.random() < 0.7
            ):  # mostly well-framed reviews with garbage inside
                body = {"request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": rng.choice(["CREATE", "UPDATE"]),
                                    "object": garbage(1), "oldObject": garbage(1)}}  # fmt: skip
            for path in ("/mutate", "/validate"):
                async with session.post(server.url + path, json=body, ssl=server.ssl) as response:
                    assert response.status < 500, (path, body, await response.text())


NODE_SA = "system:serviceaccount:kxpu-system:kxpu-node"


def node_request(new: dict[str, Any], old: dict[str, Any], node: str | None = "n1") -> dict[str, Any]:
    """An UPDATE by the node daemon's account; its bound token names ``node`` (None: a legacy token)."""
    req = request(new, "UPDATE", old, user=NODE_SA)
    if node is not None:
        req["userInfo"]["extra"] = {"authentication.kubernetes.io/node-name": [node]}
    return req


def test_the_node_daemon_may_only_mark_its_own_bound_pods_allocated() -> None:
    """The daemon's identity is trusted for the allocated mark on pods bound to its node, nothing more."""
    signed = {
        "kxpu.io/assignment": "{}",
        "kxpu.io/assignment-signature": "v2.x.y",
        "kxpu.io/bind-phase": "allocating",
    }
    old = pod("p", [{"nvidia.com/gpu": 1}], annotations=signed, node="n1")
    old["metadata"]["labels"] = {"kxpu.io/assigned": "true"}

    def changed(
        annotations: dict[str, str | None] | None = None, labels: dict[str, str] | None = None
    ) -> Any:
        new = json.loads(json.dumps(old))
        for key, value in (annotations or {}).items():
            if value is None:
                new["metadata"]["annotations"].pop(key, None)
            else:
                new["metadata"]["annotations"][key] = value
        if labels is not None:
            new["metadata"]["labels"] = labels
        return new

    def check(req: dict[str, Any]) -> str | None:
        return webhook.validate(req, FAMILIES, TRUSTED, node_users=[NODE_SA])

    allocated = changed({"kxpu.io/allocated.nvidia.com_gpu": "1700000000", "kxpu.io/bind-phase": "allocated"})
    assert check(node_request(allocated, old)) is None
    assert check(node_request(allocated, old, node=None)) is None  # a token that names no node
    other_node = check(node_request(allocated, old, node="n2"))
    assert other_node == "the kxpu node daemon of node n2 may not mark a pod bound to node n1"
    unbound = json.loads(json.dumps(old))
    del unbound["spec"]["nodeName"]
    marked_unbound = allocated | {"spec": unbound["spec"]}
    assert (
        check(node_request(marked_unbound, unbound))
        == "the kxpu node daemon may only mark pods bound to a node"
    )
    for new, before in (
        (changed({"kxpu.io/assignment": '{"forged": 1}'}), old),
        (changed({"kxpu.io/assignment-signature": None}), old),
        (changed({"kxpu.io/bind-phase": "allocating-again"}), old),
        (changed({"kxpu.io/lock.nvidia.com_gpu": "x"}), old),
        (old, allocated),  # taking the allocated mark off again
    ):
        why = check(node_request(new, before))
        assert why is not None and why.startswith("the kxpu node daemon may only set kxpu.io/allocated.*"), (
            why
        )
        assert webhook_metrics.reason_of(why) == "reserved-annotations"
    dropped = check(node_request(changed(labels={}), old))
    assert dropped == "only the kxpu scheduler may set or remove the kxpu.io/assigned label"
    assert check(request(allocated, "UPDATE", old, user=TRUSTED[0])) is None  # the extender: all of them
    # CREATE with kxpu's annotations: nobody but the extender
    assert "may not carry" in str(check(request(allocated, user=NODE_SA)))


async def test_oversized_bodies_are_refused_before_they_are_read(server: Server) -> None:
    big = b'{"request": {"x": "' + b"a" * (webhook.MAX_BODY_BYTES + 10) + b'"}}'
    async with (
        aiohttp.ClientSession() as session,
        session.post(server.url + "/validate", data=big, ssl=server.ssl) as response,
    ):
        assert response.status == 413
        text = await response.text()
        assert text == f"request body is {len(big)} bytes; the limit is {webhook.MAX_BODY_BYTES}"


async def test_deep_json_is_a_400_not_a_server_error(server: Server) -> None:
    async with aiohttp.ClientSession() as session:
        for depth in (150, 200_000):
            deep = '{"request": {"object": ' + "[" * depth + "]" * depth + "}}"
            for path in ("/mutate", "/validate"):
                async with session.post(server.url + path, data=deep, ssl=server.ssl) as response:
                    text = await response.text()
                    assert (
                        response.status == 400
                        and text == "request body: JSON nested more than 100 levels deep"
                    )


def big_review(name: str, annotations: int = 6000) -> dict[str, Any]:
    """A valid review of a pod with many annotations (about 1 MiB): parsed on the worker thread."""
    p = pod(name, [{"cpu": 1}], annotations={f"example.com/a{i}": "v" * 150 for i in range(annotations)})
    return request(p) | {"uid": "req-1"}


async def test_large_reviews_are_answered_like_small_ones(server: Server) -> None:
    answer = await server.review("/validate", big_review("big"))
    assert answer["allowed"] is True


async def guarded(
    tmp_path: Path, **limits: Any
) -> tuple[web.AppRunner, bounds.GuardedSite, str, ssl.SSLContext]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "g.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "g.crt"))
    tls = webhook.ReloadingTLS(tmp_path / "g.crt", tmp_path / "g.key")
    conn = {k: limits.pop(k) for k in ("max_connections", "max_per_peer", "request_timeout_s") if k in limits}
    app = webhook.make_app(FAMILIES, "kxpu-scheduler", TRUSTED, request_timeout_s=conn.get("request_timeout_s", 10.0),
                           **limits)  # fmt: skip
    runner = web.AppRunner(app)
    await runner.setup()
    site = bounds.GuardedSite(runner, "127.0.0.1", 0, ssl_context=tls.context,
                                      max_connections=conn.get("max_connections", 256),
                                      max_per_peer=conn.get("max_per_peer"),
                                      request_timeout_s=conn.get("request_timeout_s", 10.0))  # fmt: skip
    app[webhook.GUARD].append(site.guard)
    await site.start()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return runner, site, f"https://127.0.0.1:{site.port}", client


async def test_slow_clients_are_cut_off_and_connections_are_capped(tmp_path: Path) -> None:
    """Slowloris (headers or body trickled) holds a connection for the request timeout only; past the cap, new
    connections are closed at once while a review on an open connection is still answered."""
    import asyncio
    import time

    runner, site, url, client_ssl = await guarded(tmp_path, max_connections=4, request_timeout_s=1.0)
    port = site.port
    try:

        async def tls_open() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ssl, server_hostname="127.0.0.1"
            )

        # headers never finished: closed after the timeout
        reader, writer = await tls_open()
        writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 10) == b""
        assert 0.9 <= time.monotonic() - started < 5
        writer.close()
        # body trickled: 408 naming the limit
        reader, writer = await tls_open()
        writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        reply = await asyncio.wait_for(reader.read(), 10)
        assert reply.startswith(b"HTTP/1.1 408") and b"request body not received within 1s" in reply
        writer.close()
        # the cap: 4 held connections, the 5th is closed at once (in the TLS handshake or right after it)
        held = [await tls_open() for _ in range(4)]
        for _, w in held:
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        for r, _ in held:
            assert (await asyncio.wait_for(r.readuntil(b"ok"), 10)).startswith(b"HTTP/1.1 200")
        try:
            r5, w5 = await tls_open()
            w5.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await asyncio.wait_for(r5.read(), 10) == b""
        except (ConnectionError, ssl.SSLError):
            pass
        assert site.guard.refused >= 1
        # once the held ones go (idle past the timeout), a new connection is served again
        for _, w in held:
            w.close()

        async def served() -> bool:
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(url + "/healthz", ssl=client_ssl) as resp,
                ):
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        deadline = time.monotonic() + 10
        while not await served():
            assert time.monotonic() < deadline, "no connection served after the held ones closed"
            await asyncio.sleep(0.1)
    finally:
        await runner.cleanup()


async def test_one_client_address_gets_only_its_share_of_connections(tmp_path: Path) -> None:
    """A pod holding connections cannot take them all: past max_per_peer from its address, it is refused."""
    import asyncio

    runner, site, _, client_ssl = await guarded(tmp_path, max_connections=8, max_per_peer=3)
    try:

        async def tls_open() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(
                "127.0.0.1", site.port, ssl=client_ssl, server_hostname="127.0.0.1"
            )

        held = [await tls_open() for _ in range(3)]
        for r, w in held:
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(r.readuntil(b"ok"), 10)).startswith(b"HTTP/1.1 200")
        try:
            r4, w4 = await tls_open()
            w4.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await asyncio.wait_for(r4.read(), 10) == b""
        except (ConnectionError, ssl.SSLError):
            pass
        assert site.guard.refused == 1 and site.guard.per_peer == {"127.0.0.1": 3}
        for _, w in held:
            w.close()
    finally:
        await runner.cleanup()


async def test_many_large_bodies_at_once_are_refused_not_buffered(tmp_path: Path) -> None:
    """Large bodies reserve their size from a shared budget: past it, 503 at once, before reading."""
    import asyncio

    runner, site, url, client_ssl = await guarded(tmp_path, body_budget=300_000)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", site.port, ssl=client_ssl,
                                                       server_hostname="127.0.0.1")  # fmt: skip
        writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 250000\r\n\r\n{")
        await writer.drain()
        async with aiohttp.ClientSession() as session:
            for _ in range(50):  # the first request's handler reserves once its headers are in
                async with session.post(url + "/validate", data=b"x" * 100_000, ssl=client_ssl) as response:
                    text = await response.text()
                if response.status == 503:
                    break
                await asyncio.sleep(0.05)
            assert response.status == 503 and text.startswith("too many large requests at once"), text
            writer.close()  # its reservation is returned once the server sees the connection go
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": big_review("b", 1000),
            }
            for _ in range(100):
                async with session.post(url + "/validate", json=review, ssl=client_ssl) as response:
                    if response.status != 503:
                        reply = await response.json()
                        break
                await asyncio.sleep(0.05)
            assert response.status == 200 and reply["response"]["allowed"] is True
    finally:
        await runner.cleanup()


async def test_a_bad_request_writes_one_short_log_line(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """A megabyte-long container name in a denied pod: the log line is cut, saying how much was left out."""
    import structlog

    from kxpu.logs import configure_logging

    configure_logging("info", "json")  # writes to the sys.stderr capsys put in place
    try:
        p = pod("p", [{"nvidia.com/gpu": 1}], schedulerName="kxpu-scheduler")
        p["spec"]["containers"][0]["name"] = "c" * 1_000_000
        p["spec"]["containers"][0]["securityContext"] = {"privileged": True}
        answer = await server.review("/validate", request(p))
        assert not answer["allowed"]
        lines = [line for line in capsys.readouterr().err.splitlines() if '"denied"' in line]
    finally:
        structlog.reset_defaults()
    assert len(lines) == 1 and len(lines[0]) < 5000, [len(line) for line in lines]
    assert "more characters)" in lines[0]

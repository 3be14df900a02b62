"""/status (and /metrics when asked) behind TokenReview + SubjectAccessReview: the daemon's HTTP server and
`kxpu status` against a stand-in API server over real HTTP (tests/kube_review_fake.py); e2e/test_http_auth.py
does the same against the real API server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient, KubeConfig

from kxpu.daemon.http import HealthServer
from kxpu.kube import review
from kxpu.kube.review import ReviewAuthorizer
from kxpu.status import DaemonRefused, daemon_status, status_token
from kxpu.testing.process import DaemonProcess
from tests.kube_review_fake import FakeReviewApi, User
from tests.test_daemon import simulated
from tests.waiting import wait_until

READER, STRANGER, REVIEWER = "reader-token", "stranger-token", "daemon-token"


@pytest.fixture
async def api() -> AsyncIterator[FakeReviewApi]:
    fake = FakeReviewApi(
        tokens={
            READER: User("system:serviceaccount:kxpu:reader"),
            STRANGER: User("system:serviceaccount:default:stranger"),
            REVIEWER: User("system:serviceaccount:kxpu:kxpu"),
        },
        allowed={("system:serviceaccount:kxpu:reader", "/status", "get")},
        reviewers={"system:serviceaccount:kxpu:kxpu"},
    )
    await fake.start()
    yield fake
    await fake.stop()


def _client(api: FakeReviewApi, token: str = REVIEWER) -> Callable[[], AsyncClient]:
    return lambda: AsyncClient(config=KubeConfig.from_dict(api.kubeconfig(token)), field_manager="kxpu")


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    started: list[HealthServer] = []

    async def start(authorize: Any, protect_metrics: bool = False) -> HealthServer:
        http = HealthServer(
            "127.0.0.1:0",
            lambda: (True, {"ready": True}),
            lambda: {"resources": {"example.com/npu": {"phase": "registered"}}},
            authorize,
            protect_metrics,
        )
        await http.start()
        started.append(http)
        return http

    yield start
    for http in started:
        await http.stop()


async def _get(port: int, path: str, token: str | None = None) -> tuple[int, dict[str, str], Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    is_json = headers.get("content-type") == "application/json"
    return int(lines[0].split()[1]), headers, json.loads(body) if is_json else body.decode()


async def test_status_needs_a_token_whose_user_may_get_it(api: FakeReviewApi, serve: Any) -> None:
    http = await serve(ReviewAuthorizer(_client(api)))

    code, headers, body = await _get(http.port, "/status")
    assert code == 401 and headers["www-authenticate"].startswith("Bearer")
    assert api.token_reviews == 0  # nothing to review

    code, _, body = await _get(http.port, "/status", "made-up")
    assert code == 401 and "invalid bearer token" in body["error"]

    code, _, body = await _get(http.port, "/status", STRANGER)
    assert code == 403
    assert body["error"] == 'user "system:serviceaccount:default:stranger" may not get /status'

    code, _, body = await _get(http.port, "/status", READER)
    assert code == 200 and body == {"resources": {"example.com/npu": {"phase": "registered"}}}
    # What the API server was asked: the user TokenReview named, on the non-resource URL.
    assert api.access_reviews[-1] == {
        "user": "system:serviceaccount:kxpu:reader",
        "uid": "uid-1",
        "groups": ["system:authenticated"],
        "nonResourceAttributes": {"path": "/status", "verb": "get"},
    }

    # Decisions are cached for a while: the same tokens again cost the API server nothing.
    reviews = api.token_reviews
    assert (await _get(http.port, "/status", READER))[0] == 200
    assert (await _get(http.port, "/status", STRANGER))[0] == 403
    assert api.token_reviews == reviews

    # Probes and (by default) /metrics are never checked: the kubelet and Prometheus send no token.
    for path in ("/healthz", "/readyz", "/metrics"):
        assert (await _get(http.port, path))[0] == 200, path


async def test_metrics_can_be_protected_too(api: FakeReviewApi, serve: Any) -> None:
    api.allowed.add(("system:serviceaccount:kxpu:reader", "/metrics", "get"))
    http = await serve(ReviewAuthorizer(_client(api)), protect_metrics=True)
    assert (await _get(http.port, "/metrics"))[0] == 401
    assert (await _get(http.port, "/metrics", STRANGER))[0] == 403
    code, _, text = await _get(http.port, "/metrics", READER)
    assert code == 200 and "# TYPE" in text
    assert (await _get(http.port, "/healthz"))[0] == 200


async def test_no_decision_without_the_api_server_is_503_and_not_cached(
    api: FakeReviewApi, serve: Any
) -> None:
    """Fail closed, say why, and ask again next time."""
    unreachable = ReviewAuthorizer(_client(FakeReviewApi(url="http://127.0.0.1:1")))
    http = await serve(unreachable)
    code, _, body = await _get(http.port, "/status", READER)
    assert code == 503 and body["error"].startswith("cannot review the token with the API server: ")
    assert (await _get(http.port, "/status", READER))[0] == 503
    assert unreachable.reviews == 2

    # The daemon's own account may not create reviews (the chart's RBAC missing): 503 naming the refusal.
    forbidden = await serve(ReviewAuthorizer(_client(api, STRANGER)))
    code, _, body = await _get(forbidden.port, "/status", READER)
    assert code == 503 and 'cannot create resource "tokenreviews"' in body["error"]

    # No API access at all (no service account, no kubeconfig): 503 with what to do.
    none = await serve(ReviewAuthorizer(None, "no API access: use --http-auth=none"))
    code, _, body = await _get(none.port, "/status", READER)
    assert code == 503 and body == {"error": "no API access: use --http-auth=none"}


def _kxpu_status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kxpu",
            "status",
            "--pod-resources-socket",
            "/nonexistent.sock",
            "-o",
            "json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )


async def test_kxpu_status_sends_a_token_to_a_daemon_that_checks_it(
    api: FakeReviewApi,
    write_config: Callable[..., Path],
    daemons: Callable[..., Any],
    workdir: Path,
) -> None:
    """The whole path: `kxpu plugin --http-auth kubernetes` with a kubeconfig (its account reviews tokens),
    and `kxpu status` with --token-file, with --kubeconfig's token, and with none."""
    daemon_kubeconfig = workdir / "daemon.kubeconfig"
    daemon_kubeconfig.write_text(yaml.safe_dump(api.kubeconfig(REVIEWER)))
    daemon: DaemonProcess = await daemons(
        write_config([simulated()]), "--http-auth", "kubernetes", env={"KUBECONFIG": str(daemon_kubeconfig)}
    )
    await wait_until(lambda: "waiting for the kubelet" in daemon.log_text(), what="the daemon to start")
    url = f"http://127.0.0.1:{daemon.http_port}"
    token_file = workdir / "token"
    token_file.write_text(READER + "\n")
    reader_kubeconfig = workdir / "reader.kubeconfig"
    reader_kubeconfig.write_text(yaml.safe_dump(api.kubeconfig(READER)))
    empty_home = {"HOME": str(workdir), "KUBECONFIG": str(workdir / "none")}

    def daemon_errors(result: subprocess.CompletedProcess[str]) -> list[str]:
        return [e for e in json.loads(result.stdout)["errors"] if e.startswith("kxpu daemon")]

    result = await asyncio.to_thread(
        _kxpu_status, "--daemon", url, "--token-file", str(token_file), env=empty_home
    )
    assert daemon_errors(result) == [] and json.loads(result.stdout)["resources"] == {
        "example.com/npu": "waiting-for-kubelet"
    }
    result = await asyncio.to_thread(
        _kxpu_status, "--daemon", url, "--kubeconfig", str(reader_kubeconfig), env=empty_home
    )
    assert daemon_errors(result) == []
    # A kubeconfig found in the environment is not lent unasked: no token, so 401
    result = await asyncio.to_thread(
        _kxpu_status, "--daemon", url, env={"HOME": str(workdir), "KUBECONFIG": str(reader_kubeconfig)}
    )
    assert [e.startswith(f"kxpu daemon at {url}: 401 Unauthorized") for e in daemon_errors(result)] == [True]
    result = await asyncio.to_thread(_kxpu_status, "--daemon", url, env=empty_home)
    assert daemon_errors(result) == [
        f"kxpu daemon at {url}: 401 Unauthorized: a bearer token is needed (Authorization: Bearer <token>); "
        "`kxpu status` sends one; pass a token with --token-file (by default the pod's service account token "
        "is sent)"
    ]
    stranger = workdir / "stranger"
    stranger.write_text(STRANGER)
    result = await asyncio.to_thread(
        _kxpu_status, "--daemon", url, "--token-file", str(stranger), env=empty_home
    )
    assert daemon_errors(result) == [
        f'kxpu daemon at {url}: 403 Forbidden: user "system:serviceaccount:default:stranger" may not get /status; '
        "that user needs RBAC `get` on the non-resource URL /status"
    ]
    result = await asyncio.to_thread(_kxpu_status, "--daemon", url, "--token-file", str(workdir / "missing"))
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"kxpu: error: --token-file {workdir / 'missing'}: No such file or directory"
    )


def test_a_token_goes_unasked_only_to_a_daemon_on_this_host(tmp_path: Path) -> None:
    """/status is plain HTTP: a credential is sent to another host only when the user names it."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(FakeReviewApi(url="https://x").kubeconfig("secret")))
    assert status_token("http://127.0.0.1:5978", None, kubeconfig) == "secret"
    assert status_token("http://localhost:5978", None, kubeconfig) == "secret"
    assert status_token("http://10.1.2.3:5978", None, kubeconfig) is None
    token = tmp_path / "token"
    token.write_text("chosen\n")
    assert status_token("http://10.1.2.3:5978", token, kubeconfig) == "chosen"


def test_a_kubeconfig_found_unasked_lends_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator's token in $KUBECONFIG is not sent to whatever answers on the daemon's port."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(FakeReviewApi(url="https://x").kubeconfig("admin-secret")))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr("kxpu.status.SERVICE_ACCOUNT_TOKEN", tmp_path / "no-token")
    assert status_token("http://127.0.0.1:5978", None, None) is None


def test_the_token_does_not_follow_a_redirect(tmp_path: Path) -> None:
    """A daemon (or whatever holds its port) answering 302 to another host gets no second request."""
    import http.server
    import threading

    seen: list[str | None] = []
    port: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{port[0]}/elsewhere")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    port.append(server.server_port)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(DaemonRefused):
            daemon_status(f"http://127.0.0.1:{port[0]}", token="secret")
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Bearer secret"]  # asked once; the redirect was not followed


async def test_a_daemon_without_api_access_says_so_once_and_answers_503(
    write_config: Callable[..., Path], daemons: Callable[..., Any], workdir: Path
) -> None:
    nowhere = {"HOME": str(workdir), "KUBECONFIG": str(workdir / "no-kubeconfig")}
    daemon: DaemonProcess = await daemons(
        write_config([simulated()]), "--http-auth", "kubernetes", env=nowhere
    )
    await wait_until(lambda: "waiting for the kubelet" in daemon.log_text(), what="the daemon to start")
    assert (await daemon.http_get("/status"))[0] == 401  # no token sent: that is said first
    code, _, body = await _get(daemon.http_port, "/status", READER)
    reason = (
        "--http-auth=kubernetes, but this daemon has no API access to review tokens (no service-account token "
        f"in /var/run/secrets/kubernetes.io/serviceaccount and no kubeconfig at {workdir / 'no-kubeconfig'}): "
        "give it a service account token or a kubeconfig, or start it with --http-auth=none"
    )
    assert code == 503 and body == {"error": reason}
    lines = [line for line in daemon.log_text().splitlines() if "no API access" in line]
    assert len(lines) == 1 and "level=warning" in lines[0] and json.dumps(reason)[1:-1] in lines[0], lines
    assert (await daemon.http_get("/healthz"))[0] == 200


async def test_an_api_server_that_does_not_answer_is_a_503_in_bounded_time(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that hangs (no route to the Service IP, a stuck API server): the caller hears why."""
    monkeypatch.setattr(review, "REVIEW_SECONDS", 0.5)
    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    silence = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = silence.sockets[0].getsockname()[1]
    http = await serve(ReviewAuthorizer(_client(FakeReviewApi(url=f"http://127.0.0.1:{port}"))))
    loop = asyncio.get_running_loop()
    began = loop.time()
    code, _, body = await _get(http.port, "/status", READER)
    assert (code, body) == (
        503,
        {"error": "cannot review the token with the API server: the API server did not answer within 0.5 s"},
    )
    assert loop.time() - began < 5
    for writer in held:
        writer.close()
    silence.close()

"""The node daemon's /status behind the real API server's TokenReview and SubjectAccessReview: no token 401,
a token whose user may not `get` /status 403, one that may 200; `kxpu status` with a token file works; the
probes need no token."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

from e2e import kube
from e2e.configs import NPU, simulated
from e2e.conftest import E2E, kxpu_binary

NAMESPACE = "kxpu-e2e-http-auth"
ROLE = "kxpu-e2e-status-reader"
URL = "http://127.0.0.1:5978"  # the daemon's default --http-address


def _get(path: str, token: str | None = None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(URL + path)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_status_answers_only_tokens_allowed_to_get_it(e2e: E2E) -> None:
    cluster = e2e.cluster
    objects = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        *(
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": NAMESPACE}}
            for name in ("reader", "stranger")
        ),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": ROLE},
            "rules": [{"nonResourceURLs": ["/status"], "verbs": ["get"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": ROLE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ROLE},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NAMESPACE}],
        },
    ]
    cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    )
    e2e.cleanups.append(
        lambda: cluster.kubectl(
            "delete",
            "clusterrolebinding/" + ROLE,
            "clusterrole/" + ROLE,
            "namespace/" + NAMESPACE,
            "--wait=false",
        )
    )
    reader = cluster.kubectl("create", "token", "reader", "-n", NAMESPACE, "--duration=10m").strip()
    stranger = cluster.kubectl("create", "token", "stranger", "-n", NAMESPACE, "--duration=10m").strip()

    # The daemon reviews tokens with the credentials it has: here the admin kubeconfig (in the chart, its
    # service account bound to system:auth-delegator). --http-auth kubernetes is the default.
    e2e.kxpu([simulated()], env={"KUBECONFIG": str(cluster.kubeconfig)})
    kube.wait_resource(cluster, NPU, allocatable=4, capacity=4)

    assert _get("/healthz")[0] == 200 and _get("/readyz")[0] == 200  # the kubelet's probes carry no token
    code, body = _get("/status")
    assert code == 401, body
    code, body = _get("/status", "not-a-token")
    assert code == 401, body
    code, body = _get("/status", stranger)
    assert (code, body) == (
        403,
        {"error": f'user "system:serviceaccount:{NAMESPACE}:stranger" may not get /status'},
    )

    # A fresh binding may take a moment to reach the authorizer; a denial is cached for 10 s.
    def allowed() -> dict[str, object] | None:
        code, body = _get("/status", reader)
        return body if code == 200 else None

    status = kube.wait_until("the reader to be allowed", allowed, 30)
    assert status["resources"][NPU]["phase"] == "registered"  # type: ignore[index]

    token_file = e2e.tmp / "reader.token"
    token_file.write_text(reader)
    result = subprocess.run(
        [str(kxpu_binary()), "status", "--daemon", URL, "--token-file", str(token_file), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(result.stdout)
    assert not [e for e in doc["errors"] if e.startswith("kxpu daemon")], doc["errors"]
    assert doc["resources"] == {NPU: "registered"}

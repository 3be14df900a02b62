"""The chart with sharing on and its image missing (a typo, a registry down): the webhook never runs, and every
workload that does not ask for a shared device is admitted and runs as if kxpu were not installed. Only pods
asking for the shared resources wait on the webhook (failurePolicy Fail: refused until it answers, never placed
unchecked)."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from e2e import kube
from e2e.cluster import Cluster
from e2e.conftest import E2E
from e2e.test_helm import CHART, HELM, helm

RELEASE = "kxpu-e2e-noimage"
NAMESPACE = "kxpu-e2e-noimage"
RES = "noimage.kxpu.io/npu"
TLS_SECRET = "kxpu-e2e-noimage-tls"

pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm is not built: run `make helm` (hack/helm/build.sh)"
)


@pytest.fixture
def release(e2e: E2E, tmp_path: Path) -> Iterator[Cluster]:
    cluster = e2e.cluster
    ca = trustme.CA()
    cert = ca.issue_cert(f"{RELEASE}-webhook.{NAMESPACE}.svc")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    values = {
        # Not in containerd, and never pulled: what a mistyped repository or an unreachable registry gives.
        "image": {"repository": "kxpu.local/kxpu-missing", "tag": "0.0.0", "pullPolicy": "Never"},
        "config": {
            "version": "v1",
            "resources": [{"name": RES, "simulated": {"count": 1}, "sharing": {"splitCount": 2}}],
        },
        "sharing": {"enabled": True, "families": [{"resource": RES}]},
        "webhook": {
            "tls": {"secretName": TLS_SECRET, "caBundle": base64.b64encode(ca.cert_pem.bytes()).decode()}
        },
    }
    (tmp_path / "values.json").write_text(json.dumps(values))
    k = cluster.kubectl
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(
            k, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", timeout=120
        )
        k("create", "namespace", NAMESPACE)
        k("create", "secret", "tls", TLS_SECRET, "-n", NAMESPACE,
          f"--cert={tmp_path / 'tls.crt'}", f"--key={tmp_path / 'tls.key'}")  # fmt: skip
        cleanup.callback(helm, cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--ignore-not-found",
                         "--wait", "--timeout", "90s")  # fmt: skip
        helm(
            cluster,
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "-f",
            str(tmp_path / "values.json"),
        )
        yield cluster


def test_sharing_with_its_image_missing_blocks_no_other_pod(e2e: E2E, release: Cluster) -> None:
    cluster = release

    def webhook_cannot_start() -> str | None:
        pods = cluster.kubectl_json(
            "get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=webhook"
        )
        for pod in pods["items"]:
            for status in pod.get("status", {}).get("containerStatuses", []):
                reason = status.get("state", {}).get("waiting", {}).get("reason")
                if reason == "ErrImageNeverPull":
                    return str(reason)
        return None

    kube.wait_until("the webhook pod failing on its missing image", webhook_cannot_start, 90)
    registered = cluster.kubectl_json("get", "mutatingwebhookconfiguration", f"{RELEASE}-webhook-{NAMESPACE}")
    assert registered["webhooks"][0]["failurePolicy"] == "Fail"

    # An ordinary pod in an ordinary namespace (the webhook's namespaceSelector takes it in): admitted at once and
    # running, the webhook never called (matchConditions: it asks for no shared resource).
    plain = e2e.pod("plain", "echo end-of-report", {})
    kube.wait_pod_log(cluster, plain.name, "end-of-report", timeout=60)
    assert kube.get_pod(cluster, plain.name)["status"]["phase"] == "Running"

    # A pod asking for a share is refused while no webhook answers, saying why: never placed without a signature.
    shared = kube.PodSpec(name=f"{e2e.label[:30]}-shared", script="true", limits={RES: 1, RES + "mem": 100})
    err = create_error(cluster, shared)
    assert "failed calling webhook" in err and f"{RELEASE}-webhook" in err, (
        err
    )  # names the webhook it waits on
    assert not cluster.kubectl("get", "pod", shared.name, "--ignore-not-found").strip()


def create_error(cluster: Cluster, spec: kube.PodSpec) -> str:
    """kubectl create's error for a pod the API server refuses."""
    proc = subprocess.run(
        [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "create", "-f", "-"],
        input=json.dumps(spec.manifest()),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0, proc.stdout
    return proc.stderr

"""What users apply from this repository, applied to the real cluster: every Kubernetes manifest under examples/
(dry-run=server: the API server validates each object and runs admission; the quick starts apply the rest for
real), deploy/manifests/kxpu.yaml as deploy/README.md tells (for real: the node gets its devices), kxpu-dra.yaml
(dry-run), and examples/sharing/kube-scheduler.yaml loaded by the cluster's own kube-scheduler."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from e2e import kube
from e2e.cluster import REPO, Cluster
from e2e.conftest import E2E
from e2e.test_helm import ARCHIVE
from e2e.test_quickstart import NAMESPACE, release_images

EXAMPLES = REPO / "examples"
MANIFESTS = REPO / "deploy" / "manifests"


def kube_manifests() -> list[Path]:
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        # (KubeSchedulerConfiguration is a component's config, not an API object: the last test loads it)
        objects = docs and all({"apiVersion", "kind", "metadata"} <= d.keys() for d in docs)
        if objects and docs[0]["kind"] != "KubeSchedulerConfiguration":
            out.append(path)
    return out


def test_the_manifests_are_found() -> None:
    names = {str(p.relative_to(EXAMPLES)) for p in kube_manifests()}
    assert {
        "dra/pod.yaml",
        "dra/shares-pod.yaml",
        "sharing/webhooks.yaml",
        "quickstart/npu-pod.yaml",
    } <= names


@pytest.mark.parametrize("path", kube_manifests(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_is_accepted_by_the_api_server(cluster: Cluster, path: Path) -> None:
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(path))
    kinds = [d["kind"] for d in yaml.safe_load_all(path.read_text()) if d]
    assert out.count("(server dry run)") == len(kinds), out


@pytest.mark.skipif(not ARCHIVE.is_file(), reason=f"no image archive at {ARCHIVE}: run `make image`")
def test_plain_manifests_serve_the_node(e2e: E2E) -> None:
    """`kubectl apply -f deploy/manifests/kxpu.yaml` (the chart's defaults: two simulated NPUs per node): the
    daemon becomes Ready and the node advertises them; `kubectl delete -f` takes them away again."""
    assert "kubectl apply -f deploy/manifests/kxpu.yaml" in (REPO / "deploy" / "README.md").read_text()
    cluster = e2e.cluster
    release_images(cluster)
    plain = str(MANIFESTS / "kxpu.yaml")
    dra = str(MANIFESTS / "kxpu-dra.yaml")
    e2e.cleanups.append(
        lambda: cluster.kubectl("delete", "-f", plain, "--ignore-not-found", "--wait=true", timeout=180)
    )
    cluster.kubectl("apply", "-f", plain)
    cluster.kubectl(
        "rollout", "status", "daemonset/kxpu-plugin", "-n", NAMESPACE, "--timeout=120s", timeout=150
    )
    kube.wait_resource(cluster, "example.com/sim-npu", allocatable=2, capacity=2, timeout=60)
    # The DRA rendering, into the same namespace (which kxpu.yaml made): every object valid, admission passed.
    out = cluster.kubectl("apply", "--dry-run=server", "-f", dra)
    assert "deviceclass.resource.k8s.io/npu.example.com created (server dry run)" in out, out
    cluster.kubectl("delete", "-f", plain, "--wait=true", timeout=180)
    kube.wait_resource(cluster, "example.com/sim-npu", allocatable=0, timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_kube_scheduler_takes_the_example_config(cluster: Cluster, tmp_path: Path) -> None:
    """examples/sharing/kube-scheduler.yaml, with this cluster's kubeconfig added, is what the cluster's own
    kube-scheduler loads and serves with (its strict decoding and validation refuse anything else)."""
    config = yaml.safe_load((EXAMPLES / "sharing" / "kube-scheduler.yaml").read_text())
    config["clientConnection"] = {"kubeconfig": str(cluster.kubeconfig)}
    path = tmp_path / "kube-scheduler.yaml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    log = tmp_path / "kube-scheduler.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(cluster.k8s_bin / "kube-scheduler"), f"--config={path}", f"--secure-port={port}",
             "--bind-address=127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

        def healthy() -> bool:
            assert proc.poll() is None, f"kube-scheduler exited {proc.returncode}: {log.read_text()[-2000:]}"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as r,
            ):
                return bool(r.read() == b"ok")
            return False

        kube.wait_until("kube-scheduler healthy with the example config", healthy, 60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""kxpu installed the way users install it: the image imported into containerd, the Helm chart installed.

Needs the image archive (`make image`: hack/image/build.sh) and helm (`make helm`: hack/helm/build.sh); the
scenario is skipped, saying which, when either is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tarfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import kube
from e2e.cluster import REPO, Cluster
from e2e.configs import simulated
from e2e.conftest import E2E

ARCHIVE = Path(os.environ.get("KXPU_IMAGE_ARCHIVE", REPO / "out" / "kxpu-image.tar"))
CHART = REPO / "deploy" / "helm" / "kxpu"
RELEASE = "kxpu-e2e"
NAMESPACE = "kxpu-e2e-helm"
RESOURCE = (
    "helm.kxpu.io/npu"  # not the other scenarios' resource: the chart's daemon may outlive a failure here
)


def _helm_path() -> Path | None:
    if os.environ.get("KXPU_HELM"):
        return Path(os.environ["KXPU_HELM"])
    out = subprocess.run(
        ["bash", str(REPO / "hack" / "helm" / "build.sh"), "path"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return Path(out) if out and Path(out).is_file() else None


HELM = _helm_path()

pytestmark = [
    pytest.mark.skipif(
        not ARCHIVE.is_file(), reason=f"no image archive at {ARCHIVE}: run `make image` (hack/image/build.sh)"
    ),
    pytest.mark.skipif(HELM is None, reason="helm is not built: run `make helm` (hack/helm/build.sh)"),
]


def image_ref(archive: Path) -> str:
    """The reference containerd gives the image on import (the index's io.containerd.image.name)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        assert member is not None, f"{archive} has no index.json: not an OCI archive"
        index = json.load(member)
    name = index["manifests"][0].get("annotations", {}).get("io.containerd.image.name")
    assert isinstance(name, str), f"{archive}: the manifest has no io.containerd.image.name annotation"
    return name


def helm(cluster: Cluster, *args: str, timeout: float = 180) -> str:
    assert HELM is not None
    proc = subprocess.run(
        [str(HELM), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"helm {' '.join(args[:2])} failed: {proc.stderr.strip()}"
    return proc.stdout


def daemon_pods(
    cluster: Cluster, namespace: str = NAMESPACE, release: str = RELEASE, selector: str = ""
) -> list[dict[str, Any]]:
    """The release's pods (``selector``: more labels, e.g. ``app.kubernetes.io/component=webhook``)."""
    labels = ",".join(filter(None, [f"app.kubernetes.io/instance={release}", selector]))
    out = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", labels)
    items = out.get("items", [])
    assert isinstance(items, list)
    return items


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def diagnostics(cluster: Cluster, namespace: str = NAMESPACE, release: str = RELEASE) -> str:
    """What an operator would look at when the daemon pod does not become Ready."""
    parts = []
    for args in (
        ("get", "daemonsets,deployments,pods", "-n", namespace, "-o", "wide"),
        ("describe", "pods", "-n", namespace),
        (
            "logs",
            "-n",
            namespace,
            "-l",
            f"app.kubernetes.io/instance={release}",
            "--tail=60",
            "--all-containers",
        ),
    ):
        parts.append(f"$ kubectl {' '.join(args)}\n{cluster.kubectl(*args, check=False)}")
    return "\n".join(parts)


@pytest.fixture
def release(e2e: E2E) -> Iterator[Cluster]:
    """The image imported and the chart installed; uninstalled (and its namespace deleted) afterwards."""
    cluster = e2e.cluster
    ref = image_ref(ARCHIVE)
    cluster.ctr("images", "import", str(ARCHIVE))
    assert ref in cluster.ctr("images", "ls", "-q").split(), (
        f"{ref} not in containerd after importing {ARCHIVE}"
    )
    repository, _, tag = ref.rpartition(":")
    config = {"version": "v1", "resources": [simulated(count=2, name=RESOURCE)]}
    try:
        helm(
            cluster, "upgrade", "--install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            # Imported, not pulled: there is no registry.
            "--set", "image.pullPolicy=Never",
            "--set-json", f"config={json.dumps(config)}",
        )  # fmt: skip
        yield cluster
    finally:
        helm(cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "90s")
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=90s", timeout=120)


def test_helm_install_serves_devices(e2e: E2E, release: Cluster) -> None:
    """The chart's DaemonSet becomes Ready, the node advertises its devices, and a pod gets one."""
    cluster = release
    try:
        (pod,) = kube.wait_until(
            "one Ready kxpu daemon pod", lambda: [p for p in daemon_pods(cluster) if ready(p)], 120
        )
    except kube.WaitTimeout as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster)}") from None
    container = pod["spec"]["containers"][0]
    assert container["image"] == image_ref(ARCHIVE)
    assert pod["spec"]["priorityClassName"] == "system-node-critical"

    kube.wait_resource(cluster, RESOURCE, allocatable=2, capacity=2)

    # The metrics endpoint the Service and ServiceMonitor point at, straight at the pod.
    base = f"http://{pod['status']['podIP']}:5978"
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    assert f'kxpu_resource_registered{{resource="{RESOURCE}"}} 1.0' in metrics, metrics[-2000:]
    with urllib.request.urlopen(f"{base}/readyz", timeout=5) as resp:
        assert resp.status == 200

    workload = e2e.pod(
        "helm-one", 'echo "SIM_VISIBLE_DEVICES=$SIM_VISIBLE_DEVICES"\necho end-of-report', {RESOURCE: 1}
    )
    log = kube.wait_pod_log(cluster, workload.name, "end-of-report", timeout=90)
    assert re.search(r"^SIM_VISIBLE_DEVICES=sim-npu-[01]$", log, re.M), log

    # /status is checked (plugin.httpAuth: kubernetes): no token, 401; `kxpu status` in the pod sends the pod's
    # own token, which the daemon has the API server review through the chart's RBAC. This cluster runs no
    # kube-proxy: the pod reaches the `kubernetes` Service as in test_helm_sharing (imported here, not at the
    # top: that module imports this one).
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/status", timeout=5)
    assert refused.value.code == 401
    if shutil.which("iptables") is None:
        return  # the route below needs it (test_helm_sharing is skipped then too)
    from e2e.test_helm_sharing import ServiceRoutes

    routes = ServiceRoutes()
    e2e.cleanups.append(routes.close)
    routes.api_server_for_pods()
    out = cluster.kubectl(
        "exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "kxpu", "status", "-o", "json"
    )
    doc = json.loads(out)
    assert not [e for e in doc["errors"] if e.startswith("kxpu daemon")], doc["errors"]
    assert doc["resources"] == {RESOURCE: "registered"}

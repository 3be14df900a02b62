"""The README's four quick starts, run verbatim on the real cluster (``e2e/quickstart.py`` extracts them).

What a user's cluster has and this one lacks, the harness provides before the blocks run, and nothing else:
the images the blocks name, under those names (kxpu's archive tagged as the chart's default
``ghcr.io/kxpu/kxpu:<version>``, busybox as ``busybox:1.37``, kube-scheduler from the cluster's own binary as
``registry.k8s.io/kube-scheduler:<server version>``: there is no registry here), and kube-proxy's part for the
Services the blocks use (test_helm_sharing.ServiceRoutes). Each block's output is then checked for what the
README says it shows. A README edit that breaks a block fails here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from e2e import kube, oci, quickstart
from e2e.cluster import NODE_NAME, REPO, SERVICE_CIDR, Cluster
from e2e.conftest import E2E
from e2e.test_helm import ARCHIVE, HELM, diagnostics, image_ref
from e2e.test_helm import pytestmark as helm_skips
from e2e.test_helm_sharing import ServiceRoutes
from kxpu.sharing.inventory import annotation_key
from kxpu.sharing.lock import lock_key

pytestmark = helm_skips

NAMESPACE, RELEASE = "kxpu-system", "kxpu"  # what the README's blocks use
BUSYBOX = "docker.io/library/busybox:1.37"  # `busybox:1.37` in the examples


def version() -> str:
    text: str = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    return text


class Shell:
    """A user's shell: kubectl and helm on PATH, KUBECONFIG set, in a directory with the repository's deploy/ and
    examples/ (nothing else the blocks could lean on)."""

    def __init__(self, cluster: Cluster, work: Path) -> None:
        assert HELM is not None
        self.cluster, self.work = cluster, work
        bin_dir = work / "bin"
        bin_dir.mkdir()
        (bin_dir / "helm").symlink_to(HELM)
        (bin_dir / "kubectl").symlink_to(cluster.kubectl_bin)
        for name in ("deploy", "examples"):
            (work / name).symlink_to(REPO / name)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "KUBECONFIG": str(cluster.kubeconfig),
        }

    def run(self, mode: str, step: str, block: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"README quick start {mode!r}, {step} block, exit {proc.returncode}:\n{block}\n"
                f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}\n"
                f"{diagnostics(self.cluster, NAMESPACE, RELEASE)}"
            )
        return proc.stdout


def release_images(cluster: Cluster) -> None:
    """kxpu's archive under the chart's default reference and busybox under the examples' one, as a registry (or
    a mirror) would serve them."""
    cluster.ctr("images", "import", str(ARCHIVE))
    cluster.ctr("images", "tag", "--force", image_ref(ARCHIVE), f"ghcr.io/kxpu/kxpu:{version()}")
    cluster.ctr("images", "tag", "--force", "kxpu.local/busybox:v1", BUSYBOX)


def server_version(cluster: Cluster) -> str:
    doc = json.loads(cluster.kubectl("version", "-o", "json"))
    match = re.match(r"v\d+\.\d+\.\d+", doc["serverVersion"]["gitVersion"])
    assert match, doc
    return match.group(0)


@pytest.fixture
def shell(e2e: E2E, tmp_path: Path) -> Iterator[Shell]:
    """The images under the names the README uses, the kubernetes Service routed for pods; afterwards, whatever
    happened, the release, its namespace and the examples' objects gone and the node's kxpu annotations cleared."""
    cluster = e2e.cluster
    if shutil.which("iptables") is None:
        pytest.skip("iptables not found: the Services need NAT rules (there is no kube-proxy)")
    if SERVICE_CIDR not in "".join(
        p.read_text() for p in (cluster.state / "cni" / "net.d").glob("*.conflist")
    ):
        pytest.skip(
            "the running cluster predates the pods' route to Service IPs: restart it (make cluster-down)"
        )
    release_images(cluster)
    work = tmp_path / "user"
    work.mkdir()
    k = cluster.kubectl
    with contextlib.ExitStack() as cleanup:  # unwound last to first
        examples = [str(p) for p in sorted((REPO / "examples").rglob("*.yaml")) if "pod" in p.name]
        for example in examples:
            cleanup.callback(
                k, "delete", "-f", example, "--ignore-not-found", "--wait=true", check=False, timeout=120
            )
        cleanup.callback(
            k, "annotate", "node", NODE_NAME, f"{annotation_key('example.com/sim-npu')}-",
            f"{lock_key('example.com/sim-npu')}-", check=False,
        )  # fmt: skip
        cleanup.callback(k, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true", check=False,
                         timeout=120)  # fmt: skip
        assert HELM is not None
        uninstall = [
            str(HELM),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "uninstall",
            RELEASE,
            "-n",
            NAMESPACE,
        ]
        cleanup.callback(
            subprocess.run, [*uninstall, "--ignore-not-found", "--wait"], check=False, timeout=180
        )
        routes = ServiceRoutes()
        cleanup.callback(routes.close)
        routes.api_server_for_pods()
        e2e.cleanups.append(cleanup.pop_all().close)
    yield Shell(cluster, work)


def run_all(shell: Shell, mode: str, between: Callable[[], None] | None = None) -> tuple[str, str]:
    """Install, (the harness's part, if any), try, clean up; returns the install and try blocks' output."""
    qs = quickstart.load()[mode]
    installed = shell.run(mode, "install", qs.install)
    if between is not None:
        between()
    tried = shell.run(mode, "try", qs.try_)
    shell.run(mode, "clean up", qs.clean_up)
    assert not shell.cluster.kubectl("get", "namespace", NAMESPACE, "--ignore-not-found").strip(), (
        f"{mode}: the clean-up block left namespace {NAMESPACE}"
    )
    return installed, tried


def test_quickstart_device_plugin(shell: Shell) -> None:
    _, out = run_all(shell, "device-plugin")
    assert re.search(r"^KXPU_VISIBLE_DEVICES=sim-[01]$", out, re.M), out
    # kxpu status: both devices, one held by the pod
    assert re.search(r"example\.com/sim-npu\s+sim-[01]\s+Healthy\b.*default/npu-pod/main", out), out
    kube.wait_resource(shell.cluster, "example.com/sim-npu", allocatable=0, timeout=60)


def test_quickstart_dra(shell: Shell) -> None:
    _, out = run_all(shell, "dra")
    assert "npu.example.com" in out  # kubectl get resourceslices
    assert re.search(r"^NPU_VISIBLE_DEVICES=sim-npu-3$", out, re.M), out  # the 64 GiB one, by CEL
    assert re.search(r"npu-workload-npus-\S+\s+allocated,reserved", out), out
    assert re.search(r"sim-npu-3\s.*default/npu-workload/main", out), out  # kxpu status: the claim's holder


def test_quickstart_sharing_extender(shell: Shell) -> None:
    cluster = shell.cluster
    ks_binary = cluster.k8s_bin / "kube-scheduler"
    archive = shell.work.parent / "kube-scheduler.tar"
    oci.binary_image(archive, f"registry.k8s.io/kube-scheduler:{server_version(cluster)}", ks_binary)
    cluster.ctr("images", "import", str(archive))
    pod = yaml.safe_load((REPO / "examples" / "quickstart" / "shared-pod.yaml").read_text())
    pod["metadata"]["name"] = "quickstart-dry-run"

    routes = ServiceRoutes()

    def webhook_reachable() -> None:
        """kube-proxy's part: the API server reaches the webhook Service at a webhook pod."""
        service = cluster.kubectl_json("get", "service", f"{RELEASE}-webhook", "-n", NAMESPACE)
        pods = cluster.kubectl_json(
            "get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=webhook"
        )
        routes.service_for_host(service["spec"]["clusterIP"], pods["items"][0]["status"]["podIP"], 8443)

        def admitted() -> bool:  # raises (and is polled again) while the API server cannot reach the webhook
            cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod))
            return True

        kube.wait_until("the webhook admitting a dry-run pod", admitted, 60)

    try:
        _, out = run_all(shell, "sharing-extender", webhook_reachable)
    finally:
        routes.close()
    assert re.search(r"^kxpu-scheduler$", out, re.M), out
    assert re.search(r"^CUDA_DEVICE_MEMORY_LIMIT_0=4000m$", out, re.M), out
    assert re.search(r"^CUDA_DEVICE_SM_LIMIT=25$", out, re.M), out
    # kxpu status --cluster: the pod's share of its NPU
    assert re.search(r"shared-npu-pod/main \(4000 MiB, 25%\)", out), out


def test_quickstart_sharing_dra(shell: Shell) -> None:
    _, out = run_all(shell, "sharing-dra")
    assert 'deployment "shared-npu-workload" successfully rolled out' in out, out
    assert re.search(r"^CUDA_DEVICE_MEMORY_LIMIT_0=6144m$", out, re.M), out
    assert re.search(r"^CUDA_DEVICE_SM_LIMIT=30$", out, re.M), out
    # kxpu status: every NPU holds two of the four claims
    for device in ("sim-npu-0", "sim-npu-1"):
        (line,) = [ln for ln in out.splitlines() if re.search(rf"\s{device}\s", ln)]
        assert line.count("/main") == 2, out

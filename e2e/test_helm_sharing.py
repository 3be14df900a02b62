"""The chart with ``sharing.enabled``: its kube-scheduler + extender, webhook and node daemon, all as pods.

kube-scheduler's image is written locally from the cluster's own binary (``e2e/oci.py``) and imported, like
kxpu's image; the webhook's certificate comes from a throwaway CA (trustme). The e2e cluster runs no
kube-proxy, and its API server listens on loopback only, so the scenario does kube-proxy's part for the two
Services it needs (pods have a route to Service IPs through the host, ``e2e/cluster.py``): pods to
``kubernetes`` (10.96.0.1:443 DNAT to 127.0.0.1:6443, with ``route_localnet``) and the API server to the
webhook's ClusterIP (DNAT to the pod, masqueraded as the pod bridge); the rules (iptables nat, tagged with a
comment) and the sysctl are undone afterwards. Skipped, saying why, without the image archive, helm or iptables.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from e2e import kube, oci
from e2e.cluster import API_PORT, NODE_NAME, POD_SUBNET, SERVICE_CIDR, SERVICE_IP, Cluster
from e2e.conftest import E2E
from e2e.test_helm import ARCHIVE, CHART, daemon_pods, diagnostics, helm, image_ref, ready
from e2e.test_helm import pytestmark as helm_skips
from kxpu.sharing import signing
from kxpu.sharing.inventory import annotation_key
from kxpu.sharing.lock import lock_key

pytestmark = helm_skips  # no image archive or no helm: skipped, saying which

RELEASE = "kxpu-e2e-sharing"  # contains the chart's name: the objects are named <release>-<component>
NAMESPACE = "kxpu-e2e-helm-sharing"
TENANT_NS = "kxpu-e2e-helm-tenant"  # any namespace but kube-system and the release's goes through the webhook
RES = "helm.kxpu.io/snpu"  # neither test_helm.py's nor test_sharing.py's resource
MEM, CORES = RES + "mem", RES + "cores"
DEVICES, SPLIT = 2, 4
SCHEDULER_NAME = "kxpu-scheduler"  # the chart's default sharing.schedulerName
TLS_SECRET = "kxpu-e2e-webhook-tls"
WEBHOOK = f"{RELEASE}-webhook"
SIGNING_SECRET = f"{RELEASE}-signing-ed25519"  # made by the extender on first start; read by it only
VERIFY_KEYS = f"{RELEASE}-verify-keys"  # the public keys the extender publishes for the node daemons
RULE_TAG = "kxpu-e2e-helm-sharing"  # the comment on every iptables rule this scenario adds
REPORT_END = "end-of-report"


def dnat(to: str) -> tuple[str, ...]:
    return ("DNAT", "--to-destination", to)


class ServiceRoutes:
    """kube-proxy's part, for the Services this scenario uses: DNAT rules in the nat table, removed on close."""

    def __init__(self) -> None:
        self.rules: list[list[str]] = []
        self.localnet = Path("/proc/sys/net/ipv4/conf/all/route_localnet")
        self.localnet_was: str | None = None

    def add(self, chain: str, *match: str, target: tuple[str, ...]) -> None:
        rule = [chain, "-p", "tcp", *match, "-m", "comment", "--comment", RULE_TAG, "-j", *target]
        subprocess.run(["iptables", "-t", "nat", "-I", *rule], check=True, capture_output=True, timeout=30)
        self.rules.append(rule)

    def api_server_for_pods(self) -> None:
        """Pods reach the ``kubernetes`` Service (their in-cluster config) at the API server on loopback."""
        self.localnet_was = self.localnet.read_text().strip()
        self.localnet.write_text("1")  # "all": the pod bridge appears only with the first pod
        self.add(
            "PREROUTING",
            "-s",
            POD_SUBNET,
            "-d",
            SERVICE_IP,
            "--dport",
            "443",
            target=dnat(f"127.0.0.1:{API_PORT}"),
        )

    def service_for_host(self, service_ip: str, pod_ip: str, port: int) -> None:
        """The API server reaches a Service (port 443) at its pod; from the pod bridge's address, since pods have
        no route back to the host's others."""
        self.add("OUTPUT", "-d", service_ip, "--dport", "443", target=dnat(f"{pod_ip}:{port}"))
        self.add(
            "POSTROUTING", "-d", pod_ip, "--dport", str(port), "!", "-s", POD_SUBNET, target=("MASQUERADE",)
        )

    def close(self) -> None:
        for rule in reversed(self.rules):
            subprocess.run(
                ["iptables", "-t", "nat", "-D", *rule], check=False, capture_output=True, timeout=30
            )
        self.rules.clear()
        if self.localnet_was is not None:
            self.localnet.write_text(self.localnet_was)


def kube_scheduler_image(cluster: Cluster, work: Path) -> str:
    """kube-scheduler's image, from the cluster's own binary, imported into containerd; returns its ref."""
    binary = cluster.k8s_bin / "kube-scheduler"
    version = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    ref = f"kxpu.local/kube-scheduler:{version.stdout.split()[-1]}"  # "Kubernetes v1.34.4"
    archive = work / "kube-scheduler.tar"
    oci.binary_image(archive, ref, binary)
    cluster.ctr("images", "import", str(archive))
    assert ref in cluster.ctr("images", "ls", "-q").split(), f"{ref} not in containerd after import"
    return ref


def values(kxpu_ref: str, scheduler_ref: str, ca_pem: bytes) -> dict[str, Any]:
    repository, _, tag = kxpu_ref.rpartition(":")
    ks_repository, _, ks_tag = scheduler_ref.rpartition(":")
    return {
        # Imported, not pulled: there is no registry.
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "config": {
            "version": "v1",
            "resources": [
                {
                    "name": RES,
                    "simulated": {"count": DEVICES, "memoryMiB": 16000, "cores": 64},
                    "sharing": {"splitCount": SPLIT},  # the chart fills in its signing key
                }
            ],
        },
        "sharing": {"enabled": True, "families": [{"resource": RES}]},
        "scheduler": {
            "kubeScheduler": {"image": {"repository": ks_repository, "tag": ks_tag, "pullPolicy": "Never"}}
        },
        "webhook": {"tls": {"secretName": TLS_SECRET, "caBundle": base64.b64encode(ca_pem).decode()}},
    }


@pytest.fixture
def release(e2e: E2E, tmp_path: Path) -> Iterator[tuple[Cluster, ServiceRoutes]]:
    """Both images imported, the kubernetes Service routed, the TLS Secret made and the chart installed with
    sharing on; afterwards (each step whatever the others do) uninstalled, namespaces deleted, rules removed and
    the node's annotations cleared."""
    cluster = e2e.cluster
    if shutil.which("iptables") is None:
        pytest.skip("iptables not found: the Services need NAT rules (there is no kube-proxy)")
    if SERVICE_CIDR not in "".join(
        p.read_text() for p in (cluster.state / "cni" / "net.d").glob("*.conflist")
    ):
        pytest.skip(
            "the running cluster predates the pods' route to Service IPs: restart it (make cluster-down)"
        )
    kxpu_ref = image_ref(ARCHIVE)
    cluster.ctr("images", "import", str(ARCHIVE))
    scheduler_ref = kube_scheduler_image(cluster, tmp_path)
    ca = trustme.CA()
    cert = ca.issue_cert(f"{WEBHOOK}.{NAMESPACE}.svc", f"{WEBHOOK}.{NAMESPACE}.svc.cluster.local")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    (tmp_path / "values.json").write_text(json.dumps(values(kxpu_ref, scheduler_ref, ca.cert_pem.bytes())))
    k = cluster.kubectl
    with contextlib.ExitStack() as cleanup:  # unwound last to first
        cleanup.callback(kube.wait_resource, cluster, RES, allocatable=0, timeout=60)
        cleanup.callback(
            k, "annotate", "node", NODE_NAME, f"{annotation_key(RES)}-", f"{lock_key(RES)}-", check=False
        )
        routes = ServiceRoutes()
        cleanup.callback(routes.close)
        routes.api_server_for_pods()
        for ns in (NAMESPACE, TENANT_NS):
            cleanup.callback(k, "delete", "namespace", ns, "--ignore-not-found", "--wait=true", "--timeout=90s",
                             timeout=120)  # fmt: skip
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
        yield cluster, routes


def wait_ready(cluster: Cluster, component: str, timeout: float = 120, count: int = 1) -> dict[str, Any]:
    """The component's pod (the first of ``count``), once all are Ready; on a timeout the failure carries the
    release's pods and logs."""

    def all_ready() -> list[dict[str, Any]] | None:
        pods = daemon_pods(cluster, NAMESPACE, RELEASE, f"app.kubernetes.io/component={component}")
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live if len(live) == count and all(ready(p) for p in live) else None

    try:
        pods = kube.wait_until(f"{count} Ready {component} pod(s)", all_ready, timeout)
    except kube.WaitTimeout as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None
    return pods[0]


def test_helm_sharing_schedules_a_shared_pod(release: tuple[Cluster, ServiceRoutes]) -> None:
    """The chart's three parts come up as pods; a pod asking for memory and cores of the shared resource,
    without a scheduler name, is mutated by the webhook, placed and bound by the chart's kube-scheduler and
    extender with a signed assignment, and its container sees its limits."""
    cluster, routes = release
    scheduler = wait_ready(cluster, "scheduler")
    webhook = wait_ready(cluster, "webhook", count=2)  # two replicas (and a PodDisruptionBudget)
    wait_ready(cluster, "plugin")
    service_ip = cluster.kubectl_json("get", "service", WEBHOOK, "-n", NAMESPACE)["spec"]["clusterIP"]
    routes.service_for_host(service_ip, webhook["status"]["podIP"], 8443)
    kube.wait_resource(cluster, RES, allocatable=DEVICES * SPLIT, timeout=60)
    kube.wait_until(
        "the inventory annotation on the node",
        lambda: (
            annotation_key(RES) in (cluster.kubectl_json("get", "node", NODE_NAME)["metadata"]["annotations"])
        ),
        60,
    )

    cluster.kubectl("create", "namespace", TENANT_NS)
    spec = kube.PodSpec(
        name="shared",
        script=f"env | grep -E '^(CUDA_|KXPU_)' | sort; echo {REPORT_END}",
        limits={MEM: 3000, CORES: 30},
        namespace=TENANT_NS,
    )
    manifest = json.dumps(spec.manifest())
    assert "schedulerName" not in manifest

    def admitted() -> bool:  # raises (and is polled again) while the API server cannot reach the webhook
        cluster.kubectl("create", "--dry-run=server", "-f", "-", input=manifest)
        return True

    kube.wait_until("the webhook admitting a dry-run pod", admitted, 60)
    cluster.kubectl("create", "-f", "-", input=manifest)
    try:
        pod = kube.wait_pod_phase(cluster, spec.name, "Running", TENANT_NS, timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None

    assert pod["spec"]["schedulerName"] == SCHEDULER_NAME, pod["spec"]
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert pod["spec"]["containers"][0]["resources"]["limits"].get(RES) == "1", pod["spec"]
    # kube-scheduler's Scheduled and the extender's KxpuAssigned (events are recorded asynchronously)
    kube.wait_until(
        "Scheduled and KxpuAssigned events",
        lambda: (
            {"Scheduled", "KxpuAssigned"}
            <= {e.get("reason") for e in kube.events_for(cluster, spec.name, TENANT_NS)}
        ),
        30,
    )
    # The assignment is Ed25519-signed with the chart's key, which only the scheduler pod holds: it verifies with
    # the public keys the extender published for the nodes, for exactly this pod and node.
    secret = cluster.kubectl_json("get", "secret", SIGNING_SECRET, "-n", NAMESPACE)
    private = signing.parse_keyring(base64.b64decode(secret["data"]["keys"]))
    published = cluster.kubectl_json("get", "configmap", VERIFY_KEYS, "-n", NAMESPACE)["data"]["keys"]
    keys = signing.parse_keyring(published, private_ok=False)
    assert keys.public_keys.keys() == private.public_keys.keys() and "PRIVATE" not in published
    meta = pod["metadata"]
    assert meta["annotations"][signing.SIGNATURE_ANNOTATION].startswith("v2.")
    assignment = signing.verify(
        meta["annotations"].get(signing.ASSIGNMENT_ANNOTATION),
        meta["annotations"].get(signing.SIGNATURE_ANNOTATION),
        keys,
        pod_uid=meta["uid"],
        namespace=TENANT_NS,
        name=spec.name,
        node=NODE_NAME,
        now=time.time(),
        max_age_s=3600,
    )
    (grant,) = assignment.containers[0].devices
    assert (grant.memory_mib, grant.cores) == (3000, 30), assignment

    log = kube.wait_pod_log(cluster, spec.name, REPORT_END, TENANT_NS)
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert env.get("CUDA_DEVICE_MEMORY_LIMIT_0") == "3000m", log
    assert env.get("CUDA_DEVICE_SM_LIMIT") == "30", log
    assert env.get("KXPU_VISIBLE_DEVICES") == grant.uuid, (log, assignment)

    # The extender's metrics, straight at the scheduler pod (the headless Service's endpoint).
    url = f"http://{scheduler['status']['podIP']}:9401/metrics"
    with contextlib.closing(urllib.request.urlopen(url, timeout=5)) as resp:
        metrics = resp.read().decode()
    assert "kxpu_scheduler_decisions" in metrics, metrics[-2000:]

    # The key was made in the cluster by the extender (no Helm owner: in no release revision), and a restart of
    # the scheduler pod keeps it: the next pod's assignment is signed with the same key id.
    labels = secret["metadata"].get("labels") or {}
    assert labels.get("app.kubernetes.io/managed-by") == "kxpu", secret["metadata"]
    assert "meta.helm.sh/release-name" not in (secret["metadata"].get("annotations") or {})
    manifest_text = helm(cluster, "get", "manifest", RELEASE, "--namespace", NAMESPACE)
    assert "PRIVATE KEY" not in manifest_text and "kind: Secret" not in manifest_text
    key_id = meta["annotations"][signing.SIGNATURE_ANNOTATION].split(".")[1]
    cluster.kubectl(
        "delete", "pod", scheduler["metadata"]["name"], "-n", NAMESPACE, "--wait=true", timeout=120
    )
    wait_ready(cluster, "scheduler")
    after = cluster.kubectl_json("get", "secret", SIGNING_SECRET, "-n", NAMESPACE)
    assert after["data"] == secret["data"] and after["metadata"]["uid"] == secret["metadata"]["uid"]
    again = kube.PodSpec(
        name="shared-again", script="true", limits={MEM: 1000, CORES: 10}, namespace=TENANT_NS
    )
    cluster.kubectl("create", "-f", "-", input=json.dumps(again.manifest()))
    try:
        second = kube.wait_pod_phase(cluster, again.name, "Running", TENANT_NS, timeout=90)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None
    assert second["metadata"]["annotations"][signing.SIGNATURE_ANNOTATION].split(".")[1] == key_id

"""The node daemon's identity reaches no further than its node, on a real API server (docs/security.md).

The chart is installed with sharing on and a resource served through DRA, so the daemon holds every role it can
hold. Then, as an attacker with root on the node would, the scenario takes a token of the daemon's ServiceAccount
bound to the daemon's pod on this node (TokenRequest with a pod boundObjectRef: what the kubelet mounts), and
sends the writes issue 19 lists. The API server refuses each one that reaches past the node (the chart's
ValidatingAdmissionPolicy, or RBAC) and allows each one the daemon does. A second Node, API-only (no kubelet),
carries the "other node" objects. The daemon itself keeps working under the policy (inventory, ResourceSlices),
and its container runs as the chart promises: no capabilities, no new privileges, seccomp, as /proc reports.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from e2e import kube
from e2e.cluster import API_PORT, NODE_NAME, SERVICE_CIDR, TEST_IMAGE, Cluster
from e2e.test_helm import ARCHIVE, CHART, daemon_pods, diagnostics, helm, image_ref, ready
from e2e.test_helm import pytestmark as helm_skips
from e2e.test_helm_sharing import ServiceRoutes, kube_scheduler_image
from kxpu.sharing.inventory import annotation_key
from kxpu.sharing.lock import lease_name, lock_key

pytestmark = helm_skips  # no image archive or no helm: skipped, saying which

RELEASE = "kxpu-e2e-sec"  # contains the chart's name: objects are <release>-<component>
NAMESPACE = "kxpu-e2e-security"
RES = "sec.kxpu.io/snpu"  # shared through the extender (device plugin)
DRA_RES = "sec.kxpu.io/dnpu"  # served through DRA
DRIVER = "dnpu.sec.kxpu.io"  # the driver name kxpu derives from DRA_RES
OTHER_DRIVER = "other.example.com"
OTHER_NODE = "kxpu-e2e-sec-other"  # an API-only Node: no kubelet behind it
SERVICE_ACCOUNT = f"{RELEASE}-plugin"
POLICY = f"{RELEASE}-plugin-node-scope"
SCHEDULER_ACCOUNT = f"{RELEASE}-scheduler"  # kube-scheduler's and the extender's, one pod
SCHEDULER_POLICY = f"{RELEASE}-scheduler-scope"
SCHEDULER_NAME = "kxpu-scheduler"  # the chart's default sharing.schedulerName: the pods the release schedules
TEST_LOCK = "kxpu.io/lock.sec-test"  # a node lock annotation of no real resource
LEADER_LEASE = f"{RELEASE}-scheduler"
TLS_SECRET = "kxpu-e2e-sec-webhook-tls"
WEBHOOK = f"{RELEASE}-webhook"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def values(kxpu_ref: str, scheduler_ref: str, ca_pem: bytes) -> dict[str, Any]:
    repository, _, tag = kxpu_ref.rpartition(":")
    ks_repository, _, ks_tag = scheduler_ref.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "config": {
            "version": "v1",
            "resources": [
                {
                    "name": RES,
                    "simulated": {"count": 2, "memoryMiB": 16000, "cores": 64},
                    "sharing": {"splitCount": 2},
                },
                {"name": DRA_RES, "simulated": {"count": 2}, "serve": "dra"},
            ],
        },
        # Only the real node: the DaemonSet must not put a pod on the API-only Node (nothing would ever run it).
        "plugin": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [NODE_NAME]}
                                ]
                            }
                        ]
                    }
                }
            }
        },
        "sharing": {"enabled": True, "families": [{"resource": RES}]},
        "scheduler": {
            "kubeScheduler": {"image": {"repository": ks_repository, "tag": ks_tag, "pullPolicy": "Never"}}
        },
        "webhook": {"tls": {"secretName": TLS_SECRET, "caBundle": base64.b64encode(ca_pem).decode()}},
    }


class Api:
    """Raw requests to the API server with one bearer token: what the API server answers, status and message."""

    def __init__(self, cluster: Cluster, token: str) -> None:
        self.token = token
        self.ctx = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))

    def send(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, str]:
        request = urllib.request.Request(
            f"https://127.0.0.1:{API_PORT}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": content_type,
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.ctx) as resp:
                return resp.status, ""
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, str(json.loads(text).get("message", text))
            except ValueError:
                return exc.code, text


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def lease_path(name: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{name}"


SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def slice_body(
    name: str, node: str, driver: str, pool: str | None = None, devices: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A slice as kxpu publishes it: one pool per node, named after the node (``pool`` to forge another)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices or [],
        },
    }


FAULTY_DEVICES = [
    {"name": f"sec-{effect.lower()}", "taints": [{"key": key, "value": "xid-79", "effect": effect}]}
    for key, effect in (
        ("kxpu.io/device-lost", "NoExecute"),
        ("kxpu.io/ecc-fatal", "NoSchedule"),
        ("kxpu.io/unmonitored", "None"),
    )
]


def lock_lease(node: str) -> dict[str, Any]:
    """A node lock Lease as the extender makes it (kxpu.kube.sharing.lease)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(node, RES),
            "namespace": NAMESPACE,
            "labels": {"kxpu.io/node-lock": "true"},
            "annotations": {"kxpu.io/node": node, "kxpu.io/resource": RES},
        },
        "spec": {"holderIdentity": "held-by-the-test", "leaseDurationSeconds": 60},
    }


def idle_pod(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "nodeName": node,  # bound at creation, as the scheduler would
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "main",
                    "image": TEST_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
                }
            ],
        },
    }


def scheduled_pod(name: str, node: str | None) -> dict[str, Any]:
    """A pod of the release's scheduler: bound at creation to ``node`` (the API-only Node: it stays Pending, never
    admitted, as a pod whose kubelet is down), or held unbound by a scheduling gate."""
    pod = idle_pod(name, node or NODE_NAME)
    pod["spec"]["schedulerName"] = SCHEDULER_NAME
    # The API-only Node turns unreachable (NoExecute): stay, as a pod on a node that is down does for a while.
    pod["spec"]["tolerations"] = [{"operator": "Exists", "effect": "NoExecute"}]
    if node is None:
        del pod["spec"]["nodeName"]
        pod["spec"]["schedulingGates"] = [{"name": "kxpu.io/e2e-hold"}]
    return pod


def token_claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return claims


@pytest.fixture(scope="module")
def secured(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The chart installed with sharing and DRA, the API-only second Node and the pods and Leases the checks
    write to; everything removed afterwards, each step whatever the others do."""
    if shutil.which("iptables") is None:
        pytest.skip("iptables not found: the Services need NAT rules (there is no kube-proxy)")
    if SERVICE_CIDR not in "".join(
        p.read_text() for p in (cluster.state / "cni" / "net.d").glob("*.conflist")
    ):
        pytest.skip(
            "the running cluster predates the pods' route to Service IPs: restart it (make cluster-down)"
        )
    work = tmp_path_factory.mktemp("security")
    cluster.ctr("images", "import", str(ARCHIVE))
    scheduler_ref = kube_scheduler_image(cluster, work)
    ca = trustme.CA()
    cert = ca.issue_cert(f"{WEBHOOK}.{NAMESPACE}.svc", f"{WEBHOOK}.{NAMESPACE}.svc.cluster.local")
    cert.private_key_pem.write_to_path(str(work / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(work / "tls.crt"))
    (work / "values.json").write_text(
        json.dumps(values(image_ref(ARCHIVE), scheduler_ref, ca.cert_pem.bytes()))
    )
    k = cluster.kubectl
    with contextlib.ExitStack() as cleanup:  # unwound last to first
        cleanup.callback(
            k, "annotate", "node", NODE_NAME, f"{annotation_key(RES)}-", f"{lock_key(RES)}-",
            "kxpu.io/devices.sec-test-", f"{TEST_LOCK}-", check=False,
        )  # fmt: skip
        cleanup.callback(k, "label", "node", NODE_NAME, "kxpu.io/sharing-", check=False)
        cleanup.callback(k, "uncordon", NODE_NAME, check=False)  # were the cordon ever allowed
        cleanup.callback(k, "taint", "node", NODE_NAME, "kxpu.io/e2e-evil-", check=False)  # or the taint
        routes = ServiceRoutes()
        cleanup.callback(routes.close)
        routes.api_server_for_pods()
        cleanup.callback(k, "delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=true",
                         "--timeout=90s", timeout=120)  # fmt: skip
        k("create", "namespace", NAMESPACE)
        k("create", "secret", "tls", TLS_SECRET, "-n", NAMESPACE,
          f"--cert={work / 'tls.crt'}", f"--key={work / 'tls.key'}")  # fmt: skip
        cleanup.callback(helm, cluster, "uninstall", RELEASE, "--namespace", NAMESPACE, "--ignore-not-found",
                         "--wait", "--timeout", "90s")  # fmt: skip
        helm(
            cluster, "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(work / "values.json")
        )
        for name in ("sec-admin-own", "sec-admin-other-node", "sec-admin-other-driver"):
            cleanup.callback(k, "delete", "resourceslice", name, "--ignore-not-found", check=False)
        cleanup.callback(k, "delete", "node", OTHER_NODE, "--ignore-not-found", check=False)
        # No kubelet will ever confirm the deletion of a pod on the API-only Node: force it.
        for pod_name in ("sec-other-node", "sec-sched-bound"):
            cleanup.callback(k, "delete", "pod", pod_name, "-n", NAMESPACE, "--ignore-not-found",
                             "--grace-period=0", "--force", check=False)  # fmt: skip
        k(
            "create",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": OTHER_NODE}}),
        )
        for pod in (
            idle_pod("sec-own-node", NODE_NAME),
            idle_pod("sec-other-node", OTHER_NODE),
            scheduled_pod("sec-sched-bound", OTHER_NODE),
            scheduled_pod("sec-sched-gated", None),
        ):
            k("create", "-f", "-", input=json.dumps(pod))
        for node in (NODE_NAME, OTHER_NODE):
            k("apply", "-f", "-", input=json.dumps(lock_lease(node)))
        k("create", "-f", "-", input=json.dumps(slice_body("sec-admin-other-node", OTHER_NODE, DRIVER)))
        k(
            "create",
            "-f",
            "-",
            input=json.dumps(slice_body("sec-admin-other-driver", NODE_NAME, OTHER_DRIVER)),
        )
        yield cluster


def component_pod(cluster: Cluster, component: str, timeout: float = 150) -> dict[str, Any]:
    try:
        (pod,) = kube.wait_until(
            f"one Ready {component} pod",
            lambda: [
                p
                for p in daemon_pods(cluster, NAMESPACE, RELEASE, f"app.kubernetes.io/component={component}")
                if ready(p)
            ],
            timeout,
        )
    except kube.WaitTimeout as exc:
        raise AssertionError(f"{exc}\n{diagnostics(cluster, NAMESPACE, RELEASE)}") from None
    return pod


def node_token(cluster: Cluster, bound_to: str | None) -> str:
    args = ["create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE, "--duration=600s"]
    if bound_to is not None:
        args += ["--bound-object-kind=Pod", f"--bound-object-name={bound_to}"]
    return cluster.kubectl(*args).strip()


def test_the_daemon_works_under_the_policy_unprivileged(secured: Cluster) -> None:
    """Everything the daemon writes goes through the policy with its own (projected, pod-bound) token: its Node's
    inventory and its ResourceSlices appear; and the kernel shows its container holding no capability."""
    cluster = secured
    pod = component_pod(cluster, "plugin")
    cluster.kubectl("get", "validatingadmissionpolicy", POLICY)  # installed, so it is what the writes pass
    kube.wait_until(
        "the daemon's inventory annotation on its Node",
        lambda: (
            annotation_key(RES) in cluster.kubectl_json("get", "node", NODE_NAME)["metadata"]["annotations"]
        ),
        60,
    )

    def published() -> list[dict[str, Any]]:
        items = cluster.kubectl_json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")[
            "items"
        ]
        return [
            s
            for s in items
            if s["spec"].get("nodeName") == NODE_NAME and s["metadata"]["name"].startswith(NODE_NAME)
        ]

    kube.wait_until("the daemon's ResourceSlice", published, 60)

    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"] == {"drop": ["ALL"]}, sc
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    tasks = {
        line.split()[0]: line.split()[1]
        for line in cluster.ctr("tasks", "ls").splitlines()[1:]
        if line.strip()
    }
    status = dict(
        line.split(":", 1)
        for line in Path(f"/proc/{tasks[container_id]}/status").read_text().splitlines()
        if ":" in line
    )
    assert int(status["CapEff"].strip(), 16) == 0 and int(status["CapPrm"].strip(), 16) == 0, status["CapEff"]
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # a filter: RuntimeDefault
    assert (
        status["Uid"].split()[0] == "0"
    )  # root without capabilities: owns the kubelet's directories, no more


def test_a_node_token_is_refused_beyond_its_node(secured: Cluster) -> None:
    """Root on this node holds the daemon's pod-bound token: every write past the node is refused."""
    cluster = secured
    daemon = component_pod(cluster, "plugin")
    scheduler = component_pod(cluster, "scheduler")
    kube.wait_until(
        "the leader-election Lease",
        lambda: cluster.kubectl("get", "lease", LEADER_LEASE, "-n", NAMESPACE, check=False),
        60,
    )
    token = node_token(cluster, daemon["metadata"]["name"])
    assert token_claims(token)["kubernetes.io"]["node"]["name"] == NODE_NAME
    node = Api(cluster, token)
    by_policy = f"ValidatingAdmissionPolicy '{POLICY}'"

    refused = {
        # The extender's container, restarted with an attacker's image, would hold the signing key.
        "image of the scheduler pod": node.send(
            "PATCH",
            pod_path(NAMESPACE, scheduler["metadata"]["name"]),
            {"spec": {"containers": [{"name": "kube-scheduler", "image": "attacker.example/evil:1"}]}},
            STRATEGIC,
        ),
        "a pod on another node": node.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-other-node"),
            {"metadata": {"annotations": {"kxpu.io/allocated.sec.kxpu.io-snpu": "1"}}},
            MERGE,
        ),
        "spec of a pod on its own node": node.send(
            "PATCH", pod_path(NAMESPACE, "sec-own-node"), {"spec": {"activeDeadlineSeconds": 1}}, MERGE
        ),
        "an assignment on its own node's pod": node.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-own-node"),
            {"metadata": {"annotations": {"kxpu.io/assignment": "forged"}}},
            MERGE,
        ),
        "a label of its own node's pod": node.send(
            "PATCH", pod_path(NAMESPACE, "sec-own-node"), {"metadata": {"labels": {"x": "y"}}}, MERGE
        ),
        "another Node": node.send(
            "PATCH",
            f"/api/v1/nodes/{OTHER_NODE}",
            {"metadata": {"annotations": {"kxpu.io/devices.sec-test": "forged"}}},
            MERGE,
        ),
        "cordon its own Node": node.send(
            "PATCH", f"/api/v1/nodes/{NODE_NAME}", {"spec": {"unschedulable": True}}, MERGE
        ),
        "a foreign annotation on its own Node": node.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {"metadata": {"annotations": {"example.com/x": "y"}}},
            MERGE,
        ),
        "the leader-election Lease": node.send(
            "PATCH", lease_path(LEADER_LEASE), {"spec": {"holderIdentity": "attacker"}}, MERGE
        ),
        "another node's lock Lease": node.send(
            "PATCH", lease_path(lease_name(OTHER_NODE, RES)), {"spec": {"holderIdentity": None}}, MERGE
        ),
        # A holder it wrote could name any pending pod, which the extender's sweep would then mark Failed.
        "a new holder in its own lock Lease": node.send(
            "PATCH", lease_path(lease_name(NODE_NAME, RES)), {"spec": {"holderIdentity": "forged"}}, MERGE
        ),
        # Another node's device names in a pool of that name would make that node's devices look allocated.
        "a slice on its node in another node's pool": node.send(
            "POST", SLICES, slice_body("sec-node-other-pool", NODE_NAME, DRIVER, pool=OTHER_NODE)
        ),
        "another node's slice (create)": node.send(
            "POST", SLICES, slice_body("sec-node-other-node", OTHER_NODE, DRIVER)
        ),
        "another node's slice (delete)": node.send("DELETE", f"{SLICES}/sec-admin-other-node"),
        "another driver's slice on its node (create)": node.send(
            "POST", SLICES, slice_body("sec-node-other-driver", NODE_NAME, OTHER_DRIVER)
        ),
        "another driver's slice on its node (delete)": node.send(
            "DELETE", f"{SLICES}/sec-admin-other-driver"
        ),
    }
    for what, (status, message) in refused.items():
        assert status == 403, f"{what}: allowed ({status})"
        assert by_policy in message, f"{what}: refused, but not by the policy: {message}"
    # Past RBAC too (no verb for it at all): creating a Lease.
    status, message = node.send(
        "POST", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases", lock_lease("x")
    )
    assert status == 403, message

    # The objects are as they were.
    assert (
        cluster.kubectl_json("get", "pod", scheduler["metadata"]["name"], "-n", NAMESPACE)["spec"][
            "containers"
        ][0]["image"]
        == scheduler["spec"]["containers"][0]["image"]
    )
    assert not cluster.kubectl_json("get", "node", NODE_NAME)["spec"].get("unschedulable")
    cluster.kubectl("get", "resourceslice", "sec-admin-other-node", "sec-admin-other-driver")

    # A token that names no node (unbound) gets nothing, not even what the daemon does on its own node.
    unbound = Api(cluster, node_token(cluster, None))
    status, message = unbound.send(
        "PATCH",
        f"/api/v1/nodes/{NODE_NAME}",
        {"metadata": {"annotations": {"kxpu.io/devices.sec-test": "x"}}},
        MERGE,
    )
    assert status == 403 and "names no node" in message, (status, message)


def test_a_node_token_does_what_the_daemon_does(secured: Cluster) -> None:
    """The same token is allowed exactly the daemon's writes on its own node."""
    cluster = secured
    daemon = component_pod(cluster, "plugin")
    node = Api(cluster, node_token(cluster, daemon["metadata"]["name"]))
    allowed = {
        "mark its own pod allocated": node.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-own-node"),
            {
                "metadata": {
                    "annotations": {
                        "kxpu.io/allocated.sec.kxpu.io-snpu": "1",
                        "kxpu.io/bind-phase": "allocated",
                    }
                }
            },
            MERGE,
        ),
        "its own Node's inventory and label": node.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {
                "metadata": {
                    "labels": {"kxpu.io/sharing": "true"},
                    "annotations": {"kxpu.io/devices.sec-test": "x"},
                }
            },
            MERGE,
        ),
        "release its own lock Lease": node.send(
            "PATCH", lease_path(lease_name(NODE_NAME, RES)), {"spec": {"holderIdentity": None}}, MERGE
        ),
        # With devices tainted as kxpu taints faults (kxpu.dra.taints), one per effect.
        "create its own slice": node.send(
            "POST", SLICES, slice_body("sec-node-own", NODE_NAME, DRIVER, devices=FAULTY_DEVICES)
        ),
    }
    for what, (status, message) in allowed.items():
        assert status in (200, 201), f"{what}: refused ({status}): {message}"
    annotations = cluster.kubectl_json("get", "pod", "sec-own-node", "-n", NAMESPACE)["metadata"][
        "annotations"
    ]
    assert annotations["kxpu.io/bind-phase"] == "allocated"
    lease = cluster.kubectl_json("get", "lease", lease_name(NODE_NAME, RES), "-n", NAMESPACE)
    assert not lease["spec"].get("holderIdentity")
    # Update and delete of its own node's slices of its driver: one the daemon published, unchanged; then the one
    # made above (404: the daemon, under the same policy, already removed it as not its own).
    (own,) = [
        s
        for s in cluster.kubectl_json("get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}")[
            "items"
        ]
        if s["spec"].get("nodeName") == NODE_NAME and s["metadata"]["name"].startswith(NODE_NAME)
    ][:1]
    status, message = node.send("PUT", f"{SLICES}/{own['metadata']['name']}", own)
    assert status in (200, 409), f"update of its own slice refused ({status}): {message}"
    status, message = node.send("DELETE", f"{SLICES}/sec-node-own")
    assert status in (200, 404), f"delete of its own slice refused ({status}): {message}"
    kube.wait_until(
        "the test's slice gone",
        lambda: not cluster.kubectl("get", "resourceslice", "sec-node-own", "--ignore-not-found").strip(),
        30,
    )


def scheduler_token(cluster: Cluster) -> str:
    """A token of the scheduler pod's account, bound to that pod: what its containers hold."""
    pod = component_pod(cluster, "scheduler")
    return cluster.kubectl(
        "create", "token", SCHEDULER_ACCOUNT, "-n", NAMESPACE, "--duration=600s",
        "--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
    ).strip()  # fmt: skip


def test_a_scheduler_token_is_refused_what_neither_scheduler_does(secured: Cluster) -> None:
    """A compromised extender (or kube-scheduler beside it) holds the scheduler pod's token, whose RBAC allows
    patching any pod, pod status and Node: the API server refuses every such write but the two's own."""
    cluster = secured
    daemon = component_pod(cluster, "plugin")
    sched = Api(cluster, scheduler_token(cluster))
    by_policy = f"ValidatingAdmissionPolicy '{SCHEDULER_POLICY}'"
    failed = {"status": {"phase": "Failed", "reason": "KxpuAllocationExpired", "message": "e2e"}}

    refused = {
        # Restarted with an attacker's image, the daemon's container would have its node's devices and token.
        "image of the node daemon's pod": sched.send(
            "PATCH",
            pod_path(NAMESPACE, daemon["metadata"]["name"]),
            {"spec": {"containers": [{"name": daemon["spec"]["containers"][0]["name"], "image": "evil:1"}]}},
            STRATEGIC,
        ),
        "image of a pod it schedules": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-bound"),
            {"spec": {"containers": [{"name": "main", "image": "evil:1"}]}},
            STRATEGIC,
        ),
        "a foreign label on a pod it schedules": sched.send(
            "PATCH", pod_path(NAMESPACE, "sec-sched-bound"), {"metadata": {"labels": {"x": "y"}}}, MERGE
        ),
        "kxpu's label on another scheduler's pod": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-own-node"),
            {"metadata": {"labels": {"kxpu.io/assigned": "true"}}},
            MERGE,
        ),
        "cordon a Node": sched.send(
            "PATCH", f"/api/v1/nodes/{NODE_NAME}", {"spec": {"unschedulable": True}}, MERGE
        ),
        "taint a Node": sched.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {"spec": {"taints": [{"key": "kxpu.io/e2e-evil", "effect": "NoSchedule"}]}},
            MERGE,
        ),
        "a kxpu annotation other than the lock on a Node": sched.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {"metadata": {"annotations": {"kxpu.io/devices.sec-test": "forged"}}},
            MERGE,
        ),
        "Failed with another reason": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-bound") + "/status",
            {"status": {"phase": "Failed", "reason": "Evicted"}},
            MERGE,
        ),
        "Failed, an unbound pod": sched.send(
            "PATCH", pod_path(NAMESPACE, "sec-sched-gated") + "/status", failed, MERGE
        ),
        "Failed, another scheduler's running pod": sched.send(
            "PATCH", pod_path(NAMESPACE, "sec-own-node") + "/status", failed, MERGE
        ),
        "Ready=False on another scheduler's pod": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-own-node") + "/status",
            {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Evil"}]}},
            STRATEGIC,
        ),
        "a pod's IP": sched.send(
            "PATCH", pod_path(NAMESPACE, "sec-own-node") + "/status", {"status": {"podIP": "10.9.9.9"}}, MERGE
        ),
    }
    for what, (status, message) in refused.items():
        assert status == 403, f"{what}: allowed ({status})"
        assert by_policy in message, f"{what}: refused, but not by the policy: {message}"

    # The objects are as they were.
    pod = cluster.kubectl_json("get", "pod", daemon["metadata"]["name"], "-n", NAMESPACE)
    assert pod["spec"]["containers"][0]["image"] == daemon["spec"]["containers"][0]["image"]
    node = cluster.kubectl_json("get", "node", NODE_NAME)
    assert not node["spec"].get("unschedulable") and not any(
        t["key"] == "kxpu.io/e2e-evil" for t in node["spec"].get("taints", [])
    )
    assert (
        cluster.kubectl_json("get", "pod", "sec-sched-bound", "-n", NAMESPACE)["status"]["phase"] == "Pending"
    )
    assert (
        cluster.kubectl_json("get", "pod", "sec-sched-gated", "-n", NAMESPACE)["status"]["phase"] == "Pending"
    )
    own = cluster.kubectl_json("get", "pod", "sec-own-node", "-n", NAMESPACE)
    assert own["status"]["phase"] != "Failed" and own["status"].get("podIP") != "10.9.9.9"


def test_a_scheduler_token_does_what_the_two_schedulers_do(secured: Cluster) -> None:
    """The same token is allowed the extender's writes (watch label and kxpu annotations on its pods, the annotation
    node lock, Failed for a pod bound but never admitted) and kube-scheduler's (PodScheduled, DisruptionTarget)."""
    cluster = secured
    sched = Api(cluster, scheduler_token(cluster))
    uid = cluster.kubectl_json("get", "pod", "sec-sched-bound", "-n", NAMESPACE)["metadata"]["uid"]
    lock_path = "/metadata/annotations/" + TEST_LOCK.replace("/", "~1")
    allowed = {
        # KubeSchedulerAPI.label_pod, byte for byte
        "the watch label": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-bound"),
            {"metadata": {"uid": uid, "labels": {"kxpu.io/assigned": "true"}}},
            MERGE,
        ),
        "a kxpu annotation": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-bound"),
            {"metadata": {"annotations": {"kxpu.io/bind-phase": "allocating"}}},
            MERGE,
        ),
        "take the node lock": sched.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            {"metadata": {"annotations": {TEST_LOCK: "held-by-the-test"}}},
            MERGE,
        ),
        "release the node lock": sched.send(
            "PATCH",
            f"/api/v1/nodes/{NODE_NAME}",
            [
                {"op": "test", "path": lock_path, "value": "held-by-the-test"},
                {"op": "remove", "path": lock_path},
            ],
            "application/json-patch+json",
        ),
        # kube-scheduler's updatePod (schedule_one.go): a strategic merge patch of status
        "PodScheduled=False": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-gated") + "/status",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "e2e",
                        }
                    ]
                }
            },
            STRATEGIC,
        ),
        # its preemption (preemption/executor.go), on a victim of any scheduler
        "DisruptionTarget on a victim": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-own-node") + "/status",
            {
                "status": {
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                            "message": "kxpu-scheduler: preempting to accommodate a higher priority pod",
                        }
                    ]
                }
            },
            STRATEGIC,
        ),
        # KubeSchedulerAPI._fail_unadmitted: a pod bound to a node whose kubelet never admitted it
        "Failed, bound and never admitted": sched.send(
            "PATCH",
            pod_path(NAMESPACE, "sec-sched-bound") + "/status",
            {
                "metadata": {"uid": uid},
                "status": {"phase": "Failed", "reason": "KxpuAllocationExpired", "message": "e2e"},
            },
            MERGE,
        ),
    }
    for what, (status, message) in allowed.items():
        assert status == 200, f"{what}: refused ({status}): {message}"
    bound = cluster.kubectl_json("get", "pod", "sec-sched-bound", "-n", NAMESPACE)
    assert bound["metadata"]["labels"]["kxpu.io/assigned"] == "true"
    assert bound["metadata"]["annotations"]["kxpu.io/bind-phase"] == "allocating"
    assert (bound["status"]["phase"], bound["status"]["reason"]) == ("Failed", "KxpuAllocationExpired")
    assert TEST_LOCK not in cluster.kubectl_json("get", "node", NODE_NAME)["metadata"].get("annotations", {})
    gated = cluster.kubectl_json("get", "pod", "sec-sched-gated", "-n", NAMESPACE)
    assert {"type": "PodScheduled", "reason": "Unschedulable"} in [
        {"type": c["type"], "reason": c.get("reason")} for c in gated["status"]["conditions"]
    ]

"""HAMi's pod specs on the stock kube-scheduler, and namespace quota, on the DRA path (the real 1.37 cluster).

``kxpu webhook`` with ``convertToClaims`` runs as a host process behind a Mutating (``sideEffects:
NoneOnDryRun``) and a ValidatingWebhookConfiguration scoped to one namespace; kxpu's node daemon serves the
nvidia backend over the fake NVML's eight A100s through DRA with shares. A pod written for HAMi
(``nvidia.com/gpu: 1``, ``nvidia.com/gpumem: 3000``) is converted at admission into a claim from a template the
webhook made, allocated by the stock kube-scheduler by consumable capacity, prepared by kxpu, and its container
sees the limits; a namespace's ResourceQuota on the DeviceClass refuses a second claim.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from e2e import dra, kube
from e2e.conftest import E2E
from e2e.sharing_support import Proc, kxpu_command, shared_condition
from e2e.test_helm import CHART, HELM
from kxpu.testing.fake_nvml import FAKE_NVML_ENV

NS = "kxpu-e2e-dra-hami"
DRIVER = "gpu.nvidia.com"  # the driver kxpu derives from nvidia.com/gpu, and the DeviceClass named after it
GPU, GPUMEM, GPUCORES, GPUMEM_PCT = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpucores",
    "nvidia.com/gpumem-percentage",
)
WEBHOOK_PORT, WEBHOOK_METRICS_PORT = 18447, 19414
CONFIG = "kxpu-e2e-dra-hami"
QUOTA_KEY = f"{DRIVER}.deviceclass.resource.k8s.io/devices"
GPUMEM_QUOTA = f"requests.{GPUMEM}"
CHART_TEST_VALUES = CHART.parent.parent / "tests" / "values-sharing.yaml"
REPORT = "env | grep -E '^(CUDA_|NVIDIA_VISIBLE)' | sort; echo end-of-report"


def start_gpus(e2e: E2E) -> None:
    """Eight fake A100s through DRA with shares (1 MiB steps: a 3000 MiB request is granted exactly)."""
    dra.forget_driver(e2e, DRIVER)
    resource = {
        "name": GPU,
        "nvidia": {},
        "serve": "dra",
        "dra": {"shares": {"memoryStepMiB": 1, "minMemoryMiB": 1}},
    }
    e2e.kxpu([resource], env={FAKE_NVML_ENV: "a100-8x"})
    kube.wait_until(
        "eight shared GPUs in the pool",
        lambda: (len(d := dra.pool_devices(e2e.cluster, DRIVER)) == 8 and all(x.get("allowMultipleAllocations") for x in d))
        or None,
        timeout=60,
    )  # fmt: skip
    dra.device_class(e2e, DRIVER, DRIVER)


def _webhooks(ca_pem: bytes) -> str:
    bundle = base64.b64encode(ca_pem).decode()
    names = [GPU, GPUMEM, GPUMEM_PCT, GPUCORES]
    docs = []
    for kind, path, side_effects in (
        ("Mutating", "/mutate", "NoneOnDryRun"),
        ("Validating", "/validate", "None"),
    ):
        hook = {
            "name": f"{kind.lower()}.e2e-dra-hami.kxpu.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": side_effects,  # the mutating one makes claim templates, never in a dry run
            "failurePolicy": "Fail",
            "timeoutSeconds": 10,
            "clientConfig": {"url": f"https://127.0.0.1:{WEBHOOK_PORT}{path}", "caBundle": bundle},
            "rules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
            ],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NS}},
            "matchConditions": [{"name": "shared", "expression": shared_condition(names, False)}],
        }
        docs.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": f"{kind}WebhookConfiguration",
                "metadata": {"name": CONFIG},
                "webhooks": [hook],
            }
        )
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})


def hami_pod(
    e2e: E2E, name: str, limits: Mapping[str, Any], annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A pod as HAMi's users write it: the shared-device names in its limits (and requests), no claim."""
    spec = kube.PodSpec(
        name=f"hami-{name}", script=REPORT, limits=limits, labels={"kxpu-e2e": e2e.label}, namespace=NS
    )
    manifest = spec.manifest()
    manifest["metadata"]["annotations"] = dict(annotations or {})
    return manifest


def create(e2e: E2E, manifest: Mapping[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
    cluster = e2e.cluster
    return subprocess.run(
        [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "create", "-f", "-", *extra],
        input=json.dumps(manifest),
        capture_output=True,
        text=True,
        timeout=60,
    )


def webhook_identity(e2e: E2E, work: Path) -> Path:
    """A kubeconfig for the webhook's own service account holding exactly the chart's RBAC for it (its
    ClusterRole and binding as ``helm template`` renders them with convertToClaims): what the chart grants is
    what the scenario proves enough. Where helm is not built, the admin kubeconfig (the RBAC is then untested)."""
    cluster = e2e.cluster
    if HELM is None:
        return cluster.kubeconfig
    rendered = subprocess.run(
        [str(HELM), "template", "kxpu", str(CHART), "--namespace", NS, "--values", str(CHART_TEST_VALUES),
         "--set", "webhook.convertToClaims=true", "--show-only", "templates/webhook.yaml"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    keep = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    assert sorted(d["kind"] for d in keep) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"], keep
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": keep}))
    for doc in keep:
        if doc["kind"] != "ServiceAccount":
            kind, name = doc["kind"].lower(), doc["metadata"]["name"]
            e2e.cleanups.append(
                partial(cluster.kubectl, "delete", kind, name, "--ignore-not-found", check=False)
            )
    account = next(d["metadata"]["name"] for d in keep if d["kind"] == "ServiceAccount")
    token = cluster.kubectl("create", "token", account, "-n", NS, "--duration=1h").strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": server}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "webhook", "context": {"cluster": "e2e", "user": account}}],
        "current-context": "webhook",
    }
    path = work / "webhook.kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    return path


@contextlib.contextmanager
def converting_webhook(e2e: E2E) -> Iterator[Proc]:
    """The webhook with convertToClaims, registered for NS; on exit the pods go first (while kxpu still serves
    their claims' unprepare), then the registrations, the namespace and the process."""
    cluster = e2e.cluster
    work = e2e.tmp / "webhook"
    work.mkdir()
    cluster.issue_certificate(work, "tls", "kxpu-e2e-dra-hami-webhook", sans=["IP:127.0.0.1"])
    config = {"version": "v1", "families": [{"resource": GPU}], "convertToClaims": True}
    (work / "control-plane.yaml").write_text(json.dumps(config))
    k = cluster.kubectl
    k("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=90s", timeout=120)
    k("create", "namespace", NS)
    env = {"KUBECONFIG": str(webhook_identity(e2e, work)), "PATH": "/usr/bin:/bin", "HOME": "/root"}
    proc = Proc(
        "webhook",
        [
            *kxpu_command(),
            "webhook",
            "--config",
            str(work / "control-plane.yaml"),
            "--address",
            f"127.0.0.1:{WEBHOOK_PORT}",
            "--metrics-address",
            f"127.0.0.1:{WEBHOOK_METRICS_PORT}",
            "--tls-cert-file",
            str(work / "tls.crt"),
            "--tls-key-file",
            str(work / "tls.key"),
            "--log-level",
            "debug",
        ],
        work / "webhook.log",
        env,
    )
    e2e.logs["webhook"] = proc.log
    proc.start()
    try:
        kube.wait_until(
            "the webhook's /healthz",
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{WEBHOOK_METRICS_PORT}/healthz", timeout=2).status
                == 200
            ),
            timeout=60,
        )
        k("apply", "-f", "-", input=_webhooks((cluster.pki / "ca.crt").read_bytes()))
        yield proc
    finally:
        k("delete", "pods", "-n", NS, "--all", "--wait=true", "--timeout=60s", check=False, timeout=90)
        k(
            "delete",
            "mutatingwebhookconfiguration,validatingwebhookconfiguration",
            CONFIG,
            "--ignore-not-found",
            check=False,
        )
        k(
            "delete",
            "namespace",
            NS,
            "--ignore-not-found",
            "--wait=true",
            "--timeout=90s",
            check=False,
            timeout=120,
        )
        proc.stop()


def limits_in(log: str) -> dict[str, str]:
    return dict(re.findall(r"^(CUDA_[A-Z_0-9]+)=(.*)$", log, re.M))


def claim_of(e2e: E2E, pod: str) -> dict[str, Any]:
    status = kube.get_pod(e2e.cluster, pod, NS).get("status", {})
    (name,) = [
        s["resourceClaimName"] for s in status.get("resourceClaimStatuses", []) if s.get("resourceClaimName")
    ]
    return e2e.cluster.kubectl_json("get", "resourceclaim", name, "-n", NS)


def templates(e2e: E2E) -> list[str]:
    listing = e2e.cluster.kubectl_json("get", "resourceclaimtemplates", "-n", NS)
    return [t["metadata"]["name"] for t in listing.get("items", [])]


def test_a_hami_pod_spec_runs_through_dra_with_its_limits(e2e: E2E) -> None:
    """``nvidia.com/gpu: 1, nvidia.com/gpumem: 3000`` is admitted, converted into a consumable-capacity claim, placed
    by the stock kube-scheduler, prepared by kxpu, and its container carries HAMi-core's memory limit; a spec no
    claim can express is denied in one line; a dry run creates nothing."""
    start_gpus(e2e)
    with converting_webhook(e2e):
        a = hami_pod(e2e, "a", {GPU: 1, GPUMEM: 3000}, {"nvidia.com/use-gputype": "a100"})
        b = hami_pod(e2e, "b", {GPUMEM: 2000, GPUCORES: 30})

        # A dry run shows the conversion and makes no template (sideEffects: NoneOnDryRun).
        dry = create(e2e, a, "--dry-run=server", "-o", "json")
        assert dry.returncode == 0, dry.stderr
        converted = json.loads(dry.stdout)
        assert converted["spec"]["resourceClaims"][0]["resourceClaimTemplateName"].startswith("kxpu-gpu-")
        assert templates(e2e) == []

        for manifest in (a, b):
            made = create(e2e, manifest)
            assert made.returncode == 0, made.stderr
        logs = {}
        for manifest in (a, b):
            name = manifest["metadata"]["name"]
            kube.wait_pod_phase(e2e.cluster, name, "Running", namespace=NS)
            logs[name] = kube.wait_pod_log(e2e.cluster, name, "end-of-report", namespace=NS)
        # HAMi-core's variables, as on the extender path: memory only for a, memory and SMs for b
        assert limits_in(logs["hami-a"]) == {"CUDA_DEVICE_MEMORY_LIMIT_0": "3000m"}, logs["hami-a"]
        assert limits_in(logs["hami-b"]) == {
            "CUDA_DEVICE_MEMORY_LIMIT_0": "2000m",
            "CUDA_DEVICE_SM_LIMIT": "30",
        }, logs["hami-b"]

        stored = kube.get_pod(e2e.cluster, "hami-a", NS)
        resources = stored["spec"]["containers"][0]["resources"]
        assert not any(
            n.startswith("nvidia.com/") for kind in ("limits", "requests") for n in resources.get(kind) or {}
        )
        assert stored["spec"]["schedulerName"] == "default-scheduler"
        for name, memory, cores in (("hami-a", "3000Mi", "0"), ("hami-b", "2000Mi", "30")):
            claim = claim_of(e2e, name)
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            assert result["shareID"] and result["consumedCapacity"] == {"memory": memory, "cores": cores}, (
                result
            )
            assert claim["metadata"]["ownerReferences"][0]["name"] == name, "the claim goes with its pod"
        assert len(templates(e2e)) == 2  # one per shape, made by the webhook

        refused = create(e2e, hami_pod(e2e, "pct", {GPUMEM_PCT: 50}))
        assert refused.returncode != 0
        assert "nvidia.com/gpumem-percentage 50 cannot become a DRA claim" in refused.stderr, refused.stderr


def test_a_namespace_quota_on_the_device_class_refuses_a_second_claim(e2e: E2E) -> None:
    """ResourceQuota ``gpu.nvidia.com.deviceclass.resource.k8s.io/devices: 1``: the first converted pod's claim
    counts one device (whatever memory it asks: quota cannot count capacity in 1.37), the second pod's claim is
    refused by the API server and the pod stays Pending with the reason; a claim made by hand is refused too."""
    start_gpus(e2e)
    with converting_webhook(e2e):
        quota = {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "gpus", "namespace": NS},
            # GPUMEM_QUOTA would cap the extender path's pods (the shared names are extended resources in their
            # limits); a converted pod names none, so it is not counted (docs/dra.md, Quota)
            "spec": {
                "hard": {QUOTA_KEY: "1", "count/resourceclaims.resource.k8s.io": "5", GPUMEM_QUOTA: "500"}
            },
        }
        e2e.cluster.kubectl("apply", "-f", "-", input=json.dumps(quota))

        def hard() -> bool:
            status = e2e.cluster.kubectl_json("get", "resourcequota", "gpus", "-n", NS).get("status") or {}
            return QUOTA_KEY in (status.get("hard") or {})

        kube.wait_until("the quota's status", hard, timeout=60)
        first = create(e2e, hami_pod(e2e, "first", {GPU: 1, GPUMEM: 1000}))
        assert first.returncode == 0, first.stderr
        kube.wait_pod_phase(e2e.cluster, "hami-first", "Running", namespace=NS)

        def used() -> bool | None:
            status = e2e.cluster.kubectl_json("get", "resourcequota", "gpus", "-n", NS).get("status") or {}
            return (status.get("used") or {}).get(QUOTA_KEY) == "1" or None

        kube.wait_until("one device counted against the quota", used, timeout=60)
        status = e2e.cluster.kubectl_json("get", "resourcequota", "gpus", "-n", NS)["status"]
        assert status["used"][GPUMEM_QUOTA] == "0", (
            status
        )  # 1000 MiB asked, over the 500 of the old-style quota
        second = create(e2e, hami_pod(e2e, "second", {GPU: 1, GPUMEM: 1000}))
        assert second.returncode == 0, (
            second.stderr
        )  # the pod is admitted; its claim is what the quota refuses

        def refusal() -> str | None:
            for event in kube.events_for(e2e.cluster, "hami-second", NS):
                if event.get("reason") == "FailedResourceClaimCreation":
                    return str(event.get("message"))
            return None

        message = kube.wait_until("the second claim refused by the quota", refusal, timeout=60)
        assert "exceeded quota: gpus" in message and QUOTA_KEY in message, message
        assert kube.get_pod(e2e.cluster, "hami-second", NS)["status"]["phase"] == "Pending"

        claim = {
            "apiVersion": dra.API,
            "kind": "ResourceClaim",
            "metadata": {"name": "by-hand", "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": dra.exactly(DRIVER, 1)}]}},
        }
        by_hand = create(e2e, claim)
        assert by_hand.returncode != 0 and "exceeded quota: gpus" in by_hand.stderr, by_hand.stderr

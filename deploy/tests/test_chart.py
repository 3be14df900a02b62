"""The Helm chart: lint, render with default and override values, and check what a node will actually get."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.tests.conftest import (
    CHART,
    OVERRIDES,
    REPO,
    Rendered,
    chart_values,
    override_values,
    template,
    template_error,
)
from e2e.sharing_support import SHARED_CONDITION_START, STATUS_CHANGES_METADATA, shared_condition
from kxpu.config import parse_config
from kxpu.sharing.config import KeySource

NAMESPACED = {"ConfigMap", "DaemonSet", "Service", "ServiceAccount", "ServiceMonitor"}
# Every DaemonSet leaves control-plane nodes out unless plugin.controlPlane is true.
NO_CP = {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}
HOST_PATHS = {
    "device-plugins": ("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/device-plugins", "Directory"),
    "dev": ("/dev", "/dev", "Directory"),
    "cdi": ("/var/run/cdi", "/var/run/cdi", "DirectoryOrCreate"),
    "state": ("/run/kxpu", "/run/kxpu", "DirectoryOrCreate"),
    "pod-resources": (
        "/var/lib/kubelet/pod-resources",
        "/var/lib/kubelet/pod-resources",
        "DirectoryOrCreate",
    ),
}


@pytest.fixture(scope="module")
def default(helm: Path) -> Rendered:
    return template(helm)


@pytest.fixture(scope="module")
def overrides(helm: Path) -> Rendered:
    return template(helm, "--values", str(OVERRIDES))


def container(ds: dict[str, Any]) -> dict[str, Any]:
    (only,) = ds["spec"]["template"]["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def host_paths(ds: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """volume name -> (host path, container path, hostPath type)."""
    spec = ds["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container(ds)["volumeMounts"]}
    return {
        v["name"]: (v["hostPath"]["path"], mounts[v["name"]], v["hostPath"]["type"])
        for v in spec["volumes"]
        if "hostPath" in v
    }


def config_of(rendered: Rendered, ds: dict[str, Any]) -> dict[str, Any]:
    """The kxpu config file a DaemonSet's pods read: the ConfigMap key mounted as /etc/kxpu/config.yaml."""
    spec = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "config"]
    (item,) = volume["configMap"]["items"]
    assert item["path"] == "config.yaml"
    assert {"name": "config", "mountPath": "/etc/kxpu", "readOnly": True} in container(ds)["volumeMounts"]
    cm = rendered.one("ConfigMap", volume["configMap"]["name"])
    loaded: dict[str, Any] = yaml.safe_load(cm["data"][item["key"]])
    return loaded


@pytest.mark.parametrize("values", [[], ["--values", str(OVERRIDES)]], ids=["default", "overrides"])
def test_helm_lint(helm: Path, values: list[str]) -> None:
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *values], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_objects(default: Rendered) -> None:
    kinds = sorted(d["kind"] for d in default.docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "Service",
        "ServiceAccount",
    ]
    for doc in default.docs:
        if doc["kind"] in NAMESPACED:
            assert doc["metadata"]["namespace"] == "kxpu-system", doc["metadata"]["name"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == "kxpu"


def test_daemonset_runs_the_node_daemon(default: Rendered) -> None:
    ds = default.one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert c["image"] == "ghcr.io/kxpu/kxpu:0.1.0"  # the released image at the chart's appVersion
    assert c["args"][:2] == ["plugin", "--config=/etc/kxpu/config.yaml"]
    assert {"--http-address=:5978", "--http-auth=kubernetes", "--log-format=json", "--log-level=info"} <= set(
        c["args"]
    )
    assert "--device-plugin-dir=/var/lib/kubelet/device-plugins" in c["args"]
    assert c["ports"] == [{"name": "metrics", "containerPort": 5978, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert host_paths(ds) == HOST_PATHS
    # The runtime cannot create /dev/termination-log in the host's read-only /dev.
    assert c["terminationMessagePath"].startswith("/tmp/")
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["automountServiceAccountToken"] is True  # to review the tokens sent to /status
    sc = c["securityContext"]
    # The simulated default opens no device: root without capabilities, not privileged (test_chart_security.py).
    assert sc["privileged"] is False and sc["runAsUser"] == 0 and sc["readOnlyRootFilesystem"] is True
    # One DaemonSet, so it runs on every node but the control plane's: no node-config affinity.
    assert pod["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [NO_CP]}]
            }
        }
    }


POD_UID = {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}


def test_daemonset_rolls_with_surge_and_names_sockets_after_the_pod(default: Rendered, helm: Path) -> None:
    """Zero-downtime upgrades (docs/dra.md, "Upgrades"): the new pod starts beside the old one, which goes only
    once the new one is Ready; the DRA sockets are named after the pod's UID, so the kubelet registers both."""
    for rendered in (default, template(helm, "-f", str(DRA_VALUES))):
        for ds in rendered.kinds("DaemonSet"):
            assert ds["spec"]["updateStrategy"] == {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            }
            c = container(ds)
            assert POD_UID in c["env"]
            # No host port or host network: two pods of the DaemonSet fit on one node.
            assert all("hostPort" not in port for port in c["ports"])
            assert not ds["spec"]["template"]["spec"].get("hostNetwork", False)
    ds = template(helm, "-f", str(DRA_VALUES)).kinds("DaemonSet")[0]
    mounts = {m["name"]: m["mountPath"] for m in container(ds)["volumeMounts"]}
    # Both pods see the same driver directory (its checkpoint and locks) and registry (each one's socket).
    assert mounts["kubelet-plugins"] == "/var/lib/kubelet/plugins"
    assert mounts["plugins-registry"] == "/var/lib/kubelet/plugins_registry"
    stop_first = template(
        helm, "--set", "plugin.updateStrategy.rollingUpdate.maxSurge=0", "--set",
        "plugin.updateStrategy.rollingUpdate.maxUnavailable=1",
    ).one("DaemonSet")  # fmt: skip
    assert stop_first["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_a_vendor_library_reaches_the_daemon_through_extra_volumes(
    default: Rendered, helm: Path, tmp_path: Path
) -> None:
    """The image ships no vendor library (libdcmi.so, libcndev.so, libhlml.so; NVML comes with NVIDIA's runtime):
    an operator mounts the node's driver files and picks a RuntimeClass; by default neither is rendered."""
    spec = default.one("DaemonSet")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in spec
    default_names = {v["name"] for v in spec["volumes"]}
    values = tmp_path / "ascend.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "plugin": {
                    "runtimeClassName": "nvidia",
                    "extraVolumes": [
                        {
                            "name": "ascend-driver",
                            "hostPath": {"path": "/usr/local/Ascend/driver", "type": "Directory"},
                        }
                    ],
                    "extraVolumeMounts": [
                        {"name": "ascend-driver", "mountPath": "/usr/local/Ascend/driver", "readOnly": True}
                    ],
                }
            }
        )
    )
    spec = template(helm, "-f", str(values)).one("DaemonSet")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert set(volumes) == default_names | {"ascend-driver"}
    assert volumes["ascend-driver"]["hostPath"] == {"path": "/usr/local/Ascend/driver", "type": "Directory"}
    mount = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}["ascend-driver"]
    assert mount == {"name": "ascend-driver", "mountPath": "/usr/local/Ascend/driver", "readOnly": True}


def test_config_is_the_values_config(default: Rendered) -> None:
    ds = default.one("DaemonSet")
    config = config_of(default, ds)
    handover = config.pop("devicePluginHandover")  # the one key the chart adds (plugin.devicePluginHandover)
    assert config == chart_values()["config"] and handover in ("alongside", "standby")
    parse_config(config, "values.yaml config")  # what kxpu would load: valid, not just YAML


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--kube-version", "1.37.0"], {"default": "alongside", "a": "alongside"}),
        (["--kube-version", "1.36.4"], {"default": "standby", "a": "standby"}),
        (["--kube-version", "1.34.4"], {"default": "standby", "a": "standby"}),
        (["--kube-version", "1.37.0", "--set", "plugin.devicePluginHandover=standby"], {"default": "standby", "a": "standby"}),
        (["--kube-version", "1.34.4", "--set", "plugin.devicePluginHandover=alongside"], {"default": "alongside", "a": "alongside"}),
        (["--kube-version", "1.37.0", "--set", "config.devicePluginHandover=standby"], {"default": "standby", "a": "alongside"}),
    ],
    ids=["1.37-auto", "1.36-auto", "1.34-auto", "standby", "alongside", "a-config-keeps-its-own"],
)  # fmt: skip
def test_device_plugin_handover_follows_the_cluster_version_unless_set(
    helm: Path, args: list[str], expected: dict[str, str]
) -> None:
    """alongside needs the 1.37 kubelet's endpoints per socket: before it, the kubelet drops the new pod's devices
    when the old pod stops (docs/dra.md, "Upgrades"). Each node config gets the value unless it names its own."""
    rendered = template(helm, *node_config("a", '[{"name":"a.io/b","simulated":{"count":1}}]'), *args)
    got = {
        name: config_of(rendered, ds)["devicePluginHandover"]
        for name, ds in daemonsets_by_config(rendered).items()
    }
    assert got == expected
    for ds in rendered.kinds("DaemonSet"):
        parse_config(config_of(rendered, ds), "rendered config")


def test_default_rbac_only_reviews_tokens_for_status(default: Rendered) -> None:
    """TokenReview + SubjectAccessReview (system:auth-delegator) for /status' callers, and `get` on /status
    itself for `kubectl exec <daemon pod> -- kxpu status`; nothing else."""
    assert not default.kinds("Role")
    reader = default.one("ClusterRole", "kxpu-status-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/status"], "verbs": ["get"]}]
    assert sorted(bound_roles(default, "kxpu-plugin")) == [
        "ClusterRole/kxpu-status-reader",
        "ClusterRole/system:auth-delegator",
    ]
    assert default.one("ServiceAccount")["automountServiceAccountToken"] is False  # the pod decides


def test_no_api_access_with_http_auth_none(helm: Path) -> None:
    rendered = template(helm, "--set", "plugin.httpAuth=none")
    assert not rendered.kinds("ClusterRole") and not rendered.kinds("ClusterRoleBinding")
    ds = rendered.one("DaemonSet")
    assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "--http-auth=none" in container(ds)["args"]


def test_metrics_auth_makes_prometheus_send_its_token(helm: Path) -> None:
    rendered = template(helm, "--set", "plugin.httpAuthMetrics=true", "--set", "serviceMonitor.enabled=true")
    assert "--http-auth-metrics" in container(rendered.one("DaemonSet"))["args"]
    (endpoint,) = rendered.one("ServiceMonitor", "kxpu-plugin")["spec"]["endpoints"]
    assert endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"


def test_headless_metrics_service(default: Rendered) -> None:
    svc = default.one("Service")
    ds = default.one("DaemonSet")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 5978, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()


# -- overrides ------------------------------------------------------------------------------------------------
def daemonsets_by_config(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {ds["metadata"]["labels"]["kxpu.io/node-config"]: ds for ds in rendered.kinds("DaemonSet")}


def test_one_daemonset_per_node_config(overrides: Rendered) -> None:
    by_config = daemonsets_by_config(overrides)
    assert sorted(by_config) == ["big-npu", "default", "fpga-nodes"]
    assert by_config["fpga-nodes"]["metadata"]["name"] == "kxpu-plugin-fpga-nodes"
    selectors = [tuple(sorted(ds["spec"]["selector"]["matchLabels"].items())) for ds in by_config.values()]
    assert len(set(selectors)) == 3, "DaemonSet selectors must not overlap"
    for ds in by_config.values():
        assert (
            ds["spec"]["selector"]["matchLabels"].items()
            <= ds["spec"]["template"]["metadata"]["labels"].items()
        )
    values = override_values()
    expected = {"default": values["config"], **values["nodeConfigs"]}
    for name, ds in by_config.items():
        config = config_of(overrides, ds)
        assert config.pop("devicePluginHandover") in ("alongside", "standby")  # helm's version: see below
        assert config == {k: v for k, v in expected[name].items() if k != "devicePluginHandover"}
        parse_config(config_of(overrides, ds), name)
    checksums = {
        ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"] for ds in by_config.values()
    }
    assert len(checksums) == 3


def test_node_config_affinity_keeps_user_terms(overrides: Rendered) -> None:
    by_config = daemonsets_by_config(overrides)
    user_terms = override_values()["plugin"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    wanted = {
        "default": {"key": "kxpu.io/config", "operator": "NotIn", "values": ["big-npu", "fpga-nodes"]},
        "fpga-nodes": {"key": "kxpu.io/config", "operator": "In", "values": ["fpga-nodes"]},
        "big-npu": {"key": "kxpu.io/config", "operator": "In", "values": ["big-npu"]},
    }
    for name, ds in by_config.items():
        pod = ds["spec"]["template"]["spec"]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ]
        # Terms are ORed, expressions ANDed: the config expression joins every term the user wrote.
        assert terms == [
            {"matchExpressions": [*t["matchExpressions"], wanted[name], NO_CP]} for t in user_terms
        ]
        assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_node_config_affinity_without_user_affinity(helm: Path) -> None:
    rendered = template(helm, *node_config("a"))
    by_config = daemonsets_by_config(rendered)
    for name, op in (("default", "NotIn"), ("a", "In")):
        affinity = by_config[name]["spec"]["template"]["spec"]["affinity"]
        assert affinity == {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kxpu.io/config", "operator": op, "values": ["a"]},
                                NO_CP,
                            ]
                        }
                    ]
                }
            }
        }


def test_override_pod_settings(overrides: Rendered) -> None:
    ds = daemonsets_by_config(overrides)["default"]
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    assert c["image"] == "registry.example.com/kxpu@sha256:" + "0123456789abcdef" * 4
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert c["args"][-1] == "--import=acme_npu" and "--log-level=debug" in c["args"]
    assert "--http-address=:9500" in c["args"] and c["ports"][0]["containerPort"] == 9500
    # The host's kubelet directory moved; inside the container the daemon still finds it at the standard path.
    paths = host_paths(ds)
    assert paths["device-plugins"] == (
        "/var/lib/k0s/kubelet/device-plugins",
        "/var/lib/kubelet/device-plugins",
        "Directory",
    )
    assert "pod-resources" not in paths
    assert c["securityContext"] == {
        "runAsUser": 0,
        "runAsGroup": 0,
        "runAsNonRoot": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert c["env"] == [POD_UID, {"name": "PYTHONPATH", "value": "/opt/acme"}]  # no API access: no NODE_NAME
    assert ds["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "accel"
    assert pod["automountServiceAccountToken"] is False


def test_mps_and_telemetry_settings(helm: Path, default: Rendered) -> None:
    """hostPID and the MPS /dev/shm only when asked; the shm is the state directory's mps/shm (docs/mps.md)."""
    ds = daemonsets_by_config(default)["default"]
    assert "hostPID" not in ds["spec"]["template"]["spec"] and "mps-shm" not in host_paths(ds)
    rendered = template(helm, "--set", "plugin.hostPID=true", "--set", "plugin.mpsShm=true")
    ds = daemonsets_by_config(rendered)["default"]
    assert ds["spec"]["template"]["spec"]["hostPID"] is True
    assert host_paths(ds)["mps-shm"] == ("/run/kxpu/mps/shm", "/dev/shm", "DirectoryOrCreate")
    assert host_paths(ds)["state"][:2] == ("/run/kxpu", "/run/kxpu")  # mpsRoot's host path is the daemon's


def test_no_wildcards_in_any_role(default: Rendered, overrides: Rendered) -> None:
    for rendered in (default, overrides):
        for role in rendered.kinds("ClusterRole") + rendered.kinds("Role"):
            for rule in role["rules"]:
                for field in ("apiGroups", "resources", "nonResourceURLs", "verbs"):
                    assert "*" not in rule.get(field, []), (role["metadata"]["name"], rule)
                assert set(rule["verbs"]) <= {"get", "list", "watch", "patch"}, rule


def test_service_monitor(overrides: Rendered) -> None:
    sm = overrides.one("ServiceMonitor")
    svc = overrides.one("Service")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["honorLabels"] is True  # telemetry's namespace/pod/container labels are kept
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint[
        "relabelings"
    ]
    assert svc["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}


def test_namespaced_objects_carry_the_namespace(overrides: Rendered) -> None:
    for doc in overrides.docs:
        if doc["kind"] in NAMESPACED:
            assert doc["metadata"]["namespace"] == "kxpu-system", doc["metadata"]["name"]


def node_config(name: str, resources: str = '[{"name":"a.io/b","simulated":{}}]') -> list[str]:
    return ["--set-json", f'nodeConfigs={{"{name}":{{"version":"v1","resources":{resources}}}}}']


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (node_config("default"), 'not "default"'),
        (node_config("Bad_Name"), "nodeConfigs.Bad_Name"),
        (node_config("a", "[]"), "nodeConfigs.a.resources"),
        (["--set-json", "config.resources=[]"], "config.resources must list"),
        (["--set", "config.version=v2"], "config.version must be v1"),
        (["--set", "serviceMonitor.enabled=true", "--set", "service.enabled=false"], "needs service.enabled"),
        (["--set", "plugin.devicePluginHandover=later"], "plugin.devicePluginHandover"),
    ],
    ids=[
        "reserved-name",
        "bad-name",
        "empty-node-config",
        "empty-config",
        "bad-version",
        "monitor-without-service",
        "bad-handover",
    ],
)
def test_bad_values_are_refused(helm: Path, args: list[str], message: str) -> None:
    assert message in template_error(helm, *args)


def test_plain_manifests_are_current(helm: Path) -> None:
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "helm" / "manifests.sh"), "--check"],
        capture_output=True,
        text=True,
        env={"KXPU_HELM": str(helm), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_plain_manifests_have_no_helm_labels() -> None:
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "manifests" / "kxpu.yaml").read_text()) if d]
    assert docs[0]["kind"] == "Namespace"
    for doc in docs:
        labels = doc["metadata"].get("labels", {})
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/managed-by" not in labels


# -- sharing --------------------------------------------------------------------------------------------------
SHARING_VALUES = OVERRIDES.parent / "values-sharing.yaml"


@pytest.fixture(scope="module")
def sharing(helm: Path) -> Rendered:
    return template(helm, "--values", str(SHARING_VALUES))


def test_helm_lint_with_sharing(helm: Path) -> None:
    for extra in ([], ["--set", "webhook.certManager.enabled=true", "--set", "webhook.tls.secretName="]):
        proc = subprocess.run(
            [str(helm), "lint", "--strict", str(CHART), "--values", str(SHARING_VALUES), *extra],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sharing_is_off_by_default(default: Rendered) -> None:
    assert not default.kinds("Deployment") and not default.kinds("Secret")
    assert not default.kinds("MutatingWebhookConfiguration") and not default.kinds(
        "ValidatingWebhookConfiguration"
    )
    assert chart_values()["sharing"]["enabled"] is False


def rules(role: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    """(apiGroup, resource, resourceNames, verbs) per rule, for exact comparison."""
    out = []
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.append((group, resource, tuple(rule.get("resourceNames", ())), tuple(rule["verbs"])))
    return sorted(out)


def bound_roles(rendered: Rendered, account: str) -> dict[str, dict[str, Any]]:
    """Roles and ClusterRoles (by kind/name) bound to a service account of the release."""
    out = {}
    for binding in rendered.kinds("RoleBinding") + rendered.kinds("ClusterRoleBinding"):
        if {"kind": "ServiceAccount", "name": account, "namespace": "kxpu-system"} in binding["subjects"]:
            ref = binding["roleRef"]
            out[f"{ref['kind']}/{ref['name']}"] = binding
    return out


def test_sharing_rbac_is_exact(sharing: Rendered) -> None:
    extender = rules(sharing.one("ClusterRole", "kxpu-scheduler-extender"))
    assert extender == [
        ("", "events", (), ("create",)),
        ("", "nodes", (), ("get", "list", "watch", "patch")),
        ("", "pods", (), ("get", "list", "watch", "patch")),
        ("", "pods/binding", (), ("create",)),
        ("", "pods/status", (), ("patch",)),
    ]
    assert rules(sharing.one("Role", "kxpu-scheduler")) == [
        ("", "configmaps", ("kxpu-verify-keys",), ("get", "update")),
        # the Ed25519 key: read through the API, created by the extender on first start (never rendered)
        ("", "secrets", (), ("create",)),
        ("", "secrets", ("kxpu-signing-ed25519",), ("get",)),
        ("coordination.k8s.io", "leases", (), ("create",)),
        ("coordination.k8s.io", "leases", (), ("get", "list", "watch", "patch")),
        ("coordination.k8s.io", "leases", ("kxpu-scheduler",), ("get", "update")),
    ]
    assert sorted(bound_roles(sharing, "kxpu-scheduler")) == [
        "ClusterRole/kxpu-scheduler-extender",
        "ClusterRole/system:kube-scheduler",
        "ClusterRole/system:volume-scheduler",
        "Role/extension-apiserver-authentication-reader",
        "Role/kxpu-scheduler",
    ]
    assert rules(sharing.one("ClusterRole", "kxpu-plugin-sharing")) == [
        ("", "events", (), ("create",)),
        ("", "nodes", (), ("get", "patch")),
        ("", "pods", (), ("get", "patch")),
    ]
    # Ed25519: the nodes read public keys only; no Secret at all
    assert rules(sharing.one("Role", "kxpu-plugin-signing-key")) == [
        ("", "configmaps", ("kxpu-verify-keys",), ("get",)),
        ("coordination.k8s.io", "leases", (), ("get", "patch")),
    ]
    assert sorted(bound_roles(sharing, "kxpu-plugin")) == [
        "ClusterRole/kxpu-plugin-sharing",
        "ClusterRole/kxpu-status-reader",
        "ClusterRole/system:auth-delegator",
        "Role/kxpu-plugin-signing-key",
    ]
    assert not bound_roles(sharing, "kxpu-webhook")
    for role in sharing.kinds("ClusterRole") + sharing.kinds("Role"):
        for rule in role["rules"]:
            fields = ("apiGroups", "resources", "nonResourceURLs", "verbs")
            assert not {"*"} & {value for f in fields for value in rule.get(f, [])}, rule


def test_node_daemon_gets_its_node_name_and_the_key(sharing: Rendered) -> None:
    by_config = daemonsets_by_config(sharing)
    for ds in by_config.values():
        assert ds["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
        env = container(ds)["env"]
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in env
    config = config_of(sharing, by_config["default"])
    assert config["resources"][0]["sharing"]["signingKey"] == {
        "configMap": "kxpu-system/kxpu-verify-keys",
        "field": "keys",
    }
    assert config["resources"][0]["sharing"]["extraKeys"] == []
    assert config["resources"][0]["sharing"]["lockNamespace"] == "kxpu-system"
    parse_config(config, "sharing default")
    # A resource naming its own key keeps it.
    own = config_of(sharing, by_config["own-key"])
    assert own["resources"][0]["sharing"]["signingKey"] == {"file": "/etc/kxpu/keys"}
    # No key material at all in the chart's output: the extender makes its key in the cluster
    assert not sharing.kinds("Secret")


def test_two_renders_are_identical_and_hold_no_key(helm: Path) -> None:
    """GitOps tools render on every sync (`helm template`, no lookup): a key made at render time would change
    at every sync, refusing pending pods and uncounting running ones. Every scheme renders the same twice,
    and nothing in it is a key."""
    for scheme in ("ed25519", "hmac", "hmac+ed25519", "ed25519+hmac"):
        args = ["-f", str(SHARING_VALUES), "--set", f"sharing.signing.scheme={scheme}"]
        first = subprocess.run([str(helm), "template", "kxpu", str(CHART), "--namespace", "kxpu-system", *args],
                               capture_output=True, text=True, check=True, timeout=120).stdout  # fmt: skip
        second = subprocess.run([str(helm), "template", "kxpu", str(CHART), "--namespace", "kxpu-system", *args],
                                capture_output=True, text=True, check=True, timeout=120).stdout  # fmt: skip
        assert first == second, scheme
        assert "PRIVATE KEY" not in first and "kind: Secret" not in first, scheme


def test_control_plane_and_scheduler_config(sharing: Rendered) -> None:
    from kxpu.sharing.control_plane import ControlPlaneConfig

    cm = sharing.one("ConfigMap", "kxpu-sharing")
    control = ControlPlaneConfig.model_validate(yaml.safe_load(cm["data"]["control-plane.yaml"]))
    assert [f.count for f in control.resource_families()] == ["example.com/sim-npu", "nvidia.com/gpu"]
    assert control.signing_key == KeySource(secret="kxpu-system/kxpu-signing-ed25519", generate=True)
    assert control.extra_keys == []
    assert control.public_keys_config_map == "kxpu-system/kxpu-verify-keys"
    assert (control.node_lock, control.lock_namespace) == ("lease", "kxpu-system")
    assert control.trusted_users == [
        "system:serviceaccount:kxpu-system:kxpu-scheduler",
        "system:serviceaccount:ops:repair-bot",
    ]
    assert control.node_users == ["system:serviceaccount:kxpu-system:kxpu-plugin"]  # only the allocated mark
    config = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    assert config["kind"] == "KubeSchedulerConfiguration"
    most_allocated = {
        "type": "MostAllocated",
        "resources": [{"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}],
    }
    assert config["profiles"] == [
        {
            "schedulerName": "kxpu-scheduler",
            # binpack: kube-scheduler's node score packs too (its LeastAllocated default would pull pods apart)
            "pluginConfig": [{"name": "NodeResourcesFit", "args": {"scoringStrategy": most_allocated}}],
        }
    ]
    assert config["leaderElection"] == {
        "leaderElect": True,
        "resourceName": "kxpu-scheduler",
        "resourceNamespace": "kxpu-system",
    }
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:8888"
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert extender["nodeCacheCapable"] is True and extender["ignorable"] is False
    managed = {m["name"]: m["ignoredByScheduler"] for m in extender["managedResources"]}
    # Every name the extender parses is managed; only the counts are also counted by kube-scheduler.
    assert managed == {
        name: name != family.count for family in control.resource_families() for name in family.names
    }


def test_scheduler_deployment(sharing: Rendered) -> None:
    deploy = sharing.one("Deployment", "kxpu-scheduler")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kxpu-scheduler"
    containers = {c["name"]: c for c in pod["containers"]}
    scheduler, extender = containers["kube-scheduler"], containers["extender"]
    # the cluster's version (helm template: helm's own); test_release.py checks it follows --kube-version
    assert scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1."), scheduler["image"]
    assert scheduler["command"] == ["kube-scheduler", "--config=/etc/kxpu/scheduler-config.yaml"]
    assert scheduler["livenessProbe"]["httpGet"] == {
        "path": "/healthz",
        "port": "scheduler",
        "scheme": "HTTPS",
    }
    assert extender["image"] == "ghcr.io/kxpu/kxpu:0.1.0"
    assert extender["args"][:4] == [
        "scheduler",
        "--config=/etc/kxpu/control-plane.yaml",
        "--address=127.0.0.1:8888",
        "--metrics-address=:9401",
    ]
    assert extender["ports"] == [{"name": "metrics", "containerPort": 9401, "protocol": "TCP"}]
    assert extender["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert extender["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    for c in (scheduler, extender):
        assert {"name": "config", "mountPath": "/etc/kxpu", "readOnly": True} in c["volumeMounts"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # the Ed25519 private key is read by the extender through the API (its Role: this Secret only), not mounted
    assert pod["volumes"] == [{"name": "config", "configMap": {"name": "kxpu-sharing"}}]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_webhook_deployment_and_tls(sharing: Rendered) -> None:
    deploy = sharing.one("Deployment", "kxpu-webhook")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    assert c["args"][:4] == [
        "webhook",
        "--config=/etc/kxpu/control-plane.yaml",
        "--address=:8443",
        "--metrics-address=:9402",
    ]
    assert {"--tls-cert-file=/etc/kxpu/tls/tls.crt", "--tls-key-file=/etc/kxpu/tls/tls.key"} <= set(c["args"])
    assert {"name": "tls", "mountPath": "/etc/kxpu/tls", "readOnly": True} in c["volumeMounts"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kxpu-webhook-tls"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    svc = sharing.one("Service", "kxpu-webhook")
    assert {"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"} in svc["spec"]["ports"]
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_webhook_rolls_without_a_moment_unanswered(sharing: Rendered, helm: Path) -> None:
    """helm upgrade (e2e/test_helm_upgrade.py): a replica goes only once its successor is Ready, and a terminating
    one keeps answering while the API server's route to it goes (preStop), within its grace period."""
    deploy = sharing.one("Deployment", "kxpu-webhook")
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deploy["spec"]["template"]["spec"]
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    assert pod["terminationGracePeriodSeconds"] == 15
    assert sharing.one("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    at_once = template(helm, "-f", str(SHARING_VALUES), "--set", "webhook.drainSeconds=0")
    assert (
        "lifecycle"
        not in at_once.one("Deployment", "kxpu-webhook")["spec"]["template"]["spec"]["containers"][0]
    )


@pytest.mark.parametrize("kind", ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"])
def test_webhook_configurations(sharing: Rendered, kind: str) -> None:
    (hook,) = sharing.one(kind)["webhooks"]
    assert hook["failurePolicy"] == "Ignore"  # from values-sharing.yaml; the chart's default is Fail
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["clientConfig"]["service"] == {
        "name": "kxpu-webhook",
        "namespace": "kxpu-system",
        "path": "/mutate" if kind.startswith("Mutating") else "/validate",
        "port": 443,
    }
    assert hook["clientConfig"]["caBundle"] == "Q0EgUEVN"
    assert hook["namespaceSelector"] == {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": ["kube-system", "kxpu-system", "monitoring"],
            }
        ]
    }
    (rule,) = hook["rules"]
    # the validating webhook sees pods/status too: the API server takes metadata changes through it
    assert rule["resources"] == (
        ["pods", "pods/status"] if kind == "ValidatingWebhookConfiguration" else ["pods"]
    )
    assert rule["operations"] == (["CREATE"] if kind.startswith("Mutating") else ["CREATE", "UPDATE"])
    assert chart_values()["webhook"]["failurePolicy"] == "Fail"
    # only pods asking for a shared resource (every name of every family) are sent: an outage touches no other pod
    config = yaml.safe_load(sharing.one("ConfigMap", "kxpu-sharing")["data"]["control-plane.yaml"])
    asks = hook["matchConditions"][0]["expression"]
    assert asks.startswith(SHARED_CONDITION_START) and asks == shared_condition(
        ["example.com/sim-npu", "example.com/sim-npucores", "example.com/sim-npumem",
         "example.com/sim-npumem-percentage", "nvidia.com/gpu", "nvidia.com/gpucores", "nvidia.com/gpu-memory",
         "nvidia.com/gpumem-percentage"],
        kxpu_metadata=not kind.startswith("Mutating"),
    )  # fmt: skip
    if kind.startswith("Mutating"):
        assert [c["name"] for c in hook["matchConditions"]] == ["asks-for-shared-devices"]
    else:  # the extender's updates skip the call; the node daemon's and everyone else's are validated
        trusted = ",".join(f"'{u}'" for u in config["trustedUsers"])
        assert "kxpu-plugin" not in trusted
        assert hook["matchConditions"][1:] == [
            {
                "name": "not-a-kxpu-update",
                "expression": f"request.operation != 'UPDATE' || !(request.userInfo.username in [{trusted}])",
            },
            # the kubelet's status updates skip the call unless they change labels or annotations; the same
            # expression as the e2e harness registers (so the e2e suite proves the API server compiles it)
            {"name": "status-changes-metadata", "expression": STATUS_CHANGES_METADATA},
        ]


def test_convert_to_claims_lets_the_webhook_make_claim_templates_only(helm: Path) -> None:
    """webhook.convertToClaims (the DRA path): the control plane says so, the webhook gets a token and may create
    and get ResourceClaimTemplates (nothing else), and its mutating registration declares NoneOnDryRun."""
    off = template(helm, "--values", str(SHARING_VALUES))
    assert "convertToClaims" not in yaml.safe_load(
        off.one("ConfigMap", "kxpu-sharing")["data"]["control-plane.yaml"]
    )
    on = template(helm, "--values", str(SHARING_VALUES), "--set", "webhook.convertToClaims=true")
    config = yaml.safe_load(on.one("ConfigMap", "kxpu-sharing")["data"]["control-plane.yaml"])
    assert config["convertToClaims"] is True
    assert on.one("ServiceAccount", "kxpu-webhook")["automountServiceAccountToken"] is True
    pod = on.one("Deployment", "kxpu-webhook")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    assert sorted(bound_roles(on, "kxpu-webhook")) == ["ClusterRole/kxpu-webhook-claim-templates"]
    assert rules(on.one("ClusterRole", "kxpu-webhook-claim-templates")) == [
        ("resource.k8s.io", "resourceclaimtemplates", (), ("create", "get"))
    ]
    assert on.one("MutatingWebhookConfiguration")["webhooks"][0]["sideEffects"] == "NoneOnDryRun"
    assert on.one("ValidatingWebhookConfiguration")["webhooks"][0]["sideEffects"] == "None"
    assert off.one("MutatingWebhookConfiguration")["webhooks"][0]["sideEffects"] == "None"


def test_webhook_runs_two_replicas_with_a_disruption_budget(sharing: Rendered, helm: Path) -> None:
    assert chart_values()["webhook"]["replicas"] == 2
    pdb = sharing.one("PodDisruptionBudget", "kxpu-webhook")
    deploy = sharing.one("Deployment", "kxpu-webhook")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    one = template(helm, "-f", str(SHARING_VALUES), "--set", "webhook.replicas=1")
    assert not one.kinds("PodDisruptionBudget")  # minAvailable 1 of 1 would block every drain


def test_webhook_certificate_from_cert_manager(helm: Path) -> None:
    rendered = template(helm, "--set", "sharing.enabled=true", "--set", "webhook.certManager.enabled=true")
    cert = rendered.one("Certificate")
    assert cert["spec"]["secretName"] == "kxpu-webhook-tls"
    assert "kxpu-webhook.kxpu-system.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"name": "kxpu-webhook-selfsigned", "kind": "Issuer"}
    assert rendered.one("Issuer")["spec"] == {"selfSigned": {}}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        hook = rendered.one(kind)
        assert hook["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": "kxpu-system/kxpu-webhook"
        }
        assert "caBundle" not in hook["webhooks"][0]["clientConfig"]
        assert hook["webhooks"][0]["failurePolicy"] == "Fail"
    volumes = {
        v["name"]: v
        for v in rendered.one("Deployment", "kxpu-webhook")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["tls"]["secret"]["secretName"] == "kxpu-webhook-tls"


def test_sharing_metrics_are_scraped(sharing: Rendered) -> None:
    monitor = sharing.one("ServiceMonitor", "kxpu-sharing")
    selected = [
        s["metadata"]["name"]
        for s in sharing.kinds("Service")
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert sorted(selected) == ["kxpu-scheduler-metrics", "kxpu-webhook"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and "relabelings" not in endpoint


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "needs webhook.tls.secretName"),
        (["--set", "webhook.tls.secretName=x"], "needs webhook.tls.caBundle"),
        (
            ["--set", "webhook.certManager.enabled=true", "--set", "webhook.failurePolicy=Maybe"],
            "Fail or Ignore",
        ),
    ],
    ids=["no-certificate", "no-ca", "bad-failure-policy"],
)
def test_bad_sharing_values_are_refused(helm: Path, args: list[str], message: str) -> None:
    assert message in template_error(helm, "--set", "sharing.enabled=true", *args)


DRA_VALUES = Path(__file__).parent / "values-dra.yaml"


@pytest.fixture(scope="module")
def dra(helm: Path) -> Rendered:
    return template(helm, "--values", str(DRA_VALUES))


def test_helm_lint_with_dra(helm: Path) -> None:
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), "--values", str(DRA_VALUES)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_dra_objects_without_a_dra_resource(default: Rendered) -> None:
    assert not default.kinds("DeviceClass")
    assert "kxpu-plugin-dra" not in {r["metadata"]["name"] for r in default.kinds("ClusterRole")}
    mounts = {
        m["name"]
        for m in default.one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert not mounts & {"kubelet-plugins", "plugins-registry"}


def test_dra_device_classes_one_per_driver_and_extra(dra: Rendered) -> None:
    classes = {c["metadata"]["name"]: c["spec"] for c in dra.kinds("DeviceClass")}
    assert set(classes) == {"npu.example.com", "gpu.nvidia.com", "big.npu.example.com"}
    assert classes["gpu.nvidia.com"]["selectors"] == [
        {"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}
    ]
    assert "64Gi" in classes["big.npu.example.com"]["selectors"][0]["cel"]["expression"]


def test_dra_rbac_is_exact(dra: Rendered) -> None:
    assert rules(dra.one("ClusterRole", "kxpu-plugin-dra")) == [
        ("", "events", (), ("create",)),
        ("", "nodes", (), ("get",)),
        ("resource.k8s.io", "resourceclaims", (), ("get", "list", "watch")),
        (
            "resource.k8s.io",
            "resourceclaims/driver",
            ("npu.example.com", "gpu.nvidia.com"),
            ("associated-node:patch",),
        ),
        ("resource.k8s.io", "resourceclaims/status", (), ("patch",)),
        ("resource.k8s.io", "resourceslices", (), ("list", "watch", "create", "update", "delete")),
    ]
    assert "ClusterRole/kxpu-plugin-dra" in bound_roles(dra, "kxpu-plugin")


def test_dra_daemonsets_get_the_plugin_dirs_node_name_and_token(dra: Rendered) -> None:
    for ds in dra.kinds("DaemonSet"):
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kubelet-plugins"] == "/var/lib/kubelet/plugins"
        assert mounts["plugins-registry"] == "/var/lib/kubelet/plugins_registry"
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container[
            "env"
        ]
        assert pod["automountServiceAccountToken"] is True


def test_a_draining_driver_keeps_the_plugin_dirs_api_access_and_its_slices_in_the_policy(helm: Path) -> None:
    """A resource moved from DRA to the device plugin: listed in dra.drainingDrivers, the new pods still see the
    claims' checkpoint (so its devices are withheld and its claims unprepared), with no DeviceClass to claim."""
    rendered = template(helm, "--set", "dra.drainingDrivers={npu.example.com}")
    assert not rendered.kinds("DeviceClass")
    assert "ClusterRole/kxpu-plugin-dra" in bound_roles(rendered, "kxpu-plugin")
    container = rendered.one("DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["kubelet-plugins"] == "/var/lib/kubelet/plugins"
    assert mounts["plugins-registry"] == "/var/lib/kubelet/plugins_registry"
    policy = rendered.one("ValidatingAdmissionPolicy")
    assert '["npu.example.com"]' in [v["expression"] for v in policy["spec"]["variables"]]


def test_dra_taints_reach_every_dra_resource_that_names_none(helm: Path, dra: Rendered) -> None:
    """dra.taints fills in each DRA resource's dra.taints on every node config; a resource's own taints win, a
    device-plugin resource gets none; the configs load."""
    rendered = template(
        helm,
        "--values",
        str(DRA_VALUES),
        "--set",
        "dra.taints.deviceLost=NoExecute",
        "--set",
        "dra.taints.unmonitored=None",
        "--set",
        "nodeConfigs.gpu-nodes.resources[1].dra.taints.deviceLost=NoSchedule",
    )
    configs = {ds["metadata"]["name"]: config_of(rendered, ds) for ds in rendered.kinds("DaemonSet")}
    taints = {
        (ds, r["name"]): (r.get("dra") or {}).get("taints")
        for ds, c in configs.items()
        for r in c["resources"]
    }
    assert taints == {
        ("kxpu-plugin", "example.com/npu"): {"deviceLost": "NoExecute", "unmonitored": "None"},
        ("kxpu-plugin", "example.com/fpga"): None,
        ("kxpu-plugin-gpu-nodes", "nvidia.com/gpu"): {"deviceLost": "NoExecute", "unmonitored": "None"},
        ("kxpu-plugin-gpu-nodes", "example.com/npu"): {"deviceLost": "NoSchedule"},
    }
    for config in configs.values():
        parse_config(config)
    # Without dra.taints nothing is added (each resource's default: NoSchedule for every fault).
    assert all("taints" not in str(config_of(dra, ds)) for ds in dra.kinds("DaemonSet"))


@pytest.mark.parametrize(
    ("scheme", "accept_hmac", "extender", "nodes", "node_secret"),
    [
        ("hmac", True, ["kxpu-signing-key"], ["secret"], True),
        ("hmac+ed25519", True, ["kxpu-signing-key", "kxpu-signing-ed25519"], ["secret", "configMap"], True),
        ("ed25519+hmac", True, ["kxpu-signing-ed25519", "kxpu-signing-key"], ["configMap", "secret"], True),
        ("ed25519+hmac", False, ["kxpu-signing-ed25519", "kxpu-signing-key"], ["configMap"], False),
    ],
)
def test_the_upgrade_from_hmac_keys_step_by_step(
    helm: Path, scheme: str, accept_hmac: bool, extender: list[str], nodes: list[str], node_secret: bool
) -> None:
    """Each step of docs/sharing.md's upgrade: which key signs, which verify where, who may read the HMAC Secret."""
    from kxpu.sharing.control_plane import ControlPlaneConfig

    rendered = template(
        helm,
        "-f",
        str(SHARING_VALUES),
        "--set",
        f"sharing.signing.scheme={scheme}",
        "--set",
        f"sharing.signing.nodesAcceptHmac={str(accept_hmac).lower()}",
    )
    cm = rendered.one("ConfigMap", "kxpu-sharing")
    control = ControlPlaneConfig.model_validate(yaml.safe_load(cm["data"]["control-plane.yaml"]))
    sources = [control.signing_key, *control.extra_keys]
    assert [str(s.secret).partition("/")[2] for s in sources] == extender
    assert all(s.generate and s.hmac == (s.secret == "kxpu-system/kxpu-signing-key") for s in sources)
    node = config_of(rendered, daemonsets_by_config(rendered)["default"])["resources"][0]["sharing"]
    node_sources = [node["signingKey"], *node["extraKeys"]]
    assert [next(iter(k for k in s if k in ("secret", "configMap"))) for s in node_sources] == nodes
    plugin_rules = rules(rendered.one("Role", "kxpu-plugin-signing-key"))
    assert (("", "secrets", ("kxpu-signing-key",), ("get",)) in plugin_rules) == node_secret
    assert all(s.get("hmac") is (s.get("secret") == "kxpu-system/kxpu-signing-key") or "configMap" in s
               for s in node_sources)  # fmt: skip
    assert not rendered.kinds("Secret")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "sharing.signing.scheme=rsa"], '"rsa" is not ed25519, hmac'),
        (["--set", "sharing.signing.scheme=hmac+hmac"], "is not ed25519, hmac"),
        (
            ["--set", "sharing.signing.scheme=hmac", "--set", "sharing.signing.nodesAcceptHmac=false"],
            "no key to verify",
        ),
        (["--set", "sharing.nodeLock=node"], '"node" is not lease or annotation'),
    ],
)
def test_bad_signing_values_are_refused(helm: Path, args: list[str], message: str) -> None:
    assert message in template_error(helm, "-f", str(SHARING_VALUES), *args)


def test_spread_keeps_kube_schedulers_own_scoring(helm: Path) -> None:
    rendered = template(helm, "-f", str(SHARING_VALUES), "--set", "sharing.nodePolicy=spread")
    config = yaml.safe_load(rendered.one("ConfigMap", "kxpu-sharing")["data"]["scheduler-config.yaml"])
    assert config["profiles"] == [{"schedulerName": "kxpu-scheduler"}]


def test_two_scheduler_replicas_elect_a_leader(helm: Path) -> None:
    """A standby kube-scheduler + extender pair: both replicas' kube-schedulers take part in leader election."""
    rendered = template(helm, "-f", str(SHARING_VALUES), "--set", "scheduler.replicas=2")
    assert rendered.one("Deployment", "kxpu-scheduler")["spec"]["replicas"] == 2
    config = yaml.safe_load(rendered.one("ConfigMap", "kxpu-sharing")["data"]["scheduler-config.yaml"])
    assert config["leaderElection"]["leaderElect"] is True
    message = template_error(
        helm,
        "-f",
        str(SHARING_VALUES),
        "--set",
        "scheduler.replicas=2",
        "--set",
        "scheduler.kubeScheduler.leaderElect=false",
    )
    assert "scheduler.replicas > 1 needs scheduler.kubeScheduler.leaderElect: true" in message

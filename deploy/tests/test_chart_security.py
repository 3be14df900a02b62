"""Least privilege, checked on what the chart renders (docs/security.md): the node daemon's roles, the admission
policy that scopes them to its node, its container's privileges, and the hardening of the control plane's roles.

e2e/test_security.py shows the same policy refusing and allowing on a real API server.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from deploy.tests.conftest import OVERRIDES, Rendered, template, template_error
from kxpu.kube.sharing.api import KubeSchedulerAPI
from kxpu.sharing.lock import ASSIGNED_POD_LABEL, LOCK_PREFIX

VALUES = Path(__file__).parent
SHARING = ["--values", str(VALUES / "values-sharing.yaml")]
DRA = ["--values", str(VALUES / "values-dra.yaml")]
RENDERS = {
    "default": [],
    "overrides": ["--values", str(OVERRIDES)],
    "sharing": SHARING,
    "dra": DRA,
    "sharing+dra": [*SHARING, *DRA],
}
WRITES = {"create", "update", "patch", "delete", "deletecollection", "bind", "escalate", "impersonate"}
PLUGIN_SA = "kxpu-plugin"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
POLICY = "kxpu-plugin-node-scope"
SCHEDULER_SA = "kxpu-scheduler"
SCHEDULER_POLICY = "kxpu-scheduler-scope"
# The built-in ClusterRoles the chart binds to the scheduler's account (not rendered: Kubernetes makes them), with
# their pod and Node writes as Kubernetes 1.34-1.37 define them (plugin/pkg/auth/authorizer/rbac/bootstrappolicy).
BUILT_IN_SCHEDULER_ROLES = {"system:kube-scheduler", "system:volume-scheduler"}
BUILT_IN_POD_AND_NODE_WRITES = {
    ("", "pods", "delete"),
    ("", "pods/binding", "create"),
    ("", "bindings", "create"),
    ("", "pods/status", "patch"),
    ("", "pods/status", "update"),
    ("", "pods/finalizers", "update"),  # an authorization check for owner references, no endpoint
}


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, Rendered]:
    return {name: template(helm, *args) for name, args in RENDERS.items()}


def roles_of(rendered: Rendered, account: str) -> list[dict[str, Any]]:
    """The Roles and ClusterRoles bound to a ServiceAccount of the release (namespace kxpu-system)."""
    subject = {"kind": "ServiceAccount", "name": account, "namespace": "kxpu-system"}
    out = []
    for binding in rendered.kinds("RoleBinding") + rendered.kinds("ClusterRoleBinding"):
        if subject in binding["subjects"]:
            ref = binding["roleRef"]
            out += [r for r in rendered.kinds(ref["kind"]) if r["metadata"]["name"] == ref["name"]]
    return out


def written(rendered: Rendered, account: str) -> set[tuple[str, str]]:
    """(apiGroup, resource) the account may write."""
    return {
        (group, resource)
        for role in roles_of(rendered, account)
        for rule in role["rules"]
        if WRITES & set(rule["verbs"])
        for group in rule.get("apiGroups", [])  # a nonResourceURLs rule has none
        for resource in rule.get("resources", [])
    }


def policy_matches(policy: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, operation) the policy sees."""
    return {
        (group, resource, op)
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for op in rule["operations"]
    }


def variables(policy: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


def pod_security(ds: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec.get("securityContext", {}), container["securityContext"]


@pytest.mark.parametrize("name", RENDERS)
def test_no_wildcards_anywhere(rendered: dict[str, Rendered], name: str) -> None:
    for role in rendered[name].kinds("ClusterRole") + rendered[name].kinds("Role"):
        for rule in role["rules"]:
            fields = (
                "apiGroups",
                "resources",
                "nonResourceURLs",
                "verbs",
            )  # /status' reader: nonResourceURLs
            assert not {"*"} & {value for f in fields for value in rule.get(f, [])}, (
                role["metadata"]["name"],
                rule,
            )


@pytest.mark.parametrize("name", RENDERS)
def test_every_daemon_write_goes_through_the_node_policy(rendered: dict[str, Rendered], name: str) -> None:
    """Whatever the node daemon may write, the ValidatingAdmissionPolicy bound to its account sees: no release
    lets a node write pods, Nodes, Leases or ResourceSlices anywhere but on itself."""
    r = rendered[name]
    writes = written(r, PLUGIN_SA)
    policies = r.kinds("ValidatingAdmissionPolicy")
    if not writes:
        assert not policies and not r.kinds("ValidatingAdmissionPolicyBinding")
        return
    policy = r.one("ValidatingAdmissionPolicy", POLICY)
    binding = r.one("ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert policy["spec"]["failurePolicy"] == "Fail"
    (condition,) = policy["spec"]["matchConditions"]
    assert (
        condition["expression"]
        == f'request.userInfo.username == "system:serviceaccount:kxpu-system:{PLUGIN_SA}"'
    )
    matched = policy_matches(policy)
    for group, resource in writes:
        for op in ("CREATE", "UPDATE", "DELETE"):
            assert (group, resource, op) in matched, (group, resource, op)
    # Writes of the kinds that name a node are checked against the node the token is bound to, and a token naming
    # none gets nothing: the first validation.
    assert NODE_NAME_EXTRA in variables(policy)["node"]
    first = policy["spec"]["validations"][0]
    assert first["expression"] == "variables.node != ''"
    checks = " ".join(v["expression"] for v in policy["spec"]["validations"])
    for kind in ("'/pods'", "'/nodes'", "'coordination.k8s.io/leases'", "'resource.k8s.io/resourceslices'"):
        assert f"variables.kind != {kind} ||" in checks, kind
    # Pods and Nodes: spec never changes; Leases: only those of the caller's node
    assert checks.count("object.spec == oldObject.spec") == 2
    assert "'kxpu-lock.' + variables.node + '.'" in checks
    # A lock Lease may only be released (a holder a node wrote could name any pending pod), and slices live in the
    # pool named after the caller's node (another node's pool would make its devices look allocated)
    assert "!has(object.spec.holderIdentity)" in checks
    assert "object.spec.pool.name == variables.node" in checks
    assert "oldObject.spec.pool.name == variables.node" in checks


def test_the_policy_allows_only_the_releases_drivers(rendered: dict[str, Rendered]) -> None:
    assert variables(rendered["dra"].one("ValidatingAdmissionPolicy", POLICY))["drivers"] == (
        '["npu.example.com","gpu.nvidia.com"]'
    )
    assert variables(rendered["sharing"].one("ValidatingAdmissionPolicy", POLICY))["drivers"] == "[]"


@pytest.mark.parametrize("name", ["sharing", "sharing+dra"])
def test_node_roles_read_keys_by_name_and_write_nothing_cluster_wide_but_scoped_kinds(
    rendered: dict[str, Rendered], name: str
) -> None:
    r = rendered[name]
    assert written(r, PLUGIN_SA) <= {
        ("", "nodes"),
        ("", "pods"),
        ("", "events"),
        ("coordination.k8s.io", "leases"),
        ("resource.k8s.io", "resourceslices"),
    }
    for role in roles_of(r, PLUGIN_SA):
        for rule in role["rules"]:
            if {"secrets", "configmaps"} & set(rule.get("resources", [])):
                assert rule.get("resourceNames") and rule["verbs"] == ["get"], rule


def granted_updates(rendered: Rendered, account: str) -> set[tuple[str, str]]:
    """(apiGroup, resource) of pods and Nodes the account may update or patch: its rendered roles and the built-in
    ones the chart binds it to."""
    rendered_rules = {
        (group, resource, verb)
        for role in roles_of(rendered, account)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule["verbs"]
    }
    return {
        (group, resource)
        for group, resource, verb in rendered_rules | BUILT_IN_POD_AND_NODE_WRITES
        if verb in {"update", "patch"}
        and resource.split("/")[0] in {"pods", "nodes"}
        and resource != "pods/finalizers"
    }


def matches(matched: set[tuple[str, str, str]], group: str, resource: str, op: str) -> bool:
    parent = resource.split("/")[0]
    return any((group, r, op) in matched for r in (resource, f"{parent}/*" if "/" in resource else resource))


@pytest.mark.parametrize("name", RENDERS)
def test_every_scheduler_pod_and_node_update_goes_through_the_scheduler_policy(
    rendered: dict[str, Rendered], name: str
) -> None:
    """The scheduler pod's account (kube-scheduler and the extender) may patch pods, pods/status and Nodes
    cluster-wide by RBAC; the policy bound to it sees every such update, with every subresource."""
    r = rendered[name]
    if not r.kinds("Deployment") or not any(
        d["metadata"]["name"] == SCHEDULER_SA for d in r.kinds("Deployment")
    ):  # no sharing: no scheduler, no policy
        assert SCHEDULER_POLICY not in {p["metadata"]["name"] for p in r.kinds("ValidatingAdmissionPolicy")}
        return
    policy = r.one("ValidatingAdmissionPolicy", SCHEDULER_POLICY)
    binding = r.one("ValidatingAdmissionPolicyBinding", SCHEDULER_POLICY)
    assert binding["spec"] == {"policyName": SCHEDULER_POLICY, "validationActions": ["Deny"]}
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert policy["spec"]["failurePolicy"] == "Fail"
    (condition,) = policy["spec"]["matchConditions"]
    assert (
        condition["expression"]
        == f'request.userInfo.username == "system:serviceaccount:kxpu-system:{SCHEDULER_SA}"'
    )
    # The account is the scheduler pod's, and holds the built-in roles whose writes are listed above.
    deployment = r.one("Deployment", SCHEDULER_SA)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == SCHEDULER_SA
    subject = {"kind": "ServiceAccount", "name": SCHEDULER_SA, "namespace": "kxpu-system"}
    built_in = {
        b["roleRef"]["name"]
        for b in r.kinds("ClusterRoleBinding")
        if subject in b["subjects"] and b["roleRef"]["name"].startswith("system:")
    }
    assert built_in == BUILT_IN_SCHEDULER_ROLES
    updates = granted_updates(r, SCHEDULER_SA)
    assert updates >= {("", "pods"), ("", "nodes"), ("", "pods/status")}, updates
    matched = policy_matches(policy)
    for group, resource in updates:
        assert matches(matched, group, resource, "UPDATE"), (group, resource)
    # Subresources the account is not granted are matched too (and refused), so a new grant cannot slip past.
    for resource in ("pods/ephemeralcontainers", "pods/resize", "nodes/status"):
        assert matches(matched, "", resource, "UPDATE"), resource
    # Only updates: binding (create) and preemption (delete) are left to RBAC, as docs/security.md says.
    assert {op for _, _, op in matched} == {"UPDATE"}

    checks = " ".join(v["expression"] for v in policy["spec"]["validations"])
    for kind in ("'/pods'", "'/nodes'"):
        assert f"variables.kind != {kind} ||" in checks, kind
    assert checks.count("object.spec == oldObject.spec") == 2  # pods and Nodes: no image change, no cordon
    # Exactly the extender's writes: the watch label on its pods, the annotation node lock, Failed with its reason.
    assert f"k == '{ASSIGNED_POD_LABEL}'" in checks
    assert f"k.startsWith('{LOCK_PREFIX}')" in checks
    v = variables(policy)
    assert "'KxpuAllocationExpired'" in v["failsUnadmitted"]
    assert '"KxpuAllocationExpired"' in inspect.getsource(KubeSchedulerAPI._fail_unadmitted)
    assert "oldObject.spec.?nodeName.orValue('') != ''" in v["failsUnadmitted"]
    assert v["ours"].endswith('== "kxpu-scheduler"')  # sharing.schedulerName, the profile kube-scheduler runs


def test_the_scheduler_policy_follows_the_scheduler_name(helm: Path) -> None:
    r = template(helm, *SHARING, "--set", "sharing.schedulerName=gpu-sched")
    assert variables(r.one("ValidatingAdmissionPolicy", SCHEDULER_POLICY))["ours"].endswith('== "gpu-sched"')


def test_extender_writes_only_its_own_configmap(rendered: dict[str, Rendered]) -> None:
    """No `create` on ConfigMaps (RBAC cannot limit it to a name): the chart makes the public keys' ConfigMap."""
    r = rendered["sharing"]
    for role in roles_of(r, "kxpu-scheduler"):
        for rule in role["rules"]:
            if "configmaps" in rule["resources"]:
                assert rule["resourceNames"] == ["kxpu-verify-keys"], rule
    cm = r.one("ConfigMap", "kxpu-verify-keys")
    assert "data" not in cm  # the extender fills it in; Helm leaves it alone on upgrade


@pytest.mark.parametrize("name", RENDERS)
def test_daemon_container_is_least_privilege(rendered: dict[str, Rendered], name: str) -> None:
    """Unprivileged unless its node config names a backend that opens device nodes (values.yaml, per backend)."""
    for ds in rendered[name].kinds("DaemonSet"):
        pod, sc = pod_security(ds)
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert sc["readOnlyRootFilesystem"] is True
        config = ds["metadata"]["labels"]["kxpu.io/node-config"]
        device_backend = (name, config) in {("dra", "gpu-nodes"), ("sharing+dra", "gpu-nodes")}  # nvidia: {}
        if device_backend:
            assert sc["privileged"] is True
            continue
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        # The writable places are the host paths it serves through and an in-memory /tmp.
        spec = ds["spec"]["template"]["spec"]
        tmp = next(v for v in spec["volumes"] if v["name"] == "tmp")
        assert tmp["emptyDir"]["medium"] == "Memory"


def test_privileged_by_backend(helm: Path) -> None:
    def privileged(*args: str) -> bool:
        (ds,) = template(helm, *args).kinds("DaemonSet")
        return bool(pod_security(ds)[1]["privileged"])

    one = '{{"version":"v1","resources":[{{"name":"a.io/b","{backend}":{{}}}}]}}'
    for backend in ("nvidia", "ascend", "cambricon", "gaudi"):
        assert privileged("--set-json", "config=" + one.format(backend=backend)), backend
    for backend in ("simulated", "amd", "neuron"):
        assert not privileged("--set-json", "config=" + one.format(backend=backend)), backend
    assert privileged("--set", "plugin.privileged=true")
    assert not privileged(
        "--set-json", "config=" + one.format(backend="nvidia"), "--set", "plugin.privileged=false"
    )
    assert "plugin.privileged" in template_error(helm, "--set", "plugin.privileged=maybe")
    (ds,) = template(helm, "--set-json", 'plugin.capabilities.add=["SYS_PTRACE"]').kinds("DaemonSet")
    assert pod_security(ds)[1]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}


def test_control_plane_nodes_only_when_asked(helm: Path, rendered: dict[str, Rendered]) -> None:
    no_cp = {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}
    for r in rendered.values():
        for ds in r.kinds("DaemonSet"):
            terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
            assert all(no_cp in t["matchExpressions"] for t in terms), ds["metadata"]["name"]
    (ds,) = template(helm, "--set", "plugin.controlPlane=true").kinds("DaemonSet")
    assert "affinity" not in ds["spec"]["template"]["spec"]


@pytest.mark.parametrize("name", ["", "default"])
def test_existing_service_account_must_be_named(helm: Path, name: str) -> None:
    """serviceAccount.create: false never hands the daemon's roles to the namespace's default account."""
    message = template_error(
        helm, *SHARING, "--set", "serviceAccount.create=false", "--set", f"serviceAccount.name={name}"
    )
    assert "serviceAccount.create: false needs serviceAccount.name" in message
    # ... even without any role to hand out: the daemon's pods would run as it.
    assert "serviceAccount.name" in template_error(helm, "--set", "serviceAccount.create=false")


def test_existing_service_account_gets_the_roles_and_the_policy(helm: Path) -> None:
    r = template(
        helm, *SHARING, *DRA, "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=npu-node"
    )
    assert not r.kinds("ServiceAccount") or all(
        sa["metadata"]["name"] != "npu-node" for sa in r.kinds("ServiceAccount")
    )
    assert written(r, "npu-node") and not written(r, "default")
    (condition,) = r.one("ValidatingAdmissionPolicy", POLICY)["spec"]["matchConditions"]
    assert condition["expression"].endswith(':kxpu-system:npu-node"')


def test_removed_node_label_role_is_refused(helm: Path) -> None:
    """Nothing patches node labels: the old switch for a cluster-wide Node patch role is refused, not ignored."""
    assert "plugin.rbac.nodeLabels was removed" in template_error(
        helm, "--set", "plugin.rbac.nodeLabels=true"
    )


def test_kube_scheduler_by_digest(helm: Path) -> None:
    digest = "sha256:" + "ab" * 32
    r = template(helm, *SHARING, "--set", f"scheduler.kubeScheduler.image.digest={digest}")
    containers = r.one("Deployment", "kxpu-scheduler")["spec"]["template"]["spec"]["containers"]
    images = {c["name"]: c["image"] for c in containers}
    assert images["kube-scheduler"] == f"registry.k8s.io/kube-scheduler@{digest}"
    bad = template_error(helm, *SHARING, "--set", "scheduler.kubeScheduler.image.digest=latest")
    assert "scheduler.kubeScheduler.image.digest" in bad

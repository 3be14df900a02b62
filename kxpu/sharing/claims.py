"""Pods written for HAMi or kxpu's extender, turned at admission into DRA consumable-capacity claims.

A container asking ``nvidia.com/gpu: 1, nvidia.com/gpumem: 3000, nvidia.com/gpucores: 30`` (any family's names)
loses those limits and gets, instead, a pod claim made from a ResourceClaimTemplate that asks the family's
DeviceClass for ``count`` devices, each with ``capacity.requests: {memory: 3000Mi, cores: "30"}``: the stock
kube-scheduler packs it by consumable capacity (KEP-5075) and kxpu's DRA driver gives the container the same
in-container limits as the extender path (HAMi-core's variables, or MPS's).

Why a template, not a claim: a mutating webhook may be called for a pod that is then refused (a later webhook,
quota), called again (reinvocation), or called in a dry run; a ResourceClaim it created would then be left
holding devices, and it could not be owned by a pod that has no UID yet (a Deployment's pods have no name either).
A template holds nothing: the API server's resourceclaim controller makes each pod's claim from it when the pod
exists, owned by the pod and deleted with it. The template's name is a hash of its spec, so every pod of one shape
in a namespace shares one, creating it again is harmless (409), and nothing is created in a dry run.

The pure part is here (no Kubernetes import): what to patch and which templates must exist. The webhook creates
them through the API before it answers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kxpu.dra.slices import binary_quantity
from kxpu.sharing.model import ContainerRequest, DeviceFilter, PodRequest
from kxpu.sharing.requests import RequestError, ResourceFamily, check_containers, parse_pod

API_VERSION = "resource.k8s.io/v1"
# On every template the webhook makes: what made it (``kubectl delete resourceclaimtemplates -l`` clears them).
CONVERTED_LABEL = "kxpu.io/converted-from"
NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
STOCK_SCHEDULER = "default-scheduler"
_NOT_LABEL = re.compile(r"[^a-z0-9-]+")
_HASH_LEN = 12


@dataclass(frozen=True, slots=True)
class ClaimFamily:
    """A sharing family and where its devices are on the DRA path: the DeviceClass claims name, and the driver
    whose attributes selectors read (``device.attributes["<driver>"]``)."""

    family: ResourceFamily
    device_class: str
    driver: str


@dataclass(frozen=True, slots=True)
class Template:
    """A ResourceClaimTemplate that must exist in ``namespace`` before the pod is admitted."""

    namespace: str
    name: str
    spec: dict[str, Any]
    family: str

    def manifest(self) -> dict[str, Any]:
        label = _NOT_LABEL.sub("-", self.family.replace("/", ".").lower()).strip("-")[:63].strip("-")
        return {
            "apiVersion": API_VERSION,
            "kind": "ResourceClaimTemplate",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {CONVERTED_LABEL: label, "app.kubernetes.io/managed-by": "kxpu"},
            },
            "spec": {"spec": self.spec},
        }


@dataclass(frozen=True, slots=True)
class Conversion:
    patch: list[dict[str, Any]] = field(default_factory=list)
    templates: list[Template] = field(default_factory=list)


def _label(text: str) -> str:
    return _NOT_LABEL.sub("-", text.lower()).strip("-")[:40].strip("-") or "device"


def _escape(segment: str) -> str:
    return segment.replace("~", "~0").replace("/", "~1")


def _cel_string(value: str) -> str:
    # JSON's string escapes (\", \\, \uXXXX) are CEL's too: a value can never end the literal early.
    return json.dumps(value)


def _selectors(driver: str, wanted: DeviceFilter) -> list[dict[str, Any]]:
    """The pod's use-type / nouse-type / use-uuid / nouse-uuid annotations as CEL over kxpu's attributes
    (``model``, ``uuid``, ``id``), guarded with ``has`` so a device without the attribute is only not matched."""
    attrs = f"device.attributes[{_cel_string(driver)}]"

    def model_contains(types: frozenset[str]) -> str:
        tests = " || ".join(f"{attrs}.model.lowerAscii().contains({_cel_string(t)})" for t in sorted(types))
        return f"(has({attrs}.model) && ({tests}))"

    def named(ids: frozenset[str]) -> str:
        listed = "[" + ", ".join(_cel_string(i) for i in sorted(ids)) + "]"
        return f"((has({attrs}.uuid) && {attrs}.uuid in {listed}) || (has({attrs}.id) && {attrs}.id in {listed}))"

    expressions = []
    if wanted.use_types:
        expressions.append(model_contains(wanted.use_types))
    if wanted.nouse_types:
        expressions.append(f"!{model_contains(wanted.nouse_types)}")
    if wanted.use_uuids:
        expressions.append(named(wanted.use_uuids))
    if wanted.nouse_uuids:
        expressions.append(f"!{named(wanted.nouse_uuids)}")
    return [{"cel": {"expression": e}} for e in expressions]


def claim_spec(
    where: ClaimFamily, container: ContainerRequest, wanted: DeviceFilter, numa_bind: bool
) -> dict[str, Any]:
    """The ResourceClaim spec of one container's share of one family.

    Memory in MiB becomes a byte quantity per device (``3000Mi``, ``4Gi``); 100 % of the memory (the default when a container names none)
    is no memory request, so the claim consumes the published default, the whole memory. Cores are always named
    (``"0"``: no compute limit, best-effort time-sharing, as on the extender path). Only a count is the whole
    device: no capacity request at all, exclusive. Other percentages cannot be written as a capacity request
    (it is absolute, and the device is not known yet): refused with what to ask instead.
    """
    family = where.family
    requests: dict[str, str] = {}
    count_only = (
        container.memory_mib is None and container.memory_percentage == 100 and container.cores == 100
    )
    if container.memory_mib is not None:
        # as the API server stores it (4096 MiB comes back as 4Gi): a template made again compares equal
        requests["memory"] = binary_quantity(container.memory_mib * 2**20)
    elif container.memory_percentage != 100:
        raise RequestError(
            f"container {container.container!r}: {family.memory_percentage} {container.memory_percentage} cannot "
            f"become a DRA claim (capacity requests are absolute, in MiB): ask for {family.memory} instead"
        )
    if not count_only:
        requests["cores"] = str(container.cores)
    request_name = _label(family.short)
    exactly: dict[str, Any] = {
        "deviceClassName": where.device_class,
        "allocationMode": "ExactCount",
        "count": container.count,
    }
    if requests:
        exactly["capacity"] = {"requests": requests}
    selectors = _selectors(where.driver, wanted)
    if selectors:
        exactly["selectors"] = selectors
    devices: dict[str, Any] = {"requests": [{"name": request_name, "exactly": exactly}]}
    if numa_bind and container.count > 1:
        devices["constraints"] = [{"requests": [request_name], "matchAttribute": NUMA_ATTRIBUTE}]
    return {"devices": devices}


def template_name(family: ResourceFamily, spec: Mapping[str, Any]) -> str:
    """``kxpu-<family>-<hash of the spec>``: one template per shape and namespace, the same on every call."""
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:_HASH_LEN]
    return f"kxpu-{_label(family.short)}-{digest}"


def _check_pod(pod: Mapping[str, Any], names: frozenset[str], protected: Sequence[str]) -> None:
    """The webhook's checks of a shared pod that hold on the DRA path too (one-line RequestError)."""
    spec = pod.get("spec") or {}
    check_containers(spec, names, protected, "kxpu's DRA driver sets from the claim")
    if spec.get("nodeName"):
        raise RequestError(
            "pods asking for shared devices must be placed by the scheduler (their claims allocated), "
            "not have nodeName preset"
        )


# Each template is an API call the webhook makes, one after another, before it answers (and an object left in
# the namespace): a bound keeps one pod from holding the webhook past its deadline or filling etcd.
MAX_TEMPLATES_PER_POD = 16


def convert(
    pod: Mapping[str, Any],
    namespace: str,
    families: Sequence[ClaimFamily],
    protected_env: Sequence[str] = (),
    extender_scheduler: str | None = None,
) -> Conversion:
    """The JSONPatch that turns a pod's shared-device limits into claims, and the templates those name.

    A pod naming ``extender_scheduler`` (written for the extender path) is handed to the stock kube-scheduler:
    the extender's kube-scheduler goes once the cluster has moved. An empty Conversion: the pod asks for none of
    ``families``. RequestError (one line): it asks for something that can never be granted, or that a claim
    cannot express.
    """
    by_count = {f.family.count: f for f in families}
    names = frozenset(n for f in families for n in f.family.names)
    asked: list[PodRequest] = parse_pod(pod, [f.family for f in families])
    if not asked:
        return Conversion()
    _check_pod(pod, names, protected_env)
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    index = {str(c.get("name", "")): n for n, c in enumerate(containers)}
    existing = {str(c.get("name", "")) for c in spec.get("resourceClaims") or []}
    patch: list[dict[str, Any]] = []
    templates: dict[str, Template] = {}
    pod_claims: list[dict[str, str]] = []
    container_claims: dict[int, list[dict[str, str]]] = {}
    for request in asked:
        where = by_count[request.resource]
        for container in request.containers:
            n = index[container.container]
            claim = claim_spec(where, container, request.device_filter, request.numa_bind)
            name = template_name(where.family, claim)
            templates[name] = Template(namespace, name, claim, where.family.count)
            pod_claim = f"kxpu-{_label(where.family.short)}-{n}"
            if pod_claim in existing:
                raise RequestError(
                    f"pod already has a resourceClaims entry named {pod_claim!r}, which kxpu needs for container "
                    f"{container.container!r}: rename it"
                )
            pod_claims.append({"name": pod_claim, "resourceClaimTemplateName": name})
            container_claims.setdefault(n, []).append({"name": pod_claim})
    if len(templates) > MAX_TEMPLATES_PER_POD:
        raise RequestError(
            f"pod needs {len(templates)} distinct claim templates (one per container and shape); kxpu makes at "
            f"most {MAX_TEMPLATES_PER_POD} for one pod: give its containers fewer distinct shared-device requests"
        )
    for n, claims in sorted(container_claims.items()):
        resources = containers[n].get("resources") or {}
        base = f"/spec/containers/{n}/resources"
        for kind in ("limits", "requests"):
            for name in sorted(set(resources.get(kind) or {}) & names):
                patch.append({"op": "remove", "path": f"{base}/{kind}/{_escape(name)}"})
        if resources.get("claims"):
            patch += [{"op": "add", "path": f"{base}/claims/-", "value": c} for c in claims]
        else:
            patch.append({"op": "add", "path": f"{base}/claims", "value": claims})
    if spec.get("resourceClaims"):
        patch += [{"op": "add", "path": "/spec/resourceClaims/-", "value": c} for c in pod_claims]
    else:
        patch.append({"op": "add", "path": "/spec/resourceClaims", "value": pod_claims})
    if extender_scheduler and spec.get("schedulerName") == extender_scheduler:
        patch.append({"op": "replace", "path": "/spec/schedulerName", "value": STOCK_SCHEDULER})
    return Conversion(patch, list(templates.values()))

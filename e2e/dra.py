"""DRA objects for the scenarios: DeviceClasses, claim templates, claims and ResourceSlices, through kubectl.

Each scenario registers clean-ups on its ``E2E`` context, so that the next one starts with no
DeviceClass, claim or ResourceSlice of a driver it does not run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from e2e import kube
from e2e.cluster import NODE_NAME, Cluster
from e2e.conftest import E2E

API = "resource.k8s.io/v1"


def apply(e2e: E2E, *objects: Mapping[str, Any]) -> None:
    e2e.cluster.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    )


def device_class(e2e: E2E, name: str, driver: str, expression: str | None = None) -> str:
    """A DeviceClass selecting ``driver``'s devices (and ``expression``, a CEL selector, if given)."""
    selectors = [{"cel": {"expression": f'device.driver == "{driver}"'}}]
    if expression:
        selectors.append({"cel": {"expression": expression}})
    apply(
        e2e,
        {
            "apiVersion": API,
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": selectors},
        },
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl("delete", "deviceclass", name, "--ignore-not-found", check=False)
    )
    return name


def exactly(device_class: str, count: int = 1, selector: str | None = None) -> dict[str, Any]:
    """A request's ``exactly`` body."""
    body: dict[str, Any] = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    if selector:
        body["selectors"] = [{"cel": {"expression": selector}}]
    return body


def claim_template(
    e2e: E2E,
    name: str,
    requests: Sequence[Mapping[str, Any]],
    config: Sequence[Any] = (),
    constraints: Sequence[Mapping[str, Any]] = (),
) -> str:
    """A ResourceClaimTemplate; ``requests``: ``[{"name": "npu", "exactly": {...}}]`` or ``firstAvailable``;
    ``constraints``: ``[{"requests": [...], "matchAttribute": "<domain>/<name>"}]``."""
    spec: dict[str, Any] = {"devices": {"requests": [dict(r) for r in requests]}}
    if config:
        spec["devices"]["config"] = list(config)
    if constraints:
        spec["devices"]["constraints"] = [dict(c) for c in constraints]
    apply(
        e2e,
        {
            "apiVersion": API,
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "default", "labels": {"kxpu-e2e": e2e.label}},
            "spec": {"spec": spec},
        },
    )
    e2e.cleanups.append(
        lambda: e2e.cluster.kubectl(
            "delete", "resourceclaimtemplate", name, "--ignore-not-found", check=False
        )
    )
    return name


def claim_pod(e2e: E2E, name: str, script: str, template: str) -> kube.PodSpec:
    """A pod whose one container uses one claim made from ``template``."""
    spec = kube.PodSpec(
        name=f"{e2e.label[:30]}-{name}",
        script=script,
        labels={"kxpu-e2e": e2e.label},
        claims=[{"name": "devices", "resourceClaimTemplateName": template}],
    )
    e2e.pods.append(spec)
    kube.create_pod(e2e.cluster, spec)
    return spec


def pod_claim(cluster: Cluster, pod: str) -> dict[str, Any]:
    """The ResourceClaim made for a pod from its template (named in the pod's status)."""
    status = kube.get_pod(cluster, pod).get("status", {})
    names = [s.get("resourceClaimName") for s in status.get("resourceClaimStatuses", [])]
    names = [n for n in names if n]
    if not names:
        raise AssertionError(f"pod {pod} has no ResourceClaim in its status yet")
    return cluster.kubectl_json("get", "resourceclaim", names[0], "-n", "default")


def allocated_devices(claim: Mapping[str, Any], driver: str) -> list[str]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    return [r["device"] for r in results if r.get("driver") == driver and r.get("pool") == NODE_NAME]


def slices(cluster: Cluster, driver: str) -> list[dict[str, Any]]:
    listing = cluster.kubectl_json("get", "resourceslices", f"--field-selector=spec.driver={driver}")
    items: list[dict[str, Any]] = listing.get("items", [])
    return items


def pool_devices(cluster: Cluster, driver: str, node: str = NODE_NAME) -> list[dict[str, Any]]:
    """The devices the scheduler would consider: the newest generation of a complete pool."""
    specs = [s["spec"] for s in slices(cluster, driver) if s["spec"].get("nodeName") == node]
    if not specs:
        return []
    newest = max(s["pool"]["generation"] for s in specs)
    current = [s for s in specs if s["pool"]["generation"] == newest]
    if len(current) != current[0]["pool"]["resourceSliceCount"]:
        return []
    return [d for s in current for d in s.get("devices", [])]


def forget_driver(e2e: E2E, driver: str) -> None:
    """After the scenario: its driver's slices go (a stopped kxpu keeps them for its restart)."""

    def remove() -> None:
        e2e.cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.driver={driver}", check=False)

    e2e.cleanups.append(remove)

"""What the scenarios ask Kubernetes: pods, node resources, events, logs and the kubelet's device checkpoint.

Everything goes through kubectl (``-o json``) so that a scenario asserts what the API server and the kubelet
report, the way an operator would see it. Waits poll with a deadline and fail with what was last seen.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

from e2e.cluster import DEVICE_PLUGIN_DIR, NODE_NAME, TEST_IMAGE, Cluster

CHECKPOINT = DEVICE_PLUGIN_DIR / "kubelet_internal_checkpoint"
T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold by its deadline; the message says what was last observed."""


def wait_until(what: str, probe: Callable[[], T | None], timeout: float = 60, interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns something truthy and return it; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = probe()
        except Exception as exc:  # the API may be briefly unavailable (kubelet restart); keep polling
            value, last = None, f"{type(exc).__name__}: {exc}"
        else:
            if value:
                return value
            last = value
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


# -- node -----------------------------------------------------------------------------------------------------
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$"
)
_SUFFIXES = {
    **{s: Decimal(1024) ** (n + 1) for n, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("k", 3), ("M", 6), ("G", 9))},
    **{s: Decimal(10) ** e for s, e in (("T", 12), ("P", 15), ("E", 18))},
}


def parse_quantity(text: str) -> int:
    """A whole-number resource.Quantity as the API server writes it (``4``, ``1k``, ``2Ki``, ``1e3``): the
    node reports 1,000 devices as ``1k``."""
    match = _QUANTITY.match(text.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix[:1] in ("e", "E"):
        value = number * Decimal(10) ** int(suffix[1:])
    else:
        value = number * _SUFFIXES.get(suffix, Decimal(1))
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of devices")
    return int(value)


def node_resource(cluster: Cluster, resource: str) -> tuple[int, int]:
    """(capacity, allocatable) of an extended resource on the node; 0 when not reported."""
    status = cluster.kubectl_json("get", "node", NODE_NAME)["status"]
    capacity = status.get("capacity", {}).get(resource, "0")
    allocatable = status.get("allocatable", {}).get(resource, "0")
    return parse_quantity(capacity), parse_quantity(allocatable)


def wait_resource(
    cluster: Cluster, resource: str, *, allocatable: int, capacity: int | None = None, timeout: float = 60
) -> None:
    """Wait until the node reports ``allocatable`` (and ``capacity`` if given) for ``resource``."""
    seen: list[tuple[int, int]] = []

    def probe() -> bool:
        cap, alloc = node_resource(cluster, resource)
        seen.append((cap, alloc))
        return alloc == allocatable and (capacity is None or cap == capacity)

    try:
        wait_until(f"{resource} allocatable={allocatable} capacity={capacity}", probe, timeout)
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc}; last (capacity, allocatable) = {seen[-1] if seen else None}") from None


def node_heartbeat(cluster: Cluster) -> datetime:
    """When the kubelet last wrote the node's Ready condition."""
    node = cluster.kubectl_json("get", "node", NODE_NAME)
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    return datetime.fromisoformat(ready["lastHeartbeatTime"].replace("Z", "+00:00"))


def node_ready(cluster: Cluster) -> bool:
    node = cluster.kubectl_json("get", "node", NODE_NAME)
    conditions = node["status"]["conditions"]
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


# -- pods -----------------------------------------------------------------------------------------------------
@dataclass
class PodSpec:
    """A one-container busybox pod that requests devices and runs a shell script, then idles until deleted."""

    name: str
    script: str
    limits: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace: str = "default"
    idle: bool = True  # keep running after the script (for restart scenarios and log reads)
    # DRA: the pod's resourceClaims ({"name", "resourceClaimTemplateName" | "resourceClaimName"}); the container
    # uses all of them.
    claims: Sequence[Mapping[str, str]] = ()

    def manifest(self) -> dict[str, Any]:
        # PID 1 in the container ignores SIGTERM by default; trap it so deletion is quick.
        body = "trap 'exit 0' TERM\n" + self.script + ("\nsleep 3600 & wait\n" if self.idle else "\n")
        limits = {k: str(v) for k, v in self.limits.items()}
        resources: dict[str, Any] = {"limits": limits, "requests": limits}
        if self.claims:
            resources["claims"] = [{"name": c["name"]} for c in self.claims]
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": dict(self.labels)},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 2,
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "main",
                        "image": TEST_IMAGE,
                        "imagePullPolicy": "Never",  # local images only; there is no registry
                        "command": ["sh", "-c", body],
                        "resources": resources,
                    }
                ],
            },
        }
        if self.claims:
            pod["spec"]["resourceClaims"] = [dict(c) for c in self.claims]
        return pod


def create_pod(cluster: Cluster, spec: PodSpec) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(spec.manifest()))


def get_pod(cluster: Cluster, name: str, namespace: str = "default") -> dict[str, Any]:
    return cluster.kubectl_json("get", "pod", name, "-n", namespace)


def wait_pod_phase(
    cluster: Cluster, name: str, phase: str, namespace: str = "default", timeout: float = 90
) -> dict[str, Any]:
    """Wait for a pod phase; a pod that reaches a different terminal phase fails at once."""
    state: dict[str, Any] = {}

    def probe() -> dict[str, Any] | None:
        pod = get_pod(cluster, name, namespace)
        state["status"] = pod.get("status", {})
        current = state["status"].get("phase")
        if current == phase:
            return pod
        if current in ("Failed", "Succeeded"):
            raise AssertionError(f"pod {name} reached {current} while waiting for {phase}: {describe(pod)}")
        return None

    try:
        return wait_until(f"pod {namespace}/{name} phase {phase}", probe, timeout)
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc}; pod status: {json.dumps(state.get('status'))[:2000]}") from None


def wait_pod_log(
    cluster: Cluster, name: str, marker: str, namespace: str = "default", timeout: float = 30
) -> str:
    """Wait until the pod log contains ``marker`` (the script's last line) and return the whole log."""

    def probe() -> str | None:
        out = pod_log(cluster, name, namespace)
        return out if marker in out else None

    return wait_until(f"log of {namespace}/{name} to contain {marker!r}", probe, timeout)


def pod_log(cluster: Cluster, name: str, namespace: str = "default") -> str:
    return cluster.kubectl("logs", name, "-n", namespace)


def describe(pod: dict[str, Any]) -> str:
    status = pod.get("status", {})
    return json.dumps(
        {
            "phase": status.get("phase"),
            "reason": status.get("reason"),
            "message": status.get("message"),
            "containers": status.get("containerStatuses"),
        }
    )


def container_state(pod: dict[str, Any]) -> tuple[str, int]:
    """(containerID, restartCount) of the pod's only container; unchanged means it was not restarted."""
    cs = pod["status"]["containerStatuses"][0]
    return cs.get("containerID", ""), int(cs.get("restartCount", 0))


def events_for(cluster: Cluster, name: str, namespace: str = "default") -> list[dict[str, Any]]:
    out = cluster.kubectl_json(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.kind=Pod,involvedObject.name={name}",
    )
    items = out.get("items", [])
    assert isinstance(items, list)
    return items


def delete_pods(cluster: Cluster, selector: str, namespace: str = "default", timeout: float = 60) -> None:
    """Delete pods by label and wait until they are gone, so their devices are free for the next scenario."""
    cluster.kubectl(
        "delete",
        "pods",
        "-n",
        namespace,
        "-l",
        selector,
        "--wait=true",
        f"--timeout={int(timeout)}s",
        "--ignore-not-found",
        timeout=timeout + 30,
    )


# -- kubelet device checkpoint --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointEntry:
    pod_uid: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    alloc_response: bytes  # serialized ContainerAllocateResponse as the kubelet stored it


def read_checkpoint(path: Path = CHECKPOINT) -> list[CheckpointEntry]:
    """The kubelet's record of which devices it gave to which container (survives kubelet restarts)."""
    data = json.loads(path.read_text())["Data"]
    entries = []
    for e in data.get("PodDeviceEntries") or []:
        ids = e.get("DeviceIDs") or {}
        # DeviceIDs is keyed by NUMA node (or a flat list in very old kubelets).
        flat = [d for v in ids.values() for d in v] if isinstance(ids, dict) else list(ids)
        raw = e.get("AllocResp") or ""
        entries.append(
            CheckpointEntry(
                e["PodUID"],
                e["ContainerName"],
                e["ResourceName"],
                tuple(sorted(flat)),
                base64.b64decode(raw) if raw else b"",
            )
        )
    return entries


def devices_by_pod(cluster: Cluster, resource: str, pods: list[str]) -> dict[str, tuple[str, ...]]:
    """Devices the kubelet checkpointed for each named pod (by UID) for ``resource``."""
    uids = {get_pod(cluster, p)["metadata"]["uid"]: p for p in pods}
    out: dict[str, tuple[str, ...]] = {}
    for entry in read_checkpoint():
        if entry.resource == resource and entry.pod_uid in uids:
            out[uids[entry.pod_uid]] = out.get(uids[entry.pod_uid], ()) + entry.device_ids
    return out

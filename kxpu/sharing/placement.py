"""What bind checks before it acts on a request: names as the API server validates them, and whether the
pod may run on the node at all.

``/bind`` is an HTTP request (from kube-scheduler beside the extender, but anything that reaches the
port can send one), and its names go into API paths: an empty name turns a GET into a cluster-wide
LIST, a ``..`` reaches other paths. So every name is checked against the API server's own rules
(``check_names``) before it is used. And the node must be one kube-scheduler itself could have chosen
for the pod as the API server holds it (``why_not_on``): its ``nodeSelector``, its required node
affinity, the node's ``NoSchedule``/``NoExecute`` taints and cordon, all against the node as the
extender's watch last saw it. kube-scheduler ran the same checks before calling bind; a request that
fails them did not come from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# k8s.io/apimachinery/pkg/util/validation: IsDNS1123Subdomain (pod and node names), IsDNS1123Label (namespaces)
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_LABEL_RE = re.compile(_LABEL)
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"


def _bad_name(kind: str, value: str, subdomain: bool) -> str | None:
    limit = 253 if subdomain else 63
    shown = value[:80] + ("…" if len(value) > 80 else "")
    if not value:
        return f"{kind} is empty"
    if len(value) > limit:
        return f"{kind} {shown!r} is longer than {limit} characters"
    if not (_SUBDOMAIN if subdomain else _LABEL_RE).fullmatch(value):
        rule = "a DNS-1123 subdomain" if subdomain else "a DNS-1123 label"
        return (
            f"{kind} {shown!r} is not {rule} (lowercase letters, digits, '-'{', and .' if subdomain else ''})"
        )
    return None


def check_pod_names(namespace: str, name: str) -> str | None:
    """Why a pod's namespace and name are not ones the API server could hold (None: they are valid)."""
    return _bad_name("namespace", namespace, subdomain=False) or _bad_name("pod name", name, subdomain=True)


def check_names(namespace: str, name: str, node: str) -> str | None:
    """Why a bind's names are not names the API server could hold (None: they are valid)."""
    return (
        _bad_name("PodNamespace", namespace, subdomain=False)
        or _bad_name("PodName", name, subdomain=True)
        or _bad_name("Node", node, subdomain=True)
    )


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What a node's placement depends on, as the extender's node watch last saw it."""

    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()  # {key, value, effect}
    unschedulable: bool = False


def _tolerated(taint: Mapping[str, str], tolerations: Sequence[Any]) -> bool:
    for t in tolerations:
        if not isinstance(t, Mapping):
            continue
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        operator = t.get("operator") or "Equal"
        if not t.get("key"):
            if operator == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if operator == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _requirement(expr: Any, value: str | None) -> bool:
    if not isinstance(expr, Mapping):
        return False
    operator, values = expr.get("operator"), expr.get("values") or []
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except (TypeError, ValueError):
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _term(term: Any, node: str, labels: Mapping[str, str]) -> bool:
    if not isinstance(term, Mapping):
        return False
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False  # an empty term matches no node
    if not all(_requirement(e, labels.get(str((e or {}).get("key")))) for e in exprs):
        return False
    return all(
        isinstance(f, Mapping) and f.get("key") == "metadata.name" and _requirement(f, node) for f in fields
    )


def why_not_on(pod: Mapping[str, Any], node: str, facts: NodeFacts) -> str | None:
    """Why ``pod`` may not run on ``node`` (None: it may), as kube-scheduler's NodeAffinity, TaintToleration
    and NodeUnschedulable plugins decide for a node."""
    spec = pod.get("spec") or {}
    selector = spec.get("nodeSelector") or {}
    for key, value in selector.items() if isinstance(selector, Mapping) else ():
        if facts.labels.get(key) != value:
            return f"its nodeSelector {key}={value} does not match node {node}"
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or None
    if required is not None:
        terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
        if not any(_term(t, node, facts.labels) for t in terms or []):
            return f"its required node affinity excludes node {node}"
    tolerations = spec.get("tolerations") or []
    if facts.unschedulable and not _tolerated(
        {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}, tolerations
    ):
        return f"node {node} is cordoned (unschedulable)"
    for taint in facts.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, tolerations):
            return f"it does not tolerate node {node}'s taint {taint.get('key')}:{taint.get('effect')}"
    return None

"""The Grafana dashboards ask only for series kxpu exports, with labels they have, and show every kxpu metric.

Four dashboards: kxpu-node.json over the node daemon's metrics (kxpu.daemon.metrics), kxpu-scheduler.json
over the sharing control plane's (kxpu.sharing.extender_metrics and kxpu.sharing.webhook_metrics), and two over
telemetry: kxpu-fleet.json (every vendor across nodes) and kxpu-pods.json (per pod and DRA claim). The names
come from the PromQL of every panel and template variable; what kxpu exports comes from the prometheus-client
registry after importing the three modules (their metrics plus the process collector's), with the series
each metric type produces: a counter ``x`` is queried as ``x_total``, a histogram ``x`` as ``x_bucket``,
``x_sum`` and ``x_count`` (never bare).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from kxpu.daemon import late_metrics, metrics, telemetry_metrics
from kxpu.dra import metrics as dra_metrics
from kxpu.sharing import extender_metrics, webhook_metrics

late_metrics.load()  # as the daemon does once it has registered: the node's metrics are in the registry from then

GRAFANA = Path(__file__).resolve().parents[1] / "grafana"
# dashboard file -> (its uid, the metric names it must show and may query)
DASHBOARDS = {
    "kxpu-node.json": (
        "kxpu-node",
        metrics.METRIC_NAMES | telemetry_metrics.METRIC_NAMES | dra_metrics.METRIC_NAMES,
    ),
    "kxpu-scheduler.json": ("kxpu-scheduler", extender_metrics.METRIC_NAMES | webhook_metrics.METRIC_NAMES),
    # Telemetry across vendors and nodes, and per pod/claim (docs/telemetry.md): the names each must show.
    "kxpu-fleet.json": (
        "kxpu-fleet",
        frozenset(
            {
                "kxpu_device_info",
                "kxpu_device_holder_info",
                "kxpu_device_compute_utilization_ratio",
                "kxpu_device_memory_used_bytes",
                "kxpu_device_memory_total_bytes",
                "kxpu_device_power_watts",
                "kxpu_device_temperature_celsius",
                "kxpu_device_ecc_errors",
                "kxpu_container_over_grant",
            }
        ),
    ),
    "kxpu-pods.json": (
        "kxpu-pods",
        frozenset(
            {
                "kxpu_device_holder_info",
                "kxpu_device_compute_utilization_ratio",
                "kxpu_device_memory_used_bytes",
                "kxpu_container_memory_used_bytes",
                "kxpu_container_memory_granted_bytes",
                "kxpu_container_compute_utilization_ratio",
                "kxpu_container_compute_granted_ratio",
                "kxpu_container_over_grant",
                "kxpu_container_grant_exceeded",
                "kxpu_container_processes",
            }
        ),
    ),
}
ALL_NAMES = frozenset().union(*(names for _, names in DASHBOARDS.values()))
by_dashboard = pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
# Labels Prometheus attaches to every scraped series (the chart's ServiceMonitor adds `node`), and `le`.
TARGET_LABELS = {"node", "instance", "job", "namespace", "pod", "service", "endpoint", "container"}
KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}


def load(dashboard: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GRAFANA / dashboard).read_text())
    return data


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))  # collapsed rows keep their panels inside


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            # Grafana's label_values(selector, label): the selector is PromQL, the label is not.
            found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
            exprs.append(found.group(1) if found else query)
    return exprs


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names it is filtered on) for each series selector in a PromQL expression."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, $variables)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    found = []
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?(\s*\()?", text):
        name, matchers, call = match.groups()
        if call or name in KEYWORDS:
            continue  # a function or aggregation, or an operator
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""))
        found.append((name, labels))
    return found


def exported() -> dict[str, tuple[str, str]]:
    """Every series name kxpu's /metrics can have -> (metric family, type)."""
    series = {}
    for family in REGISTRY.collect():
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] = (family.name, family.type)
    return series


def label_names() -> dict[str, set[str]]:
    """kxpu metric family -> its label names (the wrappers keep them in ``_labelnames``; the extender's
    allocation gauges and the telemetry gauges come from collectors that declare them in CACHE_LABELS and
    LABELS)."""
    out = {}
    for module in (metrics, dra_metrics, telemetry_metrics, extender_metrics, webhook_metrics):
        for obj in vars(module).values():
            if isinstance(obj, late_metrics.LateMetric):
                obj = obj.real
            if isinstance(obj, MetricWrapperBase):
                out[obj._name] = set(obj._labelnames)
    for name, names in [*extender_metrics.CACHE_LABELS.items(), *telemetry_metrics.LABELS.items()]:
        out[name] = set(names)
    return out


def test_metric_names_match_the_registry() -> None:
    kxpu_families = {f.name for f in REGISTRY.collect() if f.name.startswith("kxpu_")}
    assert kxpu_families == set(ALL_NAMES)
    assert not metrics.METRIC_NAMES & (extender_metrics.METRIC_NAMES | webhook_metrics.METRIC_NAMES)
    assert not metrics.METRIC_NAMES & telemetry_metrics.METRIC_NAMES
    assert all(n.startswith("kxpu_scheduler_") for n in extender_metrics.METRIC_NAMES)
    assert all(n.startswith("kxpu_webhook_") for n in webhook_metrics.METRIC_NAMES)


@by_dashboard
def test_dashboard_queries_only_exported_series(dashboard: str) -> None:
    series = exported()
    used = [(expr, name) for expr in expressions(load(dashboard)) for name, _ in selectors(expr)]
    assert used, "no PromQL found in the dashboard"
    unknown = sorted({f"{name}  (in: {expr})" for expr, name in used if name not in series})
    assert not unknown, "series kxpu does not export:\n" + "\n".join(unknown)
    kxpu_bases = {series[name][0] for _, name in used if name.startswith("kxpu_")}
    assert kxpu_bases <= DASHBOARDS[dashboard][1]


@by_dashboard
def test_dashboard_filters_on_labels_the_metrics_have(dashboard: str) -> None:
    labels = label_names()
    series = exported()
    for expr in expressions(load(dashboard)):
        for name, used in selectors(expr):
            if name not in series:
                continue  # reported by test_dashboard_queries_only_exported_series
            family, kind = series[name]
            if family not in labels:
                continue  # process_* metrics: only target labels are used on them
            allowed = labels[family] | TARGET_LABELS | ({"le"} if kind == "histogram" else set())
            assert used <= allowed, f"{name} has no label(s) {sorted(used - allowed)}: {expr}"


@by_dashboard
def test_joins_match_on_labels_the_joined_metrics_have(dashboard: str) -> None:
    """``a * on (x, y) b`` finds nothing unless both sides carry x and y (health and telemetry meet on
    (resource, uuid)); ``group_left (z)`` copies z only if a joined side has it."""
    labels = label_names()
    series = exported()
    for expr in expressions(load(dashboard)):
        families = [series[name][0] for name, _ in selectors(expr) if name in series]
        have = [labels[f] | TARGET_LABELS for f in families if f in labels]
        for kind, names in re.findall(r"\b(on|group_left|group_right)\s*\(([^)]*)\)", expr):
            wanted = {n.strip() for n in names.split(",") if n.strip()}
            if kind == "on":
                for family, own in zip([f for f in families if f in labels], have, strict=True):
                    assert wanted <= own, (
                        f"{family} has no label(s) {sorted(wanted - own)} to join on: {expr}"
                    )
            else:
                assert any(wanted <= own for own in have), f"no joined metric has {sorted(wanted)}: {expr}"


@by_dashboard
def test_every_kxpu_metric_is_on_the_dashboard(dashboard: str) -> None:
    series = exported()
    exprs = expressions(load(dashboard))
    shown = {series[name][0] for expr in exprs for name, _ in selectors(expr) if name in series}
    assert set(DASHBOARDS[dashboard][1]) - shown == set()


@by_dashboard
def test_dashboard_is_importable(dashboard: str) -> None:
    data = load(dashboard)
    assert data["uid"] == DASHBOARDS[dashboard][0] and data["title"]
    ids = [p["id"] for p in panels(data["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(data["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ('sum by (le, resource) (rate(a_bucket{x="1"}[5m]))', [("a_bucket", {"x"})]),
        (
            'process_rss and on (instance) b_total{node=~"$node"}',
            [("process_rss", set()), ("b_total", {"node"})],
        ),
        ('count(c{d="e"} == 0) or vector(0)', [("c", {"d"})]),
        (
            'histogram_quantile(0.99, sum without (pod) (rate(h_bucket{s!~"a|b"}[$__rate_interval])))',
            [("h_bucket", {"s"})],
        ),
    ],
)
def test_selector_parser(expr: str, expected: list[tuple[str, set[str]]]) -> None:
    assert selectors(expr) == expected

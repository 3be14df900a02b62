"""Prometheus metrics of the admission webhook (``kxpu webhook``).

Names are documented in the README; the Grafana dashboard test checks that
``deploy/grafana/kxpu-scheduler.json`` uses only names listed here and in the extender's.
Reasons are a short fixed vocabulary, never a message, so the label's cardinality stays
bounded: for denials ``reason_of`` below; for allowed reviews ``valid``, ``no-change``,
``shared-devices`` (patched), ``not-a-pod`` and ``not-a-pod-create``.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# The API server waits timeoutSeconds (5 s in the chart) for an answer.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

ADMISSIONS = Counter(
    "kxpu_webhook_admissions",
    "Admission reviews answered, by webhook (mutate, validate), verdict (allowed, patched, denied) and reason",
    ["webhook", "verdict", "reason"],
)
ADMISSION_SECONDS = Histogram(
    "kxpu_webhook_admission_duration_seconds",
    "Admission review handling time, by webhook (mutate, validate)",
    ["webhook"],
    buckets=_LATENCY_BUCKETS,
)
TLS_RELOADS = Counter(
    "kxpu_webhook_tls_reloads",
    "Serving certificate loads (at start and after a change), by result",
    ["result"],
)

REFUSED = Counter(
    "kxpu_webhook_refused_requests",
    "Requests refused before any review (body too large or slow, not JSON, nested too deeply, too many large "
    "bodies at once), by webhook and HTTP status",
    ["webhook", "status"],
)

METRIC_NAMES = frozenset(
    {
        "kxpu_webhook_admissions",
        "kxpu_webhook_admission_duration_seconds",
        "kxpu_webhook_tls_reloads",
        "kxpu_webhook_refused_requests",
    }
)


def reason_of(message: str) -> str:
    """A denial message's category: reserved-annotations, privileged, node-name or invalid-request."""
    if "kxpu's own annotations" in message or message.startswith(
        ("only the kxpu scheduler", "the kxpu node daemon")
    ):
        return "reserved-annotations"
    if "is privileged" in message:
        return "privileged"
    if "nodeName preset" in message:
        return "node-name"
    return "invalid-request"

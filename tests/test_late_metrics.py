"""Metrics used before prometheus-client is loaded (``kxpu.daemon.late_metrics``): the daemon registers with
the kubelet first, and what its metrics were given meanwhile must be exported as if they had been there."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from kxpu.daemon import late_metrics
from kxpu.daemon.late_metrics import LateMetric


@pytest.fixture
def deferring(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process where nothing has loaded the metrics yet (the module's state is the process's)."""
    monkeypatch.setattr(late_metrics, "_loaded", False)
    monkeypatch.setattr(late_metrics, "_deferring", False)
    monkeypatch.setattr(late_metrics, "_metrics", [])
    monkeypatch.setattr(late_metrics, "_pending", [])
    yield
    for metric in late_metrics._metrics:
        if metric.real is not None:
            REGISTRY.unregister(metric.real)


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_what_is_done_while_deferring_is_exported_once_loaded(deferring: None) -> None:
    counter = LateMetric("Counter", "kxpu_test_late_events", "test", ["resource"])
    gauge = LateMetric("Gauge", "kxpu_test_late_health", "test", ["device"])
    histogram = LateMetric("Histogram", "kxpu_test_late_seconds", "test", ["resource"], buckets=(0.1, 1.0))
    plain = LateMetric("Counter", "kxpu_test_late_restarts", "test")
    late_metrics.defer()
    counter.labels("a").inc()
    counter.labels("a").inc(2)
    gauge.labels("gpu-0").set(1)
    gauge.labels("gpu-1").set(1)
    gauge.remove("gpu-1")  # removed after it was set: gone once loaded
    gauge.remove("gpu-9")  # never there: nothing
    kept = histogram.labels("a")  # a series looked up once and kept (the DRA preparer's)
    kept.observe(0.05)
    plain.inc()
    assert not late_metrics.loaded() and counter.real is None  # nothing made yet
    late_metrics.load()
    assert _sample("kxpu_test_late_events_total", resource="a") == 3
    assert _sample("kxpu_test_late_health", device="gpu-0") == 1
    assert _sample("kxpu_test_late_health", device="gpu-1") is None
    assert _sample("kxpu_test_late_restarts_total") == 1
    kept.observe(0.5)  # the kept series goes to the real one from now on
    assert _sample("kxpu_test_late_seconds_count", resource="a") == 2
    assert _sample("kxpu_test_late_seconds_bucket", resource="a", le="0.1") == 1


def test_a_process_that_never_defers_makes_a_metric_at_its_first_use(deferring: None) -> None:
    counter = LateMetric("Counter", "kxpu_test_eager_events", "test", ["resource"])
    counter.labels("a").inc()
    assert late_metrics.loaded()
    assert _sample("kxpu_test_eager_events_total", resource="a") == 1


def test_a_gauge_read_at_scrape_time_can_be_given_while_deferring(deferring: None) -> None:
    """The DRA preparer and claim cache hand their gauges a function (read when /metrics is asked) as they are
    made, before the daemon has registered and loaded the library."""
    gauge = LateMetric("Gauge", "kxpu_test_late_claims", "test", ["driver"])
    held: dict[str, int] = {"a": 1}
    late_metrics.defer()
    gauge.labels("d").set_function(lambda: len(held))
    late_metrics.load()
    assert _sample("kxpu_test_late_claims", driver="d") == 1
    held["b"] = 2
    assert _sample("kxpu_test_late_claims", driver="d") == 2


def test_a_kept_call_the_metric_refuses_is_one_line_and_the_rest_are_replayed(deferring: None) -> None:
    """A call that would have raised at its use (here a label too many) must not take the other kept calls, or
    the daemon's start, with it: it is logged in one line when the library loads."""
    gauge = LateMetric("Gauge", "kxpu_test_late_refused", "test", ["device"])
    counter = LateMetric("Counter", "kxpu_test_late_after", "test")
    late_metrics.defer()
    gauge.labels("gpu-0", "extra").set(1)
    counter.inc()
    with capture_logs() as logs:
        late_metrics.load()
    assert _sample("kxpu_test_late_after_total") == 1
    assert late_metrics.loaded() and gauge.real is not None
    assert [(e["event"], e["metric"], e["log_level"]) for e in logs] == [
        ("a metric call made while starting was refused", "kxpu_test_late_refused", "error")
    ]
    assert "Incorrect label count" in logs[0]["reason"]

"""Prometheus metrics of kxpu's DRA drivers (on the node daemon's /metrics, beside the device plugin's).
Names are documented in the README; the dashboard test checks the node dashboard uses only these. Made once
the daemon has registered (``kxpu.daemon.late_metrics``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from kxpu.daemon.late_metrics import LateMetric

# Prepare reads the claim from the API server and writes a CDI spec: milliseconds, with a tail.
_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

PREPARE_SECONDS = LateMetric(
    "Histogram",
    "kxpu_dra_prepare_duration_seconds",
    "NodePrepareResources handling time per claim",
    ["driver"],
    buckets=_BUCKETS,
)
UNPREPARE_SECONDS = LateMetric(
    "Histogram",
    "kxpu_dra_unprepare_duration_seconds",
    "NodeUnprepareResources handling time per claim",
    ["driver"],
    buckets=_BUCKETS,
)
PREPARE_ERRORS = LateMetric(
    "Counter", "kxpu_dra_prepare_errors", "Claims refused or failed at prepare", ["driver"]
)
CLAIMS_PREPARED = LateMetric(
    "Gauge", "kxpu_dra_claims_prepared", "Claims prepared on this node now", ["driver"]
)
DRIVER_REGISTERED = LateMetric(
    "Gauge", "kxpu_dra_registered", "1 while the kubelet has accepted the DRA driver", ["driver"]
)
SLICE_WRITES = LateMetric(
    "Counter",
    "kxpu_dra_slice_publications",
    "ResourceSlice publications, by result (written, unchanged, failed)",
    ["driver", "result"],
)
POOL_GENERATION = LateMetric(
    "Gauge", "kxpu_dra_pool_generation", "Generation of the node's pool as last published", ["driver"]
)
CLAIM_READS = LateMetric(
    "Counter",
    "kxpu_dra_claim_reads",
    "Claims prepare read, by source (cache: the node's watch-fed claim cache; api: a GET)",
    ["driver", "source"],
)
CLAIM_CACHE_CLAIMS = LateMetric(
    "Gauge",
    "kxpu_dra_claim_cache_claims",
    "Claims the node's claim cache holds (allocated on this node, not yet prepared)",
    ["driver"],
)

METRIC_NAMES = frozenset(
    {
        "kxpu_dra_claim_cache_claims",
        "kxpu_dra_claim_reads",
        "kxpu_dra_prepare_duration_seconds",
        "kxpu_dra_unprepare_duration_seconds",
        "kxpu_dra_prepare_errors",
        "kxpu_dra_claims_prepared",
        "kxpu_dra_registered",
        "kxpu_dra_slice_publications",
        "kxpu_dra_pool_generation",
    }
)


# The Reading each gauge series follows now (weak: a Reading lives as long as the object it reads from).
_readings: weakref.WeakValueDictionary[tuple[str, tuple[str, ...]], Reading] = weakref.WeakValueDictionary()


class Reading:
    """A gauge series whose value is read from a live object when /metrics is asked (never set per claim).

    ``stop()`` lets go of that object: the series keeps its last value, and the registry no longer holds a stopped
    driver's preparer or cache in memory (a driver a reload removed stayed there, read by every scrape). A newer
    Reading of the same series (the driver started again) is left as it is."""

    def __init__(self, gauge: LateMetric, labels: tuple[str, ...], read: Callable[[], float]) -> None:
        self._key = (gauge.name, labels)
        self._series = gauge.labels(*labels)
        self._read: Callable[[], float] | None = read
        _readings[self._key] = self
        self._series.set_function(read)

    def stop(self, last: float | None = None) -> None:
        """Keep ``last`` (what it reads now when None) and let go of the object read."""
        read, self._read = self._read, None
        if read is None or _readings.get(self._key) is not self:
            return
        value = float(read()) if last is None else last
        self._series.set_function(lambda: value)
        del _readings[self._key]

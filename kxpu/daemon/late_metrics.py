"""Prometheus metrics that can be used before prometheus-client is loaded.

The node daemon registers with the kubelet first and loads what registration does not need afterwards:
prometheus-client (with its exposition's http.server, urllib and wsgiref) is about a tenth of the start. While
the daemon defers (``defer()`` … ``load()``), what is done to a metric is kept, in order, and replayed into the
real metric when the library loads, so a registration, a device's health or a failure counted while starting
is exported as if the metric had been there all along. A process that never defers (a test, a tool) makes a
metric at its first use, as a module-level prometheus-client metric would be.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kxpu.logs import get_logger

log = get_logger("kxpu.metrics")


class Child(Protocol):
    """One labelled series (prometheus-client's ``labels()`` result): what kxpu's code calls on it."""

    def inc(self, amount: float = 1) -> None: ...

    def set(self, value: float) -> None: ...

    def observe(self, amount: float) -> None: ...

    def set_function(self, f: Callable[[], float]) -> None:
        """A gauge's value, read when /metrics is asked."""
        ...


_deferring = False
_loaded = False
# Held while a call is kept and while ``load()`` makes and replays, so that a call from another thread is either
# kept and replayed or made on the real metric after every kept call, never lost or reordered.
_lock = threading.RLock()
_metrics: list[LateMetric] = []
# (metric, label values, method, arguments), in the order they were done
_pending: list[tuple[LateMetric, tuple[str, ...], str, tuple[Any, ...]]] = []


def defer() -> None:
    """Keep what metrics are given until ``load()``: the daemon, from its start until it has registered."""
    global _deferring
    if not _loaded:
        _deferring = True


def loaded() -> bool:
    return _loaded


def load() -> None:
    """Import prometheus-client, make every metric in its default registry and replay what was kept."""
    global _deferring, _loaded
    with _lock:
        if _loaded:
            return
        import prometheus_client

        made = {id(metric): metric.build(prometheus_client) for metric in _metrics}
        for (
            metric,
            labels,
            method,
            args,
        ) in _pending:  # into the new metrics before any live call reaches them
            try:
                _apply(made[id(metric)], labels, method, args)
            except (
                Exception
            ) as exc:  # a call the metric refuses (its labels): it would have raised at its use
                log.error(
                    "a metric call made while starting was refused",
                    metric=metric.name,
                    call=method,
                    reason=f"{type(exc).__name__}: {exc}",
                )
        _pending.clear()
        for metric in _metrics:
            metric.real = made[id(metric)]
        _loaded, _deferring = True, False


class _Calls:
    """The calls kxpu makes on a metric or a series, each handed to ``_do`` (made now, or kept)."""

    def _do(self, method: str, *args: Any) -> None:
        raise NotImplementedError

    def inc(self, amount: float = 1) -> None:
        self._do("inc", amount)

    def set(self, value: float) -> None:
        self._do("set", value)

    def observe(self, amount: float) -> None:
        self._do("observe", amount)


class LateMetric(_Calls):
    """A prometheus-client Counter, Gauge or Histogram (``kind``), made when the daemon loads the library."""

    def __init__(
        self, kind: str, name: str, documentation: str, labelnames: Sequence[str] = (), **kwargs: Any
    ) -> None:
        self.kind, self.name, self.documentation = kind, name, documentation
        self.labelnames = tuple(labelnames)
        self.kwargs = kwargs
        self.real: Any = None
        _metrics.append(self)
        if _loaded:  # a module defining metrics imported after the daemon loaded the library
            import prometheus_client

            self.make(prometheus_client)

    def make(self, prometheus_client: Any) -> None:
        self.real = self.build(prometheus_client)

    def build(self, prometheus_client: Any) -> Any:
        cls = getattr(prometheus_client, self.kind)
        return cls(self.name, self.documentation, self.labelnames, **self.kwargs)

    def _now(self) -> Any:
        """The real metric, or None while the daemon defers (made here when nothing defers)."""
        if self.real is None and not _deferring:
            load()
        return self.real

    def _do(self, method: str, *args: Any) -> None:
        real = self._now()
        if real is None:
            with _lock:  # kept, unless the library loaded meanwhile
                if self.real is None:
                    _pending.append((self, (), method, args))
                    return
                real = self.real
        getattr(real, method)(*args)

    def labels(self, *values: str) -> Any:
        """The series (prometheus-client's own once loaded, a ``Child`` that keeps calls while deferring)."""
        real = self._now()
        if real is None:
            return _LateChild(self, values)
        return real.labels(*values)

    def remove(self, *values: str) -> None:
        self._do("remove", *values)


class _LateChild(_Calls, Child):
    """A series asked for while the daemon defers (``prepare`` keeps its series): kept calls until the library
    loads, then the real series, looked up once."""

    def __init__(self, metric: LateMetric, labels: tuple[str, ...]) -> None:
        self._metric = metric
        self._labels = labels
        self._real: Any = None

    def _do(self, method: str, *args: Any) -> None:
        if self._real is None:
            if self._metric._now() is None:
                with _lock:  # kept, unless the library loaded meanwhile
                    if self._metric.real is None:
                        _pending.append((self._metric, self._labels, method, args))
                        return
            self._real = self._metric.real.labels(*self._labels)
        getattr(self._real, method)(*args)

    def set_function(self, f: Callable[[], float]) -> None:
        self._do("set_function", f)


def _apply(real: Any, labels: tuple[str, ...], method: str, args: tuple[Any, ...]) -> None:
    """One kept call, done on the real metric."""
    if method == "remove":
        with contextlib.suppress(KeyError):  # prometheus-client versions that raise it for a missing series
            real.remove(*args)
        return
    target = real.labels(*labels) if labels else real
    getattr(target, method)(*args)

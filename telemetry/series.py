"""Counters and histograms for the request path: prometheus_client's exposition, a fraction of its cost per call.

A prometheus_client ``Counter.inc`` runs three Python frames and takes a lock; a ``Histogram.observe`` also walks
its buckets in a Python loop (~1.5-2 us each on this project's host). The router's metrics take ~11 such calls per
request (telemetry/metrics.py). Here a child's ``inc`` is one attribute add and an ``observe`` a C-level
``bisect`` plus two adds, so a request's metrics cost a few microseconds instead of ~10
(scripts/profile_router_path.py).

What Prometheus reads is what prometheus_client writes for the same metric: the same family names and types,
``_total`` and ``_created`` for a counter; ``_bucket`` (cumulative, ``le`` spelled by prometheus_client's
``floatToGoString``, ``+Inf`` last), ``_count``, ``_sum`` (left out when a bucket bound is negative, as
prometheus_client does) and ``_created`` for a histogram; ``_created`` series off with
``PROMETHEUS_DISABLE_CREATED_SERIES=True`` as there. A metric without labels is exposed from the start (zeros);
a labelled one from its first ``labels(...)``.

Thread safety: one writer thread (the router's event loop) per metric. The scrape thread only reads: a child's
figures are plain attributes and lists, read under the GIL, so a scrape sees each one whole (a histogram's count
and buckets may be one observation apart, as with any unlocked reader). Two writer threads could lose updates:
not a use here.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import INF, floatToGoString

_USE_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() not in ("true", "1", "t")
"""prometheus_client's own switch for the ``_created`` series, read the way it reads it (once, at import)."""


class CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (>= 0: the callers' contract, not checked here: this is the hot path)."""
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative (cumulated at scrape)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose bound is >= it (Prometheus' ``le``; the last bound is +Inf)."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Family:
    """One metric family and its children by label values. `labels` is for the writer thread (it may add a
    child); `collect` for the scrape thread."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> object:
        raise NotImplementedError

    def labels(self, *values: object) -> object:
        """The child for these label values (created on first use). Values are turned into str, as
        prometheus_client does."""
        key = tuple(str(v) for v in values)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected, got {len(key)}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]


class FastCounter(_Family):
    """A counter family (`name` without ``_total``: the exposition adds it, as prometheus_client's does)."""

    kind = "counter"

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: object) -> CounterChild:  # type: ignore[override]
        return super().labels(*values)  # type: ignore[return-value]

    def inc(self, amount: float = 1.0) -> None:
        """The unlabelled counter's `inc`."""
        self._children[()].inc(amount)  # type: ignore[attr-defined]

    def collect(self) -> Iterator[Metric]:
        m = Metric(self.name, self.documentation, "counter")
        for key, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, key, strict=True))
            m.add_sample(self.name + "_total", labels, child.value)  # type: ignore[attr-defined]
            if _USE_CREATED:
                m.add_sample(self.name + "_created", labels, child.created)  # type: ignore[attr-defined]
        yield m


class FastHistogram(_Family):
    """A histogram family over `buckets` (sorted upper bounds; +Inf is added when missing)."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float], registry: CollectorRegistry | None = None) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("Buckets not in sorted order")
        if not bounds or bounds[-1] != INF:
            bounds.append(INF)
        if len(bounds) < 2:
            raise ValueError("Must have at least two buckets")
        self.bounds = tuple(bounds)
        self._le = [floatToGoString(b) for b in bounds]
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: object) -> HistogramChild:  # type: ignore[override]
        return super().labels(*values)  # type: ignore[return-value]

    def observe(self, amount: float) -> None:
        """The unlabelled histogram's `observe`."""
        self._children[()].observe(amount)  # type: ignore[attr-defined]

    def collect(self) -> Iterator[Metric]:
        m = Metric(self.name, self.documentation, "histogram")
        with_sum = self.bounds[0] >= 0  # prometheus_client exposes no _sum when a bound is negative
        for key, child in list(self._children.items()):
            labels = dict(zip(self.labelnames, key, strict=True))
            counts, total = list(child.counts), child.sum  # type: ignore[attr-defined]
            acc = 0
            for le, n in zip(self._le, counts, strict=True):
                acc += n
                m.add_sample(self.name + "_bucket", {**labels, "le": le}, acc)
            m.add_sample(self.name + "_count", labels, acc)
            if with_sum:
                m.add_sample(self.name + "_sum", labels, total)
            if _USE_CREATED:
                m.add_sample(self.name + "_created", labels, child.created)  # type: ignore[attr-defined]
        yield m

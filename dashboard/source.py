"""Where the dashboard's numbers come from: the telemetry store (file or receiver URL) and, optionally,
the router's own Prometheus /metrics (`router_metrics_url`) for the endpoints' live figures.

The dashboard opens no URL taken from the store: span data is whatever a sender wrote (the receiver may
accept spans from others), so an endpoint name in a row is a label to show, never an address to fetch
(that was a server-side request forgery). The live columns come from one configured URL, the router's
/metrics, whose ``prefixroute_endpoint_*{endpoint}`` gauges are the endpoint pool's own snapshot.

`DataSource` wraps `prefixroute.telemetry.client.open_store` and survives the store going away:
- SQLite file: every call first checks the file still exists and is the same file (device + inode);
  a deleted or replaced file closes the old read-only connection (which would otherwise keep serving
  the unlinked file's stale rows forever) and the next call reopens. Missing -> `StoreMissing`.
- Receiver URL: each call is one HTTP request; `TelemetryUnavailable` when it does not answer.
Callers (the app) catch `SourceError` subclasses, show a message, and simply call again on the next
refresh: that is the retry loop.

Thread safety: Streamlit runs sessions on separate threads and shares one `DataSource` through
st.cache_resource; a `StoreReader` is single-thread, so calls are serialised with a lock (each query
takes milliseconds; the lock is never held across a network call for the URL source, which has no
shared connection).

Queries: `query` runs any `StoreQueries` method on either source; two more are file-only (`StoreReader`'s
`mean_in_flight`, which the receiver API lacks, and `endpoint_series`, a cheaper `timeseries(by_endpoint=True)`
without percentiles; a URL source answers None / its timeseries).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from prefixroute.dashboard.data import bucket_for_window, effective_span_s, has_traffic
from prefixroute.dashboard.router_metrics import EndpointLive, FlowLive, parse_flow_metrics, parse_router_metrics
from prefixroute.telemetry.client import HttpStoreClient, TelemetryUnavailable
from prefixroute.telemetry.store_reader import StoreQueries, StoreReader
from prefixroute.telemetry.store_schema import StoreMissing

SourceError = (StoreMissing, TelemetryUnavailable)

T = TypeVar("T")


class DataSource:
    """The store (exactly one of `db` / `url`, with the receiver's bearer `token` if it wants one) plus
    the router's /metrics at `router_metrics_url` (None: no live columns); see the module docstring."""

    def __init__(self, *, db: str | None = None, url: str | None = None, token: str | None = None,
                 router_metrics_url: str | None = None, metrics_timeout_s: float = 0.5,
                 http_timeout_s: float = 3.0) -> None:
        if (db is None) == (url is None):
            raise ValueError("give exactly one of db or url")
        if router_metrics_url and not router_metrics_url.startswith(("http://", "https://")):
            raise ValueError(f"router_metrics_url must be an http(s):// URL, got {router_metrics_url!r}")
        self.db = os.path.abspath(db) if db is not None else None
        self.url = url
        self.router_metrics_url = router_metrics_url or None
        self.metrics_timeout_s = metrics_timeout_s
        self._http = HttpStoreClient(url, timeout_s=http_timeout_s, token=token) if url else None
        self._reader: StoreReader | None = None
        self._identity: tuple[int, int] | None = None
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        return f"store {self.db}" if self.db else f"receiver {self.url}"

    def _file_reader(self) -> StoreReader:
        assert self.db is not None
        try:
            st = os.stat(self.db)
        except FileNotFoundError:
            self._drop_reader()
            raise StoreMissing(f"no telemetry store at {self.db}") from None
        identity = (st.st_dev, st.st_ino)
        if self._reader is not None and identity != self._identity:
            self._drop_reader()  # replaced under us (deleted and recreated): reopen
        if self._reader is None:
            self._reader = StoreReader(self.db)
            self._identity = identity
        return self._reader

    def _drop_reader(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not mask the real state
                pass
        self._reader, self._identity = None, None

    def query(self, run: Callable[[StoreQueries], T]) -> T:
        """`run` one query (a `StoreQueries` method: ``source.query(lambda q: q.summary(60.0))``) on the receiver's
        API, or on the file's reader under the lock; a file not readable yet (being created, truncated) is
        `StoreMissing`, and the next call reopens it."""
        if self._http is not None:
            return run(self._http)
        with self._lock:
            reader = self._file_reader()
            try:
                return run(reader)
            except sqlite3.DatabaseError as exc:
                # e.g. "no such table" while the receiver is creating the file, or a truncated file
                self._drop_reader()
                raise StoreMissing(f"telemetry store {self.db} is not readable yet: {exc}") from None

    def mean_in_flight(self, window_s: float, *, now: float | None = None) -> dict[str, float] | None:
        """Endpoint -> time-averaged in-flight requests over the window (`StoreReader.mean_in_flight`); None for
        a URL source (the receiver API has no such query)."""
        if self._http is not None:
            return None
        with self._lock:
            return self._file_reader().mean_in_flight(window_s, now=now)

    def endpoint_series(self, window_s: float, bucket_s: float, *,
                        now: float | None = None) -> list[dict[str, Any]]:
        """`StoreReader.endpoint_series` (per bucket and endpoint, no percentiles); a URL source uses the API's
        timeseries (same keys, plus percentiles)."""
        if self._http is not None:
            return self._http.timeseries(window_s, bucket_s, by_endpoint=True, now=now)
        with self._lock:
            return self._file_reader().endpoint_series(window_s, bucket_s, now=now)

    def ttft_predictions(self, window_s: float, *, now: float | None = None) -> dict[str, Any] | None:
        """`StoreReader.ttft_predictions` from either source; None when a receiver older than this
        dashboard has no such route (the panel says so; the rest of the page is unaffected)."""
        try:
            return self.query(lambda q: q.ttft_predictions(window_s, now=now))
        except TelemetryUnavailable as exc:
            if "HTTP 404" in str(exc):
                return None
            raise

    def runs(self) -> list[dict[str, Any]]:
        """`StoreReader.runs` (newest first) from either source; [] when the store knows no run."""
        return self.query(lambda q: q.runs())

    def live_snapshot(self, window_s: float, *, now: float | None = None, since: float | None = None
                      ) -> dict[str, Any]:
        """Every query of one live refresh at one instant `now`, as a dict: now, window_s (the window queried:
        `window_s`, cut at `since`, a run's start, so one run's figures hold none of an earlier run's), summary,
        total (store rows), and, when the window has traffic, span_s / bucket_s (charts cover the part of the
        window holding data, see data.effective_span_s), ts (fleet timeseries), ts_ep (endpoint_series),
        ep_rows (endpoints), reason_rows, reason_ts, ttft_hist, decision_hist, in_flight, ttft_pred
        (ttft_predictions over the window; None when the source has no such query)."""
        now = time.time() if now is None else now
        if since is not None:
            window_s = max(1e-3, min(window_s, now - since))
        summary = self.query(lambda q: q.summary(window_s, now=now))
        snap: dict[str, Any] = {"now": now, "window_s": window_s, "summary": summary,
                                "total": self.query(lambda q: q.num_requests())}
        if not has_traffic(summary):
            return snap
        span_s = effective_span_s(window_s, summary.get("first_start_time"), now)
        bucket_s = bucket_for_window(span_s)
        snap.update(
            span_s=span_s, bucket_s=bucket_s,
            ts=self.query(lambda q: q.timeseries(span_s, bucket_s, now=now)),
            ts_ep=self.endpoint_series(span_s, bucket_s, now=now),
            ep_rows=self.query(lambda q: q.endpoints(window_s, now=now)),
            reason_rows=self.query(lambda q: q.reasons(window_s, now=now)),
            reason_ts=self.query(lambda q: q.reasons(span_s, bucket_s, now=now)),
            ttft_hist=self.query(lambda q: q.histogram(window_s, "ttft_ms", now=now)),
            decision_hist=self.query(lambda q: q.histogram(window_s, "decision_us", now=now)),
            in_flight=self.mean_in_flight(span_s, now=now),
            ttft_pred=self.ttft_predictions(window_s, now=now))
        return snap

    def endpoint_live(self, fetch: Callable[[str, float], str] | None = None) -> dict[str, EndpointLive]:
        """Endpoint -> live figures from the router's /metrics (the only URL this opens, and only the
        configured one); empty when it is not configured or does not answer within metrics_timeout_s."""
        return self.router_live(fetch)[0]

    def router_live(self, fetch: Callable[[str, float], str] | None = None
                    ) -> tuple[dict[str, EndpointLive], FlowLive | None]:
        """`endpoint_live` and the router's gateway queue (`parse_flow_metrics`: None when it exports none), from
        one read of its /metrics; ({}, None) when it is not configured or does not answer."""
        if self.router_metrics_url is None:
            return {}, None
        fetch = fetch or _fetch_text
        try:
            text = fetch(self.router_metrics_url, self.metrics_timeout_s)
        except Exception:  # noqa: BLE001 - a router that does not answer just leaves the live columns out
            return {}, None
        return parse_router_metrics(text), parse_flow_metrics(text)

    def close(self) -> None:
        with self._lock:
            self._drop_reader()


def _fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - the configured router URL only
        return resp.read(8 << 20).decode("utf-8", "replace")

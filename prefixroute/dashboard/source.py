"""Where the dashboard's numbers come from: the telemetry store (file or receiver URL) and, optionally,
the endpoints' own Prometheus /metrics for live KV-cache usage.

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

The one query the telemetry store lacks, `mean_in_flight`, is SQL over the documented schema on the
same read-only connection (file source only).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from prefixroute.dashboard.data import EndpointLive, parse_endpoint_metrics
from prefixroute.telemetry.client import HttpStoreClient, TelemetryUnavailable
from prefixroute.telemetry.store import StoreMissing, StoreReader

SourceError = (StoreMissing, TelemetryUnavailable)

# Requests last at most minutes; rows that started this long before the window may still overlap it.
_MAX_OVERLAP_S = 3600.0

MEAN_IN_FLIGHT_SQL = """
SELECT endpoint,
       SUM(MIN(COALESCE(end_time, start_time), :t1) - MAX(start_time, :t0)) / (:t1 - :t0) AS mean_in_flight
FROM requests
WHERE start_time >= :t0 - :overlap AND start_time <= :t1 AND COALESCE(end_time, start_time) > :t0
  AND endpoint IS NOT NULL
GROUP BY endpoint
"""
"""Time-averaged requests in flight per endpoint over [t0, t1] (Little's law, exact for the stored rows):
the summed overlap of each request's [start_time, end_time] with the window, divided by its length.
Rows are written at response end, so requests still running at t1 are not counted yet."""


class DataSource:
    """The store (exactly one of `db` / `url`) plus optional endpoint scraping; see the module docstring."""

    def __init__(self, *, db: str | None = None, url: str | None = None, scrape_endpoints: bool = False,
                 scrape_timeout_s: float = 0.5, http_timeout_s: float = 3.0) -> None:
        if (db is None) == (url is None):
            raise ValueError("give exactly one of db or url")
        self.db = os.path.abspath(db) if db is not None else None
        self.url = url
        self.scrape_endpoints = scrape_endpoints
        self.scrape_timeout_s = scrape_timeout_s
        self._http = HttpStoreClient(url, timeout_s=http_timeout_s) if url else None
        self._reader: StoreReader | None = None
        self._identity: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dashboard-scrape")

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

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one StoreReader/HttpStoreClient query method by name."""
        if self._http is not None:
            return getattr(self._http, method)(*args, **kwargs)
        with self._lock:
            reader = self._file_reader()
            try:
                return getattr(reader, method)(*args, **kwargs)
            except Exception as exc:
                import sqlite3

                if isinstance(exc, sqlite3.DatabaseError):
                    # e.g. "no such table" while the receiver is creating the file, or a truncated file
                    self._drop_reader()
                    raise StoreMissing(f"telemetry store {self.db} is not readable yet: {exc}") from None
                raise

    def mean_in_flight(self, window_s: float, *, now: float | None = None) -> dict[str, float] | None:
        """Endpoint -> time-averaged in-flight requests over the window; None for a URL source
        (the receiver API has no such query)."""
        if self._http is not None:
            return None
        now = time.time() if now is None else now
        params = {"t0": now - window_s, "t1": now, "overlap": _MAX_OVERLAP_S}
        with self._lock:
            reader = self._file_reader()
            rows = reader._conn.execute(MEAN_IN_FLIGHT_SQL, params).fetchall()  # noqa: SLF001 - same read-only conn
        return {r[0]: float(r[1] or 0.0) for r in rows}

    def endpoint_live(self, endpoints: Iterable[str],
                      fetch: Callable[[str, float], str] | None = None) -> dict[str, EndpointLive]:
        """Scrape http://ENDPOINT/metrics of each endpoint concurrently (bounded by scrape_timeout_s);
        unreachable endpoints are absent from the result. Empty when scraping is off."""
        if not self.scrape_endpoints:
            return {}
        fetch = fetch or _fetch_text
        names = [e for e in endpoints if e and ":" in e]
        futures = {e: self._pool.submit(fetch, f"http://{e}/metrics", self.scrape_timeout_s) for e in names}
        out: dict[str, EndpointLive] = {}
        deadline = time.monotonic() + self.scrape_timeout_s + 0.2
        for name, fut in futures.items():
            try:
                out[name] = parse_endpoint_metrics(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - an endpoint that does not answer just shows "unavailable"
                continue
        return out

    def close(self) -> None:
        with self._lock:
            self._drop_reader()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fetch_text(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - endpoint URLs from the store
        return resp.read(4 << 20).decode("utf-8", "replace")

"""`HttpStoreClient`: the `StoreReader` query methods over the receiver's HTTP API (see http_api.py),
and `open_store` to get either from ``--db PATH`` or ``--telemetry URL``.

Both return the same JSON-able shapes, so the dashboard codes against one interface. Errors:
`StoreMissing` when the receiver answers 503 (no store yet); `TelemetryUnavailable` (an OSError)
when the URL cannot be reached; `ValueError` for a 400.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from prefixroute.telemetry.store_reader import StoreQueries, StoreReader
from prefixroute.telemetry.store_schema import StoreMissing


class TelemetryUnavailable(OSError):
    """The receiver's HTTP API did not answer."""


class HttpStoreClient(StoreQueries):
    """`StoreQueries` over the receiver's HTTP API. `token`: the receiver's bearer token (its --auth-token), sent as ``Authorization: Bearer``; a
    receiver that wants one and gets none or a wrong one answers 401 (`TelemetryUnavailable`)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"authorization": f"Bearer {token}"} if token else {}

    def _get(self, route: str, **params: Any) -> Any:
        qs = urllib.parse.urlencode({k: (int(v) if isinstance(v, bool) else v) for k, v in params.items()
                                     if v is not None})
        req = urllib.request.Request(f"{self.url}{route}?{qs}", headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except Exception:
                message = str(exc)
            if exc.code == 503:
                raise StoreMissing(message) from None
            if exc.code == 404 and route == "/api/request":
                return None
            if exc.code == 400:
                raise ValueError(message) from None
            raise TelemetryUnavailable(f"{self.url}{route}: HTTP {exc.code}: {message}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise TelemetryUnavailable(f"{self.url}: {exc}") from None

    def summary(self, window_s: float, *, now: float | None = None) -> dict[str, Any]:
        return self._get("/api/summary", window_s=window_s, now=now)

    def timeseries(self, window_s: float, bucket_s: float, *, by_endpoint: bool = False,
                   now: float | None = None) -> list[dict[str, Any]]:
        return self._get("/api/timeseries", window_s=window_s, bucket_s=bucket_s, by_endpoint=by_endpoint, now=now)

    def breakdown(self, window_s: float, by: str = "endpoint", *, now: float | None = None) -> list[dict[str, Any]]:
        return self._get("/api/breakdown", window_s=window_s, by=by, now=now)

    def endpoints(self, window_s: float, *, now: float | None = None) -> list[dict[str, Any]]:
        return self._get("/api/endpoints", window_s=window_s, now=now)

    def reasons(self, window_s: float, bucket_s: float | None = None, *,
                now: float | None = None) -> list[dict[str, Any]]:
        return self._get("/api/reasons", window_s=window_s, bucket_s=bucket_s, now=now)

    def histogram(self, window_s: float, column: str = "ttft_ms", *, bin_width: float | None = None,
                  num_bins: int = 30, now: float | None = None) -> list[dict[str, Any]]:
        return self._get("/api/histogram", window_s=window_s, column=column, bin_width=bin_width,
                         num_bins=num_bins, now=now)

    def ttft_predictions(self, window_s: float, *, now: float | None = None) -> dict[str, Any]:
        return self._get("/api/ttft_predictions", window_s=window_s, now=now)

    def recent_requests(self, limit: int = 100, *, endpoint: str | None = None,
                        run_id: str | None = None) -> list[dict[str, Any]]:
        return self._get("/api/recent", limit=limit, endpoint=endpoint, run_id=run_id)

    def runs(self) -> list[dict[str, Any]]:
        """`StoreReader.runs`; [] from a receiver older than run ids (no such route)."""
        try:
            return self._get("/api/runs")
        except TelemetryUnavailable as exc:
            if "HTTP 404" in str(exc):
                return []
            raise

    def iter_requests(self, since_s: float, *, now: float | None = None,
                      limit: int | None = None) -> Iterator[dict[str, Any]]:
        """At most `limit` rows (the receiver's default and most: http_api.MAX_ROWS), oldest first."""
        yield from self._get("/api/requests", since_s=since_s, now=now, limit=limit)

    def request(self, trace_id: str, span_id: str | None = None) -> dict[str, Any] | None:
        return self._get("/api/request", trace_id=trace_id, span_id=span_id)

    def num_requests(self) -> int:
        return int(self._get("/api/stats")["num_requests"])

    def close(self) -> None:
        pass

    def __enter__(self) -> HttpStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(db: str | os.PathLike | None = None, url: str | None = None, *,
               token: str | None = None) -> StoreQueries:
    """A reader for exactly one of `db` (SQLite file) or `url` (receiver HTTP API base URL, with its
    bearer `token` if it wants one)."""
    if (db is None) == (url is None):
        raise ValueError("give exactly one of db or url")
    return HttpStoreClient(url, token=token) if url is not None else StoreReader(db)

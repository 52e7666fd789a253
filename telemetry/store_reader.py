"""Read-only queries over the request store (store_schema.py) for the dashboard and `telemetry dump`:
`StoreReader`, every aggregate computed in SQL.

Percentiles are nearest-rank (the smallest value whose rank >= p * n), computed in SQL with window functions.
Buckets are aligned to multiples of `bucket_s` in unix time (``bucket_start = floor(start_time / bucket_s) *
bucket_s``) so they do not shift between refreshes; only non-empty buckets are returned. Every window is
``now - window_s <= start_time <= now``. Errors, refusals, hit ratios and comparable TTFT predictions are as
store_schema.py defines them.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prefixroute.telemetry.records import RECORD_FIELDS
from prefixroute.telemetry.store_schema import (COMPARABLE_PREDICTION_SQL, ERROR_SQL, PERCENTILES, RECORD_COLUMNS,
                                                REFUSED_SQL, USAGE_OK_SQL, StoreMissing)

_BREAKDOWN_COLUMNS = ("endpoint", "reason", "policy", "model", "path", "status", "service_name", "gateway_outcome")
_HISTOGRAM_COLUMNS = ("ttft_ms", "latency_ms", "decision_us", "gateway_wait_ms", "routing_ms")
_SUMMARY_PERCENTILE_COLUMNS = ("ttft_ms", "latency_ms", "decision_us", "routing_ms")

MAX_OVERLAP_S = 3600.0
"""Requests last at most minutes; rows that started this long before a window may still overlap it."""

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

ENDPOINT_SERIES_SQL = f"""
SELECT CAST(start_time / :b AS INTEGER) * :b AS bucket_start, endpoint, COUNT(*) AS num_requests,
       SUM({ERROR_SQL}) AS num_errors, SUM({REFUSED_SQL}) AS num_refused,
       SUM(CASE WHEN prompt_tokens > 0 AND cached_tokens IS NOT NULL THEN prompt_tokens END) AS prompt_tokens,
       SUM(CASE WHEN prompt_tokens > 0 AND cached_tokens IS NOT NULL THEN cached_tokens END) AS cached_tokens,
       SUM(CASE WHEN prompt_tokens > 0 AND cached_tokens IS NOT NULL
                THEN predicted_hit_ratio * prompt_tokens END) AS predicted_tokens
FROM requests WHERE start_time >= :t0 AND start_time <= :t1
GROUP BY bucket_start, endpoint ORDER BY bucket_start, endpoint
"""
"""Per bucket and endpoint: counts and token sums only (no percentiles), with the store's definitions
of an error, a refusal and of the token-weighted hit ratios (store_schema.py). `StoreReader.timeseries(
by_endpoint=True)` gives the same plus per-endpoint percentiles, which cost several times more (a
window-function sort per group)."""


class StoreQueries(Protocol):
    """The store's read queries, as `StoreReader` (a SQLite file) and `client.HttpStoreClient` (a receiver's HTTP
    API) both answer them: the same arguments, the same JSON-able results (`StoreReader` documents each)."""

    def summary(self, window_s: float, *, now: float | None = None) -> dict[str, Any]: ...

    def timeseries(self, window_s: float, bucket_s: float, *, by_endpoint: bool = False,
                   now: float | None = None) -> list[dict[str, Any]]: ...

    def breakdown(self, window_s: float, by: str = "endpoint", *,
                  now: float | None = None) -> list[dict[str, Any]]: ...

    def endpoints(self, window_s: float, *, now: float | None = None) -> list[dict[str, Any]]: ...

    def reasons(self, window_s: float, bucket_s: float | None = None, *,
                now: float | None = None) -> list[dict[str, Any]]: ...

    def histogram(self, window_s: float, column: str = "ttft_ms", *, bin_width: float | None = None,
                  num_bins: int = 30, now: float | None = None) -> list[dict[str, Any]]: ...

    def ttft_predictions(self, window_s: float, *, now: float | None = None) -> dict[str, Any]: ...

    def recent_requests(self, limit: int = 100, *, endpoint: str | None = None,
                        run_id: str | None = None) -> list[dict[str, Any]]: ...

    def iter_requests(self, since_s: float, *, now: float | None = None,
                      limit: int | None = None) -> Iterator[dict[str, Any]]: ...

    def request(self, trace_id: str, span_id: str | None = None) -> dict[str, Any] | None: ...

    def runs(self) -> list[dict[str, Any]]: ...

    def num_requests(self) -> int: ...

    def close(self) -> None: ...


class StoreReader(StoreQueries):
    """Read-only queries for the dashboard and `telemetry dump`; every aggregate is computed in SQL.

    Opening raises `StoreMissing` when the file does not exist. Each method is one short read
    transaction; an instance is for one thread (open one per thread; opening is cheap).
    `now` defaults to time.time() and exists so tests and replays can query a fixed instant.
    All results are plain JSON-able dicts/lists (the HTTP API returns them verbatim).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise StoreMissing(f"no telemetry store at {self.path}")
        self._conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        self._conn.row_factory = sqlite3.Row
        self._schema_cookie: int | None = None
        self._columns: frozenset[str] = frozenset()

    def columns(self) -> frozenset[str]:
        """Columns of the ``requests`` table now (re-read when SQLite's schema cookie changes, e.g. when
        the receiver upgraded an older file under this open reader)."""
        cookie = self._conn.execute("PRAGMA schema_version").fetchone()[0]
        if cookie != self._schema_cookie:
            self._columns = frozenset(r[1] for r in self._conn.execute("PRAGMA table_info(requests)"))
            self._schema_cookie = cookie
        return self._columns

    def _record_select(self) -> str:
        have = self.columns()
        return ", ".join(c if c in have else f"NULL AS {c}" for c in RECORD_COLUMNS)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _rows(self, sql: str, params: Mapping[str, Any] | tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in self._conn.execute(sql, params)]

    @staticmethod
    def _window(window_s: float, now: float | None) -> dict[str, float]:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        now = time.time() if now is None else now
        return {"t0": now - window_s, "t1": now}

    def summary(self, window_s: float, *, now: float | None = None) -> dict[str, Any]:
        """Fleet-wide figures over the window. Keys:

        window_s, num_requests, num_errors, error_ratio (5xx, resets, failures), num_refused, refused_ratio
        (4xx), requests_per_s, prompt_tokens, cached_tokens,
        completion_tokens, actual_hit_ratio, predicted_hit_ratio (None without usage), ttft_ms_p50/p90/p99,
        latency_ms_p50/p90/p99, decision_us_p50/p90/p99, routing_ms_p50/p90/p99 (Envoy's routing delay, rows
        with one) (None when no value), num_endpoints,
        balance_ratio (max endpoint share / fair share 1/num_endpoints; 1.0 = perfectly even, None when
        no request), first_start_time, last_start_time.
        """
        w = self._window(window_s, now)
        have = self.columns()  # a file no writer has upgraded yet lacks routing_ms: its percentiles are None
        cols = tuple(c for c in _SUMMARY_PERCENTILE_COLUMNS if c in have)
        rows = self._rows(_aggregate_sql([], [], cols), w)
        out = _finish_agg(rows[0] if rows else {"num_requests": 0}, window_s)
        for col in _SUMMARY_PERCENTILE_COLUMNS:
            for name, _ in PERCENTILES:
                out.setdefault(f"{col}_{name}", None)
        extra = self._conn.execute(
            """WITH e AS (SELECT endpoint, COUNT(*) AS n FROM requests WHERE start_time >= :t0 AND start_time <= :t1
                          AND endpoint IS NOT NULL GROUP BY endpoint)
               SELECT COUNT(*), MAX(n) * COUNT(*) * 1.0 / SUM(n),
                      (SELECT MIN(start_time) FROM requests WHERE start_time >= :t0 AND start_time <= :t1),
                      (SELECT MAX(start_time) FROM requests WHERE start_time >= :t0 AND start_time <= :t1) FROM e""",
            w).fetchone()
        out.update(window_s=window_s, num_endpoints=extra[0], balance_ratio=extra[1],
                   first_start_time=extra[2], last_start_time=extra[3])
        return out

    def timeseries(self, window_s: float, bucket_s: float, *, by_endpoint: bool = False,
                   now: float | None = None) -> list[dict[str, Any]]:
        """Per time bucket (and per endpoint when `by_endpoint`), oldest first. Each row:

        bucket_start (unix s), [endpoint], num_requests, num_errors, error_ratio, num_refused, refused_ratio,
        requests_per_s,
        prompt_tokens, cached_tokens, completion_tokens, actual_hit_ratio, predicted_hit_ratio,
        ttft_ms_p50/p90/p99, latency_ms_p50/p90/p99. Empty buckets are absent.
        """
        if not bucket_s > 0:
            raise ValueError("bucket_s must be > 0")
        w = self._window(window_s, now) | {"b": float(bucket_s)}
        cols, exprs = ["bucket_start"], ["CAST(start_time / :b AS INTEGER) * :b"]
        if by_endpoint:
            cols.append("endpoint")
            exprs.append("endpoint")
        rows = self._rows(_aggregate_sql(cols, exprs, ("ttft_ms", "latency_ms")), w)
        return [_finish_agg(r, bucket_s) for r in rows]

    def breakdown(self, window_s: float, by: str = "endpoint", *, now: float | None = None) -> list[dict[str, Any]]:
        """Per value of column `by` (endpoint, reason, policy, model, path, status, service_name,
        gateway_outcome: flow control's released:/shed: reasons, NULL for requests never held),
        most requests first. Each row: <by>, num_requests, share_ratio (of the window's requests),
        num_errors, error_ratio, num_refused, refused_ratio, requests_per_s, prompt_tokens, cached_tokens,
        completion_tokens, actual_hit_ratio, predicted_hit_ratio, ttft_ms_p50/p90/p99, latency_ms_p50/p90/p99,
        decision_us_p50/p90/p99.
        """
        if by not in _BREAKDOWN_COLUMNS:
            raise ValueError(f"by must be one of {', '.join(_BREAKDOWN_COLUMNS)}")
        w = self._window(window_s, now)
        rows = [_finish_agg(r, window_s)
                for r in self._rows(_aggregate_sql([by], [by], ("ttft_ms", "latency_ms", "decision_us")), w)]
        total = sum(r["num_requests"] for r in rows)  # a handful of groups: not a per-request loop
        for r in rows:
            r["share_ratio"] = r["num_requests"] / total if total else 0.0
        rows.sort(key=lambda r: (-r["num_requests"], str(r[by])))
        return rows

    def endpoints(self, window_s: float, *, now: float | None = None) -> list[dict[str, Any]]:
        """`breakdown(window_s, "endpoint")`: share, hit ratios, TTFT per endpoint."""
        return self.breakdown(window_s, "endpoint", now=now)

    def reasons(self, window_s: float, bucket_s: float | None = None, *,
                now: float | None = None) -> list[dict[str, Any]]:
        """Decisions by reason. Without `bucket_s`: rows {reason, num_requests, share_ratio}, most first.
        With `bucket_s`: rows {bucket_start, reason, num_requests, share_ratio (within the bucket)},
        oldest bucket first."""
        w = self._window(window_s, now)
        if bucket_s is None:
            return self._rows(
                """SELECT reason, COUNT(*) AS num_requests, COUNT(*) * 1.0 / SUM(COUNT(*)) OVER () AS share_ratio
                   FROM requests WHERE start_time >= :t0 AND start_time <= :t1
                   GROUP BY reason ORDER BY num_requests DESC, reason""", w)
        if not bucket_s > 0:
            raise ValueError("bucket_s must be > 0")
        return self._rows(
            """SELECT CAST(start_time / :b AS INTEGER) * :b AS bucket_start, reason, COUNT(*) AS num_requests,
                      COUNT(*) * 1.0 / SUM(COUNT(*)) OVER (PARTITION BY CAST(start_time / :b AS INTEGER))
                        AS share_ratio
               FROM requests WHERE start_time >= :t0 AND start_time <= :t1
               GROUP BY bucket_start, reason ORDER BY bucket_start, reason""", w | {"b": float(bucket_s)})

    def histogram(self, window_s: float, column: str = "ttft_ms", *, bin_width: float | None = None,
                  num_bins: int = 30, now: float | None = None) -> list[dict[str, Any]]:
        """Distribution of `column` (ttft_ms, latency_ms, decision_us, gateway_wait_ms or routing_ms) over the
        window, counted in SQL.

        Rows {bin_start, bin_end, num_requests} for non-empty bins, ascending. Without `bin_width`
        the width is the window's max / num_bins rounded up to 1, 2 or 5 x 10^k.
        """
        if column not in _HISTOGRAM_COLUMNS:
            raise ValueError(f"column must be one of {', '.join(_HISTOGRAM_COLUMNS)}")
        w = self._window(window_s, now)
        if bin_width is None:
            top = self._conn.execute(f"SELECT MAX({column}) FROM requests WHERE start_time >= :t0 "
                                     f"AND start_time <= :t1", w).fetchone()[0]
            if top is None:
                return []
            bin_width = _nice_width(max(top, 1e-9) / max(1, num_bins))
        if not bin_width > 0:
            raise ValueError("bin_width must be > 0")
        return self._rows(
            f"""SELECT CAST({column} / :bw AS INTEGER) * :bw AS bin_start,
                       (CAST({column} / :bw AS INTEGER) + 1) * :bw AS bin_end, COUNT(*) AS num_requests
                FROM requests WHERE start_time >= :t0 AND start_time <= :t1 AND {column} IS NOT NULL
                GROUP BY bin_start ORDER BY bin_start""", w | {"bw": float(bin_width)})

    def recent_requests(self, limit: int = 100, *, endpoint: str | None = None,
                        run_id: str | None = None) -> list[dict[str, Any]]:
        """The newest `limit` requests (record fields + end_time), newest first; `endpoints` as a list. With
        `endpoint` / `run_id`: only that endpoint's / run's (a file without run ids has no run's rows)."""
        conds, values = [], []
        if endpoint:
            conds.append("endpoint = ?")
            values.append(endpoint)
        if run_id:
            if "run_id" not in self.columns():
                return []
            conds.append("run_id = ?")
            values.append(run_id)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        params = (*values, limit)
        return [_record_row(r) for r in self._conn.execute(
            f"SELECT {self._record_select()} FROM requests {where} ORDER BY start_time DESC, id DESC LIMIT ?", params)]

    def iter_requests(self, since_s: float, *, now: float | None = None,
                      limit: int | None = None) -> Iterator[dict[str, Any]]:
        """Requests that started in the last `since_s` seconds, oldest first (streamed, for `dump`); at most
        `limit` of them (None: all)."""
        w = self._window(since_s, now)
        cut = "" if limit is None else f" LIMIT {int(limit)}"
        for r in self._conn.execute(f"SELECT {self._record_select()} FROM requests WHERE start_time >= :t0 "
                                    f"AND start_time <= :t1 ORDER BY start_time, id{cut}", w):
            yield _record_row(r)

    def request(self, trace_id: str, span_id: str | None = None) -> dict[str, Any] | None:
        """One request (by trace id, and span id when a trace has several) with every column and its
        attributes parsed under "attrs"; None when absent."""
        if span_id:
            cur = self._conn.execute("SELECT * FROM requests WHERE trace_id = ? AND span_id = ?", (trace_id, span_id))
        else:
            cur = self._conn.execute("SELECT * FROM requests WHERE trace_id = ? ORDER BY start_time LIMIT 1",
                                     (trace_id,))
        row = cur.fetchone()
        if row is None:
            return None
        d = _record_row(row)
        for c in RECORD_FIELDS:  # a file no writer has upgraded yet lacks the newer columns
            d.setdefault(c, None)
        d["attrs"] = json.loads(d["attrs"] or "{}")
        return d

    def ttft_predictions(self, window_s: float, *, now: float | None = None) -> dict[str, Any]:
        """The time model's TTFT predictions against the measured TTFT over the window. Keys:

        num_predicted: requests in the window whose decision carried a predicted TTFT (any outcome; 0 means
        the policy has no time model); fleet: one row over every comparable request (None when there is
        none); endpoints: one row per endpoint, most compared requests first. A row: [endpoint],
        num_requests (comparable requests: see the module docstring), num_alternatives (of them, those
        with an alternative's prediction), predicted_ttft_ms_p50/p90/p99, actual_ttft_ms_p50/p90/p99 (of
        the same requests), ape_ratio_p50/p90/p99 (absolute percentage error, 0-1+), error_ratio_p50/p90/p99
        (signed, (actual - predicted) / predicted), alternative_ttft_ms_p50/p90/p99.
        """
        w = self._window(window_s, now)
        if "predicted_ttft_ms" not in self.columns():  # a version-1 file: no prediction can be there
            return {"window_s": window_s, "num_predicted": 0, "fleet": None, "endpoints": []}
        num = self._conn.execute("SELECT COUNT(*) FROM requests WHERE start_time >= :t0 AND start_time <= :t1 "
                                 "AND predicted_ttft_ms IS NOT NULL", w).fetchone()[0]
        if not num:
            return {"window_s": window_s, "num_predicted": 0, "fleet": None, "endpoints": []}
        fleet = self._rows(_prediction_sql(None), w)
        for r in fleet:
            r.pop("g", None)
        rows = self._rows(_prediction_sql("endpoint"), w)
        for r in rows:
            r["endpoint"] = r.pop("g")
        rows.sort(key=lambda r: (-r["num_requests"], str(r["endpoint"])))
        return {"window_s": window_s, "num_predicted": num, "fleet": fleet[0] if fleet else None, "endpoints": rows}

    def mean_in_flight(self, window_s: float, *, now: float | None = None) -> dict[str, float]:
        """Endpoint -> time-averaged requests in flight over the window (`MEAN_IN_FLIGHT_SQL`; a file-only query:
        the HTTP API has none)."""
        now = time.time() if now is None else now
        params = {"t0": now - window_s, "t1": now, "overlap": MAX_OVERLAP_S}
        return {r[0]: float(r[1] or 0.0) for r in self._conn.execute(MEAN_IN_FLIGHT_SQL, params).fetchall()}

    def endpoint_series(self, window_s: float, bucket_s: float, *, now: float | None = None) -> list[dict[str, Any]]:
        """Rows like `timeseries(by_endpoint=True)` without the percentile columns (`ENDPOINT_SERIES_SQL`):
        bucket_start, endpoint, num_requests, num_errors, num_refused, requests_per_s, prompt_tokens,
        cached_tokens, actual_hit_ratio, predicted_hit_ratio (None without usage). A file-only query."""
        now = time.time() if now is None else now
        params = {"t0": now - window_s, "t1": now, "b": float(bucket_s)}
        rows = self._rows(ENDPOINT_SERIES_SQL, params)
        for r in rows:  # one row per bucket x endpoint (tens to hundreds), not per request
            prompt = r["prompt_tokens"] or 0
            predicted = r.pop("predicted_tokens")
            r["requests_per_s"] = r["num_requests"] / bucket_s
            r["actual_hit_ratio"] = (r["cached_tokens"] or 0) / prompt if prompt else None
            r["predicted_hit_ratio"] = (predicted or 0.0) / prompt if prompt else None
        return rows

    def num_requests(self) -> int:
        """Rows in the store (all time)."""
        return self._conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def runs(self) -> list[dict[str, Any]]:
        """The runs in the store, newest first. A row: run_id, started_at (when its writer opened the store),
        num_requests, first_start_time and last_start_time (its requests' span; None without requests).
        Requests stored before run ids existed form one more run, run_id None and started_at its first
        request, when there are any. [] for a file no writer of schema 4 has opened (no run known).
        Index lookups per run (requests_run_start), not a scan of the table."""
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "runs" not in tables or "run_id" not in self.columns():
            return []
        out = self._rows(
            """SELECT run_id, started_at,
                      (SELECT COUNT(*) FROM requests q WHERE q.run_id = r.run_id) AS num_requests,
                      (SELECT MIN(start_time) FROM requests q WHERE q.run_id = r.run_id) AS first_start_time,
                      (SELECT MAX(start_time) FROM requests q WHERE q.run_id = r.run_id) AS last_start_time
               FROM runs r ORDER BY started_at DESC, run_id DESC""")
        legacy = self._rows("SELECT COUNT(*) AS num_requests, MIN(start_time) AS first_start_time, "
                            "MAX(start_time) AS last_start_time FROM requests WHERE run_id IS NULL")[0]
        if legacy["num_requests"]:
            out.append({"run_id": None, "started_at": legacy["first_start_time"], **legacy})
        return out


def _pct_exprs(prefix: str) -> str:
    # Nearest rank: the smallest value with rank >= p*n (the epsilon absorbs p*n landing a hair above an integer).
    return ", ".join(f"MIN(CASE WHEN rn >= {p!r} * n - 1e-9 THEN v END) AS {prefix}_{name}"
                     for name, p in PERCENTILES)


def _aggregate_sql(group_cols: list[str], group_exprs: list[str], pct_columns: tuple[str, ...]) -> str:
    """One statement: per-group counts, tokens, hit ratios and percentiles of `pct_columns`.

    `base` is the windowed table with the group keys materialised as columns g_*.
    """
    g_select = ", ".join(f"{e} AS {c}" for c, e in zip(group_cols, group_exprs)) or "0 AS g_all"
    keys = group_cols or ["g_all"]
    k = ", ".join(keys)
    parts = [f"base AS (SELECT {g_select}, * FROM requests WHERE start_time >= :t0 AND start_time <= :t1)",
             f"""agg AS (SELECT {k}, COUNT(*) AS num_requests, SUM({ERROR_SQL}) AS num_errors,
                 SUM({REFUSED_SQL}) AS num_refused,
                 SUM(CASE WHEN {USAGE_OK_SQL} THEN prompt_tokens END) AS prompt_tokens,
                 SUM(CASE WHEN {USAGE_OK_SQL} THEN cached_tokens END) AS cached_tokens,
                 SUM(CASE WHEN {USAGE_OK_SQL} THEN predicted_hit_ratio * prompt_tokens END) AS predicted_tokens,
                 SUM(completion_tokens) AS completion_tokens
               FROM base GROUP BY {k})"""]
    joins = []
    for col in pct_columns:
        parts.append(f"""r_{col} AS (SELECT {k}, {col} AS v,
                 ROW_NUMBER() OVER (PARTITION BY {k} ORDER BY {col}) AS rn,
                 COUNT(*) OVER (PARTITION BY {k}) AS n FROM base WHERE {col} IS NOT NULL)""")
        parts.append(f"p_{col} AS (SELECT {k}, {_pct_exprs(col)} FROM r_{col} GROUP BY {k})")
        joins.append(f"LEFT JOIN p_{col} USING ({k})")
    pct_select = ", ".join(f"{col}_{name}" for col in pct_columns for name, _ in PERCENTILES)
    return (f"WITH {', '.join(parts)} SELECT agg.*, {pct_select} FROM agg {' '.join(joins)} "
            f"ORDER BY {k}")


_PREDICTION_PCT_COLUMNS = ("predicted_ttft_ms", "actual_ttft_ms", "ape_ratio", "error_ratio", "alternative_ttft_ms")


def _prediction_sql(group_col: str | None) -> str:
    """Comparable predictions of the window, per `group_col` value (or all together as one group g = 0):
    counts and the percentiles of `_PREDICTION_PCT_COLUMNS` (nearest rank, as `_aggregate_sql`)."""
    g = group_col or "0"
    parts = [f"""base AS (SELECT {g} AS g, predicted_ttft_ms, ttft_ms AS actual_ttft_ms, alternative_ttft_ms,
                 ABS(ttft_ms - predicted_ttft_ms) / MAX(ttft_ms, 1.0) AS ape_ratio,
                 (ttft_ms - predicted_ttft_ms) / MAX(predicted_ttft_ms, 1.0) AS error_ratio
               FROM requests WHERE start_time >= :t0 AND start_time <= :t1 AND {COMPARABLE_PREDICTION_SQL})""",
             """agg AS (SELECT g, COUNT(*) AS num_requests, COUNT(alternative_ttft_ms) AS num_alternatives
               FROM base GROUP BY g)"""]
    joins = []
    for col in _PREDICTION_PCT_COLUMNS:
        parts.append(f"""r_{col} AS (SELECT g, {col} AS v, ROW_NUMBER() OVER (PARTITION BY g ORDER BY {col}) AS rn,
                 COUNT(*) OVER (PARTITION BY g) AS n FROM base WHERE {col} IS NOT NULL)""")
        parts.append(f"p_{col} AS (SELECT g, {_pct_exprs(col)} FROM r_{col} GROUP BY g)")
        joins.append(f"LEFT JOIN p_{col} USING (g)")
    pct_select = ", ".join(f"{col}_{name}" for col in _PREDICTION_PCT_COLUMNS for name, _ in PERCENTILES)
    return f"WITH {', '.join(parts)} SELECT agg.*, {pct_select} FROM agg {' '.join(joins)} ORDER BY g"


def _finish_agg(row: dict[str, Any], span_s: float) -> dict[str, Any]:
    prompt = row.get("prompt_tokens") or 0
    row["num_errors"] = row.get("num_errors") or 0
    row["error_ratio"] = row["num_errors"] / row["num_requests"] if row["num_requests"] else 0.0
    row["num_refused"] = row.get("num_refused") or 0
    row["refused_ratio"] = row["num_refused"] / row["num_requests"] if row["num_requests"] else 0.0
    row["requests_per_s"] = row["num_requests"] / span_s if span_s > 0 else 0.0
    row["actual_hit_ratio"] = (row.get("cached_tokens") or 0) / prompt if prompt else None
    predicted = row.pop("predicted_tokens", None)
    row["predicted_hit_ratio"] = (predicted or 0.0) / prompt if prompt else None
    row["prompt_tokens"] = row.get("prompt_tokens") or 0
    row["cached_tokens"] = row.get("cached_tokens") or 0
    row["completion_tokens"] = row.get("completion_tokens") or 0
    row.pop("g_all", None)
    return row


def _record_row(row: sqlite3.Row) -> dict[str, Any]:
    d = dict(row)
    d["endpoints"] = json.loads(d["endpoints"]) if d.get("endpoints") else []
    if d.get("stream") is not None:
        d["stream"] = bool(d["stream"])
    return d


def _nice_width(raw: float) -> float:
    exp = math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * 10 ** exp >= raw:
            return float(m * 10 ** exp)
    return float(10 ** (exp + 1))

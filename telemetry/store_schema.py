"""The request store's table, one SQLite row per routed request, and the definitions every query shares.

Schema (table ``requests``; the record fields are those of `records.RequestRecord`)::

    id                  INTEGER PRIMARY KEY   -- insertion order
    trace_id            TEXT NOT NULL         -- 32 lower-case hex
    span_id             TEXT NOT NULL         -- 16 lower-case hex, the router's span
    parent_span_id      TEXT                  -- incoming traceparent's span, NULL when the router began the trace
    request_id          TEXT
    start_time          REAL NOT NULL         -- unix seconds, request arrival at the gateway
    end_time            REAL                  -- unix seconds, response end
    model, tenant_hash, policy, reason, endpoint  TEXT   -- endpoint = the endpoint that served the request
    endpoints           TEXT                  -- JSON array: the decision, primary first then fallbacks
    matched_blocks, total_blocks  INTEGER
    predicted_hit_ratio REAL                  -- 0-1, the router's estimate
    predicted_ttft_ms   REAL                  -- the time model's TTFT prediction at the primary (NULL: none)
    alternative_endpoint TEXT                 -- the best other endpoint it scored
    alternative_ttft_ms REAL                  -- its predicted TTFT there
    index_source        TEXT                  -- where the primary's prefix match came from (events, feedback,
                                                 approximate; NULL: nothing matched)
    decision_us, ttft_ms, latency_ms  REAL
    prompt_tokens, completion_tokens, cached_tokens  INTEGER   -- NULL when the response carried no usage
    stream              INTEGER               -- 0/1
    status              INTEGER               -- HTTP status sent to the client, 0 = reset before headers
    error               TEXT
    path                TEXT
    service_name        TEXT                  -- resource service.name of the sender
    attrs               TEXT NOT NULL         -- JSON object: every span + resource attribute (drill-down)
    run_id              TEXT                  -- the run of the stack that stored it (NULL: stored before v4)
    router_ttft_ms, router_latency_ms  REAL   -- the router's own measurement (its event loop's clock; NULL in
                                                 Envoy-only rows and rows stored before v5)
    timing_source       TEXT                  -- whose clock ttft_ms / latency_ms are: "envoy" (Envoy's record of
                                                 the request, joined by the router's traceparent / request id) or
                                                 "router" (no Envoy record: telemetry/receiver.py); NULL before v5
    gateway_wait_ms     REAL                  -- flow control: ms held in the gateway queue (0: never held; NULL
                                                 in Envoy-only rows and rows stored before v6)
    gateway_outcome     TEXT                  -- why it left the queue: "released:REASON" / "shed:REASON"; NULL
                                                 when never held (records.py)
    routing_ms          REAL                  -- Envoy's routing delay, last request byte to first upstream byte
                                                 (records.py); NULL without a facts record and before v7
    UNIQUE (trace_id, span_id)                -- an OTLP retry re-sending a batch replaces, never duplicates

    indexes: requests_start_time (start_time), requests_endpoint_start (endpoint, start_time),
             requests_run_start (run_id, start_time)

Table ``runs`` (run_id TEXT PRIMARY KEY, started_at REAL): one row per run, added when a writer opens the
file with its `run_id` (`prefixroute up` draws one per start and gives it to the receiver, which keeps it
across its own restarts; a receiver started alone draws its own). `StoreReader.runs` lists them with
their requests' time span, so a reader can show one run: the store has one writer at a time, so runs do
not overlap in time and a run's rows are the rows of its time span.

Schema versions (meta ``schema_version``): 2 added predicted_ttft_ms, alternative_endpoint and
alternative_ttft_ms; 3 added index_source; 4 added run_id and the runs table; 5 added router_ttft_ms,
router_latency_ms and timing_source (ttft_ms and latency_ms from Envoy's clock); 6 added
gateway_wait_ms and gateway_outcome (the gateway queue); 7 added routing_ms (the routing
delay by Envoy's clock). Opening an older file with
`TelemetryStore` adds the missing columns in place (ALTER TABLE ADD COLUMN: old rows read NULL, nothing is
rewritten); a `StoreReader` on a file no writer has upgraded yet reads those columns as NULL.

A request is *refused* when ``400 <= status < 500`` (the client's fault: bad input, unknown model,
too large, not allowed; `error` then holds the refusal message) and an *error* when it was not refused
and ``error IS NOT NULL OR status = 0 OR status >= 500`` (a 5xx, a reset, a response cut short). The
two never overlap: aggregates report num_errors / error_ratio and num_refused / refused_ratio.
Hit ratios are token-weighted over rows that carry usage:
``actual_hit_ratio = SUM(cached_tokens) / SUM(prompt_tokens)`` and
``predicted_hit_ratio = SUM(predicted_hit_ratio * prompt_tokens) / SUM(prompt_tokens)``, so the two
are directly comparable. A TTFT prediction is *comparable* (`ttft_predictions`) when the row has both
predicted_ttft_ms and ttft_ms, is neither an error nor a refusal (``0 < status < 400``, no error) and was
served by the primary the prediction was made for (``endpoint = endpoints[0]``); its absolute percentage
error is ``|ttft_ms - predicted_ttft_ms| / ttft_ms`` and its signed error ratio
``(ttft_ms - predicted_ttft_ms) / predicted_ttft_ms`` (>0: slower than predicted), denominators floored
at 1 ms.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefixroute.telemetry.records import RECORD_FIELDS, RequestRecord

SCHEMA_VERSION = 7

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    parent_span_id TEXT,
    request_id TEXT,
    start_time REAL NOT NULL,
    end_time REAL,
    model TEXT,
    tenant_hash TEXT,
    policy TEXT,
    reason TEXT,
    endpoint TEXT,
    endpoints TEXT,
    matched_blocks INTEGER,
    total_blocks INTEGER,
    predicted_hit_ratio REAL,
    predicted_ttft_ms REAL,
    alternative_endpoint TEXT,
    alternative_ttft_ms REAL,
    decision_us REAL,
    ttft_ms REAL,
    latency_ms REAL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    cached_tokens INTEGER,
    stream INTEGER,
    status INTEGER,
    error TEXT,
    path TEXT,
    index_source TEXT,
    gateway_wait_ms REAL,
    gateway_outcome TEXT,
    routing_ms REAL,
    service_name TEXT,
    attrs TEXT NOT NULL DEFAULT '{}',
    UNIQUE (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS requests_start_time ON requests(start_time);
CREATE INDEX IF NOT EXISTS requests_endpoint_start ON requests(endpoint, start_time);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (run_id TEXT PRIMARY KEY, started_at REAL NOT NULL);
"""

# Columns added after schema version 1, in the order they were added (name, SQL type): `TelemetryStore`
# adds the missing ones to an older file; `StoreReader` reads a missing one as NULL.
ADDED_COLUMNS: tuple[tuple[str, str], ...] = (
    ("predicted_ttft_ms", "REAL"), ("alternative_endpoint", "TEXT"), ("alternative_ttft_ms", "REAL"),
    ("index_source", "TEXT"), ("run_id", "TEXT"), ("router_ttft_ms", "REAL"), ("router_latency_ms", "REAL"),
    ("timing_source", "TEXT"), ("gateway_wait_ms", "REAL"), ("gateway_outcome", "TEXT"), ("routing_ms", "REAL"))

TIMING_COLUMNS: tuple[str, ...] = ("router_ttft_ms", "router_latency_ms", "timing_source")
"""Columns of a row's timing provenance (v5): the router's own figures and whose clock ttft_ms/latency_ms are."""
ROW_COLUMNS: tuple[str, ...] = RECORD_FIELDS + ("end_time", "service_name", "attrs", "run_id") + TIMING_COLUMNS
INSERT_SQL = (f"INSERT OR REPLACE INTO requests ({', '.join(ROW_COLUMNS)}) "
           f"VALUES ({', '.join(':' + c for c in ROW_COLUMNS)})")
# Columns returned for one request (dump / recent requests): the record fields + end_time.
RECORD_COLUMNS = RECORD_FIELDS + ("end_time",) + TIMING_COLUMNS

TIMING_UPDATE_SQL = (
    "UPDATE requests SET ttft_ms = COALESCE(:ttft_ms, ttft_ms), latency_ms = COALESCE(:latency_ms, latency_ms), "
    "end_time = COALESCE(:end_time, end_time), timing_source = 'envoy' WHERE trace_id = :trace_id AND span_id = :span_id")
"""Envoy's timing onto a router's row already stored (receiver.py: Envoy's record came after the router's)."""

REFUSED_SQL = "(CASE WHEN status >= 400 AND status < 500 THEN 1 ELSE 0 END)"
ERROR_SQL = ("(CASE WHEN status >= 400 AND status < 500 THEN 0 "
             "WHEN error IS NOT NULL OR status = 0 OR status >= 500 THEN 1 ELSE 0 END)")
USAGE_OK_SQL = "(prompt_tokens IS NOT NULL AND cached_tokens IS NOT NULL AND prompt_tokens > 0)"
COMPARABLE_PREDICTION_SQL = (
    "(predicted_ttft_ms IS NOT NULL AND ttft_ms IS NOT NULL AND status > 0 AND status < 400 AND error IS NULL "
    "AND endpoint IS NOT NULL AND json_valid(endpoints) AND endpoint = json_extract(endpoints, '$[0]'))")
"""A row whose TTFT prediction can be scored (see the module docstring); RequestRecord.is_comparable_prediction."""
PERCENTILES: tuple[tuple[str, float], ...] = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


class StoreMissing(FileNotFoundError):
    """The database file does not exist (receiver not started yet, or the file was removed)."""


def record_to_row(rec: RequestRecord, *, service_name: str | None = None,
                  attrs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A store row for a record (used by the receiver's tests and by direct in-process sinks)."""
    row: dict[str, Any] = rec.as_fields()
    row["endpoints"] = json.dumps(list(rec.endpoints))
    row["stream"] = int(rec.stream)
    row["end_time"] = rec.end_time
    row["service_name"] = service_name
    row["attrs"] = json.dumps(dict(attrs or {}), default=str)
    return row


def complete_row(row: Mapping[str, Any]) -> dict[str, Any]:
    out = {c: row.get(c) for c in ROW_COLUMNS}
    if out["attrs"] is None:
        out["attrs"] = "{}"
    return out

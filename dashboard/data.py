"""Pure data logic of the dashboard: query results -> pandas frames, colours, balance, states.

Nothing here imports Streamlit or touches the store; every function takes the plain JSON-able rows
that `StoreReader` / `HttpStoreClient` return (see telemetry/store_reader.py) and is unit-tested
on its own. Aggregation stays in SQL: these functions only reshape a handful of rows per bucket or
per endpoint (O(buckets x endpoints)), never per request.

Contracts:
- Ratios stay 0-1 in frames (charts format them as percent); times become timezone-aware UTC
  ``pandas.Timestamp`` in a ``time`` column; milliseconds stay in ``*_ms`` columns.
- Endpoint colours: `endpoint_colors` maps the *naturally sorted* endpoint names to a fixed palette
  in order, so the same set of endpoints always gets the same colours on every chart.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from prefixroute.dashboard.router_metrics import EndpointLive
from prefixroute.dashboard.tables import format_ratio

# Tableau 10 without red (red is kept for errors): distinguishable, colour-blind friendlier order.
PALETTE: tuple[str, ...] = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                            "#ff9da7", "#bab0ac", "#17becf", "#bcbd22", "#7f7f7f")
ERROR_COLOR = "#e15759"
PERCENTILE_COLORS: dict[str, str] = {"p50": "#4e79a7", "p90": "#f28e2b", "p99": "#e15759"}
HIT_KIND_DASH: dict[str, list[int]] = {"actual": [1, 0], "predicted": [6, 3]}

# Window choices (label -> seconds) and the bucket widths a chart may use; ~40-80 buckets per chart.
WINDOWS: dict[str, float] = {"1 min": 60, "5 min": 300, "15 min": 900, "1 h": 3600, "6 h": 21600, "24 h": 86400}
_NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
UNKNOWN_ENDPOINT = "unrouted"  # requests that reached no endpoint (refused by the router, none available, reset)
UNROUTED_COLOR = "#bab0ac"  # grey: not an endpoint, drawn apart from the palette


def bucket_for_window(window_s: float, target_buckets: int = 40) -> float:
    """Smallest 'nice' bucket width giving at most `target_buckets` buckets over the window (>= 1 s)."""
    if not window_s > 0:
        raise ValueError("window_s must be > 0")
    raw = window_s / max(1, target_buckets)
    for b in _NICE_BUCKETS_S:
        if b >= raw:
            return float(b)
    return float(_NICE_BUCKETS_S[-1])


def refresh_for_window(refresh_s: float, window_s: float) -> float:
    """Seconds between live refreshes for a window: `refresh_s`, slowed to window/300 for long windows.

    A refresh re-aggregates the whole window (percentiles sort it), so its cost grows with the window;
    a 24 h chart gains nothing from redrawing every 2 s, while a 5 min one should feel live.
    """
    return max(refresh_s, window_s / 300.0)


def effective_span_s(window_s: float, first_start_time: float | None, now: float, min_span_s: float = 30.0) -> float:
    """The part of the window that holds data: from the oldest request in the window (at least
    `min_span_s` back) to now, capped at the window. Charts bucket over this span, so a run that began
    a minute ago fills the chart instead of sitting in one bucket at the right edge."""
    if first_start_time is None:
        return window_s
    return min(window_s, max(min_span_s, now - first_start_time))


def _natural_key(name: str) -> list[Any]:
    # "10.0.0.2:8000" < "10.0.0.10:8000": numbers compare as numbers.
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def sort_endpoints(names: Iterable[str | None]) -> list[str]:
    """Distinct endpoint names, naturally sorted; None becomes UNKNOWN_ENDPOINT (sorted last)."""
    names = list(names)
    out = sorted({n for n in names if n and n != UNKNOWN_ENDPOINT}, key=_natural_key)
    if any(not n or n == UNKNOWN_ENDPOINT for n in names):
        out.append(UNKNOWN_ENDPOINT)
    return out


def endpoint_colors(names: Iterable[str | None]) -> dict[str, str]:
    """Endpoint -> colour: the palette in order over the naturally sorted names (cycles past 12); unrouted
    requests (UNKNOWN_ENDPOINT) are grey and do not take a palette colour."""
    real = [n for n in sort_endpoints(names) if n != UNKNOWN_ENDPOINT]
    out = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(real)}
    if len(real) < len(sort_endpoints(names)):
        out[UNKNOWN_ENDPOINT] = UNROUTED_COLOR
    return out


def has_traffic(summary: Mapping[str, Any] | None) -> bool:
    """True when the window holds at least one request."""
    return bool(summary) and int(summary.get("num_requests") or 0) > 0


@dataclasses.dataclass(frozen=True)
class TrafficState:
    """What the dashboard should say about the amount of data: one of
    ``"empty"`` (the store has never had a request), ``"idle"`` (requests exist, none in the window),
    ``"live"`` (the window has requests)."""

    kind: str
    num_requests_total: int
    num_requests_window: int


def traffic_state(summary: Mapping[str, Any] | None, num_requests_total: int) -> TrafficState:
    window = int((summary or {}).get("num_requests") or 0)
    if num_requests_total <= 0 and window == 0:
        kind = "empty"
    elif window == 0:
        kind = "idle"
    else:
        kind = "live"
    return TrafficState(kind, max(num_requests_total, window), window)


def balance_ratio(shares: Mapping[str, float] | Sequence[float]) -> float | None:
    """Max share / fair share (1 / number of endpoints): 1.0 = perfectly even, N = all on one of N.

    `shares` may be request counts or ratios (only proportions matter). None when nothing was served.
    """
    values = [float(v or 0.0) for v in (shares.values() if isinstance(shares, Mapping) else shares)]
    total = sum(v for v in values if v > 0)
    if total <= 0:
        return None
    # Endpoints with a zero share still count towards the fair share: idling one is imbalance.
    return max(values) / total * len(values)


@dataclasses.dataclass(frozen=True)
class Shares:
    """How the window's requests spread over the fleet: the one computation behind the balance tile, the
    endpoints header, the share chart's fair-share line and the table's share column, so they always agree.

    `endpoints`: the fleet, naturally sorted: every endpoint that served a request in the window and every
    endpoint the router reports (an idle endpoint counts: idling one is imbalance). Requests that reached no
    endpoint (refused by the router, none available, reset before a decision) are *unrouted*: counted apart
    (`num_unrouted`, of them `num_unrouted_refused` 4xx and `num_unrouted_errors`), never an endpoint and never
    in a share: shares are of the routed requests."""

    endpoints: tuple[str, ...]
    counts: Mapping[str, int]
    num_routed: int
    num_unrouted: int = 0
    num_unrouted_refused: int = 0
    num_unrouted_errors: int = 0

    @property
    def fair_share_ratio(self) -> float | None:
        """1 / the number of endpoints; None without endpoints."""
        return 1.0 / len(self.endpoints) if self.endpoints else None

    def share_ratio(self, endpoint: str) -> float:
        return self.counts.get(endpoint, 0) / self.num_routed if self.num_routed else 0.0

    @property
    def balance_ratio(self) -> float | None:
        """Busiest endpoint's share / fair share: 1.0 = even, N = all on one of N; None without routed requests."""
        if not self.num_routed or not self.endpoints:
            return None
        return max(self.counts.get(e, 0) for e in self.endpoints) / self.num_routed * len(self.endpoints)


def endpoint_shares(rows: Sequence[Mapping[str, Any]], live: Mapping[str, Any] | None = None) -> Shares:
    """`Shares` from `endpoints()` rows (one per endpoint, None for the unrouted) and the router's live endpoints."""
    counts: dict[str, int] = {}
    unrouted = {"num_requests": 0, "num_refused": 0, "num_errors": 0}
    for r in rows:
        name = r.get("endpoint")
        if not name or name == UNKNOWN_ENDPOINT:
            for k in unrouted:
                unrouted[k] += int(r.get(k) or 0)
        else:
            counts[name] = counts.get(name, 0) + int(r.get("num_requests") or 0)
    endpoints = tuple(sort_endpoints([*counts, *(live or {})]))
    return Shares(endpoints, counts, sum(counts.values()), unrouted["num_requests"], unrouted["num_refused"],
                  unrouted["num_errors"])


def format_balance(ratio: float | None) -> str:
    """The balance figure as every place shows it: two decimals and a multiplication sign, or a dash."""
    return "–" if ratio is None else f"{ratio:.2f}×"


def balance_verdict(ratio: float | None) -> str:
    """A short reading of `balance_ratio` (thresholds from the bench issue's 1.5x fair-share target)."""
    if ratio is None:
        return "no data"
    if ratio <= 1.2:
        return "even"
    if ratio <= 1.5:
        return "uneven"
    return "skewed"


def _to_time(frame: pd.DataFrame, column: str = "bucket_start") -> pd.DataFrame:
    frame["time"] = pd.to_datetime(frame[column], unit="s", utc=True)
    return frame


def segments(frame: pd.DataFrame, bucket_s: float | None, keys: Sequence[str]) -> pd.DataFrame:
    """`frame` (rows with bucket_start, one series per value of `keys`) with a ``segment`` column numbering each
    series' unbroken stretches: a new segment wherever the series skips a bucket. Line charts group by it, so
    no line is drawn across time without data (between two runs, an idle spell, a receiver restart). Without
    `bucket_s` every row is segment 0. Rows come back sorted by keys then time."""
    frame = frame.sort_values([*keys, "bucket_start"], kind="stable").reset_index(drop=True)
    if frame.empty or not bucket_s:
        frame["segment"] = 0
        return frame
    gap = frame.groupby(list(keys))["bucket_start"].diff() > bucket_s * 1.5
    frame["segment"] = gap.groupby([frame[k] for k in keys]).cumsum().astype("int64")
    return frame


NO_DECISION = "none"
"""The reason shown for requests stored without a routing decision (refused before one: bad input, shed, no
ready endpoint)."""


def complete_buckets(rows: Sequence[Mapping[str, Any]], bucket_s: float | None, now: float | None
                     ) -> list[Mapping[str, Any]]:
    """`rows` (timeseries rows with bucket_start) without the newest bucket while it is still filling (it ends
    after `now`): a few seconds of a bucket hold a handful of requests, often cold ones, and drew an endpoint's hit
    rate at 0% at the right edge. Kept when it is the only bucket (a run that just began has nothing else)."""
    if not rows or not bucket_s or now is None:
        return list(rows)
    done = [r for r in rows if r["bucket_start"] + bucket_s <= now]
    return done or list(rows)


def fleet_hit_frame(timeseries: Sequence[Mapping[str, Any]], bucket_s: float | None = None) -> pd.DataFrame:
    """Long frame time, kind (actual|predicted), hit_ratio, segment from fleet-wide `timeseries` rows
    (buckets without usage are dropped: no tokens, no ratio; `segments` breaks the line there)."""
    rows = [{"bucket_start": r["bucket_start"], "kind": kind, "hit_ratio": r[f"{kind}_hit_ratio"]}
            for r in timeseries for kind in ("actual", "predicted") if r.get(f"{kind}_hit_ratio") is not None]
    frame = pd.DataFrame(rows, columns=["bucket_start", "kind", "hit_ratio"])
    return _to_time(segments(frame, bucket_s, ["kind"]))


def endpoint_hit_frame(timeseries_by_endpoint: Sequence[Mapping[str, Any]],
                       bucket_s: float | None = None) -> pd.DataFrame:
    """Long frame time, endpoint, kind, hit_ratio, segment from `timeseries(by_endpoint=True)` rows."""
    rows = [{"bucket_start": r["bucket_start"], "endpoint": r.get("endpoint") or UNKNOWN_ENDPOINT, "kind": kind,
             "hit_ratio": r[f"{kind}_hit_ratio"]}
            for r in timeseries_by_endpoint for kind in ("actual", "predicted")
            if r.get(f"{kind}_hit_ratio") is not None]
    frame = pd.DataFrame(rows, columns=["bucket_start", "endpoint", "kind", "hit_ratio"])
    return _to_time(segments(frame, bucket_s, ["endpoint", "kind"]))


def percentile_frame(timeseries: Sequence[Mapping[str, Any]], column: str = "ttft_ms",
                     bucket_s: float | None = None) -> pd.DataFrame:
    """Long frame time, percentile (p50|p90|p99), value_ms, segment for `column` (ttft_ms or latency_ms)."""
    rows = [{"bucket_start": r["bucket_start"], "percentile": p, "value_ms": r[f"{column}_{p}"]}
            for r in timeseries for p in ("p50", "p90", "p99") if r.get(f"{column}_{p}") is not None]
    frame = pd.DataFrame(rows, columns=["bucket_start", "percentile", "value_ms"])
    return _to_time(segments(frame, bucket_s, ["percentile"]))


def rate_frame(timeseries_by_endpoint: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Frame time, endpoint, requests_per_s, errors_per_s per bucket and endpoint."""
    rows = [{"bucket_start": r["bucket_start"], "endpoint": r.get("endpoint") or UNKNOWN_ENDPOINT,
             "requests_per_s": r["requests_per_s"],
             "errors_per_s": r["requests_per_s"] * r["num_errors"] / r["num_requests"] if r["num_requests"] else 0.0}
            for r in timeseries_by_endpoint]
    frame = pd.DataFrame(rows, columns=["bucket_start", "endpoint", "requests_per_s", "errors_per_s"])
    return _to_time(frame)


def error_frame(timeseries: Sequence[Mapping[str, Any]], bucket_s: float) -> pd.DataFrame:
    """Frame time, errors_per_s (fleet-wide) for buckets that had errors."""
    rows = [{"bucket_start": r["bucket_start"], "errors_per_s": r["num_errors"] / bucket_s}
            for r in timeseries if r.get("num_errors")]
    return _to_time(pd.DataFrame(rows, columns=["bucket_start", "errors_per_s"]))


def histogram_frame(bins: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Frame bin_start, bin_end, num_requests from `histogram` rows."""
    return pd.DataFrame(list(bins), columns=["bin_start", "bin_end", "num_requests"])


def _index_source_text(lv: EndpointLive) -> str | None:
    """The endpoint table's index column: an endpoint publishing KV events shows ``events`` while they are used
    and ``events (STATE)`` while not (``events (undecodable)``, ``events (down)``, ``events (block size
    mismatch)``, ...: meanwhile it is matched by the router's own index, feedback)."""
    state = lv.kv_events_state
    if state:
        return "events" if state == "live" else f"events ({state.replace('_', ' ')})"
    if not lv.index_source:
        return None
    return lv.index_source + (" (down)" if lv.kv_events_connected is False else "")


def endpoint_frame(rows: Sequence[Mapping[str, Any]], *, mean_in_flight: Mapping[str, float] | None = None,
                   live: Mapping[str, EndpointLive] | None = None, shares: Shares | None = None) -> pd.DataFrame:
    """One row per endpoint of `shares` (default: `endpoint_shares(rows, live)`: the fleet, naturally sorted; an
    endpoint the router knows that served nothing has a row of zeros), from `endpoints()` rows, plus optional
    figures. Unrouted requests have no row (see `Shares`); share_ratio is of the routed requests.

    Columns (most telling first): endpoint, num_requests, share_ratio, actual_hit_ratio, predicted_hit_ratio,
    index_source (text: events / events (STATE) for an events endpoint whose events are not used now, e.g.
    events (undecodable), events (down): it is matched by feedback meanwhile / feedback / approximate), mean_in_flight, healthy (1/0), running, waiting, kv_cache_usage_ratio, conversations (whose last turn went
    there), prefill_load_ratio (the router's estimate of its recent prefill utilisation), ttft_ms_p50, ttft_ms_p99,
    requests_per_s, num_errors, num_refused.
    """
    mean_in_flight = mean_in_flight or {}
    live = live or {}
    shares = shares if shares is not None else endpoint_shares(rows, live)
    by_name = {r["endpoint"]: r for r in rows if r.get("endpoint") and r["endpoint"] != UNKNOWN_ENDPOINT}
    out = []
    for name in shares.endpoints:
        r = by_name.get(name) or {"num_requests": 0}
        lv = live.get(name, EndpointLive())
        out.append({"endpoint": name, "num_requests": r["num_requests"], "share_ratio": shares.share_ratio(name),
                    "requests_per_s": r.get("requests_per_s"), "mean_in_flight": mean_in_flight.get(name),
                    "healthy": None if lv.healthy is None else float(lv.healthy),
                    "running": lv.num_requests_running, "waiting": lv.num_requests_waiting,
                    "kv_cache_usage_ratio": lv.kv_cache_usage_ratio,
                    "conversations": lv.num_conversations, "prefill_load_ratio": lv.prefill_utilization_ratio,
                    "actual_hit_ratio": r.get("actual_hit_ratio"), "predicted_hit_ratio": r.get("predicted_hit_ratio"),
                    "index_source": _index_source_text(lv),
                    "ttft_ms_p50": r.get("ttft_ms_p50"), "ttft_ms_p99": r.get("ttft_ms_p99"),
                    "num_errors": r.get("num_errors", 0), "num_refused": r.get("num_refused", 0)})
    cols = ["endpoint", "num_requests", "share_ratio", "actual_hit_ratio", "predicted_hit_ratio", "index_source",
            "mean_in_flight",
            "healthy", "running", "waiting", "kv_cache_usage_ratio", "conversations", "prefill_load_ratio",
            "ttft_ms_p50", "ttft_ms_p99", "requests_per_s", "num_errors", "num_refused"]
    frame = pd.DataFrame(out, columns=cols)
    # Unknown figures as NaN (rendered blank), not None objects (rendered "None").
    return frame.astype({c: "float64" for c in cols
                         if c not in ("endpoint", "num_requests", "num_errors", "num_refused", "index_source")})


def unrouted_sentence(shares: Shares, num_requests: int) -> str:
    """What the unrouted requests of the window were, in one Markdown line (shown only when there are some)."""
    n = shares.num_unrouted
    other = n - shares.num_unrouted_refused - shares.num_unrouted_errors
    parts = [f"{shares.num_unrouted_refused:,} refused by the router (4xx: invalid input, unknown model, too large, "
             "not allowed)" if shares.num_unrouted_refused else "",
             f"{shares.num_unrouted_errors:,} failed before an endpoint answered (no endpoint available, or the "
             "connection reset)" if shares.num_unrouted_errors else "",
             f"{other:,} otherwise" if other else ""]
    return (f"**Unrouted: {n:,} requests** ({format_ratio(n / num_requests if num_requests else None)} of the window) "
            f"reached no endpoint: {'; '.join(p for p in parts if p)}. They are not an endpoint: left out of the "
            f"shares, the balance and the table below, counted in the errors and refusals above.")


def reasons_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Frame reason, num_requests, share_ratio (most first), None reason shown as NO_DECISION."""
    frame = pd.DataFrame([{"reason": r.get("reason") or NO_DECISION, "num_requests": r["num_requests"],
                           "share_ratio": r["share_ratio"]} for r in rows],
                         columns=["reason", "num_requests", "share_ratio"])
    return frame


def reasons_time_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame([{"bucket_start": r["bucket_start"], "reason": r.get("reason") or NO_DECISION,
                           "num_requests": r["num_requests"], "share_ratio": r["share_ratio"]} for r in rows],
                         columns=["bucket_start", "reason", "num_requests", "share_ratio"])
    return _to_time(frame)


@dataclasses.dataclass(frozen=True)
class PredictionState:
    """What the "Predicted vs actual TTFT" panel can show: kind is "unavailable" (the source has no such
    query: a receiver older than this dashboard), "none" (no decision in the window carried a predicted
    TTFT: the policy has no time model), "uncomparable" (predictions, but none on a request that succeeded
    on its primary), or "ok"."""

    kind: str
    num_predicted: int
    num_compared: int


def prediction_state(result: Mapping[str, Any] | None) -> PredictionState:
    if result is None:
        return PredictionState("unavailable", 0, 0)
    num_predicted = int(result.get("num_predicted") or 0)
    num_compared = int((result.get("fleet") or {}).get("num_requests") or 0)
    if num_predicted == 0:
        return PredictionState("none", 0, 0)
    return PredictionState("ok" if num_compared else "uncomparable", num_predicted, num_compared)


PREDICTION_COLUMNS = ("endpoint", "num_requests", "predicted_ttft_ms_p50", "actual_ttft_ms_p50", "ape_ratio_p50",
                      "error_ratio_p50", "alternative_ttft_ms_p50", "num_alternatives")


def prediction_frame(result: Mapping[str, Any] | None) -> pd.DataFrame:
    """One row per endpoint (naturally sorted) from `ttft_predictions` (columns PREDICTION_COLUMNS):
    requests with a comparable prediction, median predicted and median actual TTFT of those requests,
    median absolute percentage error (0-1), median signed error ratio, median predicted TTFT of the
    best alternative and how many had one."""
    rows = (result or {}).get("endpoints") or []
    by_name = {(r.get("endpoint") or UNKNOWN_ENDPOINT): r for r in rows}
    out = [{c: (name if c == "endpoint" else by_name[name].get(c)) for c in PREDICTION_COLUMNS}
           for name in sort_endpoints(by_name)]
    frame = pd.DataFrame(out, columns=list(PREDICTION_COLUMNS))
    return frame.astype({c: "float64" for c in PREDICTION_COLUMNS
                         if c not in ("endpoint", "num_requests", "num_alternatives")})


def prediction_long(frame: pd.DataFrame) -> pd.DataFrame:
    """Long frame endpoint, kind (actual|predicted), ttft_ms for the per-endpoint bars."""
    long = frame.melt(id_vars=["endpoint"], value_vars=["actual_ttft_ms_p50", "predicted_ttft_ms_p50"],
                      var_name="kind", value_name="ttft_ms").dropna(subset=["ttft_ms"])
    long["kind"] = long["kind"].str.replace("_ttft_ms_p50", "", regex=False)
    return long.reset_index(drop=True)


RECENT_COLUMNS = ("time", "endpoint", "reason", "status", "ttft_ms", "timing_source", "router_ttft_ms",
                  "predicted_ttft_ms", "alternative_endpoint",
                  "alternative_ttft_ms", "gateway_wait_ms", "gateway_outcome", "latency_ms", "prompt_tokens",
                  "cached_tokens", "hit_ratio", "predicted_hit_ratio", "decision_us", "routing_ms", "policy", "model",
                  "trace_id")


def recent_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The recent-requests table: one row per request, newest first, with its own hit ratio."""
    out = []
    for r in rows:  # at most the table's limit (100) rows: a display loop, not an aggregate
        prompt, cached = r.get("prompt_tokens"), r.get("cached_tokens")
        out.append({"time": r["start_time"], "endpoint": r.get("endpoint") or UNKNOWN_ENDPOINT,
                    "reason": r.get("reason") or "", "status": r.get("status"), "ttft_ms": r.get("ttft_ms"),
                    # whose clock ttft_ms is ("envoy": Envoy's record; "router": its own, no Envoy record joined),
                    # and the router's own figure beside Envoy's (what its time model saw, late under load)
                    "timing_source": r.get("timing_source") or "", "router_ttft_ms": r.get("router_ttft_ms"),
                    "predicted_ttft_ms": r.get("predicted_ttft_ms"),
                    "alternative_endpoint": r.get("alternative_endpoint") or "",
                    "alternative_ttft_ms": r.get("alternative_ttft_ms"),
                    # flow control: time held in the gateway queue and why it left it (None: never held)
                    "gateway_wait_ms": r.get("gateway_wait_ms"), "gateway_outcome": r.get("gateway_outcome") or "",
                    "latency_ms": r.get("latency_ms"), "prompt_tokens": prompt, "cached_tokens": cached,
                    "hit_ratio": cached / prompt if prompt and cached is not None else None,
                    "predicted_hit_ratio": r.get("predicted_hit_ratio"), "decision_us": r.get("decision_us"),
                    # Envoy's routing delay: the request's end to its upstream start (None: no facts record)
                    "routing_ms": r.get("routing_ms"),
                    "policy": r.get("policy") or "", "model": r.get("model") or "", "trace_id": r["trace_id"]})
    frame = pd.DataFrame(out, columns=list(RECENT_COLUMNS))
    frame["time"] = pd.to_datetime(frame["time"], unit="s", utc=True)
    return frame

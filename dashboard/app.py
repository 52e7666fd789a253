"""The Streamlit app (run by `prefixroute dashboard`; settings from PREFIXROUTE_DASHBOARD_* variables).

Pages (sidebar): Live (hit rates, latency, traffic, endpoints, routing; refreshed every refresh_s by
an `st.fragment(run_every=...)`, so only that part re-renders: no full-page reload, no flicker),
Requests (newest requests, drill-down to one request's trace attributes), Benchmarks (results.json
files of `prefixroute bench`).

Every number comes from one SQL query of the store per panel (data.py only reshapes rows); one
`now` is taken per refresh and passed to every query so all panels describe the same window.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from prefixroute import settings
from prefixroute.dashboard import bench_results as BR
from prefixroute.dashboard import charts as C
from prefixroute.dashboard import data as D
from prefixroute.dashboard import flow_panel, tiers_panel
from prefixroute.dashboard import tables as T
from prefixroute.dashboard.cli import DashboardSettings
from prefixroute.dashboard.router_metrics import EndpointLive
from prefixroute.dashboard.source import DataSource, SourceError
from prefixroute.telemetry.store_schema import StoreMissing

if TYPE_CHECKING:
    from pandas.io.formats.style import Styler

st.set_page_config(page_title="prefixroute dashboard", page_icon=":material/alt_route:", layout="wide")

cfg = settings.from_namespace(DashboardSettings, None)

# Live parts re-render in place: keep them fully opaque while a refresh runs (Streamlit fades "stale"
# elements during a rerun, which at a 2 s refresh reads as constant flicker).
st.html("<style>[data-stale='true'] { opacity: 1 !important; transition: none !important; }</style>")


@st.cache_resource(show_spinner=False)
def get_source(db: str | None, url: str | None, token: str | None, router_metrics_url: str | None,
               metrics_timeout_s: float) -> DataSource:
    return DataSource(db=db, url=url, token=token, router_metrics_url=router_metrics_url,
                      metrics_timeout_s=metrics_timeout_s)


_kw = cfg.source_kwargs()
source = get_source(_kw.get("db"), _kw.get("url"), _kw.get("token"), cfg.router_metrics_url or None,
                    cfg.metrics_timeout_s)

# --- sidebar --------------------------------------------------------------------------------------------
st.sidebar.title("prefixroute")
page = st.sidebar.radio("Page", ["Live", "Requests", "Benchmarks"], key="page")
_window_labels = list(D.WINDOWS)
_default_label = min(_window_labels, key=lambda k: abs(D.WINDOWS[k] - cfg.window_s))
window_label = st.sidebar.selectbox("Window", _window_labels, index=_window_labels.index(_default_label),
                                    key="window", help="Time range of every chart and figure.")
window_s = float(D.WINDOWS[window_label])
refresh_s = D.refresh_for_window(cfg.refresh_s, window_s)


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M:%S UTC")


@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def runs_snapshot(_source: DataSource, source_key: str, tick: int) -> list[dict]:
    """The store's runs (newest first), shared by every viewer within one refresh period."""
    return _source.runs()


def _runs() -> list[dict]:
    try:
        return runs_snapshot(source, source.description, int(time.time() // refresh_s))
    except SourceError:
        return []  # the pages say what is wrong with the source


def _hhmm(ts: float | None) -> str:
    return "–" if ts is None else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%H:%M")


def _run_label(run: dict) -> str:
    """An earlier run as the selector lists it, short enough for the sidebar: its span (UTC) and size."""
    start = run["first_start_time"] if run["run_id"] is None else run["started_at"]
    prefix = "before run ids, " if run["run_id"] is None else ""
    return f"{prefix}{_hhmm(start)}–{_hhmm(run['last_start_time'])} UTC · {run['num_requests']:,} req."


CURRENT_RUN, ALL_RUNS, UNMARKED_RUN = "current", "all", "unmarked"
_known_runs = _runs()
if _known_runs:
    _choices = [CURRENT_RUN, *[r["run_id"] or UNMARKED_RUN for r in _known_runs[1:]], ALL_RUNS]
    _labels = {CURRENT_RUN: f"Current (since {_hhmm(_known_runs[0]['started_at'])} UTC)", ALL_RUNS: "All runs",
               **{(r["run_id"] or UNMARKED_RUN): _run_label(r) for r in _known_runs[1:]}}
    run_choice = st.sidebar.selectbox(
        "Run", _choices, format_func=lambda c: _labels.get(c, c), key="run",
        help="Each start of `prefixroute up` is a new run in the same store. The current run is shown by default, "
             "so a restart starts from a clean page; pick an earlier run to look back, or all runs.")
else:
    run_choice = ALL_RUNS  # a store without run ids (an older receiver): everything in it


def selected_run(choice: str, runs: list[dict]) -> dict | None:
    """The run `choice` names among `runs` (newest first): the newest for CURRENT_RUN, None for all runs or a
    run no longer in the store."""
    if not runs or choice == ALL_RUNS:
        return None
    if choice == CURRENT_RUN:
        return runs[0]
    return next((r for r in runs if (r["run_id"] or UNMARKED_RUN) == choice), None)


def run_bounds(run: dict | None, current: bool) -> tuple[float | None, float | None]:
    """(since, now) of the queries for a run: from its start; up to now for the current run, to its last
    request for an earlier one (its figures then stay as they were when it ended)."""
    if run is None:
        return None, None
    since = min(x for x in (run["started_at"], run["first_start_time"]) if x is not None)
    if current:
        return since, None
    return since, (run["last_start_time"] or since) + 1e-3


st.sidebar.caption(f"Reading {'store `' + os.path.basename(source.db) + '`' if source.db else source.url}  \n"
                   f"Refresh every {refresh_s:g} s", help=source.description)


def show_source_error(exc: Exception) -> None:
    """Store missing / receiver down: say so, say how to fix it; the next refresh retries."""
    if isinstance(exc, StoreMissing) and source.db:
        st.warning(f"**Telemetry store not available.** {exc}.  \n"
                   f"Start the receiver that writes it, and this page recovers by itself "
                   f"(retrying every {refresh_s:g} s):", icon=":material/hourglass_empty:")
        st.code(f"prefixroute telemetry --db {source.db}", language="bash")
    elif isinstance(exc, StoreMissing):
        st.warning(f"**The receiver at {source.url} has no store yet.** {exc}. Retrying every {refresh_s:g} s.",
                   icon=":material/hourglass_empty:")
    else:
        st.error(f"**Telemetry receiver not reachable.** {exc}  \nRetrying every {refresh_s:g} s; "
                 f"check that `prefixroute telemetry` is running and serves its HTTP API there.",
                 icon=":material/power_off:")


def show_no_traffic(in_run: bool = False) -> None:
    what = ("**No traffic yet in this run.** The stack is up but has routed no request since it started"
            if in_run else "**No traffic yet.** The store is ready but holds no routed request")
    st.info(f"{what}. Send some through the gateway and the charts appear within a second or two:",
            icon=":material/inbox:")
    st.code("prefixroute up --traffic shared-prompts        # whole stack with a steady demo load\n"
            "# or, with a gateway already on :8080:\n"
            "curl -s http://127.0.0.1:8080/v1/chat/completions \\\n"
            "  -H 'content-type: application/json' \\\n"
            "  -d '{\"model\": \"meta-llama/Llama-3.1-8B-Instruct\", \"max_tokens\": 16,\n"
            "       \"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]}'",
            language="bash")


def _colors(names: list[str]) -> dict[str, str]:
    # Remember every endpoint seen in this session, so an endpoint idle in this window keeps its colour.
    known = st.session_state.setdefault("known_endpoints", set())
    known.update(n for n in names if n)
    return D.endpoint_colors(known)


def _chart(chart, key: str, height: int = C.HEIGHT) -> None:
    # An explicit element height: the whole chart (axes and legend included) is fitted into it.
    # The keyed container gives the chart a stable CSS class (st-key-chart-KEY) for browser tests.
    with st.container(key=f"chart-{key}"):
        st.altair_chart(chart, key=key, width="stretch", height=height)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def _empty_note(text: str) -> None:
    st.caption(f"_{text}_")


# --- Live page ------------------------------------------------------------------------------------------
@st.cache_data(ttl=60, max_entries=16, show_spinner=False)
def live_snapshot(_source: DataSource, source_key: str, window_s: float, tick: int, since: float | None,
                  now: float | None) -> dict:
    """Every query of one live refresh, shared by all viewers of the same window and run within one refresh
    period (`tick`), so ten open browsers cost the database what one does. Errors are not cached."""
    return _source.live_snapshot(window_s, since=since, now=now)


def live_panels(window_s: float, run_choice: str) -> None:
    """The Live page's panels, redrawn every refresh: one snapshot of the store for the selected run and window,
    then the tiles, hit rates, latency, traffic, endpoints, TTFT predictions and routing, in that order."""
    runs = _runs()  # resolved at every refresh: "current" follows a restart of the stack
    run = selected_run(run_choice, runs)
    current = run_choice == CURRENT_RUN
    since, until = run_bounds(run, current)
    try:
        snap = live_snapshot(source, source.description, window_s, int(time.time() // refresh_s), since, until)
    except SourceError as exc:
        show_source_error(exc)
        return
    summary = snap["summary"]
    state = D.traffic_state(summary, run["num_requests"] if run is not None else snap["total"])
    run_text = ("" if run is None else
                f"Run {run['run_id'] or '(before run ids)'}{' (current)' if current else ''}, since "
                f"{_clock(since)} · ")
    if state.kind != "live":
        _quiet_window(state, run, runs, run_text)
        return
    live, flow = source.router_live()  # the router's own /metrics only: never a URL named in span data
    # One computation for every figure of how requests spread (tile, header, fair-share line, table).
    shares = D.endpoint_shares(snap["ep_rows"], live)
    colors = _colors(list(shares.endpoints))  # endpoints only: a chart's legend lists every colour it is given
    st.caption(f"{run_text}window {window_label} ending {_clock(snap['now'])} · {summary['num_requests']:,} requests"
               f" · charts over the last {snap['span_s']:,.0f} s that hold data, in {snap['bucket_s']:g} s buckets")
    _summary_tiles(summary, snap["span_s"], shares)
    _hit_rate_panels(snap, colors)
    _latency_panels(snap)
    _traffic_panels(snap, colors, shares)
    _endpoint_panels(snap, live, shares, colors)
    tiers_panel.render(st, live)
    flow_panel.render(st, flow)
    prediction_panel(snap.get("ttft_pred"), colors)
    _routing_panels(snap)


def _quiet_window(state: D.TrafficState, run: dict | None, runs: list[dict], run_text: str) -> None:
    """What the Live page says instead of charts: no request ever (in this run), or none in the window."""
    if state.kind == "empty":
        if run is not None and len(runs) > 1:
            st.caption(f"{run_text}earlier runs: pick one under Run in the sidebar.")
        show_no_traffic(in_run=run is not None and len(runs) > 1)
        return
    holder = "This run holds" if run is not None else "The store holds"
    st.info(f"**No requests in the last {window_label}.** {holder} {state.num_requests_total:,} requests; "
            "pick a longer window in the sidebar, or send traffic.", icon=":material/bedtime:")


def _summary_tiles(summary: dict, span_s: float, shares: D.Shares) -> None:
    """Two rows of four tiles: at 1,280 px each tile has room for its whole label and value."""
    k = [*st.columns(4), *st.columns(4)]
    k[0].metric("Hit rate (actual)", T.format_ratio(summary["actual_hit_ratio"]),
                help="Server-reported cached prompt tokens / prompt tokens, over the window.")
    k[1].metric("Hit rate (predicted)", T.format_ratio(summary["predicted_hit_ratio"]),
                help="The router's estimate (prefix index), weighted by prompt tokens like the actual rate.")
    k[2].metric("TTFT p50", T.format_ms(summary["ttft_ms_p50"]), help="Time to first token at the gateway.")
    k[3].metric("TTFT p99", T.format_ms(summary["ttft_ms_p99"]))
    k[4].metric("Requests / s", f"{summary['num_requests'] / span_s:.2f}",
                help="Requests in the window / the part of the window that holds data (the charted span).")
    k[5].metric("Errors", T.format_ratio(summary["error_ratio"]), delta=f"{summary['num_errors']:,} requests",
                delta_color="off", delta_arrow="off",
                help="5xx, resets and failed requests (e.g. a stream cut short). Refusals are not errors.")
    k[6].metric("Refused", T.format_ratio(summary.get("refused_ratio")),
                delta=f"{summary.get('num_refused') or 0:,} requests", delta_color="off", delta_arrow="off",
                help="Requests refused with a 4xx (invalid input, unknown model, too large, not allowed): the "
                     "client's, counted apart from errors.")
    k[7].metric("Balance", D.format_balance(shares.balance_ratio),
                help=f"Busiest endpoint's share of the routed requests / fair share (1/N over the "
                     f"{len(shares.endpoints)} endpoints). 1.00× is perfectly even; N× is all on one endpoint.")


def _hit_rate_panels(snap: dict, colors: dict[str, str]) -> None:
    st.subheader("Prefix-cache hit rate")
    c1, c2 = st.columns(2)
    with c1:
        st.markdown("**Fleet: actual vs predicted**")
        frame = D.fleet_hit_frame(D.complete_buckets(snap["ts"], snap["bucket_s"], snap["now"]), snap["bucket_s"])
        if len(frame):
            _chart(C.fleet_hit(frame), "hit_fleet")
        else:
            _empty_note("no request reported token usage")
    with c2:
        st.markdown("**Per endpoint** (solid: actual, dashed: predicted)")
        frame = D.endpoint_hit_frame(D.complete_buckets(snap["ts_ep"], snap["bucket_s"], snap["now"]),
                                     snap["bucket_s"])
        if len(frame):
            _chart(C.endpoint_hit(frame, colors), "hit_endpoint")
        else:
            _empty_note("no request reported token usage")
    st.caption(f"Per {snap['bucket_s']:g} s bucket, up to the last complete one (the bucket still filling is left "
               "out: its few requests are not a rate).")


def _latency_panels(snap: dict) -> None:
    ts, bucket_s = snap["ts"], snap["bucket_s"]
    st.subheader("Latency")
    c1, c2, c3 = st.columns(3)
    with c1:
        st.markdown("**Time to first token**")
        _chart(C.percentiles(D.percentile_frame(ts, "ttft_ms", bucket_s), "TTFT (ms)"), "ttft_pct")
    with c2:
        st.markdown("**TTFT distribution**")
        frame = D.histogram_frame(snap["ttft_hist"])
        if len(frame):
            _chart(C.histogram(frame, "TTFT (ms)"), "ttft_hist")
        else:
            _empty_note("no TTFT recorded")
    with c3:
        st.markdown("**End-to-end latency**")
        _chart(C.percentiles(D.percentile_frame(ts, "latency_ms", bucket_s), "latency (ms)"), "latency_pct")


def _traffic_panels(snap: dict, colors: dict[str, str], shares: D.Shares) -> None:
    # The request rate also draws the unrouted requests, grey.
    rate_colors = {**colors, **({D.UNKNOWN_ENDPOINT: D.UNROUTED_COLOR} if shares.num_unrouted else {})}
    st.subheader("Traffic")
    c1, c2 = st.columns([2, 1])
    with c1:
        st.markdown("**Request rate by endpoint**")
        _chart(C.request_rate(D.rate_frame(snap["ts_ep"]), rate_colors), "rate")
    with c2:
        st.markdown("**Errors**")
        frame = D.error_frame(snap["ts"], snap["bucket_s"])
        if len(frame):
            _chart(C.errors(frame), "errors")
        else:
            st.success("No errors in this window.", icon=":material/check_circle:")


def _endpoint_panels(snap: dict, live: dict[str, EndpointLive], shares: D.Shares, colors: dict[str, str]) -> None:
    """The share and hit-rate bars per endpoint, and the endpoint tables (the window's requests; the live state)."""
    balance, in_flight = shares.balance_ratio, snap["in_flight"]
    st.subheader("Endpoints")
    ep_frame = D.endpoint_frame(snap["ep_rows"], mean_in_flight=in_flight, live=live, shares=shares)
    if shares.num_unrouted:
        with st.container(key="unrouted"):  # a stable CSS class (st-key-unrouted) for browser tests
            st.markdown(D.unrouted_sentence(shares, snap["summary"]["num_requests"]))
    c1, c2 = st.columns(2)
    with c1:
        st.markdown(f"**Share of routed requests** · balance {D.format_balance(balance)} "
                    f"({D.balance_verdict(balance)})")
        _chart(C.endpoint_share(ep_frame, colors, shares.fair_share_ratio), "share", C.bar_height(len(ep_frame)))
    with c2:
        st.markdown("**Hit rate per endpoint** (filled: actual, outlined: predicted)")
        _chart(C.endpoint_hit_bars(ep_frame, colors), "hit_bars", C.bar_height(len(ep_frame), 44))
    _endpoint_tables(ep_frame, colors)
    notes = []
    if in_flight is None:
        notes.append("mean in-flight needs the SQLite store (--db); the receiver API has no such query")
    if not live:
        notes.append("healthy / running / waiting / KV usage unavailable: " +
                     ("no --router-metrics-url configured" if not source.router_metrics_url else
                      f"the router's metrics at {source.router_metrics_url} did not answer"))
    st.caption("Hit: actual (server-reported cached / prompt tokens); predicted: the router's estimate. "
               "In-flight: time-averaged requests in flight over the charted span (from the stored start/end "
               "times). Healthy, running, waiting, KV usage: live, from the router's endpoint pool (its "
               "/metrics). Conversations: requests extending an earlier prompt that the router follows there; "
               "prefill load: its estimate of the endpoint's recent prefill utilisation, what a conversation's "
               "further turns are priced at (an endpoint under ~0.3 takes new conversations). Index: where the router learns what the endpoint caches (events: its KV events; feedback: "
               "its own picks corrected by the cached tokens responses report; approximate: its picks alone). "
               "Errors: 5xx and failed requests; refused: 4xx."
               + ("  \n" + _sentence("; ".join(notes)) if notes else ""))


def _endpoint_tables(ep_frame: pd.DataFrame, colors: dict[str, str]) -> None:
    """HTML tables (not the canvas grid): every cell's whole text is in the page, and two of them (the window's
    requests; the live state) so that each fits 1,280 px whole (the browser test measures it). Columns with no
    value at all (e.g. the live ones when the router's metrics cannot be read) are left out."""
    def endpoint_styler(table: pd.DataFrame) -> Styler:
        return table.style.hide(axis="index").apply(
            lambda col: [f"border-left: 6px solid {colors.get(v, '#ccc')}; overflow-wrap: anywhere" for v in col],
            subset=["endpoint"])

    with st.container(key="endpoint-table"):
        st.table(endpoint_styler(T.endpoint_table(ep_frame)))
    live_table = T.endpoint_table(ep_frame, T.LIVE_TABLE_COLUMNS)
    if len(live_table.columns) > 1:
        with st.container(key="endpoint-live-table"):
            st.markdown("**Live, from the router's endpoint pool**")
            st.table(endpoint_styler(live_table))


def _routing_panels(snap: dict) -> None:
    summary, reason_rows = snap["summary"], snap["reason_rows"]
    st.subheader("Routing")
    c1, c2, c3 = st.columns(3)
    with c1:
        st.markdown("**Decisions by reason**")
        _chart(C.reasons(D.reasons_frame(reason_rows)), "reasons", C.bar_height(len(reason_rows)))
    with c2:
        st.markdown("**Reasons over time**")
        _chart(C.reasons_over_time(D.reasons_time_frame(snap["reason_ts"])), "reasons_time")
    st.caption("Reasons: affinity (sent where most of its prefix is cached); cold (no endpoint holds its prefix); "
               "spill (its prefix is cached elsewhere, sent to a less loaded endpoint); load (placed by load: no "
               "prefix to match, or a partial holder); failover (retried after an endpoint failed); policy (a "
               "policy that does not match prefixes); unrouted (only the gateway's record arrived: the router was "
               "down or restarting); none (no routing decision: refused before one, for bad input, shedding or no ready "
               "endpoint).")
    with c3:
        st.markdown(f"**Decision time** · p50 {T.format_us(summary['decision_us_p50'])} · "
                    f"p99 {T.format_us(summary['decision_us_p99'])}")
        routing = [summary.get(f"routing_ms_{p}") for p in ("p50", "p99")]
        if routing[0] is not None:  # Envoy's clock, on the facts path: what the whole routing hop added
            st.caption(f"Routing delay (Envoy: request end to upstream start) · p50 "
                       f"{T.format_us(routing[0] * 1000)} · p99 {T.format_us(routing[1] * 1000)}")
        frame = D.histogram_frame(snap["decision_hist"])
        if len(frame):
            _chart(C.histogram(frame, "decision time (µs)", "#b07aa1"), "decision_hist")
        else:
            _empty_note("no decision times recorded")


def prediction_panel(result: dict | None, colors: dict[str, str]) -> None:
    """Predicted vs actual TTFT per endpoint: does the time model behind the decisions match what happened?"""
    st.subheader("Predicted vs actual TTFT per endpoint")
    state = D.prediction_state(result)
    with st.container(key="ttft-predictions"):  # a stable CSS class (st-key-ttft-predictions) for browser tests
        if state.kind == "unavailable":
            st.info(f"**TTFT predictions unavailable.** The receiver at {source.url} does not serve them (a version "
                    "older than this dashboard); upgrade it to see this panel.", icon=":material/info:")
            return
        if state.kind == "none":
            st.info(f"**No TTFT predictions in the last {window_label}.** No decision in this window carried a "
                    "predicted TTFT: the routing policy has no time model, so there is nothing to compare with the "
                    "measured TTFT.", icon=":material/info:")
            return
        if state.kind == "uncomparable":
            st.info(f"**{state.num_predicted:,} decisions carried a predicted TTFT, none can be scored yet.** A "
                    "prediction is compared only on a request that succeeded on the primary it was made for.",
                    icon=":material/info:")
            return
        fleet = result["fleet"]
        frame = D.prediction_frame(result)
        k = st.columns(4)
        k[0].metric("TTFT error (median)", T.format_ratio(fleet.get("ape_ratio_p50")),
                    help="How far the router's predicted TTFT was from the measured one: median absolute "
                         "percentage error |actual - predicted| / actual over the requests scored.")
        k[1].metric("Predicted TTFT p50", T.format_ms(fleet.get("predicted_ttft_ms_p50")))
        k[2].metric("Actual TTFT p50", T.format_ms(fleet.get("actual_ttft_ms_p50")),
                    help="Measured, over the same requests as the predicted p50.")
        k[3].metric("Requests with a prediction", f"{state.num_compared:,}",
                    delta=f"of {state.num_predicted:,} predicted", delta_color="off", delta_arrow="off",
                    help="Scored here: requests whose decision predicted a TTFT and that succeeded on the endpoint "
                         "the prediction was for. Of all the decisions that carried a prediction (the second "
                         "figure), the others failed, were refused or were served by a fallback endpoint.")
        c1, c2 = st.columns(2)
        with c1:
            st.markdown("**Median TTFT per endpoint** (filled: actual, outlined: predicted)")
            _chart(C.prediction_bars(D.prediction_long(frame), colors), "ttft_pred", C.bar_height(len(frame), 44))
        with c2:
            st.markdown("**Per endpoint**")
            st.table(T.prediction_table(frame))
        st.caption("Per endpoint: requests whose decision predicted a TTFT there and that it served successfully; "
                   "median predicted and median actual TTFT of those requests; median absolute percentage error "
                   "|actual - predicted| / actual; median bias (actual - predicted) / predicted (above 0: slower "
                   "than predicted); median predicted TTFT at the best alternative the decision scored.")


# --- Requests page ------------------------------------------------------------------------------------
RECENT_LIMIT = 100


def requests_table(run_choice: str) -> None:
    run = selected_run(run_choice, _runs())
    try:
        # One run's requests (a run stored before run ids has none to filter on: all of them then).
        rows = source.query(lambda q: q.recent_requests(
            RECENT_LIMIT, run_id=run["run_id"] if run is not None and run["run_id"] else None))
    except SourceError as exc:
        show_source_error(exc)
        return
    if not rows:
        show_no_traffic()
        return
    frame = D.recent_frame(rows)
    shown_before = st.session_state.get("recent_shown", [])
    version = st.session_state.setdefault("recent_table_version", 0)
    key = f"recent_table_{version}"
    event = st.dataframe(frame, key=key, hide_index=True, on_select="rerun", selection_mode="single-row",
                         height=420, column_config={
                             "time": st.column_config.DatetimeColumn("time (UTC)", format="HH:mm:ss.SSS"),
                             "ttft_ms": st.column_config.NumberColumn(
                                 "TTFT (ms)", format="%.1f", help="Time to first token, by the clock in the next "
                                 "column."),
                             "timing_source": st.column_config.TextColumn(
                                 "TTFT clock", help="Whose clock measured TTFT and latency: envoy (the gateway's "
                                 "record of the request: first token byte from the server) or router (no gateway "
                                 "record arrived: the router's own timing)."),
                             "router_ttft_ms": st.column_config.NumberColumn(
                                 "router's TTFT (ms)", format="%.1f", help="The router's own measurement (when its "
                                 "event loop saw the first token; tens of ms late under load). Equal to TTFT when "
                                 "the clock is router."),
                             "predicted_ttft_ms": st.column_config.NumberColumn("predicted TTFT (ms)",
                                                                                format="%.1f"),
                             "alternative_endpoint": st.column_config.TextColumn(
                                 "alternative", width="medium", help="The best other endpoint the decision scored, and its "
                                 "predicted TTFT in the next column."),
                             "alternative_ttft_ms": st.column_config.NumberColumn("alternative TTFT (ms)",
                                                                                  format="%.1f"),
                             "gateway_wait_ms": st.column_config.NumberColumn("gateway wait (ms)", format="%.1f"),
                             "gateway_outcome": st.column_config.TextColumn("gateway queue"),
                             "latency_ms": st.column_config.NumberColumn("latency (ms)", format="%.1f"),
                             "hit_ratio": st.column_config.NumberColumn("hit (actual)", format="percent"),
                             "predicted_hit_ratio": st.column_config.NumberColumn("hit (predicted)",
                                                                                  format="percent"),
                             "decision_us": st.column_config.NumberColumn("decision (µs)", format="%.0f"),
                             "routing_ms": st.column_config.NumberColumn("routing delay (ms)", format="%.2f"),
                             "prompt_tokens": st.column_config.NumberColumn("prompt tokens", format="%d"),
                             "cached_tokens": st.column_config.NumberColumn("cached tokens", format="%d"),
                         })
    selected = list(event.selection.rows)
    if selected:
        # The click refers to the rows the user saw (the previous refresh), not the ones just queried.
        idx = selected[0]
        seen = shown_before if idx < len(shown_before) else list(frame["trace_id"])
        st.session_state["pending_trace_id"] = seen[idx]  # applied before the text input is drawn
        st.session_state["recent_table_version"] = version + 1  # a fresh table: no stale selection
        st.session_state["recent_shown"] = list(frame["trace_id"])
        st.rerun()
    st.session_state["recent_shown"] = list(frame["trace_id"])
    st.caption(f"The {len(frame)} newest requests as of {_clock(time.time())}. Select a row for its trace.")


def request_detail() -> None:
    if "pending_trace_id" in st.session_state:
        st.session_state["trace_id"] = st.session_state.pop("pending_trace_id")
    trace_id = st.text_input("Trace id", key="trace_id", placeholder="32 hex characters, or select a row above")
    if not trace_id:
        return
    try:
        req = source.query(lambda q: q.request(trace_id.strip().lower()))
    except SourceError as exc:
        show_source_error(exc)
        return
    if req is None:
        st.warning(f"No request with trace id `{trace_id}` in the store (retention may have removed it).")
        return
    c = st.columns(3) + st.columns(3)  # two rows: endpoint names and token counts fit without truncation
    c[0].metric("Endpoint", req.get("endpoint") or "–")
    c[1].metric("Reason", req.get("reason") or "–")
    c[2].metric("Status", str(req.get("status")))
    c[3].metric("TTFT", T.format_ms(req.get("ttft_ms")))
    c[4].metric("Latency", T.format_ms(req.get("latency_ms")))
    prompt, cached = req.get("prompt_tokens"), req.get("cached_tokens")
    c[5].metric("Cached / prompt tokens", f"{cached if cached is not None else '–'} / "
                                          f"{prompt if prompt is not None else '–'}")
    left, right = st.columns(2)
    with left:
        st.markdown("**Request record**")
        record = {k: v for k, v in req.items() if k != "attrs"}
        record["start_time_utc"] = dt.datetime.fromtimestamp(req["start_time"], dt.timezone.utc).isoformat()
        st.json(record, expanded=True)
    with right:
        st.markdown("**Trace attributes** (span + resource)")
        st.json(req.get("attrs") or {}, expanded=True)


# --- Benchmarks page ----------------------------------------------------------------------------------
@st.cache_data(show_spinner=False, max_entries=64)
def _load_bench(path: str, mtime_s: float) -> BR.BenchResult:  # mtime in the key: a rewritten file reloads
    return BR.load_bench_result(path)


def benchmarks_page() -> None:
    st.title("Benchmarks")
    roots = BR.bench_roots(cfg.bench_dir)
    paths = [p for root in roots for p in BR.find_bench_results(root)]
    if not paths:
        st.info(f"**No benchmark results in {' or '.join(f'`{r}`' for r in roots)}.** Run one (it writes "
                f"`results.json` under `{roots[-1]}`), then press Reload:", icon=":material/bar_chart:")
        st.code("prefixroute bench --workload shared-prompts --routers prefixroute:random,prefixroute:prefix",
                language="bash")
        st.button("Reload", key="bench_reload")
        return
    results, skipped = [], []
    for p in paths:
        try:
            results.append(_load_bench(p, os.path.getmtime(p)))
        except (OSError, ValueError) as exc:
            skipped.append((p, exc if isinstance(exc, ValueError) else ValueError(f"{p}: {exc}")))
    if skipped:  # said once, small: the committed sweeps are not errors
        with st.expander(BR.skipped_summary(skipped)):
            st.caption("  \n".join(str(exc) for _, exc in skipped))
    if not results:
        return
    labels = [r.label for r in results]
    choice = st.selectbox("Results", range(len(results)), format_func=lambda i: labels[i], key="bench_choice")
    res = results[choice]
    st.caption(f"{res.path} · written {_clock(res.mtime_s)} · workload "
               + ", ".join(f"{k}={v}" for k, v in res.workload.items() if not isinstance(v, (dict, list))))
    frame = BR.bench_frame(res)
    c1, c2 = st.columns(2)
    with c1:
        st.markdown("**Hit rate by router** (server-reported cached / prompt tokens)")
        _chart(C.bench_hit(frame, res.upper_bound_hit_ratio), "bench_hit", C.bar_height(len(frame)))
    with c2:
        st.markdown("**TTFT by router**")
        _chart(C.bench_ttft(BR.bench_ttft_long(frame)), "bench_ttft", C.bar_height(len(frame), 54))
    st.dataframe(frame, key="bench_table", hide_index=True, column_config={
        "hit_ratio": st.column_config.NumberColumn("hit rate", format="percent"),
        "ttft_ms_p50": st.column_config.NumberColumn("TTFT p50 (ms)", format="%.1f"),
        "ttft_ms_p90": st.column_config.NumberColumn("TTFT p90 (ms)", format="%.1f"),
        "ttft_ms_p99": st.column_config.NumberColumn("TTFT p99 (ms)", format="%.1f"),
        "e2e_ms_p50": st.column_config.NumberColumn("e2e p50 (ms)", format="%.0f"),
        "throughput_rps": st.column_config.NumberColumn("req/s", format="%.2f"),
        "balance_ratio": st.column_config.NumberColumn("balance (max/fair)", format="%.2f×"),
    })
    st.button("Reload", key="bench_reload")


# --- dispatch -----------------------------------------------------------------------------------------
if page == "Live":
    st.title("Prefix-aware routing: live")
    st.fragment(live_panels, run_every=refresh_s)(window_s, run_choice)
elif page == "Requests":
    st.title("Recent requests")
    live_table = st.toggle("Live updates", value=True, key="recent_live",
                           help="Turn off to hold the table still while reading it.")
    st.fragment(requests_table, run_every=cfg.refresh_s if live_table else None)(run_choice)
    st.subheader("Request trace")
    request_detail()
else:
    benchmarks_page()

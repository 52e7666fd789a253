"""Altair chart builders: frames from data.py in, `alt.Chart` out (no Streamlit, no I/O).

Every chart: units in axis titles, times on a UTC axis with `labelOverlap` so ticks never collide,
endpoint colours from `data.endpoint_colors` (one mapping per refresh, shared by all charts), legends
at the bottom with a column limit so long endpoint names wrap instead of squeezing the plot.
"""

from __future__ import annotations

from collections.abc import Mapping

import altair as alt
import pandas as pd

from prefixroute.dashboard.data import ERROR_COLOR, HIT_KIND_DASH, PERCENTILE_COLORS

HEIGHT = 260
_TIME_AXIS = alt.Axis(format="%H:%M:%S", labelOverlap=True, labelAngle=0, tickCount=6, title="time (UTC)",
                       labelBound=True)  # a tick label near the right edge is hidden, not cut by the chart


def bar_height(num_bars: int, per_bar_px: int = 36) -> int:
    """Element height for a horizontal bar chart: room for each bar's label plus the x axis."""
    return max(C_MIN_BAR_HEIGHT, 70 + per_bar_px * num_bars)


C_MIN_BAR_HEIGHT = 150


def _x_time() -> alt.X:
    return alt.X("time:T", axis=_TIME_AXIS, scale=alt.Scale(type="utc"))


def _legend(title: str | None = None, columns: int = 4) -> alt.Legend:
    # On top, one compact row: Streamlit fits the whole chart (legend included) into the given height,
    # so a tall bottom legend would squash the plot.
    return alt.Legend(orient="top", title=title, columns=columns, labelLimit=240, symbolLimit=0, padding=0,
                      offset=4)


def endpoint_scale(colors: Mapping[str, str]) -> alt.Scale:
    return alt.Scale(domain=list(colors), range=list(colors.values()))


def _pct_axis(title: str) -> alt.Axis:
    return alt.Axis(format=".0%", title=title, tickCount=5)


def fleet_hit(frame: pd.DataFrame) -> alt.Chart:
    """Actual (solid) vs predicted (dashed) fleet hit ratio per bucket."""
    return (alt.Chart(frame, height=HEIGHT).mark_line(point=alt.OverlayMarkDef(size=18), interpolate="linear")
            .encode(x=_x_time(),
                    y=alt.Y("hit_ratio:Q", axis=_pct_axis("hit rate"),
                            scale=alt.Scale(domain=[0, 1])),
                    color=alt.Color("kind:N", scale=alt.Scale(domain=["actual", "predicted"],
                                                              range=["#4e79a7", "#9c755f"]),
                                    legend=_legend(None)),
                    strokeDash=alt.StrokeDash("kind:N", scale=alt.Scale(domain=list(HIT_KIND_DASH),
                                                                        range=list(HIT_KIND_DASH.values())),
                                              legend=None),
                    detail="segment:N",  # data.segments: no line across a stretch without data
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "kind:N",
                             alt.Tooltip("hit_ratio:Q", format=".1%")]))


def endpoint_hit(frame: pd.DataFrame, colors: Mapping[str, str]) -> alt.Chart:
    """Per-endpoint actual (solid) and predicted (dashed) hit ratio, endpoint colours."""
    return (alt.Chart(frame, height=HEIGHT).mark_line(interpolate="linear", point=alt.OverlayMarkDef(size=14))
            .encode(x=_x_time(),
                    y=alt.Y("hit_ratio:Q", axis=_pct_axis("hit rate"),
                            scale=alt.Scale(domain=[0, 1])),
                    # Two per row: a half-width chart at 1,280 px fits two endpoint names, not three.
                    color=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=_legend(None, 2)),
                    strokeDash=alt.StrokeDash("kind:N", scale=alt.Scale(domain=list(HIT_KIND_DASH),
                                                                        range=list(HIT_KIND_DASH.values())),
                                              legend=None),  # the panel title says solid/dashed
                    detail=["kind:N", "segment:N"],
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "endpoint:N", "kind:N",
                             alt.Tooltip("hit_ratio:Q", format=".1%")]))


def percentiles(frame: pd.DataFrame, title: str) -> alt.Chart:
    """p50/p90/p99 lines of a latency in milliseconds."""
    domain = list(PERCENTILE_COLORS)
    return (alt.Chart(frame, height=HEIGHT).mark_line(point=alt.OverlayMarkDef(size=14))
            .encode(x=_x_time(),
                    y=alt.Y("value_ms:Q", title=title, axis=alt.Axis(tickCount=5)),
                    color=alt.Color("percentile:N", scale=alt.Scale(domain=domain,
                                                                    range=[PERCENTILE_COLORS[p] for p in domain]),
                                    legend=_legend(None)),
                    detail="segment:N",
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "percentile:N",
                             alt.Tooltip("value_ms:Q", format=",.1f", title="ms")]))


def histogram(frame: pd.DataFrame, x_title: str, color: str = "#4e79a7") -> alt.Chart:
    """Bars from SQL-binned counts (bin_start..bin_end)."""
    return (alt.Chart(frame, height=HEIGHT).mark_bar(color=color, opacity=0.85)
            .encode(x=alt.X("bin_start:Q", title=x_title, bin="binned", axis=alt.Axis(labelOverlap=True)),
                    x2="bin_end:Q",
                    y=alt.Y("num_requests:Q", title="requests"),
                    tooltip=[alt.Tooltip("bin_start:Q", title="from", format=",.1f"),
                             alt.Tooltip("bin_end:Q", title="to", format=",.1f"), "num_requests:Q"]))


def request_rate(frame: pd.DataFrame, colors: Mapping[str, str]) -> alt.Chart:
    """Requests per second per bucket, stacked by endpoint."""
    return (alt.Chart(frame, height=HEIGHT).mark_bar(opacity=0.9)
            .encode(x=_x_time(),
                    y=alt.Y("requests_per_s:Q", title="requests / s", stack="zero"),
                    color=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=_legend(None)),
                    order=alt.Order("endpoint:N"),
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "endpoint:N",
                             alt.Tooltip("requests_per_s:Q", format=".2f", title="req/s")]))


def errors(frame: pd.DataFrame) -> alt.Chart:
    return (alt.Chart(frame, height=HEIGHT).mark_bar(color=ERROR_COLOR)
            .encode(x=_x_time(), y=alt.Y("errors_per_s:Q", title="errors / s"),
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"),
                             alt.Tooltip("errors_per_s:Q", format=".2f", title="errors/s")]))


def endpoint_share(frame: pd.DataFrame, colors: Mapping[str, str], fair_share_ratio: float | None = None
                   ) -> alt.LayerChart:
    """Share of the routed requests per endpoint (horizontal bars) with the fair share as a rule: `fair_share_ratio`
    (data.Shares: 1/N over the fleet's N endpoints), by default 1/rows."""
    n = 1.0 / fair_share_ratio if fair_share_ratio else max(1, len(frame))
    bars = (alt.Chart(frame).mark_bar()
            .encode(y=alt.Y("endpoint:N", title=None, sort=list(colors), axis=alt.Axis(labelLimit=220)),
                    x=alt.X("share_ratio:Q", axis=_pct_axis("share of requests"),
                            scale=alt.Scale(domain=[0, max(1.0 / n * 2, float(frame["share_ratio"].max() or 0))])),
                    color=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=None),
                    tooltip=["endpoint:N", alt.Tooltip("share_ratio:Q", format=".1%"), "num_requests:Q"]))
    fair = pd.DataFrame({"fair": [1.0 / n], "label": [f"fair share {100.0 / n:.1f} %"]})
    rule = alt.Chart(fair).mark_rule(color="#555", strokeDash=[4, 3]).encode(x="fair:Q")
    text = alt.Chart(fair).mark_text(align="left", dx=4, dy=-6, color="#555", baseline="bottom").encode(
        x="fair:Q", y=alt.value(0), text="label:N")
    return alt.layer(bars, rule, text)


def endpoint_hit_bars(frame: pd.DataFrame, colors: Mapping[str, str]) -> alt.LayerChart:
    """Per endpoint over the window: actual hit rate (solid bar) and predicted (outlined bar) side by side, each
    with its value."""
    long = frame.melt(id_vars=["endpoint"], value_vars=["actual_hit_ratio", "predicted_hit_ratio"],
                      var_name="kind", value_name="hit_ratio").dropna(subset=["hit_ratio"])
    long["kind"] = long["kind"].str.replace("_hit_ratio", "", regex=False)
    # Each bar's value at its end, inside the chart (at least 14% along, so a short bar's label stays readable).
    long["label_x"] = long["hit_ratio"].clip(lower=0.14)
    y = alt.Y("endpoint:N", title=None, sort=list(colors), axis=alt.Axis(labelLimit=220))
    y_offset = alt.YOffset("kind:N", sort=["actual", "predicted"])
    bars = (alt.Chart(long).mark_bar(strokeWidth=1.5)
            .encode(y=y, yOffset=y_offset,
                    x=alt.X("hit_ratio:Q", axis=_pct_axis("hit rate"), scale=alt.Scale(domain=[0, 1])),
                    color=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=None),
                    fillOpacity=alt.FillOpacity("kind:N", scale=alt.Scale(domain=["actual", "predicted"],
                                                                          range=[0.9, 0.15]),
                                                legend=alt.Legend(orient="top", title=None)),
                    stroke=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=None),
                    tooltip=["endpoint:N", "kind:N", alt.Tooltip("hit_ratio:Q", format=".1%")]))
    values = (alt.Chart(long).mark_text(align="right", dx=-3, fontSize=11, color="#222")
              .encode(y=y, yOffset=y_offset, x=alt.X("label_x:Q", scale=alt.Scale(domain=[0, 1])),
                      text=alt.Text("hit_ratio:Q", format=".0%")))
    return alt.layer(bars, values)


def prediction_bars(frame_long: pd.DataFrame, colors: Mapping[str, str]) -> alt.Chart:
    """Per endpoint over the window: median actual TTFT (solid bar) and median predicted TTFT of the same
    requests (outlined bar) side by side, as `endpoint_hit_bars` draws hit rates."""
    return (alt.Chart(frame_long).mark_bar(strokeWidth=1.5)
            .encode(y=alt.Y("endpoint:N", title=None, sort=list(colors), axis=alt.Axis(labelLimit=220)),
                    yOffset=alt.YOffset("kind:N", sort=["actual", "predicted"]),
                    x=alt.X("ttft_ms:Q", title="median TTFT (ms)"),
                    color=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=None),
                    fillOpacity=alt.FillOpacity("kind:N", scale=alt.Scale(domain=["actual", "predicted"],
                                                                          range=[0.9, 0.15]),
                                                legend=alt.Legend(orient="top", title=None)),
                    stroke=alt.Color("endpoint:N", scale=endpoint_scale(colors), legend=None),
                    tooltip=["endpoint:N", "kind:N", alt.Tooltip("ttft_ms:Q", format=",.1f", title="median ms")]))


def reasons(frame: pd.DataFrame) -> alt.Chart:
    return (alt.Chart(frame).mark_bar(color="#4e79a7")
            .encode(y=alt.Y("reason:N", title=None, sort="-x"),
                    x=alt.X("num_requests:Q", title="decisions (requests)"),
                    tooltip=["reason:N", "num_requests:Q", alt.Tooltip("share_ratio:Q", format=".1%")]))


REASON_COLORS = {"affinity": "#59a14f", "cold": "#76b7b2", "spill": "#f28e2b", "failover": "#e15759",
                 "load": "#4e79a7", "policy": "#b07aa1", "none": "#bab0ac"}


def reasons_over_time(frame: pd.DataFrame) -> alt.Chart:
    present = set(frame["reason"])
    # Fixed colours per reason, legend limited to the reasons present.
    domain = [r for r in REASON_COLORS if r in present] + sorted(present - set(REASON_COLORS))
    rng = [REASON_COLORS.get(r, "#7f7f7f") for r in domain]
    return (alt.Chart(frame, height=HEIGHT).mark_bar()
            .encode(x=_x_time(),
                    y=alt.Y("share_ratio:Q", axis=_pct_axis("share"), stack="normalize"),
                    color=alt.Color("reason:N", scale=alt.Scale(domain=domain, range=rng), legend=_legend(None, 3)),
                    tooltip=[alt.Tooltip("time:T", format="%H:%M:%S"), "reason:N", "num_requests:Q"]))


def bench_hit(frame: pd.DataFrame, upper_bound: float | None) -> alt.LayerChart:
    bars = (alt.Chart(frame).mark_bar(color="#59a14f")
            .encode(y=alt.Y("router:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
                    x=alt.X("hit_ratio:Q", axis=_pct_axis("hit rate"),
                            scale=alt.Scale(domain=[0, 1])),
                    tooltip=["router:N", alt.Tooltip("hit_ratio:Q", format=".1%")]))
    # Value labels inside the bar ends, so they never collide with the upper-bound rule.
    layers: list[alt.Chart] = [bars, bars.mark_text(align="right", dx=-4, fontWeight="bold").encode(
        text=alt.Text("hit_ratio:Q", format=".1%"), color=alt.value("white"))]
    if upper_bound is not None:
        ub = pd.DataFrame({"ub": [upper_bound], "label": [f"upper bound {upper_bound * 100:.1f} %"]})
        layers.append(alt.Chart(ub).mark_rule(color="#333", strokeDash=[4, 3]).encode(x="ub:Q"))
        layers.append(alt.Chart(ub).mark_text(align="right", dx=-4, dy=-4, baseline="bottom", color="#333")
                      .encode(x="ub:Q", y=alt.value(0), text="label:N"))
    return alt.layer(*layers)


def bench_ttft(frame_long: pd.DataFrame) -> alt.Chart:
    domain = list(PERCENTILE_COLORS)
    return (alt.Chart(frame_long).mark_bar()
            .encode(y=alt.Y("router:N", title=None, sort=None, axis=alt.Axis(labelLimit=260)),
                    yOffset=alt.YOffset("percentile:N", sort=domain),
                    x=alt.X("value_ms:Q", title="TTFT (ms)"),
                    color=alt.Color("percentile:N", scale=alt.Scale(domain=domain,
                                                                    range=[PERCENTILE_COLORS[p] for p in domain]),
                                    legend=_legend(None)),
                    tooltip=["router:N", "percentile:N", alt.Tooltip("value_ms:Q", format=",.1f")]))

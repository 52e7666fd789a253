"""The Live page's gateway-queue panel (flow control): what the router holds now per priority class
and by how many flows (tenants or clients), how many it held, released (by what freed capacity) and shed (by
reason and status), the mean wait of held requests and the saturation signal, from the router's /metrics
(`router_metrics.FlowLive`)."""

from __future__ import annotations

import pandas as pd

from prefixroute.dashboard.router_metrics import FlowLive


def queue_frame(flow: FlowLive) -> pd.DataFrame:
    """One row per priority class with requests held now and the flows holding them, highest priority first."""
    rows = [{"priority": p, "flows": int(flow.flows.get(p, 0)), "held now": int(n)} for p, n in flow.queue.items()]
    rows.sort(key=lambda r: -_int(r["priority"]))
    return pd.DataFrame(rows, columns=["priority", "flows", "held now"])


def counts_text(flow: FlowLive) -> str:
    """The counters as one line: held / admitted at once, released by reason, shed by reason and code."""
    released = ", ".join(f"{k} {int(v):,}" for k, v in sorted(flow.released.items()) if v) or "none"
    shed = ", ".join(f"{r} ({c}) {int(v):,}" for (r, c), v in sorted(flow.shed.items()) if v) or "none"
    return (f"Since the router started: {int(flow.num_held_total):,} held, {int(flow.num_admitted_total):,} admitted "
            f"at once; released: {released}; shed: {shed}; clients that left while held: "
            f"{int(flow.num_dropped_total):,}.")


def saturation_text(flow: FlowLive) -> str:
    if flow.saturation is None:
        return "n/a"
    if flow.saturation == float("inf"):
        return "no healthy endpoint"
    return f"{flow.saturation:.2f}" + (" (saturated)" if flow.saturation >= 1.0 else "")


def render(st, flow: FlowLive | None) -> None:  # noqa: ANN001 - the streamlit module
    """Draw the panel (nothing when the router exports no flow figures)."""
    if flow is None:
        return
    st.subheader("Gateway queue")
    c1, c2, c3 = st.columns(3)
    c1.metric("Held now", f"{int(flow.num_held):,}")
    wait = flow.mean_wait_s
    c2.metric("Mean wait of held requests", "n/a" if wait is None else f"{wait:.2f} s")
    c3.metric("Saturation signal", saturation_text(flow))
    frame = queue_frame(flow)
    if len(frame):
        st.dataframe(frame, hide_index=True)
    st.caption(counts_text(flow) + " Saturation: the least loaded endpoint's load over its bound (>= 1: no "
               "endpoint could start a request soon, so new requests are held).")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0

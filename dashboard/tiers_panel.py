"""The Live page's KV-tier panel: each endpoint's hit ratio by tier -- prompt tokens found on its GPU,
loaded from its host-memory (CPU) tier, computed -- from the server's own prefix-cache counters as the router's
pool last scraped them (``prefixroute_endpoint_prefix_cache_tokens_total{endpoint,kind}``, read through the
router's /metrics like the other live columns: `router_metrics.EndpointLive`). The counters run since each
server started, so the ratios are over its lifetime, not the page's window. Beside them, the router's own
prediction by tier for the requests it routed there (``prefixroute_predicted_tier_hit_tokens_total``, since the
router started): where the two part, the router's view of the tiers is off. Shown only when some endpoint
reports a CPU-tier hit (a fleet without offloading has nothing to split)."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from prefixroute.dashboard.router_metrics import EndpointLive

COLUMNS = ["endpoint", "GPU hit", "CPU-tier hit", "computed", "prompt tokens", "predicted GPU hit",
           "predicted CPU-tier hit"]


def tier_frame(live: Mapping[str, EndpointLive]) -> pd.DataFrame:
    """One row per endpoint that reports its prefix-cache counters, by endpoint name: the shares of its queried
    prompt tokens found on the GPU, loaded from the CPU tier and computed (they sum to 1), and the tokens
    queried, then the router's predicted shares by tier (None where it predicted none: no tier-aware events
    index, or no usage reported yet). Endpoints that queried nothing yet are left out."""
    rows = []
    for ep in sorted(live):
        f = live[ep]
        q = f.queried_tokens
        if not q or q <= 0:
            continue
        gpu = min(1.0, max(0.0, (f.gpu_hit_tokens or 0.0) / q))
        cpu = min(1.0 - gpu, max(0.0, (f.cpu_hit_tokens or 0.0) / q))
        n = f.predicted_prompt_tokens
        pred = n is not None and n > 0
        rows.append({"endpoint": ep, "GPU hit": gpu, "CPU-tier hit": cpu, "computed": 1.0 - gpu - cpu,
                     "prompt tokens": int(q),
                     "predicted GPU hit": min(1.0, (f.predicted_gpu_tokens or 0.0) / n) if pred else None,
                     "predicted CPU-tier hit": min(1.0, (f.predicted_cpu_tokens or 0.0) / n) if pred else None})
    return pd.DataFrame(rows, columns=COLUMNS)


def has_tiers(frame: pd.DataFrame) -> bool:
    """Whether any endpoint served prompt tokens from a CPU tier."""
    return bool(len(frame)) and bool((frame["CPU-tier hit"] > 0).any())


def render(st, live: Mapping[str, EndpointLive]) -> None:  # noqa: ANN001 - the streamlit module
    """Draw the panel (nothing without a CPU-tier hit anywhere)."""
    frame = tier_frame(live)
    if not has_tiers(frame):
        return
    st.subheader("KV tiers")
    total = frame["prompt tokens"].sum()
    fleet = {c: float((frame[c] * frame["prompt tokens"]).sum() / total) for c in ("GPU hit", "CPU-tier hit")}
    st.markdown(f"**Hit ratio by tier per endpoint** · fleet: GPU {fleet['GPU hit']:.1%}, CPU tier "
                f"{fleet['CPU-tier hit']:.1%}")
    long = frame.melt(id_vars=["endpoint"], value_vars=["GPU hit", "CPU-tier hit", "computed"], var_name="tier",
                      value_name="share of prompt tokens")
    st.bar_chart(long, x="endpoint", y="share of prompt tokens", color="tier", horizontal=True, stack=True)
    st.dataframe(frame.style.format({"GPU hit": "{:.1%}", "CPU-tier hit": "{:.1%}", "computed": "{:.1%}",
                                     "prompt tokens": "{:,}", "predicted GPU hit": "{:.1%}",
                                     "predicted CPU-tier hit": "{:.1%}"}, na_rep="-"), hide_index=True)
    st.caption("From each server's own counters (vllm:prefix_cache_queries / _hits, "
               "vllm:external_prefix_cache_hits), since it started: GPU hit = prompt tokens found in its GPU "
               "prefix cache; CPU-tier hit = loaded from its host-memory tier (vLLM --kv-offloading-size); "
               "computed = the rest. Predicted = what the router expected each tier to serve for the requests it "
               "routed there since it started (its KV-events view at each pick); far from the served shares, the "
               "router's view of the tiers is off.")

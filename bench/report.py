"""Write a bench run's outputs: results.json, report.md (table + ratios vs random) and PNG plots.

Plots use matplotlib's Agg backend (no display): ``ttft_cdf.png`` (TTFT CDF per router),
``hit_ratio.png`` (hit ratio per router with the upper bounds as lines: infinite cache, Belady MIN at the
fleet's capacity) and ``endpoint_share.png``
(share of requests per endpoint per router, with the fair share as a line). The per-request TTFTs for
the CDF come from the caller (results.json keeps only percentiles).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib (the [bench] extra) is imported when the plots are drawn
    from matplotlib.axes import Axes

PLOT_FILES = ("ttft_cdf.png", "hit_ratio.png", "endpoint_share.png")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def baseline_run(runs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The run to compare against: our gateway's random policy, else any router named ``*random``."""
    for name in ("prefixroute:random",):
        for r in runs:
            if r["router"] == name:
                return r
    return next((r for r in runs if r["router"].endswith("random")), None)


def target_checks(doc: Mapping[str, Any], ours: str = "prefixroute:prefix") -> list[tuple[str, str, bool]]:
    """The design targets for `ours`, as (target, measured, met). Only the targets this document can judge:
    vs random (P50 TTFT at least 80% lower, hit ratio above 90% of the upper bound, no endpoint above 1.5x its
    fair share) and vs sglang-router (hit ratio and P90 TTFT at least as good)."""
    runs = {r["router"]: r for r in doc["runs"]}
    me = runs.get(ours)
    if me is None:
        return []
    out: list[tuple[str, str, bool]] = []
    base = baseline_run(doc["runs"])
    if base is not None and base is not me and me["ttft_ms"]["p50"] is not None and base["ttft_ms"]["p50"]:
        r = me["ttft_ms"]["p50"] / base["ttft_ms"]["p50"]
        out.append(("P50 TTFT at least 80% below random", f"{(r - 1):+.0%} ({r:.2f}x)", r <= 0.2))
    ub = doc.get("upper_bound_hit_ratio")
    if ub and me["hit_ratio"] is not None:
        out.append(("hit ratio above 90% of the upper bound", f"{me['hit_ratio'] / ub:.0%}",
                    me["hit_ratio"] >= 0.9 * ub))
    share = (me.get("extra") or {}).get("max_share_over_fair")
    if share is not None:
        out.append(("no endpoint above 1.5x its fair share", f"{share:.2f}x", share <= 1.5))
    peer = runs.get("sglang-router")
    if peer is not None:
        if me["hit_ratio"] is not None and peer["hit_ratio"] is not None:
            out.append(("hit ratio at least sglang-router's", f"{me['hit_ratio']:.3f} vs {peer['hit_ratio']:.3f}",
                        me["hit_ratio"] >= peer["hit_ratio"]))
        if me["ttft_ms"]["p90"] is not None and peer["ttft_ms"]["p90"] is not None:
            out.append(("P90 TTFT at most sglang-router's",
                        f"{me['ttft_ms']['p90']:.1f} vs {peer['ttft_ms']['p90']:.1f} ms",
                        me["ttft_ms"]["p90"] <= peer["ttft_ms"]["p90"]))
    return out


PRECISE_HIT_GAIN = 1.25
"""Design target: the events-driven index's hit ratio at least 1.25x approximate's and sglang-router's."""
PRECISE_P90_RATIO = 0.8
"""Design target: its P90 TTFT at most 0.8x both of theirs."""
PREDICTION_TOLERANCE = 0.03
"""Design target: the router's predicted hit ratio within 3 points of the actual one."""


def _find_run(runs: Mapping[str, Mapping[str, Any]], *names: str) -> Mapping[str, Any] | None:
    return next((runs[n] for n in names if n in runs), None)


def index_source_checks(doc: Mapping[str, Any], policy: str = "prefix") -> list[tuple[str, str, bool]]:
    """The index sources' design targets, as (target, measured, met), for the runs this document has: the events-driven index
    (``prefixroute:POLICY@events``, else ``prefixroute:POLICY`` when the fleet published events: the gateway's
    auto source then uses them) against ``@approximate`` and sglang-router (hit ratio >= 1.25x, P90 TTFT <= 0.8x
    each), ``@feedback`` between approximate and events (hit ratio and P90), and every run of ours that reports
    predicted and actual hit ratios (router /metrics): within 3 points."""
    runs = {r["router"]: r for r in doc["runs"]}
    base = f"prefixroute:{policy}"
    events = _find_run(runs, f"{base}@events")
    if events is None and (doc.get("workload") or {}).get("kv_events"):
        events = _find_run(runs, base, f"{base}@auto")
    approx = _find_run(runs, f"{base}@approximate")
    feedback = _find_run(runs, f"{base}@feedback")
    out: list[tuple[str, str, bool]] = []

    def hit(r: Mapping[str, Any] | None) -> float | None:
        return None if r is None else r.get("hit_ratio")

    def p90(r: Mapping[str, Any] | None) -> float | None:
        return None if r is None else (r.get("ttft_ms") or {}).get("p90")

    if events is not None:
        for other in (approx, runs.get("sglang-router")):
            if other is None:
                continue
            me, them = hit(events), hit(other)
            if me is not None and them is not None:
                out.append((f"{events['router']} hit ratio >= {PRECISE_HIT_GAIN}x {other['router']}'s",
                            f"{me:.3f} vs {them:.3f} ({_ratio(me, them)})",
                            me >= PRECISE_HIT_GAIN * them))
            me, them = p90(events), p90(other)
            if me is not None and them is not None:
                out.append((f"{events['router']} P90 TTFT <= {PRECISE_P90_RATIO}x {other['router']}'s",
                            f"{me:.1f} vs {them:.1f} ms ({_ratio(me, them)})", me <= PRECISE_P90_RATIO * them))
        if feedback is not None and approx is not None:
            lo, mid, hi = hit(approx), hit(feedback), hit(events)
            if None not in (lo, mid, hi):
                out.append((f"{feedback['router']} hit ratio between approximate's and events'",
                            f"{lo:.3f} <= {mid:.3f} <= {hi:.3f}", lo <= mid <= hi))
            lo, mid, hi = p90(events), p90(feedback), p90(approx)
            if None not in (lo, mid, hi):
                out.append((f"{feedback['router']} P90 TTFT between events' and approximate's",
                            f"{lo:.1f} <= {mid:.1f} <= {hi:.1f} ms", lo <= mid <= hi))
    for r in doc["runs"]:
        rm = (r.get("extra") or {}).get("router_metrics") or {}
        pred, act = rm.get("predicted_hit_ratio"), rm.get("actual_hit_ratio")
        if pred is not None and act is not None:
            out.append((f"{r['router']} predicted hit ratio within {PREDICTION_TOLERANCE * 100:.0f} points of actual",
                        f"{pred:.3f} vs {act:.3f} ({(pred - act) * 100:+.1f} points)",
                        abs(pred - act) <= PREDICTION_TOLERANCE + 1e-9))
    return out


GOODPUT_NOTE = (
    "goodput = requests served with their first token within the deadline, per second of the run (a shed or "
    "failed request misses it); met deadline = their share of all requests; shed = requests refused for load "
    "(429/503) and, on the virtual fleet, how many of them were false: they met their deadline when the same "
    "requests were replayed with the queue holding but never shedding (and, second figure, with no gateway "
    "queue at all).")


def goodput_text(extra: Mapping[str, Any]) -> str:
    """'RPS | RATIO (deadline D s)' of a run's ``extra.goodput`` (two table cells); '- | -' without one."""
    g = extra.get("goodput")
    if not g:
        return "- | -"
    ratio = "-" if g["met_ratio"] is None else f"{g['met_ratio']:.1%}"
    return f"{g['rps']:.2f} | {ratio} (<= {g['deadline_s']:g} s)"


def shed_text(extra: Mapping[str, Any]) -> str:
    """A run's sheds, with the false ones when they were judged: '12 (false 0)'; '0' when none."""
    n = extra.get("num_shed", 0)
    fs = extra.get("false_sheds")
    if not fs:
        return str(n)
    unqueued = f", {fs['num_false_unqueued']} with no queue" if "num_false_unqueued" in fs else ""
    return f"{n} (false {fs['num_false']}{unqueued})"


def _counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if v) or "-"


def render_flow_counts(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The gateway queue's counters of each run of ours with flow control (a real run: the router's /metrics
    scraped at the end, `runner.parse_router_metrics`'s ``flow``; a virtual run: the queue's own, ``extra.flow``);
    no lines when none has them."""
    return flow_count_lines([(r["router"], ((r.get("extra") or {}).get("router_metrics") or {}).get("flow")
                              or (r.get("extra") or {}).get("flow")) for r in runs])


def flow_count_lines(rows: Sequence[tuple[str, Mapping[str, Any] | None]]) -> list[str]:
    """The gateway-queue table of (label, flow counters or None) rows (those with None left out); no lines when
    none has counters. Shared by report.md and a real sweep's report.md (label: load and router)."""
    rows = [(name, f) for name, f in rows if f]
    if not rows:
        return []
    lines = ["Gateway queue (flow control; a real run: the router's /metrics at its end; a virtual run: the queue's "
             "own counters):", "",
             "| router | admitted at once | held | released (by event) | shed (by reason) | held by bound | dropped | "
             "predicted late (by decision) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in rows:
        lines.append(f"| {name} | {f['num_admitted']} | {f['num_held']} | {_counts_text(f['released'])} | "
                     f"{_counts_text(f['shed'])} | {_counts_text(f['held_by_bound'])} | {f['num_dropped']} | "
                     f"{_counts_text(f.get('predicted_late') or {})} |")
    return lines + ["", "predicted late = arrivals whose predicted wait passed their deadline: shed (the prediction "
                    "had been right on recent requests) or held (it had not).", ""]


def _agents(run: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return (run.get("extra") or {}).get("agents")


def agent_baselines(runs: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The agents workload's two random baselines: (for TTFT and hit ratio) a random run that sent every turn,
    i.e. the chat form, our gateway's first; (for follow-up success) a random run over the Responses API (no
    affinity: about 1 - 1/N of follow-ups land where the previous response is not). Either may be None."""
    rand = [r for r in runs if _agents(r) is not None and r.get("extra", {}).get("policy") == "random"]
    rand.sort(key=lambda r: not r["router"].startswith("prefixroute:"))
    chat = next((r for r in rand if _agents(r)["api"] == "chat"), None)
    resp = next((r for r in rand if _agents(r)["api"] == "responses"), None)
    return chat, resp


AGENT_TTFT_RATIO = 0.2
"""Design target: P50 TTFT per turn at least 80% below random."""
AGENT_BOUND_RATIO = 0.95
"""Design target: hit ratio within 5% of the upper bound."""


def agent_checks(doc: Mapping[str, Any], ours: str = "prefixroute:prefix") -> list[tuple[str, str, bool]]:
    """The design targets for `ours` (the agents workload), as (target, measured, met): every follow-up served
    (none "not found"), the random Responses baseline failing follow-ups (shown, judged against ~1/N served),
    P50 TTFT of every turn at most 0.2x random's (the chat-form random run, which sends every turn), hit ratio
    at least 95% of the infinite-cache bound."""
    runs = {r["router"]: r for r in doc["runs"]}
    me = runs.get(ours)
    if me is None or _agents(me) is None:
        return []
    a = _agents(me)
    out: list[tuple[str, str, bool]] = []
    if a["follow_ups_sent"] or a["follow_ups_not_sent"]:
        out.append((f"{ours} ({a['api']}): every follow-up served, 0 not found",
                    f"{a['follow_ups_served']}/{a['follow_ups_sent'] + a['follow_ups_not_sent']} served, "
                    f"{a['not_found']} not found",
                    a["follow_ups_served"] == a["follow_ups_sent"] + a["follow_ups_not_sent"]))
    chat_base, resp_base = agent_baselines(doc["runs"])
    if resp_base is not None and resp_base is not me:
        b = _agents(resp_base)
        n = len(resp_base.get("endpoint_share") or {}) or None
        ratio = b["follow_up_success_ratio"]
        out.append((f"{resp_base['router']} (Responses, no affinity) fails about {1 - 1 / n:.0%} of follow-ups"
                    if n else f"{resp_base['router']} fails follow-ups",
                    f"{b['follow_ups_served']}/{b['follow_ups_sent']} served ({_fmt(ratio, 2)}), "
                    f"{b['not_found']} not found, {b['follow_ups_not_sent']} not sent",
                    ratio is not None and n is not None and ratio <= 1.5 / n))
    if chat_base is not None and chat_base is not me:
        mine, theirs = a["ttft_ms_by_turn"], _agents(chat_base)["ttft_ms_by_turn"]
        ratios = {t: mine[t]["p50"] / theirs[t]["p50"] for t in mine
                  if t in theirs and mine[t]["p50"] is not None and theirs[t]["p50"]}
        if ratios:
            worst = max(ratios.values())
            out.append((f"P50 TTFT of every turn at least 80% below {chat_base['router']}",
                        ", ".join(f"turn {t}: {(r - 1):+.0%}" for t, r in sorted(ratios.items(), key=lambda x: int(x[0]))),
                        worst <= AGENT_TTFT_RATIO and len(ratios) == len(mine)))
    ub = doc.get("upper_bound_hit_ratio")
    if ub and me["hit_ratio"] is not None:
        out.append(("hit ratio within 5% of the upper bound", f"{me['hit_ratio']:.3f} vs {ub:.3f} "
                    f"({me['hit_ratio'] / ub:.1%})", me["hit_ratio"] >= AGENT_BOUND_RATIO * ub))
    return out


def render_agents(doc: Mapping[str, Any]) -> list[str]:
    """The agents workload's section of report.md (and of the printed table): per router the API it was sent,
    follow-up success, TTFT overall and P50 per turn, hit ratio against the bound, ratios against random; then
    the design targets. Empty for other workloads."""
    runs = [r for r in doc["runs"] if _agents(r) is not None]
    if not runs:
        return []
    ub = doc.get("upper_bound_hit_ratio")
    turns = sorted({int(t) for r in runs for t in _agents(r)["ttft_ms_by_turn"]})
    chat_base, _ = agent_baselines(doc["runs"])
    base_turns = _agents(chat_base)["ttft_ms_by_turn"] if chat_base is not None else {}
    lines = ["Agents (tool-calling conversations; turn 0 = instructions + task, then one tool output per turn; "
             "follow-ups continue the previous response over the Responses API, or resend the whole chat "
             "conversation over chat):", ""]
    head = ["router", "API", "follow-ups served / sent", "success", "not found", "not sent", "TTFT p50 ms", "p90",
            "p99", "hit ratio", "of bound"] + [f"turn {t} p50 ms" for t in turns]
    if base_turns:
        head += [f"turn {t} p50 vs {chat_base['router']}" for t in turns]
    lines += ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for r in runs:
        a = _agents(r)
        hr = r["hit_ratio"]
        row = [r["router"], a["api"], f"{a['follow_ups_served']} / {a['follow_ups_sent']}",
               _fmt(a["follow_up_success_ratio"], 3), str(a["not_found"]), str(a["follow_ups_not_sent"]),
               _fmt(a["ttft_ms"]["p50"]), _fmt(a["ttft_ms"]["p90"]), _fmt(a["ttft_ms"]["p99"]), _fmt(hr, 3),
               f"{hr / ub:.1%}" if hr is not None and ub else "-"]
        by = a["ttft_ms_by_turn"]
        row += [_fmt((by.get(str(t)) or {}).get("p50")) for t in turns]
        if base_turns:
            row += [_ratio((by.get(str(t)) or {}).get("p50"), (base_turns.get(str(t)) or {}).get("p50"))
                    for t in turns]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "success = follow-ups answered 200 / follow-ups sent; not found = answered 404 (the endpoint "
              "does not hold the previous response); not sent = follow-ups of a conversation whose earlier turn "
              "failed (a Responses follow-up needs the previous response id). TTFT over successful requests.", ""]
    checks = agent_checks(doc)
    if checks:
        lines += ["Design targets for prefixroute:prefix (agents):", "", "| target | measured | met |",
                  "| --- | --- | --- |"]
        lines += [f"| {t} | {m} | {'yes' if ok else 'NO'} |" for t, m, ok in checks] + [""]
    return lines


def render_bounds(bounds: Mapping[str, Any] | None) -> list[str]:
    """The report's lines about the workload's bounds (`upper_bound.fleet_bounds`); empty without them."""
    if not bounds:
        return []
    lines = [f"Working set: {bounds['working_set_blocks']:,} distinct KV blocks of {bounds['block_tokens']} tokens, "
             f"{bounds['shared_working_set_blocks']:,} of them referenced by two requests or more."]
    if bounds.get("capacity_blocks"):
        shared = bounds["shared_working_set_blocks"]
        lines.append(f"Fleet KV capacity: {bounds['num_servers']} x {bounds['num_gpu_blocks']:,} = "
                     f"{bounds['capacity_blocks']:,} blocks ({bounds['num_gpu_blocks_source']}), "
                     f"{bounds['capacity_blocks'] / shared:.0%} of the shared working set."
                     if shared else "")
        lines.append(f"Upper bound at fleet capacity (Belady MIN on one cache of {bounds['capacity_blocks']:,} "
                     f"blocks): hit ratio {_fmt(bounds['belady_hit_ratio'], 3)}; for reference, one pooled LRU "
                     f"cache of that size: {_fmt(bounds['lru_pooled_hit_ratio'], 3)}.")
    if bounds.get("gpu_cpu_capacity_blocks"):
        lines.append(f"With the CPU tier ({bounds['num_servers']} x {bounds['num_cpu_blocks']:,} host blocks): Belady "
                     f"MIN on one cache of {bounds['gpu_cpu_capacity_blocks']:,} blocks (GPU + CPU): hit ratio "
                     f"{_fmt(bounds['belady_gpu_cpu_hit_ratio'], 3)}; one pooled LRU of that size: "
                     f"{_fmt(bounds['lru_pooled_gpu_cpu_hit_ratio'], 3)}.")
    if bounds.get("note"):
        lines.append(bounds["note"])
    return [" ".join(x for x in lines if x), ""]


def render_bounds_by_router(runs: Sequence[Mapping[str, Any]], bounds: Mapping[str, Any] | None) -> list[str]:
    """Each router's hit ratio beside the capacity bounds: one pooled LRU and Belady MIN at the fleet's GPU
    capacity, and at GPU + CPU capacity when the servers have a CPU tier. Empty without capacity bounds."""
    if not bounds or not bounds.get("belady_hit_ratio"):
        return []
    cols = [("pooled LRU (GPU)", "lru_pooled_hit_ratio"), ("MIN (GPU)", "belady_hit_ratio")]
    if bounds.get("belady_gpu_cpu_hit_ratio"):
        cols += [("pooled LRU (GPU+CPU)", "lru_pooled_gpu_cpu_hit_ratio"),
                 ("MIN (GPU+CPU)", "belady_gpu_cpu_hit_ratio")]
    tiered = any("hit_ratio_by_tier" in (r.get("extra") or {}) for r in runs)
    lines = ["Bounds beside each router (hit ratio; in brackets the router's share of the gap from pooled LRU to "
             "MIN at the same capacity that it closed):", "",
             "| router | hit ratio | " + ("GPU / CPU tier | " if tiered else "")
             + " | ".join(f"{name} {_fmt(bounds.get(key), 3)}" for name, key in cols) + " |",
             "| --- " * (2 + tiered + len(cols)) + "|"]
    for r in runs:
        hr = r["hit_ratio"]
        cells = []
        if tiered:
            t = (r.get("extra") or {}).get("hit_ratio_by_tier") or {}
            pred = t.get("predicted")
            cells.append((f"{_fmt(t.get('gpu'), 3)} / {_fmt(t.get('cpu'), 3)}"
                          + (f" (predicted {_fmt(pred['gpu'], 3)} / {_fmt(pred['cpu'], 3)})" if pred else ""))
                         if t else "-")
        for name, key in cols:
            v = bounds.get(key)
            if hr is None or not v:
                cells.append("-")
            elif key.startswith("belady"):
                lru = bounds.get(key.replace("belady", "lru_pooled"))
                gap = f" ({(hr - lru) / (v - lru):+.0%} of gap)" if lru is not None and v > lru else ""
                cells.append(f"{hr / v:.0%} of it{gap}")
            else:
                cells.append(f"{hr / v:.2f}x")
        lines.append(f"| {r['router']} | {_fmt(hr, 3)} | " + " | ".join(cells) + " |")
    return lines + [""]


CPU_ROLES = ("router", "envoy", "servers", "client", "other")


def render_cpu(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The CPU each kind of process took per request while the requests ran (runner.process_cpu_s), one row per
    run that measured it; nothing when none did."""
    rows = [(r["router"], (r.get("extra") or {}).get("cpu_ms_per_request")) for r in runs]
    rows = [(name, cpu) for name, cpu in rows if cpu]
    if not rows:
        return []
    lines = ["CPU per request while the requests ran, ms of all cores (router: the router's own processes, our "
             "ext_proc replicas or the peer's; envoy: our gateway's Envoy; servers: the model servers, /metrics "
             "scrapes and KV events included; client: the load generator):", "",
             "| router | " + " | ".join(CPU_ROLES) + " | all | host busy |", "| --- " * (len(CPU_ROLES) + 3) + "|"]
    for (name, cpu), r in zip(rows, (r for r in runs if (r.get("extra") or {}).get("cpu_ms_per_request"))):
        busy = (r.get("extra") or {}).get("host_cpu_busy_ratio")
        lines.append(f"| {name} | " + " | ".join(_fmt(cpu.get(k, 0.0), 2) for k in CPU_ROLES)
                     + f" | {_fmt(sum(cpu.values()), 2)} | {'-' if busy is None else f'{busy:.0%}'} |")
    return lines + [""]


def render_paired(doc: Mapping[str, Any]) -> list[str]:
    """The request-by-request TTFT comparison (results.paired_ttft), when the document has one."""
    paired = doc.get("paired_ttft")
    if not paired or not paired.get("runs"):
        return []
    ref = paired["reference"]
    lines = [f"TTFT request by request against {ref} (the same requests; diff = the router's TTFT minus {ref}'s, "
             "ms: a difference far below the spread of TTFTs shows here, as it does not in percentiles):", "",
             "| router | requests both served | diff p25 | median | p75 | slower on | same endpoint |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in paired["runs"].items():
        same = p.get("same_endpoint_ratio")
        lines.append(f"| {name} | {p['num_requests']} | {p['p25_diff_ms']:+.2f} | {p['median_diff_ms']:+.2f} | "
                     f"{p['p75_diff_ms']:+.2f} | {p['slower_ratio']:.0%} | {'-' if same is None else f'{same:.0%}'} |")
    return lines + [""]


def render_markdown(doc: Mapping[str, Any], command: str = "") -> str:
    """report.md: workload, upper bound, one table row per run, ratios vs random where present."""
    wl = doc["workload"]
    ub = doc.get("upper_bound_hit_ratio")
    runs = doc["runs"]
    base = baseline_run(runs)
    lines = ["# Benchmark report", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    params = ", ".join(f"{k}={v}" for k, v in wl.items() if not isinstance(v, (dict, list)))
    bounds = doc.get("bounds") or {}
    min_ub = bounds.get("belady_hit_ratio")
    lines += [f"Workload: {params}", "",
              f"Upper bound (one infinite cache): hit ratio {_fmt(ub, 3)}", ""]
    lines += render_bounds(bounds)
    lines.append("| router | requests | errors | hit ratio | of upper bound | of MIN bound | TTFT p50 ms | p90 | p99 | "
                 "ITL p50 ms | p99 | E2E p50 ms | p99 | req/s | goodput req/s | met deadline | shed | "
                 "max share / fair | TTFT p50 vs random | TTFT p90 vs random |")
    lines.append("| --- " * 20 + "|")
    for r in runs:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        hr = r["hit_ratio"]
        of_ub = f"{hr / ub:.0%}" if hr is not None and ub else "-"
        of_min = f"{hr / min_ub:.0%}" if hr is not None and min_ub else "-"
        max_share = (r.get("extra") or {}).get("max_share_over_fair")
        vs50 = _ratio(t["p50"], base["ttft_ms"]["p50"]) if base is not None else "-"
        vs90 = _ratio(t["p90"], base["ttft_ms"]["p90"]) if base is not None else "-"
        lines.append(f"| {r['router']} | {r['requests']} | {r['errors']} | {_fmt(hr, 3)} | {of_ub} | {of_min} | "
                     f"{_fmt(t['p50'])} | {_fmt(t['p90'])} | {_fmt(t['p99'])} | {_fmt(i['p50'], 2)} | "
                     f"{_fmt(i['p99'], 2)} | {_fmt(e['p50'])} | {_fmt(e['p99'])} | {_fmt(r['throughput_rps'], 2)} | "
                     f"{goodput_text(r.get('extra') or {})} | {shed_text(r.get('extra') or {})} | "
                     f"{_fmt(max_share, 2)} | {vs50} | {vs90} |")
    lines += ["", "hit ratio = server-reported cached prompt tokens / prompt tokens; of MIN bound = of Belady's "
              "optimal eviction on one cache of the fleet's KV capacity; max share / fair = the "
              "busiest endpoint's share of requests over 1/num_endpoints; ratios < 1 are better than random.",
              "", GOODPUT_NOTE, ""]
    lines += render_paired(doc)
    lines += render_bounds_by_router(runs, bounds)
    lines += render_cpu(runs)
    lines += render_agents(doc)
    sourced = [r for r in runs if "index_source" in (r.get("extra") or {})]
    if sourced:
        lines += [f"Prefix-index sources (servers publishing KV events: "
                  f"{'yes' if (doc.get('workload') or {}).get('kv_events') else 'no'}):", "",
                  "| router | index source | predicted hit ratio | actual hit ratio (router) | difference |",
                  "| --- | --- | --- | --- | --- |"]
        for r in sourced:
            ex = r["extra"]
            rm = ex.get("router_metrics") or {}
            pred, act = rm.get("predicted_hit_ratio"), rm.get("actual_hit_ratio")
            per_ep = rm.get("index_source_by_endpoint")
            src = ex["index_source"] + (f" ({', '.join(sorted(set(per_ep.values())))} in use)" if per_ep else "")
            diff = f"{(pred - act) * 100:+.1f} points" if pred is not None and act is not None else "-"
            lines.append(f"| {r['router']} | {src} | {_fmt(pred, 3)} | {_fmt(act, 3)} | {diff} |")
        lines.append("")
    lines += render_flow_counts(runs)
    checks_index = index_source_checks(doc)
    if checks_index:
        lines += ["Design targets (index sources):", "", "| target | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {t} | {m} | {'yes' if ok else 'NO'} |" for t, m, ok in checks_index] + [""]
    checks = target_checks(doc)
    if checks:
        lines += ["Design targets for prefixroute:prefix (the 80%-below-random target applies at a load where "
                  "random routing queues):", "", "| target | measured | met |", "| --- | --- | --- |"]
        lines += [f"| {t} | {m} | {'yes' if ok else 'NO'} |" for t, m, ok in checks] + [""]
    skipped = doc.get("skipped") or {}
    if skipped:
        lines += ["Skipped routers:", ""] + [f"- {k}: {v}" for k, v in skipped.items()] + [""]
    lines += ["Plots: " + ", ".join(f"![{p}]({p})" for p in PLOT_FILES), ""]
    return "\n".join(lines)


def plot(out_dir: Path, doc: Mapping[str, Any], ttfts_ms: Mapping[str, Sequence[float]]) -> list[Path]:
    """Write the three PNGs (`PLOT_FILES`: TTFT CDF, hit ratio, endpoint share); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws: dict[str, Callable[[Axes], None]] = {
        PLOT_FILES[0]: lambda ax: _plot_ttft_cdf(ax, doc, ttfts_ms),
        PLOT_FILES[1]: lambda ax: _plot_hit_ratio(ax, doc),
        PLOT_FILES[2]: lambda ax: _plot_endpoint_share(ax, doc),
    }
    paths = []
    for name, draw in draws.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax)
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _plot_ttft_cdf(ax: Axes, doc: Mapping[str, Any], ttfts_ms: Mapping[str, Sequence[float]]) -> None:
    import numpy as np

    for name in (r["router"] for r in doc["runs"]):
        vals = np.sort(np.asarray(ttfts_ms.get(name, ()), dtype=float))
        if len(vals):
            ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=name)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per router")
    if any(len(v) for v in ttfts_ms.values()):
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)


def _plot_hit_ratio(ax: Axes, doc: Mapping[str, Any]) -> None:
    """One bar per router, with the infinite-cache upper bound (dashed) and Belady's MIN at fleet capacity."""
    runs = doc["runs"]
    names = [r["router"] for r in runs]
    ratios = [(r["hit_ratio"] or 0.0) * 100 for r in runs]
    ax.bar(range(len(names)), ratios, color="tab:blue")
    ub = doc.get("upper_bound_hit_ratio")
    if ub is not None:
        ax.axhline(ub * 100, color="tab:red", linestyle="--", label=f"upper bound {ub * 100:.1f}%")
    min_ub = (doc.get("bounds") or {}).get("belady_hit_ratio")
    if min_ub is not None:
        ax.axhline(min_ub * 100, color="tab:orange", linestyle=":",
                   label=f"Belady MIN at fleet capacity {min_ub * 100:.1f}%")
    if ub is not None or min_ub is not None:
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("prefix-cache hit ratio (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.set_title("KV-cache hit ratio per router")


def _plot_endpoint_share(ax: Axes, doc: Mapping[str, Any]) -> None:
    """Grouped bars (router x endpoint) with the fair share; beyond 16 endpoints, too many bars to read: per
    router, the shares sorted from busiest to idlest endpoint."""
    runs = doc["runs"]
    names = [r["router"] for r in runs]
    endpoints = sorted({e for r in runs for e in r["endpoint_share"]})
    if len(endpoints) > 16:
        for r in runs:
            shares = sorted(r["endpoint_share"].values(), reverse=True)
            ax.plot(range(1, len(shares) + 1), [v * 100 for v in shares], label=r["router"])
        ax.axhline(100 / len(endpoints), color="black", linestyle=":", label="fair share")
        ax.set_xlabel("endpoint rank (busiest first)")
        ax.set_ylabel("share of requests (%)")
        ax.set_title("Requests per endpoint")
        ax.legend(fontsize=8)
        return
    width = 0.8 / max(1, len(endpoints))
    for k, e in enumerate(endpoints):
        ax.bar([i + k * width for i in range(len(names))], [r["endpoint_share"].get(e, 0.0) * 100 for r in runs],
               width=width, label=e)
    if endpoints:
        ax.axhline(100 / len(endpoints), color="black", linestyle=":", label="fair share")
        ax.legend(fontsize=7, ncol=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of requests (%)")
    ax.set_title("Requests per endpoint")


def write_outputs(out_dir: str | Path, doc: Mapping[str, Any], ttfts_ms: Mapping[str, Sequence[float]],
                  command: str = "") -> dict[str, Path]:
    """Write results.json, report.md and the plots into out_dir (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_files(out, doc, render_markdown(doc, command), lambda: plot(out, doc, ttfts_ms))


def write_files(out: Path, doc: Mapping[str, Any], markdown: str, plots: Callable[[], list[Path]]
                ) -> dict[str, Path]:
    """`out`/results.json (`doc`), `out`/report.md (`markdown`) and the files `plots()` draws (skipped, with a
    note on stderr, without matplotlib); returns the paths by stem. `out` must exist."""
    files = {"results": out / "results.json", "report": out / "report.md"}
    files["results"].write_text(json.dumps(doc, indent=2) + "\n")
    files["report"].write_text(markdown)
    try:
        paths = plots()
    except ImportError as exc:  # matplotlib comes with the [bench] extra; the numbers do not need it
        print(f"no plots: {exc} (pip install 'prefixroute[bench]')", file=sys.stderr)
        paths = []
    for p in paths:
        files[p.stem] = p
    return files

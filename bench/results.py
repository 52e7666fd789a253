"""Metrics arithmetic: per-request results -> one run's summary, and the results.json document.

Definitions (pure functions, no I/O):
- ``hit_ratio`` = sum of server-reported ``cached_tokens`` / sum of ``prompt_tokens`` over successful
  requests; None when no successful request reported cached_tokens (the server lacks prompt details).
- percentiles: numpy's linear interpolation between closest ranks (``np.percentile`` default) over
  successful requests; ITL percentiles pool every gap of every successful request. None when empty.
- ``throughput_rps`` = successful requests / (last successful finish - first start of any request).
- ``endpoint_share`` = successful requests served by an endpoint / successful requests with a known
  endpoint; every configured endpoint is listed (0.0 if it served nothing), unknown ones are added.
- ``errors`` counts every recorded failure (HTTP status != 200, stream error, timeout, deadline).
- a request *met its deadline* when it was served (200) with a TTFT at most the deadline (`DEADLINE_S`: flow
  control's default deadline_s, the same for every router of a run, ours or a peer); a shed or failed request
  missed it. ``extra.goodput`` = {``deadline_s``, ``num_met``, ``met_ratio`` = num_met / requests, ``rps`` =
  num_met / (last finish of a served request - first start of any request)}.
- a *false shed* (`false_sheds`, virtual fleet only, where the counterfactual is known): a request shed (429 or
  503) that met its deadline in a replay of the same request sequence on the same fleet with shedding off.

The run dict has exactly the keys below plus ``extra`` (additional figures: token totals, duration,
max share over fair share, error kinds), so consumers of this shape are unaffected.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from prefixroute.bench.client import RequestResult

DEADLINE_S = 30.0
"""The deadline goodput judges against: flow control's default deadline_s (a request is shed past it), so a
router without a gateway queue is judged by the deadline our queue sheds by."""

RUN_KEYS = ("router", "requests", "errors", "hit_ratio", "ttft_ms", "itl_ms", "e2e_ms", "throughput_rps",
            "endpoint_share")


def percentiles(values: Sequence[float], qs: Iterable[int]) -> dict[str, float | None]:
    """{"p50": x, ...} with linear interpolation; values None when `values` is empty."""
    qs = tuple(qs)
    if len(values) == 0:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": round(float(v), 3) for q, v in zip(qs, np.percentile(arr, qs))}


def hit_ratio(results: Sequence[RequestResult]) -> float | None:
    ok = [r for r in results if r.ok and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    if not ok or prompt == 0:
        return None
    return round(sum(r.cached_tokens or 0 for r in ok) / prompt, 6)


def throughput_rps(results: Sequence[RequestResult]) -> float:
    ok = [r for r in results if r.ok and r.e2e_ms is not None]
    if not ok:
        return 0.0
    first = min(r.start_s for r in results)
    last = max(r.start_s + r.e2e_ms / 1000.0 for r in ok)
    return round(len(ok) / (last - first), 3) if last > first else 0.0


def endpoint_share(results: Sequence[RequestResult], endpoints: Sequence[str] = ()) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter(r.endpoint for r in results if r.ok and r.endpoint)
    total = sum(counts.values())
    names = list(endpoints) + sorted(e for e in counts if e not in set(endpoints))
    return {e: round(counts.get(e, 0) / total, 6) if total else 0.0 for e in names}


def is_shed(r: RequestResult) -> bool:
    """The router (or server) refused the request for load: 429 (queue, deadline) or 503 (no endpoint)."""
    return r.status in (429, 503)


def met_deadline(r: RequestResult, deadline_s: float = DEADLINE_S) -> bool:
    """Served, with its first token within `deadline_s` of its start (module doc)."""
    return r.ok and r.ttft_ms is not None and r.ttft_ms <= deadline_s * 1000.0


def goodput(results: Sequence[RequestResult], deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """``{deadline_s, num_met, met_ratio, rps}`` (module doc); ratio None and rps 0 with no results."""
    met = sum(1 for r in results if met_deadline(r, deadline_s))
    ends = [r.start_s + r.e2e_ms / 1000.0 for r in results if r.ok and r.e2e_ms is not None]
    span = max(ends) - min(r.start_s for r in results) if ends else 0.0
    return {"deadline_s": deadline_s, "num_met": met,
            "met_ratio": round(met / len(results), 4) if results else None,
            "rps": round(met / span, 3) if span > 0 else 0.0}


def false_sheds(results: Sequence[RequestResult], unshed: Sequence[RequestResult],
                deadline_s: float = DEADLINE_S, unqueued: Sequence[RequestResult] | None = None) -> dict[str, Any]:
    """Sheds of `results` judged against `unshed`, the same request sequence replayed with shedding off
    (matched by request index): ``{num_shed, num_false, false_ratio}``, a false shed being one that met its
    deadline there (`met_deadline`); ``false_ratio`` = num_false / num_shed (None with no sheds). Also
    ``num_needed``: sheds that missed their deadline there too (the shed saved the client a late answer). With
    `unqueued` (the same requests with no gateway queue at all, each sent to an engine at once),
    ``num_false_unqueued``: the sheds that met their deadline there."""
    other = {r.index: r for r in unshed}
    shed = [r for r in results if is_shed(r)]
    false = sum(1 for r in shed if r.index in other and met_deadline(other[r.index], deadline_s))
    out = {"num_shed": len(shed), "num_false": false, "num_needed": len(shed) - false,
           "false_ratio": round(false / len(shed), 4) if shed else None}
    if unqueued is not None:
        plain = {r.index: r for r in unqueued}
        out["num_false_unqueued"] = sum(1 for r in shed if r.index in plain and met_deadline(plain[r.index],
                                                                                           deadline_s))
    return out


BLOCK_TOKENS = 16
"""The servers' KV block size (the tier prediction's unit)."""


def hit_ratio_by_tier(ok: Sequence[RequestResult]) -> dict[str, Any]:
    """``{"hit_ratio_by_tier": {"gpu": r, "cpu": r}}`` (cached prompt tokens from each tier / prompt tokens) when
    the requests know their CPU-tier hits (the virtual fleet's servers with ``--kv-offloading-size``); else {}."""
    known = [r for r in ok if r.cpu_cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in known)
    cpu = sum(r.cpu_cached_tokens or 0 for r in known)
    if not known or not prompt or not cpu:
        return {}
    gpu = sum(r.cached_tokens or 0 for r in known) - cpu
    out: dict[str, Any] = {"gpu": round(gpu / prompt, 6), "cpu": round(cpu / prompt, 6)}
    pred = [r for r in known if r.predicted_tier_blocks is not None]
    if pred:  # the router's prediction at its pick, in the server's accounting (whole blocks, n - 1 tokens at most)
        p_prompt = sum(r.prompt_tokens for r in pred)
        p_gpu = p_cpu = 0
        for r in pred:
            g, c = r.predicted_tier_blocks  # type: ignore[misc]
            cap = max(0, (r.prompt_tokens - 1) // BLOCK_TOKENS)
            g = min(g, cap)
            p_gpu += g * BLOCK_TOKENS
            p_cpu += min(c, cap - g) * BLOCK_TOKENS
        out["predicted"] = {"gpu": round(p_gpu / p_prompt, 6), "cpu": round(p_cpu / p_prompt, 6)}
    return {"hit_ratio_by_tier": out}


def summarize_run(router: str, results: Sequence[RequestResult], endpoints: Sequence[str] = (),
                  extra: Mapping[str, Any] | None = None, deadline_s: float = DEADLINE_S) -> dict[str, Any]:
    """One entry of results.json ``runs`` (see module doc for every definition; `deadline_s` is goodput's)."""
    ok = [r for r in results if r.ok]
    share = endpoint_share(results, endpoints)
    fair = 1.0 / len(share) if share else 0.0
    error_kinds = collections.Counter((r.error or f"http {r.status}").split(":")[0] for r in results if not r.ok)
    finishes = [r.start_s + r.e2e_ms / 1000.0 for r in ok if r.e2e_ms is not None]
    return {
        "router": router,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_ratio": hit_ratio(results),
        "ttft_ms": percentiles([r.ttft_ms for r in ok if r.ttft_ms is not None], (50, 90, 99)),
        "itl_ms": percentiles([g for r in ok for g in r.itl_ms], (50, 99)),
        "e2e_ms": percentiles([r.e2e_ms for r in ok if r.e2e_ms is not None], (50, 90, 99)),
        "throughput_rps": throughput_rps(results),
        "endpoint_share": share,
        "extra": {
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
            "completion_tokens": sum(r.completion_tokens for r in ok),
            "duration_s": round(max(finishes) - min(r.start_s for r in results), 3) if finishes else 0.0,
            "max_share_over_fair": round(max(share.values()) / fair, 3) if share and fair else None,
            "error_kinds": dict(error_kinds),
            "num_shed": sum(1 for r in results if is_shed(r)),
            "goodput": goodput(results, deadline_s),
            # How late the client sent open-loop requests (large = the client, not the router, was the limit).
            "send_lag_ms": percentiles([r.send_lag_ms for r in results if r.send_lag_ms is not None], (50, 99)),
            **hit_ratio_by_tier(ok),
            **(extra or {}),
        },
    }


def agent_summary(results: Sequence[RequestResult], api: str) -> dict[str, Any]:
    """The agents workload's figures of one run (results.json ``runs[i].extra.agents``).

    - ``follow_ups_sent``: follow-up turns sent (a Responses follow-up whose previous turn failed cannot be);
      ``follow_ups_served``: those answered 200; ``follow_up_success_ratio`` = served / sent (None if none
      sent); ``not_found``: follow-ups answered 404 "not found" (the endpoint did not hold the previous
      response); ``follow_ups_not_sent``: chains broken by an earlier failure.
    - ``ttft_ms``: P50/P90/P99 over successful requests; ``ttft_ms_by_turn`` and ``hit_ratio_by_turn`` per turn
      (keys are turn numbers, 0 = the first), with ``requests_by_turn`` (successful ones) for their weight.
    """
    follow = [r for r in results if r.follow_up]
    sent = [r for r in follow if r.sent]
    served = [r for r in sent if r.ok]
    turns = sorted({r.turn for r in results})
    by_turn = {t: [r for r in results if r.turn == t] for t in turns}
    return {
        "api": api,
        "first_turns_sent": sum(1 for r in results if not r.follow_up),
        "first_turns_served": sum(1 for r in results if not r.follow_up and r.ok),
        "follow_ups_sent": len(sent),
        "follow_ups_served": len(served),
        "follow_up_success_ratio": round(len(served) / len(sent), 6) if sent else None,
        "not_found": sum(1 for r in sent if r.not_found),
        "follow_ups_not_sent": len(follow) - len(sent),
        "ttft_ms": percentiles([r.ttft_ms for r in results if r.ok and r.ttft_ms is not None], (50, 90, 99)),
        "ttft_ms_by_turn": {str(t): percentiles([r.ttft_ms for r in rs if r.ok and r.ttft_ms is not None],
                                                (50, 90, 99)) for t, rs in by_turn.items()},
        "hit_ratio_by_turn": {str(t): hit_ratio(rs) for t, rs in by_turn.items()},
        "requests_by_turn": {str(t): sum(1 for r in rs if r.ok) for t, rs in by_turn.items()},
    }


PerRequest = Mapping[int, tuple[float, str | None]]
"""One run's successful requests by request index: (client TTFT ms, serving endpoint or None)."""


def per_request(results: Sequence[RequestResult]) -> dict[int, tuple[float, str | None]]:
    """`PerRequest` of a run's results: successful requests with a TTFT."""
    return {r.index: (r.ttft_ms, r.endpoint) for r in results if r.ok and r.ttft_ms is not None}


def paired_reference(routers: Sequence[str]) -> str | None:
    """The run the others are paired with: sglang-router when it ran, else the first peer (a router that is
    not ours), else None (no peer: nothing to pair with)."""
    if "sglang-router" in routers:
        return "sglang-router"
    return next((r for r in routers if not r.startswith("prefixroute")), None)


def paired_ttft(runs: Mapping[str, PerRequest], reference: str) -> dict[str, Any]:
    """Each run's TTFT request by request against `reference`'s on the same request sequence, over the
    requests both served: ``{"reference", "runs": {router: {num_requests, median_diff_ms, p25_diff_ms,
    p75_diff_ms, slower_ratio, same_endpoint_ratio}}}``; a diff is the router's TTFT minus the reference's
    (ms, > 0: slower), `slower_ratio` the share of requests with diff > 0, `same_endpoint_ratio` the share
    served by the same endpoint (None when either run's endpoints are unknown). Pairing removes what the
    request itself costs (its prompt, its place in the sequence), so a difference much smaller than the
    spread of TTFTs shows, as comparing percentiles of two runs does not (the router's hop)."""
    ref = runs[reference]
    out: dict[str, Any] = {}
    for name, rows in runs.items():
        if name == reference:
            continue
        common = sorted(set(rows) & set(ref))
        if not common:
            continue
        diffs = np.asarray([rows[i][0] - ref[i][0] for i in common], dtype=np.float64)
        known = [i for i in common if rows[i][1] is not None and ref[i][1] is not None]
        p25, p50, p75 = (round(float(v), 3) for v in np.percentile(diffs, (25, 50, 75)))
        out[name] = {"num_requests": len(common), "median_diff_ms": p50, "p25_diff_ms": p25, "p75_diff_ms": p75,
                     "slower_ratio": round(float((diffs > 0).mean()), 4),
                     "same_endpoint_ratio": (round(sum(rows[i][1] == ref[i][1] for i in known) / len(known), 4)
                                             if known else None)}
    return {"reference": reference, "runs": out}


def results_document(workload: Mapping[str, Any], upper_bound_hit_ratio: float | None,
                     runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole results.json: ``{"workload", "upper_bound_hit_ratio", "runs"}``."""
    return {"workload": dict(workload),
            "upper_bound_hit_ratio": None if upper_bound_hit_ratio is None else round(upper_bound_hit_ratio, 6),
            "runs": [dict(r) for r in runs]}


def schema() -> dict[str, Any]:
    """The JSON Schema of results.json (package data ``results.schema.json``), for consumers and tests."""
    import json
    from importlib import resources

    return json.loads(resources.files("prefixroute.bench").joinpath("results.schema.json").read_text())


def validate_document(doc: Mapping[str, Any]) -> list[str]:
    """Problems with a results.json document's shape (empty list = valid). Used by tests and `--check`."""
    problems = []
    for key in ("workload", "upper_bound_hit_ratio", "runs"):
        if key not in doc:
            problems.append(f"missing top-level key {key!r}")
    for i, run in enumerate(doc.get("runs", [])):
        for key in RUN_KEYS:
            if key not in run:
                problems.append(f"runs[{i}]: missing {key!r}")
        for key, qs in (("ttft_ms", ("p50", "p90", "p99")), ("itl_ms", ("p50", "p99")),
                        ("e2e_ms", ("p50", "p90", "p99"))):
            if set(run.get(key, {})) != set(qs):
                problems.append(f"runs[{i}].{key}: keys {sorted(run.get(key, {}))} != {list(qs)}")
        hr = run.get("hit_ratio")
        if hr is not None and not 0.0 <= hr <= 1.0:
            problems.append(f"runs[{i}].hit_ratio {hr} outside [0, 1]")
        share = run.get("endpoint_share", {})
        if share and sum(share.values()) > 0 and abs(sum(share.values()) - 1.0) > 1e-3:
            problems.append(f"runs[{i}].endpoint_share sums to {sum(share.values())}")
    return problems

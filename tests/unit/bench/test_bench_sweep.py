"""Load sweeps (issue 12): the capacity (oracle-based search and the throughput figure), the virtual sweep's
document, report and plots, the time model's prediction error, the CLI flags; and the first-token hook the
virtual fleet drives."""

from __future__ import annotations

import argparse
import json

import pytest

from prefixroute.bench import capacity, cli, sweep, sweep_report, upper_bound, virtual_run, workloads
from prefixroute.extproc.routing.settings import POLICIES
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet

PROFILE = "llama-3.1-70b-h200-tp4"


def _wl(num_requests=80, **kw):
    base = dict(num_groups=6, prefix_tokens=1024, question_tokens=16, output_tokens=4, seed=2)
    return workloads.shared_prompts(num_requests=num_requests, **{**base, **kw})


def _quiet(_msg: str) -> None:
    pass


def _predicting_policies() -> list[str]:
    """Our policies whose object keeps `predictions` (the time model's), found by running them, not by name."""
    wl = workloads.apply_arrivals(_wl(num_requests=20), "poisson", rate_rps=30.0, seed=2)
    out = []
    for p in POLICIES:
        preds: list = []
        virtual_run.simulate_policy(wl, p, num_servers=2, predictions=preds)
        if preds:
            out.append(p)
    return out


def test_throughput_figure_is_fleet_prefill_over_uncached_tokens_per_request():
    wl = _wl()
    spec = virtual_run.engine_spec()
    ub = upper_bound.upper_bound(wl)
    per_server = capacity.prefill_capacity_tokens_per_s(spec)
    assert 5_000 < per_server < 200_000
    cap = capacity.throughput_capacity_rps(wl, ub.hit_ratio, spec, 4)
    mean_uncached = ub.prompt_tokens / ub.num_requests * (1 - ub.hit_ratio)
    assert cap == pytest.approx(4 * per_server / mean_uncached)
    assert capacity.throughput_capacity_rps(wl, ub.hit_ratio, spec, 8) == pytest.approx(2 * cap)


def test_idle_prefill_is_what_a_lone_request_takes_on_the_fleet():
    # The queueing definition subtracts idle_prefill_s: on an idle server a request's TTFT is exactly it, cold
    # (several chunks) and on top of a cached prefix (the second request of a group, after the first ended).
    spec = virtual_run.engine_spec(PROFILE)
    wl = workloads.shared_prompts(num_requests=2, num_groups=1, prefix_tokens=9000, question_tokens=300,
                                  output_tokens=2, seed=3)
    wl = workloads.apply_arrivals(wl, "poisson", rate_rps=1.0, seed=0)
    sims = virtual_run.build_sim_requests(wl, spec)
    assert len(sims[0].prompt_ids) > spec.config.max_num_batched_tokens  # chunked
    sims[1].arrival_s = 100.0  # long after the first finished: an idle server with its prefix cached
    results = VirtualFleet(spec, 1).run(sims, lambda _r, _f: 0)
    first, second = sorted(results, key=lambda r: r.arrival_s)
    assert first.cached_tokens == 0 and second.cached_tokens > 8500
    assert first.ttft_s == pytest.approx(capacity.idle_prefill_s(spec, first.prompt_tokens), rel=1e-6)
    assert second.ttft_s == pytest.approx(
        capacity.idle_prefill_s(spec, second.prompt_tokens - second.cached_tokens, second.cached_tokens), rel=1e-6)
    assert capacity.idle_prefill_s(spec, second.prompt_tokens) > 3 * second.ttft_s


def test_capacity_search_brackets_the_criterion_and_is_deterministic():
    wl = _wl(num_requests=120)
    spec = virtual_run.engine_spec(PROFILE)
    cap = capacity.find_capacity(wl, spec, 3, seed=4)
    sims = virtual_run.build_sim_requests(workloads.apply_arrivals(wl, "poisson", rate_rps=1.0), spec)
    assert cap.typical_prompt_tokens == capacity.typical_prompt_tokens(sims)
    assert cap.cold_prefill_s == pytest.approx(capacity.idle_prefill_s(spec, cap.typical_prompt_tokens))
    p50, _ = capacity.oracle_queueing(wl, sims, spec, 3, cap.rps, seed=4)
    assert p50 <= cap.cold_prefill_s  # the criterion holds at the capacity ...
    p50_above, _ = capacity.oracle_queueing(wl, sims, spec, 3, 1.25 * cap.rps, seed=4)
    assert p50_above > cap.cold_prefill_s  # ... and fails 25% above it
    # Below the throughput figure (it ignores queueing), and the search says how it got there.
    assert cap.rps < cap.throughput_rps
    assert any(s["holds"] for s in cap.search) and not all(s["holds"] for s in cap.search)
    capacity._CAPACITY_CACHE.clear()
    again = capacity.find_capacity(wl, spec, 3, seed=4)
    assert again.rps == cap.rps and again.search == cap.search


def test_slower_gpus_lower_the_capacity_in_proportion():
    # --server-args=--time-scale=2 (as a real sweep passes it) doubles every step: the same search, rates halved.
    wl = _wl(num_requests=80)
    fast = capacity.find_capacity(wl, virtual_run.engine_spec(PROFILE), 2)
    slow_spec = virtual_run.engine_spec(PROFILE, ["--time-scale=2"])
    assert slow_spec.config.time_scale == 2.0
    slow = capacity.find_capacity(wl, slow_spec, 2)
    assert slow.rps == pytest.approx(fast.rps / 2, rel=1e-6)
    assert slow.cold_prefill_s == pytest.approx(2 * fast.cold_prefill_s)
    # A real sweep's capacity tolerates failure injection the virtual fleet does not simulate.
    with pytest.raises(ValueError, match="not simulated"):
        virtual_run.engine_spec(PROFILE, ["--fail-ratio=0.1"])
    assert virtual_run.engine_spec(PROFILE, ["--fail-ratio=0.1"], allow_unsimulated=True).config.time_scale == 1.0


def test_prediction_error_counts_requests_after_the_warmup_per_endpoint():
    warm = [("a", 10.0, 1.0)] * 3 + [("b", 10.0, 1.0)] * 3  # wild during each endpoint's warm-up
    later = [("a", 1.1, 1.0), ("b", 0.8, 1.0), ("a", 1.05, 1.0)]
    err, scope, n = sweep.prediction_error(warm + later, warmup=3)
    assert (err, scope, n) == (pytest.approx(0.1), "after 3 per endpoint", 3)
    # Too few per endpoint: everything counts, and the scope says so.
    err, scope, n = sweep.prediction_error(warm, warmup=200)
    assert (err, scope, n) == (pytest.approx(9.0), "all", 6)
    assert sweep.prediction_error([])[0] is None


def test_virtual_fleet_tags_each_prediction_with_the_primary_endpoint():
    policies = _predicting_policies()
    assert policies, "no policy keeps predictions (the time model's record)"
    wl = workloads.apply_arrivals(_wl(num_requests=60), "poisson", rate_rps=40.0, seed=2)
    preds: list[tuple[str, float, float]] = []
    res, endpoints, _ = virtual_run.simulate_policy(wl, policies[0], num_servers=3, predictions=preds)
    ok = [r for r in res if r.ok]
    assert len(ok) == 60 and len(preds) == 60  # one first token per request
    assert sorted(a for _, _, a in preds) == pytest.approx(sorted(r.ttft_ms / 1000 for r in ok))
    # Tagged with the endpoint that served it: per endpoint, the same actual TTFTs.
    for ep in endpoints:
        assert sorted(a for e, _, a in preds if e == ep) == pytest.approx(
            sorted(r.ttft_ms / 1000 for r in ok if r.endpoint == ep))
    none: list = []
    virtual_run.simulate_policy(wl, "random", num_servers=3, predictions=none)
    assert none == []


def test_virtual_sweep_document_report_and_plots(tmp_path):
    predicting = _predicting_policies()[0]
    routers = ("prefixroute:random", f"prefixroute:{predicting}", "sim:sglang-cache-aware", "sim:oracle",
               "sglang-router")
    wl = _wl()
    spec = virtual_run.engine_spec(PROFILE)
    doc = sweep.run_virtual_sweep(wl, routers, num_servers=4, spec=spec, load_percents=(50, 150), log=_quiet)
    cap = capacity.find_capacity(wl, spec, 4)
    assert doc["kind"] == "sweep" and doc["virtual"] is True
    assert doc["capacity_rps"] == pytest.approx(cap.rps, rel=1e-3)
    assert doc["capacity"]["definition"] == capacity.CAPACITY_DEFINITION
    assert doc["capacity"]["throughput_rps"] > doc["capacity_rps"]
    assert list(doc["skipped"]) == ["sglang-router"]
    assert [p["load_percent"] for p in doc["points"]] == [50, 150]
    assert [p["rate_rps"] for p in doc["points"]] == pytest.approx([cap.rps * 0.5, cap.rps * 1.5], rel=1e-3)
    for p in doc["points"]:
        assert list(p["runs"]) == list(routers[:4])
        for name, e in p["runs"].items():
            assert e["errors"] == 0 and e["requests"] == 80
            assert e["ttft_ms"]["p50"] <= e["ttft_ms"]["p90"] <= e["ttft_ms"]["p99"]
            assert 0 <= e["hit_ratio"] <= doc["upper_bound_hit_ratio"] + 1e-9
            assert set(e["gap_to_oracle"]) == {"p50", "p90", "p99"}
        assert p["runs"]["sim:oracle"]["gap_to_oracle"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
        pr = p["runs"][f"prefixroute:{predicting}"]
        assert pr["prediction_scope"] == "all" and pr["prediction_requests"] == 80  # < 200 per endpoint
        assert 0 <= pr["prediction_mape"] < 10
        assert "prediction_mape" not in p["runs"]["prefixroute:random"]
    hot, cold = doc["points"][1]["runs"], doc["points"][0]["runs"]
    assert hot["sim:oracle"]["ttft_ms"]["p90"] > cold["sim:oracle"]["ttft_ms"]["p90"]  # load shows
    assert hot["sim:oracle"]["ttft_ms"]["p50"] <= hot["prefixroute:random"]["ttft_ms"]["p50"]

    files = sweep_report.write_sweep_outputs(tmp_path, doc, command="prefixroute bench --sweep-load-percents 50,150")
    back = json.loads((tmp_path / "results.json").read_text())
    assert back["points"][1]["runs"]["sim:oracle"]["ttft_ms"] == hot["sim:oracle"]["ttft_ms"]
    assert back["command"].startswith("prefixroute bench")
    md = (tmp_path / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| 50% |") or line.startswith("| 150% |")]
    assert len(rows) == 2 * 4
    assert f"{doc['capacity_rps']:.3f} req/s" in md and "prediction MAPE" in md and "(all)" in md
    assert "--sweep-load-percents 50,150" in md and "sglang-router" in md  # the command; the skipped peer
    for name in sweep_report.PLOT_FILES:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG" and (tmp_path / name) in files.values()


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    return cli._main(parser.parse_args(list(argv)))


def test_cli_sweep_arguments(tmp_path, capsys):
    assert cli.parse_sweep_percents(("20", "40%", "120")) == [20.0, 40.0, 120.0]
    for bad in (("x",), ("0",), ("-5",)):
        with pytest.raises(ValueError):
            cli.parse_sweep_percents(bad)
    small = ["--num-requests", "30", "--num-groups", "4", "--prefix-tokens", "512", "--output-tokens", "4",
             "--servers", "2", "--out", str(tmp_path / "bad")]
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    assert _run("--sweep-load-percents", "50", "--trace", str(trace), *small) == 2
    assert _run("--sweep-load-percents", "50", "--arrival", "closed", *small) == 2
    assert _run("--sweep-load-percents", "50,x", "--virtual", *small) == 2
    assert _run("--sweep-load-percents", "50", "--routers", "sim:oracle", *small) == 2  # sim: needs --virtual
    assert _run("--sweep-load-percents", "50", "--server-args=--no-such-flag", *small) == 2
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "o"
    assert _run("--virtual", *small[:-2], "--routers", "prefixroute:random,sim:oracle",
                "--sweep-load-percents", "50,200", "--out", str(out)) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["kind"] == "sweep" and doc["num_requests_per_point"] == 30
    assert [p["load_percent"] for p in doc["points"]] == [50, 200]
    assert list(doc["points"][0]["runs"]) == ["prefixroute:random", "sim:oracle"]
    assert "| 200% |" in (out / "report.md").read_text()
    assert (out / "ttft_vs_load.png").exists() and (out / "hit_ratio_vs_load.png").exists()
    assert "req/s" in capsys.readouterr().out


def test_cli_sweep_defaults(tmp_path, monkeypatch):
    # Without --num-requests a virtual sweep gets 1,000+ requests per point; --num-requests overrides; the
    # default --routers become the sweep's (virtual: every policy + the sim models; real: issue 12's three).
    seen = []

    def fake(wl, routers, **kw):
        seen.append((len(wl.requests), routers))
        return {"points": [], "kind": "sweep"}

    monkeypatch.setattr(sweep, "run_virtual_sweep", fake)
    monkeypatch.setattr(sweep, "run_real_sweep", lambda wl, routers, fleet, out, **kw: fake(wl, routers))
    monkeypatch.setattr(sweep_report, "write_sweep_outputs", lambda *a, **k: {})
    monkeypatch.setattr(sweep_report, "render_report", lambda *a, **k: "")
    _run("--virtual", "--sweep-load-percents", "50", "--out", str(tmp_path))
    _run("--virtual", "--sweep-load-percents", "50", "--num-requests", "40", "--out", str(tmp_path))
    _run("--sweep-load-percents", "50", "--out", str(tmp_path))
    (n_default, r_virtual), (n_set, _), (n_real, r_real) = seen
    assert n_default >= 1000 and n_set == 40 and n_real == 300
    assert set(r_virtual) >= {f"prefixroute:{p}" for p in POLICIES} | {"sim:oracle", "sim:sglang-cache-aware"}
    assert r_virtual[-1] == "sim:oracle"
    assert len(r_real) == 3 and "sglang-router" in r_real and "prefixroute:random" in r_real
    assert not any(r.startswith("sim:") for r in r_real)


def test_oracle_runs_by_name_in_run_virtual():
    wl = workloads.apply_arrivals(_wl(num_requests=30), "poisson", rate_rps=20.0, seed=2)
    doc, _ = virtual_run.run_virtual(wl, None, ["sim:oracle", "prefixroute:random"], num_servers=2, log=_quiet)
    assert [r["router"] for r in doc["runs"]] == ["sim:oracle", "prefixroute:random"]
    assert all(r["errors"] == 0 for r in doc["runs"])


def test_retimed_keeps_tokens_and_takes_the_new_arrivals():
    wl = _wl(num_requests=10)
    spec = virtual_run.engine_spec()
    sims = virtual_run.build_sim_requests(workloads.apply_arrivals(wl, "poisson", rate_rps=1.0), spec)
    later = workloads.apply_arrivals(wl, "poisson", rate_rps=4.0)
    out = capacity.retimed(sims, later)
    at = {str(r.index): r.arrival_s for r in later.requests}
    assert [s.arrival_s for s in out] == sorted(at.values())
    assert all(s.arrival_s == at[s.request_id] for s in out)
    assert all(isinstance(s, SimRequest) for s in out) and sims[1].arrival_s != at[sims[1].request_id]


def test_a_sweep_simulates_the_whole_router_name_source_and_flow(monkeypatch):
    """``prefixroute:POLICY@SOURCE+flow``: the virtual sweep and the real sweep's plan run that router, its index
    source and flow control included, not the bare policy (they used to drop both suffixes)."""
    calls: list[tuple[str, str, bool]] = []
    real = virtual_run.simulate_policy

    def recording(wl, policy, **kw):
        calls.append((policy, kw.get("index_source", ""), kw.get("flow") is not None))
        return real(wl, policy, **kw)

    monkeypatch.setattr(virtual_run, "simulate_policy", recording)
    wl = _wl(num_requests=30)
    spec = virtual_run.engine_spec(PROFILE)
    routers = ["prefixroute:prefix@feedback+flow", "prefixroute:prefix@approximate-flow"]
    sweep.run_virtual_sweep(wl, routers, num_servers=2, spec=spec, load_percents=(120,), log=_quiet)
    ours = [c for c in calls if not c[0].startswith("sim:")]
    assert ours == [("prefix", "feedback", True), ("prefix", "approximate", False)]
    calls.clear()
    sims = virtual_run.build_sim_requests(workloads.apply_arrivals(wl, "poisson", rate_rps=1.0, seed=0), spec)
    sweep.plan_real_sweep(wl, routers, [5.0], num_servers=2, spec=spec, sims=sims)
    assert calls == [("prefix", "feedback", True), ("prefix", "approximate", False)]

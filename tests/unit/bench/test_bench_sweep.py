"""The virtual load sweep (issue 12): capacity per workload, every router per load point on one request
sequence, gaps to the oracle, the CLI flag; and the first-token hook the virtual fleet drives."""

from __future__ import annotations

import json

import pytest

from prefixroute.bench import cli, upper_bound, virtual, workloads
from prefixroute.extproc.routing.settings import RoutingSettings


def _wl(num_requests=80, **kw):
    base = dict(num_groups=6, prefix_tokens=1024, question_tokens=16, output_tokens=4, seed=2)
    return workloads.shared_prompts(num_requests=num_requests, **{**base, **kw})


def test_capacity_is_fleet_prefill_over_uncached_tokens_per_request():
    wl = _wl()
    spec = virtual.engine_spec()
    ub = upper_bound.upper_bound(wl)
    per_server = virtual.prefill_capacity_tokens_per_s(spec)
    assert 5_000 < per_server < 200_000
    cap = virtual.fleet_capacity_rps(wl, ub.hit_ratio, spec, 4)
    mean_uncached = ub.prompt_tokens / ub.num_requests * (1 - ub.hit_ratio)
    assert cap == pytest.approx(4 * per_server / mean_uncached)
    assert virtual.fleet_capacity_rps(wl, ub.hit_ratio, spec, 8) == pytest.approx(2 * cap)


def test_sweep_structure_and_oracle_no_worse_than_random_when_saturated():
    wl = _wl()
    routers = ("prefixroute:random", "prefixroute:prefix", "sim:sglang-cache-aware", "sim:oracle")
    doc = virtual.run_sweep(wl, routers, num_servers=4, load_percents=(50, 300), log=lambda _m: None)
    assert doc["capacity_rps"] > 0 and 0 < doc["upper_bound_hit_ratio"] < 1
    assert [p["load_percent"] for p in doc["points"]] == [50, 300]
    assert doc["points"][1]["rate_rps"] == pytest.approx(6 * doc["points"][0]["rate_rps"], rel=1e-3)
    for p in doc["points"]:
        assert list(p["runs"]) == list(routers)
        for name, e in p["runs"].items():
            assert e["errors"] == 0 and set(e["ttft_ms"]) == {"p50", "p90", "p99"}
            assert 0 <= e["hit_ratio"] <= doc["upper_bound_hit_ratio"] + 1e-9
            assert set(e["gap_to_oracle"]) == {"p50", "p90", "p99"}
        assert p["runs"]["sim:oracle"]["gap_to_oracle"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
        assert "prediction_mape" in p["runs"]["prefixroute:prefix"]
    sat = doc["points"][1]["runs"]
    assert sat["sim:oracle"]["ttft_ms"]["p50"] <= sat["prefixroute:random"]["ttft_ms"]["p50"]
    assert sat["sim:oracle"]["hit_ratio"] >= sat["prefixroute:random"]["hit_ratio"]
    json.dumps(doc)  # a JSON document
    table = virtual.render_sweep(doc)
    assert table.count("\n| ") == 2 + 2 * len(routers) and "sim:oracle" in table


def test_virtual_fleet_delivers_first_tokens_to_the_ttft_policy():
    wl = workloads.apply_arrivals(_wl(num_requests=60), "poisson", rate_rps=40.0, seed=2)
    preds: list[tuple[float, float]] = []
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=3, predictions=preds,
                                        routing=RoutingSettings(policy="prefix", rng_seed=0))
    ok = [r for r in res if r.ok]
    assert len(ok) == 60 and len(preds) == 60  # one first token per request
    by_actual = sorted(a for _, a in preds)
    assert by_actual == pytest.approx(sorted(r.ttft_ms / 1000 for r in ok))


def test_oracle_runs_by_name_in_run_virtual():
    wl = workloads.apply_arrivals(_wl(num_requests=30), "poisson", rate_rps=20.0, seed=2)
    doc, _ = virtual.run_virtual(wl, None, ["sim:oracle", "prefixroute:prefix"], num_servers=2, log=lambda _m: None)
    assert [r["router"] for r in doc["runs"]] == ["sim:oracle", "prefixroute:prefix"]
    assert all(r["errors"] == 0 for r in doc["runs"])


def test_cli_sweep_flags(tmp_path, capsys):
    assert cli.parse_sweep_percents(("20", "40%", "120")) == [20.0, 40.0, 120.0]
    for bad in (("x",), ("0",), ("-5",)):
        with pytest.raises(ValueError):
            cli.parse_sweep_percents(bad)
    import argparse

    def run(*argv: str) -> int:
        parser = argparse.ArgumentParser()
        cli.configure_parser(parser)
        return cli._main(parser.parse_args(list(argv)))

    assert run("--sweep-load-percents", "50") == 2  # needs --virtual
    out = tmp_path / "o"
    assert run("--virtual", "--num-requests", "30", "--num-groups", "4", "--prefix-tokens", "512",
               "--output-tokens", "4", "--routers", "prefixroute:random,sim:oracle", "--servers", "2",
               "--sweep-load-percents", "50,200", "--out", str(out)) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert [p["load_percent"] for p in doc["points"]] == [50, 200]
    assert list(doc["points"][0]["runs"]) == ["prefixroute:random", "sim:oracle"]
    assert "| 200% |" in (out / "sweep.md").read_text()

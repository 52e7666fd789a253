"""Router names with an index source (prefixroute:POLICY@SOURCE), the KV-events plumbing of the bench fleet,
the router-metrics scrape and issue 13's target checks in the report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from prefixroute.bench import fleet as fleet_mod
from prefixroute.bench import report, results, runner
from prefixroute.bench.client import RequestResult
from prefixroute.bench.fleet import FleetConfig, KVEventsPlan, fleet_publishes_events, resolve_kv_events, start_fleet
from prefixroute.bench.routers import parse_router
from prefixroute.extproc.routing.settings import INDEX_SOURCES
from prefixroute.procs import free_ports


@pytest.mark.parametrize("name,kind,policy,source", [
    ("prefixroute:prefix", "prefixroute", "prefix", ""),
    ("prefixroute:prefix@events", "prefixroute", "prefix", "events"),
    ("prefixroute:prefix@feedback", "prefixroute", "prefix", "feedback"),
    ("prefixroute:prefix@approximate", "prefixroute", "prefix", "approximate"),
    ("prefixroute:random@auto", "prefixroute", "random", "auto"),
    (" prefixroute:least-load@events ", "prefixroute", "least-load", "events"),
    ("sglang-router", "sglang-router", "cache_aware", ""),
    ("vllm-router:round_robin", "vllm-router", "round_robin", ""),
])
def test_parse_router_with_index_sources(name, kind, policy, source):
    spec = parse_router(name)
    assert (spec.kind, spec.policy, spec.index_source) == (kind, policy, source)
    assert spec.name == name.strip()


@pytest.mark.parametrize("name,fragment", [
    ("prefixroute:prefix@precise", "index source"),
    ("prefixroute:prefix@", "index source"),
    ("prefixroute:nope@events", "policy"),
    ("sglang-router:cache_aware@events", "policy"),
    ("other:prefix@events", "unknown router"),
])
def test_parse_router_rejects_bad_names(name, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_router(name)


def test_every_index_source_parses():
    for source in INDEX_SOURCES:
        assert parse_router(f"prefixroute:prefix@{source}").index_source == source


@pytest.mark.parametrize("name,kv_events,expected", [
    ("prefixroute:prefix", True, ("--tokenizer", "sim")),
    ("prefixroute:prefix", False, ("--tokenizer", "sim")),
    ("prefixroute:prefix@events", True, ("--index-source", "events", "--tokenizer", "sim")),
    ("prefixroute:prefix@auto", True, ("--index-source", "auto", "--tokenizer", "sim")),
    ("prefixroute:prefix@feedback", True, ("--index-source", "feedback", "--tokenizer", "sim")),
    ("prefixroute:prefix@approximate", True, ("--index-source", "approximate")),
    ("prefixroute:prefix@approximate", False, ("--index-source", "approximate")),
])
def test_gateway_event_args(name, kv_events, expected):
    assert runner.gateway_event_args(parse_router(name), kv_events) == expected


def test_gateway_accepts_the_flags_the_bench_passes():
    """Every flag gateway_event_args emits is one `prefixroute gateway` parses today (RoutingSettings)."""
    import argparse

    from prefixroute import settings as settings_mod
    from prefixroute.extproc import gateway
    from prefixroute.extproc.routing.settings import RoutingSettings

    parser = argparse.ArgumentParser(add_help=False)
    gateway.configure_parser(parser)
    for source in INDEX_SOURCES:
        args = runner.gateway_event_args(parse_router(f"prefixroute:prefix@{source}"), True)
        ns = parser.parse_args(["--endpoints", "127.0.0.1:1@tcp://127.0.0.1:2", *args])
        s = settings_mod.from_namespace(RoutingSettings, ns)
        assert s.index_source == source


def test_events_runs_are_skipped_without_publishing_servers_and_nothing_starts(tmp_path, monkeypatch):
    def boom(*a, **k):  # noqa: ARG001
        raise AssertionError("nothing may start for a skipped run")

    monkeypatch.setattr(runner, "run_router", boom)
    from prefixroute.bench import workloads as w

    wl = w.shared_prompts(num_groups=1, prefix_tokens=32, num_requests=2)
    fleet = FleetConfig(2, kv_events=False, ports=(1, 2))
    doc, _ = runner.run_bench(wl, 0.5, ["prefixroute:prefix@events"], fleet, tmp_path, log=lambda m: None)
    assert doc["skipped"] == {"prefixroute:prefix@events": runner.NO_EVENTS_REASON}
    assert doc["workload"]["kv_events"] is False and doc["runs"] == []


class _Done:
    def __init__(self, rc: int, out: str) -> None:
        self.returncode, self.stdout = rc, out


@pytest.mark.parametrize("rc,help_text,expected", [
    (0, "  --port PORT\n  --kv-events-config KV_EVENTS_CONFIG  vLLM's ...\n", True),
    (0, "  --port PORT\n  --num-gpu-blocks N\n", False),
    (2, "--kv-events-config", False),
])
def test_fleet_publishes_events_asks_the_model_server_once(monkeypatch, rc, help_text, expected):
    calls = []

    def fake_run(argv, **kw):  # noqa: ARG001
        calls.append(argv)
        return _Done(rc, help_text)

    monkeypatch.setattr(subprocess, "run", fake_run)
    fleet_publishes_events.cache_clear()
    try:
        assert fleet_publishes_events() is expected
        assert fleet_publishes_events() is expected
        assert len(calls) == 1 and calls[0][-2:] == ["model-server", "--help"]
    finally:
        fleet_publishes_events.cache_clear()


@pytest.mark.parametrize("kv_events,server_args,publishes,expected", [
    (None, (), True, True),
    (None, (), False, False),
    (None, ("--kv-events-config={}",), True, False),  # the user's own config: addresses unknown to the bench
    (None, ("--kv-events-config", "{}"), True, False),
    (False, (), True, False),
    (True, (), False, True),
])
def test_resolve_kv_events(monkeypatch, kv_events, server_args, publishes, expected):
    monkeypatch.setattr(fleet_mod, "fleet_publishes_events", lambda: publishes)
    fleet = FleetConfig(2, server_args=server_args, kv_events=kv_events)
    assert resolve_kv_events(fleet).kv_events is expected




def test_start_fleet_passes_the_event_flags_to_each_server(monkeypatch, tmp_path):
    started = []

    class Group:
        log_dir = tmp_path

        def start(self, name, argv, **kw):
            started.append((argv, kw["ports"]))
            return name

        def wait_ready(self, procs, timeout_s):
            pass

    plan = KVEventsPlan((20001, 20011))
    eps = start_fleet(Group(), FleetConfig(2, ports=(9001, 9002), server_args=("--time-scale=0",)),
                      plan)
    assert eps == ["127.0.0.1:9001", "127.0.0.1:9002"]
    for (argv, ports), pub, http_port in zip(started, (20001, 20011), (9001, 9002)):
        i = argv.index("--kv-events-config")
        assert json.loads(argv[i + 1])["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{pub}"
        assert argv[-1] == "--time-scale=0"  # the user's flags come last
        assert ports == (http_port, pub, pub + 1)  # checked free before the server starts
    started.clear()
    start_fleet(Group(), FleetConfig(1, ports=(9003,)))
    assert "--kv-events-config" not in started[0][0] and started[0][1] == (9003,)


ROUTER_METRICS = """\
# HELP prefixroute_prompt_tokens_total Prompt tokens of requests that reported usage.
# TYPE prefixroute_prompt_tokens_total counter
prefixroute_prompt_tokens_total{endpoint="127.0.0.1:1"} 1000.0
prefixroute_prompt_tokens_total{endpoint="127.0.0.1:2"} 3000.0
prefixroute_predicted_hit_tokens_total{endpoint="127.0.0.1:1"} 500.0
prefixroute_predicted_hit_tokens_total{endpoint="127.0.0.1:2"} 1500.0
prefixroute_actual_hit_tokens_total{endpoint="127.0.0.1:1"} 400.0
prefixroute_actual_hit_tokens_total{endpoint="127.0.0.1:2"} 1400.0
prefixroute_predicted_hit_tokens_created{endpoint="127.0.0.1:1"} 1.7e9
prefixroute_endpoint_index_source{endpoint="127.0.0.1:1",source="events"} 1.0
prefixroute_endpoint_index_source{endpoint="127.0.0.1:1",source="feedback"} 0.0
prefixroute_endpoint_index_source{endpoint="127.0.0.1:2",source="feedback"} 1.0
"""


def test_parse_router_metrics_predicted_vs_actual_and_sources():
    got = runner.parse_router_metrics(ROUTER_METRICS)
    assert got["prompt_tokens"] == 4000 and got["actual_hit_tokens"] == 1800
    assert got["predicted_hit_ratio"] == pytest.approx(0.5)
    assert got["actual_hit_ratio"] == pytest.approx(0.45)
    assert got["index_source_by_endpoint"] == {"127.0.0.1:1": "events", "127.0.0.1:2": "feedback"}
    empty = runner.parse_router_metrics("")
    assert empty["predicted_hit_ratio"] is None and "index_source_by_endpoint" not in empty


# -------------------------------------------------------------------------------------------------- report


def _run(name, *, hit, p90, extra=None):
    rows = [RequestResult(index=i, status=200, ttft_ms=p90, e2e_ms=p90 + 10, prompt_tokens=100,
                          cached_tokens=int(hit * 100), completion_tokens=4, start_s=0.1 * i, endpoint="a:1")
            for i in range(3)]
    run = results.summarize_run(name, rows, ["a:1"], extra=extra)
    run["ttft_ms"]["p90"] = p90
    return run


@pytest.mark.parametrize("events,feedback,expected", [
    # 0.5 >= 1.25 x 0.3 (approx) and x 0.35 (sglang); 400 <= 0.8 x 600 and x 700; feedback 0.4 / 500 between.
    (dict(hit=0.5, p90=400), dict(hit=0.4, p90=500), [True, True, True, True, True, True]),
    # hit 0.45: 1.5x approximate's, 1.29x sglang's; P90 550: 0.92x approximate's (NO), 0.79x sglang's;
    # feedback's hit ratio between, its P90 (500) better than events' (NO).
    (dict(hit=0.45, p90=550), dict(hit=0.4, p90=500), [True, False, True, True, True, False]),
    # events at 1.2x approximate's hit ratio and 0.9x sglang's P90; feedback above events.
    (dict(hit=0.36, p90=630), dict(hit=0.4, p90=500), [False] * 6),
])
def test_index_source_checks(events, feedback, expected):
    doc = results.results_document({"name": "capacity-pressure", "kv_events": True}, 0.66, [
        _run("prefixroute:prefix@events", **events), _run("prefixroute:prefix@feedback", **feedback),
        _run("prefixroute:prefix@approximate", hit=0.3, p90=600), _run("sglang-router", hit=0.35, p90=700)])
    checks = report.index_source_checks(doc)
    assert [ok for _, _, ok in checks] == expected
    assert checks[0][0].startswith("prefixroute:prefix@events hit ratio >= 1.25x prefixroute:prefix@approximate")


def test_plain_prefix_counts_as_events_only_when_the_fleet_published_them():
    runs = [_run("prefixroute:prefix", hit=0.5, p90=400), _run("sglang-router", hit=0.35, p90=700)]
    with_events = results.results_document({"name": "x", "kv_events": True}, 0.66, runs)
    without = results.results_document({"name": "x", "kv_events": False}, 0.66, runs)
    assert len(report.index_source_checks(with_events)) == 2
    assert report.index_source_checks(without) == []


@pytest.mark.parametrize("pred,act,ok", [(0.50, 0.48, True), (0.50, 0.53, True), (0.50, 0.46, False)])
def test_prediction_within_three_points(pred, act, ok):
    rm = {"predicted_hit_ratio": pred, "actual_hit_ratio": act}
    doc = results.results_document({"name": "x"}, 0.66, [
        _run("prefixroute:prefix@feedback", hit=act, p90=1, extra={"index_source": "feedback", "router_metrics": rm})])
    (check,) = report.index_source_checks(doc)
    assert check[2] is ok and "predicted hit ratio within 3 points" in check[0]


def test_report_shows_the_bounds_the_min_column_and_the_sources(tmp_path: Path):
    import jsonschema

    bounds = {"block_tokens": 16, "num_servers": 4, "num_gpu_blocks": 2500, "num_gpu_blocks_source":
              "--num-gpu-blocks", "capacity_blocks": 10000, "working_set_blocks": 31000,
              "shared_working_set_blocks": 20000, "capacity_over_working_set": 0.32,
              "infinite_cache_hit_ratio": 0.66, "belady_hit_ratio": 0.6, "belady_leading_hit_ratio": 0.6,
              "lru_pooled_hit_ratio": 0.42, "tokenizer": "t", "note": ""}
    rm = {"predicted_hit_ratio": 0.31, "actual_hit_ratio": 0.3,
          "index_source_by_endpoint": {"a:1": "events"}}
    doc = results.results_document({"name": "capacity-pressure", "num_requests": 3, "kv_events": True}, 0.66, [
        _run("prefixroute:prefix", hit=0.3, p90=50, extra={"index_source": "auto", "router_metrics": rm}),
        _run("prefixroute:random", hit=0.15, p90=80)])
    doc["bounds"] = bounds
    jsonschema.Draft202012Validator(results.schema()).validate(json.loads(json.dumps(doc)))
    md = report.render_markdown(doc)
    assert "Belady MIN on one cache of 10,000 blocks): hit ratio 0.600" in md
    assert "4 x 2,500 = 10,000 blocks (--num-gpu-blocks), 50% of the shared working set" in md
    row = next(line for line in md.splitlines() if line.startswith("| prefixroute:prefix |"))
    assert "| 0.300 | 45% | 50% |" in row  # of the infinite bound 0.66, of the MIN bound 0.6
    src = next(line for line in md.splitlines() if line.startswith("| prefixroute:prefix | auto"))
    assert src == "| prefixroute:prefix | auto (events in use) | 0.310 | 0.300 | +1.0 points |"
    report.write_outputs(tmp_path, doc, {"prefixroute:prefix": [50.0], "prefixroute:random": [80.0]})
    assert (tmp_path / "hit_ratio.png").stat().st_size > 5000

"""Metrics arithmetic (values computed by hand) and the report writer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from prefixroute.bench import report, results
from prefixroute.bench.client import RequestResult


def R(index=0, *, start_s=0.0, ttft=10.0, itl=(), e2e=100.0, prompt=100, cached=0, completion=5, endpoint="a:1",
      status=200, error=None):
    return RequestResult(index=index, start_s=start_s, status=status, error=error, ttft_ms=ttft, itl_ms=list(itl),
                         e2e_ms=e2e, prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
                         endpoint=endpoint)


@pytest.mark.parametrize("values,qs,expected", [
    ([1, 2, 3, 4, 5], (50, 90, 99), {"p50": 3.0, "p90": 4.6, "p99": 4.96}),
    ([10.0], (50, 99), {"p50": 10.0, "p99": 10.0}),
    ([1, 2], (50, 90), {"p50": 1.5, "p90": 1.9}),
    ([0, 100], (99,), {"p99": 99.0}),
    ([], (50, 99), {"p50": None, "p99": None}),
])
def test_percentiles_linear_interpolation(values, qs, expected):
    assert results.percentiles(values, qs) == pytest.approx(expected) if values else \
        results.percentiles(values, qs) == expected


@pytest.mark.parametrize("rows,expected", [
    ([R(prompt=100, cached=50), R(prompt=300, cached=250)], 300 / 400),
    ([R(prompt=100, cached=0)], 0.0),
    # failed requests are excluded even if they carry numbers
    ([R(prompt=100, cached=100), R(prompt=100, cached=0, status=500, error="http 500")], 1.0),
    ([R(prompt=100, cached=None)], None),  # server did not report prompt details
    ([R(prompt=0, cached=0)], None),
    ([], None),
])
def test_hit_ratio(rows, expected):
    got = results.hit_ratio(rows)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("rows,expected", [
    # 3 ok requests; first start 0, last finish 1.0 + 1.0 -> 3 / 2 s
    ([R(start_s=0.0, e2e=500), R(start_s=0.5, e2e=500), R(start_s=1.0, e2e=1000)], 1.5),
    # a failed request still counts for the first start, not for the numerator
    ([R(start_s=0.0, status=0, error="x", e2e=None), R(start_s=1.0, e2e=1000)], 0.5),
    ([R(status=0, error="x", e2e=None)], 0.0),
])
def test_throughput(rows, expected):
    assert results.throughput_rps(rows) == pytest.approx(expected)


@pytest.mark.parametrize("endpoints_served,configured,expected", [
    (["a", "a", "b", "a"], ["a", "b", "c"], {"a": 0.75, "b": 0.25, "c": 0.0}),
    (["a", None, "b"], ["a", "b"], {"a": 0.5, "b": 0.5}),  # unknown endpoint excluded from the denominator
    (["z"], ["a"], {"a": 0.0, "z": 1.0}),  # unconfigured endpoint is still listed
    ([], ["a"], {"a": 0.0}),
])
def test_endpoint_share(endpoints_served, configured, expected):
    rows = [R(i, endpoint=e) for i, e in enumerate(endpoints_served)]
    assert results.endpoint_share(rows, configured) == pytest.approx(expected)


def test_summarize_run_has_the_issue_shape_and_hand_values():
    rows = [R(0, start_s=0.0, ttft=10, itl=(1, 3), e2e=100, prompt=100, cached=0, endpoint="a:1"),
            R(1, start_s=0.1, ttft=30, itl=(2,), e2e=200, prompt=100, cached=80, endpoint="b:2"),
            R(2, start_s=0.2, ttft=20, itl=(4,), e2e=300, prompt=200, cached=160, endpoint="a:1"),
            R(3, start_s=0.3, status=0, error="timeout after 5s", ttft=None, e2e=None)]
    run = results.summarize_run("prefixroute:prefix", rows, ["a:1", "b:2"])
    assert list(run)[: len(results.RUN_KEYS)] == list(results.RUN_KEYS)
    assert run["requests"] == 4 and run["errors"] == 1
    assert run["hit_ratio"] == pytest.approx(240 / 400)
    assert run["ttft_ms"] == pytest.approx({"p50": 20.0, "p90": 28.0, "p99": 29.8})
    assert run["itl_ms"] == pytest.approx({"p50": 2.5, "p99": 3.97})
    assert run["e2e_ms"]["p50"] == pytest.approx(200.0)
    assert run["throughput_rps"] == pytest.approx(3 / 0.5)
    assert run["endpoint_share"] == pytest.approx({"a:1": 2 / 3, "b:2": 1 / 3})
    assert run["extra"]["max_share_over_fair"] == pytest.approx((2 / 3) / 0.5, abs=1e-3)
    assert run["extra"]["error_kinds"] == {"timeout after 5s": 1}
    doc = results.results_document({"name": "x", "num_requests": 4}, 0.75, [run])
    assert results.validate_document(json.loads(json.dumps(doc))) == []
    jsonschema.Draft202012Validator(results.schema()).validate(json.loads(json.dumps(doc)))


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("runs"),
    lambda d: d.__setitem__("upper_bound_hit_ratio", 1.2),
    lambda d: d["runs"][0]["ttft_ms"].pop("p99"),
    lambda d: d["runs"][0].__setitem__("requests", -1),
    lambda d: d["runs"][0].__setitem__("unexpected", 1),
    lambda d: d["runs"][0]["endpoint_share"].__setitem__("a:1", 2.0),
])
def test_schema_rejects_wrong_documents(mutate):
    jsonschema.Draft202012Validator.check_schema(results.schema())
    doc = json.loads(json.dumps(results.results_document({"name": "x", "num_requests": 1}, 0.5,
                                                         [results.summarize_run("r", [R()], ["a:1"])])))
    validator = jsonschema.Draft202012Validator(results.schema())
    validator.validate(doc)
    mutate(doc)
    assert not validator.is_valid(doc)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d.pop("upper_bound_hit_ratio"), "upper_bound_hit_ratio"),
    (lambda d: d["runs"][0].pop("endpoint_share"), "endpoint_share"),
    (lambda d: d["runs"][0]["ttft_ms"].pop("p90"), "ttft_ms"),
    (lambda d: d["runs"][0].__setitem__("hit_ratio", 1.5), "outside"),
    (lambda d: d["runs"][0].__setitem__("endpoint_share", {"a": 0.5, "b": 0.2}), "sums to"),
])
def test_validate_document_finds_problems(mutate, fragment):
    doc = results.results_document({}, 0.5, [results.summarize_run("r", [R()], ["a:1"])])
    assert results.validate_document(doc) == []
    mutate(doc)
    assert any(fragment in p for p in results.validate_document(doc))


def test_report_table_ratios_vs_random_and_plots(tmp_path):
    rand = results.summarize_run("prefixroute:random", [R(0, ttft=100), R(1, ttft=300, endpoint="b:2")],
                                 ["a:1", "b:2"])
    pref = results.summarize_run("prefixroute:prefix", [R(0, ttft=20, cached=90), R(1, ttft=60, cached=90)],
                                 ["a:1", "b:2"])
    doc = results.results_document({"name": "shared-prompts", "seed": 0}, 0.9, [rand, pref])
    files = report.write_outputs(tmp_path, doc, {"prefixroute:random": [100, 300], "prefixroute:prefix": [20, 60]},
                                 command="prefixroute bench --workload shared-prompts")
    md = files["report"].read_text()
    # p50 20+ (60-20)/2 = 40 vs 200 -> 0.20x; p90 56 vs 280 -> 0.20x; hit 0.9 of 0.9 -> 100%
    row = next(line for line in md.splitlines() if line.startswith("| prefixroute:prefix"))
    assert "| 0.900 | 100% |" in row and row.endswith("| 0.20x | 0.20x |")
    assert "max share / fair" in md and "prefixroute bench --workload shared-prompts" in md
    assert json.loads(files["results"].read_text()) == doc
    for name in report.PLOT_FILES:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def _run(name, *, p50, p90, hit, shares):
    rows = []
    for i, ep in enumerate(shares):
        rows.append(R(i, ttft=p50, endpoint=ep, prompt=100, cached=int(hit * 100)))
    run = results.summarize_run(name, rows, sorted(set(shares)))
    run["ttft_ms"]["p50"], run["ttft_ms"]["p90"] = p50, p90
    return run


@pytest.mark.parametrize("prefix,sglang,expected", [
    # p50 100 vs random 1000 (-90%), hit 0.85 of 0.9 (94%), shares 2/4 over fair 1/2... 1.0x; beats sglang
    (dict(p50=100, p90=300, hit=0.85, shares=["a", "b", "a", "b"]), dict(p50=150, p90=400, hit=0.80,
     shares=["a", "b", "a", "b"]), [True, True, True, True, True]),
    # p50 only -70%, hit 0.7 of 0.9 (78%), one endpoint has 3 of 4 (1.5x fair: still met), loses to sglang
    (dict(p50=300, p90=500, hit=0.70, shares=["a", "a", "a", "b"]), dict(p50=150, p90=400, hit=0.80,
     shares=["a", "b", "a", "b"]), [False, False, True, False, False]),
])
def test_target_checks(prefix, sglang, expected):
    doc = results.results_document({"name": "x"}, 0.9, [
        _run("prefixroute:random", p50=1000, p90=2000, hit=0.3, shares=["a", "b"]),
        _run("prefixroute:prefix", **prefix), _run("sglang-router", **sglang)])
    checks = report.target_checks(doc)
    assert [ok for _, _, ok in checks] == expected
    md = report.render_markdown(doc)
    assert "Design targets for prefixroute:prefix (the" in md and md.count("| NO |") == expected.count(False)
    assert f"| P50 TTFT at least 80% below random | {prefix['p50'] / 1000 - 1:+.0%} (" in md


@pytest.mark.parametrize("routers,reference", [
    (["prefixroute:prefix", "sglang-router", "vllm-router:random"], "sglang-router"),
    (["prefixroute:prefix", "vllm-router:random", "sglang-router"], "sglang-router"),
    (["prefixroute:prefix", "vllm-router:random"], "vllm-router:random"),
    (["prefixroute:prefix", "prefixroute:random"], None),  # no peer: nothing to pair with
])
def test_paired_reference_is_the_best_peer_that_ran(routers, reference):
    assert results.paired_reference(routers) == reference


def test_paired_ttft_compares_the_same_requests_only():
    ref = results.per_request([R(0, ttft=10.0, endpoint="a:1"), R(1, ttft=20.0, endpoint="b:2"),
                               R(2, ttft=30.0, endpoint="a:1"), R(3, ttft=40.0, endpoint="b:2"),
                               R(4, status=0, error="timeout", ttft=None)])
    ours = results.per_request([R(0, ttft=11.0, endpoint="a:1"), R(1, ttft=21.5, endpoint="a:1"),
                                R(2, ttft=29.0, endpoint="a:1"), R(4, ttft=5.0, endpoint="b:2"),
                                R(3, status=500, error="http 500", ttft=39.0)])
    doc = results.paired_ttft({"sglang-router": ref, "prefixroute:prefix": ours}, "sglang-router")
    # both served 0, 1, 2 (3 failed here, 4 there): diffs +1.0, +1.5, -1.0
    assert doc == {"reference": "sglang-router", "runs": {"prefixroute:prefix": {
        "num_requests": 3, "median_diff_ms": 1.0, "p25_diff_ms": 0.0, "p75_diff_ms": 1.25,
        "slower_ratio": round(2 / 3, 4), "same_endpoint_ratio": round(2 / 3, 4)}}}
    unknown = results.per_request([R(0, ttft=12.0, endpoint=None)])
    assert results.paired_ttft({"x": unknown, "r": ref}, "r")["runs"]["x"]["same_endpoint_ratio"] is None
    assert results.paired_ttft({"x": {}, "r": ref}, "r")["runs"] == {}  # nothing in common: no row


def test_the_pairing_is_in_the_document_and_the_report(tmp_path):
    sg = results.summarize_run("sglang-router", [R(0, ttft=10), R(1, ttft=20)], ["a:1"])
    pref = results.summarize_run("prefixroute:prefix", [R(0, ttft=12), R(1, ttft=21)], ["a:1"])
    doc = results.results_document({"name": "tenants", "num_requests": 2}, 0.9, [pref, sg])
    doc["paired_ttft"] = results.paired_ttft(
        {"prefixroute:prefix": {0: (12.0, "a:1"), 1: (21.0, "a:1")}, "sglang-router": {0: (10.0, "a:1"),
                                                                                       1: (20.0, "a:1")}},
        "sglang-router")
    validator = jsonschema.Draft202012Validator(results.schema())
    validator.validate(json.loads(json.dumps(doc)))
    md = report.render_markdown(doc)
    assert "TTFT request by request against sglang-router" in md
    row = next(line for line in md.splitlines() if line.startswith("| prefixroute:prefix | 2 | +"))
    assert row == "| prefixroute:prefix | 2 | +1.25 | +1.50 | +1.75 | 100% | 100% |"
    doc["paired_ttft"]["runs"]["prefixroute:prefix"]["slower_ratio"] = 1.5
    assert not validator.is_valid(json.loads(json.dumps(doc)))


def test_the_newest_peers_parse_and_kv_aware_gets_the_event_sources():
    from prefixroute.bench.routers import PEER_RELEASES, parse_router
    from prefixroute.bench.runner import kv_event_source_args

    assert parse_router("smg").kind == "smg" and parse_router("smg").policy == "cache_aware"
    assert parse_router("smg:round_robin/chat").workload_api == "chat"
    assert parse_router("vllm-router:kv_aware").policy == "kv_aware"
    assert parse_router("sglang-router").policy == "cache_aware"
    assert PEER_RELEASES == {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17",
                             "smg": "smg==1.13.0"}
    with pytest.raises(ValueError):
        parse_router("smg:kv_aware")
    assert kv_event_source_args(["127.0.0.1:8001@tcp://127.0.0.1:5557", "127.0.0.1:8002@tcp://127.0.0.1:5559"],
                                32, "m") == [
        "--kv-event-source", "http://127.0.0.1:8001=tcp://127.0.0.1:5557",
        "--kv-event-replay-source", "http://127.0.0.1:8001=tcp://127.0.0.1:5558",
        "--kv-event-source", "http://127.0.0.1:8002=tcp://127.0.0.1:5559",
        "--kv-event-replay-source", "http://127.0.0.1:8002=tcp://127.0.0.1:5560",
        "--kv-event-block-size", "32", "--kv-event-model", "m"]

"""--virtual: our policies' scheduling code on the model servers' virtual-time fleet (in process, no I/O)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest

from prefixroute.bench import results, upper_bound, virtual, workloads


def _wl(num_requests=60, rate=20.0, **kw):
    base = dict(num_groups=4, prefix_tokens=512, question_tokens=16, output_tokens=8, seed=1)
    wl = workloads.shared_prompts(num_requests=num_requests, **{**base, **kw})
    return workloads.apply_arrivals(wl, "poisson", rate_rps=rate, seed=1)


def test_one_server_reaches_exactly_the_upper_bound():
    # One server with a huge cache sees every request: its hits are the infinite-cache bound, token for token.
    wl = _wl()
    res, endpoints, _ = virtual.simulate_policy(wl, "random", num_servers=1)
    bound = upper_bound.upper_bound(wl)
    assert len(endpoints) == 1 and all(r.ok for r in res)
    assert sum(r.prompt_tokens for r in res) == bound.prompt_tokens
    assert sum(r.cached_tokens for r in res) == bound.cached_tokens


def test_same_document_shape_peers_skipped_and_prefix_beats_random():
    wl = _wl(num_requests=120, num_groups=8)
    bound = upper_bound.upper_bound(wl).hit_ratio
    doc, ttfts = virtual.run_virtual(wl, bound, ["prefixroute:random", "prefixroute:prefix", "sglang-router"],
                                     num_servers=4, log=lambda _m: None)
    assert results.validate_document(json.loads(json.dumps(doc))) == []
    jsonschema.Draft202012Validator(results.schema()).validate(json.loads(json.dumps(doc)))
    assert [r["router"] for r in doc["runs"]] == ["prefixroute:random", "prefixroute:prefix"]
    assert "sglang-router" in doc["skipped"]
    runs = {r["router"]: r for r in doc["runs"]}
    assert all(r["requests"] == 120 and r["errors"] == 0 for r in runs.values())
    # (results round to 6 decimals)
    assert runs["prefixroute:random"]["hit_ratio"] < runs["prefixroute:prefix"]["hit_ratio"] <= bound + 1e-6
    assert sorted(runs["prefixroute:prefix"]["endpoint_share"]) == [f"sim-{i}:8000" for i in range(4)]
    assert len(ttfts["prefixroute:prefix"]) == 120


def test_same_seed_same_results_and_policies_share_prepared_requests():
    wl = _wl(num_requests=40)
    a, _, _ = virtual.simulate_policy(wl, "random", num_servers=3, seed=5)
    b, _, _ = virtual.simulate_policy(wl, "random", num_servers=3, seed=5)
    assert [(r.endpoint, r.ttft_ms, r.cached_tokens) for r in a] == [(r.endpoint, r.ttft_ms, r.cached_tokens)
                                                                     for r in b]


def _max_overlap(res) -> int:
    """Most requests in flight at once, from (start, end) intervals. An end recomputed from milliseconds may
    land a rounding error after the next request's start at the same instant: 1 ns of slack."""
    events = sorted([(r.start_s, 1) for r in res] + [(r.start_s + r.e2e_ms / 1000.0 - 1e-9, -1) for r in res])
    most = cur = 0
    for _, d in events:
        cur += d
        most = max(most, cur)
    return most


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_keeps_the_concurrency(concurrency):
    wl = workloads.apply_arrivals(_wl(num_requests=12), "closed")
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=2, concurrency=concurrency)
    assert len(res) == 12 and all(r.ok for r in res)
    assert _max_overlap(res) == concurrency
    # each client sends its next request the moment the previous one finishes: no idle gap in the run
    span_s = max(r.start_s + r.e2e_ms / 1000.0 for r in res)
    busy_s = sum(r.e2e_ms for r in res) / 1000.0
    assert busy_s == pytest.approx(span_s * concurrency, rel=0.25 if concurrency > 1 else 1e-9)


@pytest.mark.parametrize("arrival", ["poisson", "closed"])
def test_a_turn_is_sent_only_after_the_previous_turn_finished(arrival):
    # 2 sessions x 4 turns at 50 req/s: Poisson gaps (~20 ms) are shorter than a turn (~100+ ms of decode)
    wl = workloads.multi_turn(num_sessions=2, num_turns=4, system_tokens=64, user_tokens=32, output_tokens=64,
                              seed=2)
    wl = workloads.apply_arrivals(wl, arrival, rate_rps=50.0, seed=2)
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=2, concurrency=8)
    by_index = {r.index: r for r in res}
    assert all(r.ok for r in res)
    deps = [(spec, by_index[spec.after_index]) for spec in wl.requests if spec.after_index is not None]
    assert deps
    for spec, prev in deps:
        me = by_index[spec.index]
        assert me.start_s >= prev.start_s + prev.e2e_ms / 1000.0 - 1e-9
        if spec.arrival_s is not None:
            assert me.start_s >= spec.arrival_s - 1e-9
    # with 8 clients and 2 sessions, only the session order limits concurrency: 2 at a time at most
    if arrival == "closed":
        assert _max_overlap(res) == 2


def test_prompt_longer_than_the_context_window_is_a_400_not_a_crash():
    recs = [workloads.TraceRecord(0, 600, 4, (1, 2)), workloads.TraceRecord(10, 600, 4, (1, 3))]
    wl = workloads.trace_workload(recs)
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=2, fleet_kwargs={"num_gpu_blocks": 36})
    # 36 blocks x 16 tokens = 576-token window: a 600-token prompt does not fit.
    assert [r.status for r in res] == [400, 400] and "context window" in res[0].error


@pytest.mark.parametrize("args,expected", [
    (("--time-scale=0.5",), {"time_scale": 0.5}),
    (("--time-scale", "2", "--num-gpu-blocks", "100"), {"time_scale": 2.0, "num_gpu_blocks": 100}),
    (("--seed", "3"), {}),
])
def test_server_flags_map_to_the_fleet(args, expected):
    assert virtual._fleet_kwargs(args) == expected


def test_cli_virtual_trace_writes_outputs(tmp_path):
    trace = tmp_path / "t.jsonl"
    workloads.write_trace(trace, [workloads.TraceRecord(i * 100, 700 + i, 8, (0, 10 + i % 3)) for i in range(30)])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", "--virtual", "--trace", str(trace),
                           "--trace-stop", "20", "--trace-time-scale", "0.5", "--servers", "8", "--routers",
                           "prefixroute:round-robin,prefixroute:prefix", "--profile", "llama-3.1-8b-h200",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"]["num_requests"] == 20 and doc["workload"]["duration_s"] == pytest.approx(0.95)
    assert doc["workload"]["virtual"] is True
    assert [r["requests"] for r in doc["runs"]] == [20, 20]
    assert (out / "report.md").exists() and (out / "ttft_cdf.png").exists()


# --- our model of sglang-router's cache_aware policy --------------------------------------------------------------
def _sglang(sent: dict[int, list[str]]) -> virtual.SglangCacheAwareModel:
    m = virtual.SglangCacheAwareModel(["a:1", "b:1", "c:1"], block_chars=4)
    for i, texts in sent.items():
        for t in texts:
            m.trees.record(_hashes(t), m.endpoint_ids[i])
    return m


def _hashes(text: str):
    from prefixroute.extproc.routing.hashing import hash_blocks, seed_for

    return hash_blocks(text, seed_for(None, None), 4, 1 << 30)


@pytest.mark.parametrize("sent,text,in_flight,expected", [
    ({1: ["abcdefghijkl"]}, "abcdefgh-xyz", [0, 0, 0], 1),  # 8 of 12 chars match (> 0.3): longest match
    ({1: ["abcdefghijkl"]}, "abcd-other-text-here", [0, 0, 0], 0),  # 4 of 20 (<= 0.3): smallest tree, first
    ({0: ["zzzzzzzz"], 1: ["abcdefghijkl"]}, "qqqq-other-text-here", [0, 0, 0], 2),  # smallest tree is c
    ({1: ["abcdefghijkl"]}, "abcdefgh-xyz", [10, 100, 10], 0),  # 90 > 64 and 100 > 1.5 x 10: least loaded
    ({1: ["abcdefghijkl"]}, "abcdefgh-xyz", [60, 100, 30], 2),  # imbalanced: the least loaded
    ({1: ["abcdefghijkl"]}, "abcdefgh-xyz", [60, 100, 60], 1),  # max - min = 40 <= 64: the cache wins
    ({1: ["abcdefghijkl"]}, "abcdefgh-xyz", [150, 220, 150], 1),  # 70 > 64 but 220 <= 1.5 x 150: cache wins
])
def test_sglang_model_follows_its_three_rules(sent, text, in_flight, expected):
    m = _sglang(sent)
    assert m.choose(text, in_flight) == expected
    assert m.trees.match(_hashes(text)).get(m.endpoint_ids[expected], 0) == len(_hashes(text))  # text recorded


def test_sglang_model_runs_by_name_in_a_virtual_bench():
    wl = _wl(num_requests=40)
    doc, _ = virtual.run_virtual(wl, upper_bound.upper_bound(wl).hit_ratio,
                                 ["prefixroute:prefix", "sim:sglang-cache-aware"], num_servers=2, log=lambda _m: None)
    assert [r["router"] for r in doc["runs"]] == ["prefixroute:prefix", "sim:sglang-cache-aware"]
    assert all(r["requests"] == 40 and r["errors"] == 0 and r["hit_ratio"] > 0 for r in doc["runs"])
    with pytest.raises(ValueError, match="unknown simulated router"):
        virtual.run_virtual(wl, None, ["sim:nope"], num_servers=2, log=lambda _m: None)


@pytest.mark.parametrize("arrival", ["poisson", "closed"])
def test_every_routed_request_is_released_when_it_finishes(monkeypatch, arrival):
    # The virtual runner calls RouterCore.on_release at each finish, as the gateway does at response end:
    # the prefix policy's outstanding prefill is positive while requests run and back to nothing at the end.
    from prefixroute.extproc.routing import router as router_mod

    cores, peaks = [], []

    class Recording(router_mod.RouterCore):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            cores.append(self)

        def route(self, request, endpoints, in_flight):
            d = super().route(request, endpoints, in_flight)
            peaks.append(sum(self.scheduler.policy.outstanding_prefill_tokens().values()))
            return d

    monkeypatch.setattr(router_mod, "RouterCore", Recording)
    wl = workloads.apply_arrivals(_wl(num_requests=30), arrival, rate_rps=20.0, seed=1)
    res, _, _ = virtual.simulate_policy(wl, "prefix", num_servers=2, concurrency=4)
    assert len(cores) == 1 and all(r.ok for r in res)
    assert max(peaks) > 512  # at least one uncached 512-token system prompt was outstanding
    assert cores[0].scheduler.policy.outstanding_prefill_tokens() == {}

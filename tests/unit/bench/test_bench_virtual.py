"""--virtual: the live router service (PoolRouter over a SimulatedPool) on the model servers' virtual-time fleet
(in process, no I/O): same request bytes, headers, settings and in-flight accounting as the gateway."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jsonschema
import orjson
import pytest

from prefixroute.bench import results, upper_bound, virtual_run, workloads
from prefixroute.bench.traces import TraceRecord, trace_workload, write_trace
from prefixroute.model_servers.virtual_fleet import SimRequest
from prefixroute.extproc import factory
from prefixroute.extproc.service import PoolRouter


def _wl(num_requests=60, rate=20.0, **kw):
    base = dict(num_groups=4, prefix_tokens=512, question_tokens=16, output_tokens=8, seed=1)
    wl = workloads.shared_prompts(num_requests=num_requests, **{**base, **kw})
    return workloads.apply_arrivals(wl, "poisson", rate_rps=rate, seed=1)


def test_one_server_reaches_exactly_the_upper_bound():
    # One server with a huge cache sees every request: its hits are the infinite-cache bound, token for token.
    wl = _wl()
    res, endpoints, _ = virtual_run.simulate_policy(wl, "random", num_servers=1)
    bound = upper_bound.upper_bound(wl)
    assert len(endpoints) == 1 and all(r.ok for r in res)
    assert sum(r.prompt_tokens for r in res) == bound.prompt_tokens
    assert sum(r.cached_tokens for r in res) == bound.cached_tokens


def test_same_document_shape_peers_skipped_and_prefix_beats_random():
    wl = _wl(num_requests=120, num_groups=8)
    bound = upper_bound.upper_bound(wl).hit_ratio
    doc, ttfts = virtual_run.run_virtual(wl, bound, ["prefixroute:random", "prefixroute:prefix", "sglang-router"],
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
    a, _, _ = virtual_run.simulate_policy(wl, "random", num_servers=3, seed=5)
    b, _, _ = virtual_run.simulate_policy(wl, "random", num_servers=3, seed=5)
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
    res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, concurrency=concurrency)
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
    res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, concurrency=8)
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


def test_prompt_longer_than_the_context_window_is_the_servers_400_not_a_crash():
    recs = [TraceRecord(0, 600, 4, (1, 2)), TraceRecord(10, 600, 4, (1, 3)),
            TraceRecord(20, 100, 4, (1,))]
    wl = trace_workload(recs)
    spec = virtual_run.engine_spec(server_args=("--num-gpu-blocks", "36"))
    res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, spec=spec)
    # 36 blocks x 16 tokens = 576-token window: a 600-token prompt does not fit; the server says so (routed first).
    assert [r.status for r in res] == [400, 400, 200]
    assert "maximum context length is 576 tokens" in res[0].error and res[0].endpoint is not None


@pytest.mark.parametrize("args,expected", [
    (("--time-scale=0.5",), {"time_scale": 0.5}),
    (("--time-scale", "2", "--num-gpu-blocks", "100", "--max-num-seqs=3"),
     {"time_scale": 2.0, "num_gpu_blocks": 100, "max_num_seqs": 3}),
    (("--seed", "3", "--port", "9"), {}),  # no effect on a simulated engine
])
def test_server_args_are_parsed_by_the_model_servers_parser(args, expected):
    changed = dataclasses.asdict(virtual_run.engine_spec("llama-3.1-8b-h200", args).config)
    default = dataclasses.asdict(virtual_run.engine_spec("llama-3.1-8b-h200").config)
    assert {k: v for k, v in changed.items() if default[k] != v} == expected


def test_server_args_set_the_window_models_and_default_max_tokens():
    spec = virtual_run.engine_spec("", ("--max-model-len=4096", "--lora-modules=sql,chat", "--served-model-name=m",
                                    "--default-max-tokens=5", "--profile=llama-3.1-70b-h200-tp4"))
    assert (spec.max_model_len, spec.models, spec.profile.name) == (4096, {"m", "sql", "chat"},
                                                                     "llama-3.1-70b-h200-tp4")
    req = SimRequest.from_body("0", 0.0, "/v1/completions", b'{"prompt": "hi", "model": "sql"}', spec)
    assert (req.model, req.max_tokens) == ("sql", 5)


@pytest.mark.parametrize("args,message", [
    (("--no-such-flag",), "unknown model-server flag"),
    (("--time-scale", "fast"), "--time-scale"),
    (("--fail-ratio=0.1",), "--fail-ratio is not simulated"),
    (("--extra-latency-ms", "5"), "--extra-latency-ms is not simulated"),
    (("--refuse-connections",), "--refuse-connections is not simulated"),
    (("--profile", "gpt-9"), "unknown profile"),
])
def test_unknown_or_unsimulated_server_args_are_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        virtual_run.engine_spec("", args)






# --- our model of sglang-router's cache_aware policy --------------------------------------------------------------
def _sglang(sent: dict[int, list[str]]) -> virtual_run.SglangCacheAwareModel:
    m = virtual_run.SglangCacheAwareModel(["a:1", "b:1", "c:1"], block_chars=4)
    for i, texts in sent.items():
        for t in texts:
            m.trees[m.endpoint_ids[i]].update(_hashes(t))
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
    assert m.match(_hashes(text))[expected] == len(_hashes(text))  # text recorded


def test_sglang_model_runs_by_name_in_a_virtual_bench():
    wl = _wl(num_requests=40)
    doc, _ = virtual_run.run_virtual(wl, upper_bound.upper_bound(wl).hit_ratio,
                                 ["prefixroute:prefix", "sim:sglang-cache-aware"], num_servers=2, log=lambda _m: None)
    assert [r["router"] for r in doc["runs"]] == ["prefixroute:prefix", "sim:sglang-cache-aware"]
    assert all(r["requests"] == 40 and r["errors"] == 0 and r["hit_ratio"] > 0 for r in doc["runs"])
    with pytest.raises(ValueError, match="unknown simulated router"):
        virtual_run.run_virtual(wl, None, ["sim:nope"], num_servers=2, log=lambda _m: None)


class _RecordingRouter(PoolRouter):
    """The live PoolRouter, recording what it was asked and what its pool counted at each pick."""

    made: list[_RecordingRouter] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls, self.in_flight_at_pick, self.prefill_at_pick = [], [], []
        _RecordingRouter.made.append(self)

    def route(self, method, path, headers, body):
        pick = super().route(method, path, headers, body)
        self.calls.append((method, path, dict(headers), body, pick.request))
        self.in_flight_at_pick.append(sum(self.pool.in_flight.values()))
        self.prefill_at_pick.append(sum(self.core.learner.outstanding_prefill_tokens().values()))
        return pick


@pytest.fixture
def recording(monkeypatch):
    _RecordingRouter.made = []
    monkeypatch.setattr(factory, "PoolRouter", _RecordingRouter)  # what the one factory builds
    return _RecordingRouter.made


@pytest.mark.parametrize("arrival", ["poisson", "closed"])
def test_every_pick_is_counted_in_flight_and_released_when_it_finishes(recording, arrival):
    # In-flight is the router's own count: picked at arrival, released at each finish as the gateway does at
    # response end; the prefix policy's outstanding prefill is positive while requests run, nothing at the end.
    wl = workloads.apply_arrivals(_wl(num_requests=30), arrival, rate_rps=20.0, seed=1)
    res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, concurrency=4)
    (router,) = recording
    assert all(r.ok for r in res) and len(router.calls) == 30
    assert max(router.in_flight_at_pick) == (4 if arrival == "closed" else _max_overlap(res))
    assert max(router.prefill_at_pick) > 512  # at least one uncached 512-token system prompt was outstanding
    assert dict(router.pool.in_flight) == {"sim-0:8000": 0, "sim-1:8000": 0}
    assert router.core.learner.outstanding_prefill_tokens() == {}


def test_the_router_parses_the_bytes_and_headers_a_live_client_sends(recording):
    wl = _wl(num_requests=3)
    spec = virtual_run.engine_spec()
    virtual_run.simulate_policy(wl, "prefix", num_servers=2, spec=spec)
    (router,) = recording
    for (method, path, headers, body, request), req in zip(router.calls, wl.requests):
        assert (method, path, headers) == ("POST", req.path, {"content-type": "application/json"})
        assert body == orjson.dumps(req.body(spec.served_model_name))  # what bench/client.py sends
        assert request.model == spec.served_model_name
    assert router.settings is router.core.settings  # one settings object parses and routes


def test_tenant_header_reaches_the_router_and_keeps_tenants_apart(recording, monkeypatch):
    # Two tenants send the same prompt: the tenant header salts the router's hashes (the server's cache is not
    # salted by a header, as vLLM's is not), so the prefix index never matches one tenant's prefix for the other.
    # The header counts only where the operator trusts an ingress to set it (extproc/tenants.py), as here.
    monkeypatch.setenv("PREFIXROUTE_TRUSTED_HEADERS", "tenant,fairness")
    wl = workloads.apply_arrivals(workloads.shared_prompts(num_requests=40, num_groups=1, prefix_tokens=512,
                                                           question_tokens=16, output_tokens=4, seed=3),
                                  "poisson", rate_rps=5.0, seed=3)
    spec = virtual_run.engine_spec()
    sims = [SimRequest.from_body(s.request_id, s.arrival_s, s.path, s.body, spec,
                                 {**s.headers, "x-prefixroute-tenant": f"t{int(s.request_id) % 2}"})
            for s in virtual_run.build_sim_requests(wl, spec)]
    # Text blocks (index source approximate): the tenant salts them. (Token blocks mirror the servers' caches,
    # which tenants share unless they send cache_salt: tests/unit/routing/test_routing_tokens.py.)
    virtual_run.simulate_policy(wl, "prefix", num_servers=4, spec=spec, sims=sims, index_source="approximate")
    (router,) = recording
    requests = [c[4] for c in router.calls]
    assert {r.tenant for r in requests} == {"t0", "t1"}
    first = {r.tenant: r.block_hashes[0] for r in requests}
    assert first["t0"] != first["t1"]


def test_our_router_starts_from_the_simulated_fleets_own_speed(monkeypatch):
    """`prefixroute bench` configures our time model's prior from the fleet it starts (profile, --time-scale),
    as an operator sets --ttft-prior-tokens-per-s for their GPUs; the environment's setting wins."""
    from prefixroute.bench.fleet import FleetConfig
    from prefixroute.bench.runner import prior_gateway_args

    for name in ("PREFIXROUTE_TTFT_PRIOR_TOKENS_PER_S", "PREFIXROUTE_TTFT_PRIOR_BASE_S"):
        monkeypatch.delenv(name, raising=False)
    spec = virtual_run.engine_spec("llama-3.1-70b-h200-tp4")
    rate, base = spec.time_model_prior()
    # one full chunk of the profile's cost model: ~0.64 s for 8,192 tokens on the 70B TP4 profile
    assert 11_000 < rate < 15_000 and 0.005 < base < 0.05
    slow = prior_gateway_args(FleetConfig(4, "llama-3.1-70b-h200-tp4", ("--time-scale=6",)))
    got = dict(a.lstrip("-").split("=") for a in slow)
    assert float(got["ttft-prior-tokens-per-s"]) == pytest.approx(rate / 6, rel=1e-4)
    assert float(got["ttft-prior-base-s"]) == pytest.approx(base * 6, rel=1e-4)
    monkeypatch.setenv("PREFIXROUTE_TTFT_PRIOR_TOKENS_PER_S", "5000")
    assert prior_gateway_args(FleetConfig(4, "llama-3.1-70b-h200-tp4")) == ()

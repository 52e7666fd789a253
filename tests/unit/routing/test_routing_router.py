"""RouterCore: model check, errors, index bookkeeping (routing/router.py)."""

from __future__ import annotations

import dataclasses

import pytest

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing.request import parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState

import orjson

S = RoutingSettings(rng_seed=3)
A, B, C = EndpointId("127.0.0.1:8001"), EndpointId("127.0.0.1:8002"), EndpointId("127.0.0.1:8003")
PROMPT = "shared system prompt " * 50


def chat(model: str | None = "m", content: str = PROMPT):
    body = {"messages": [{"role": "system", "content": content}, {"role": "user", "content": "q"}]}
    if model is not None:
        body["model"] = model
    return parse_request("POST", "/v1/chat/completions", {}, orjson.dumps(body), S)


@pytest.mark.parametrize("states,model,status", [
    ([], "m", 503),
    ([EndpointState(A, models=frozenset({"x"})), EndpointState(B, models=frozenset({"y"}))], "m", 404),
    ([EndpointState(A, models=frozenset({"x"}), healthy=False)], "m", 404),
    ([EndpointState(A, models=frozenset({"m"}), healthy=False), EndpointState(B, models=frozenset({"y"}))], "m",
     503),
    ([EndpointState(A, healthy=False)], "m", 503),  # models unknown and down: might serve it -> 503
    ([EndpointState(A, healthy=False)], None, 503),
])
def test_errors(states, model, status):
    with pytest.raises(OpenAIError) as info:
        RouterCore(S).route(chat(model), states, {})
    assert info.value.status == status
    if status == 503:
        assert info.value.retry_after_s and info.value.retry_after_s >= 1
    else:
        assert info.value.param == "model" and "`m`" in info.value.message


@pytest.mark.parametrize("states,model,expected", [
    ([EndpointState(A, models=frozenset({"x"})), EndpointState(B, models=frozenset({"m", "lora"}))], "lora", B),
    ([EndpointState(A, models=frozenset({"x"})), EndpointState(B)], "m", B),  # unknown models: eligible
])
def test_model_restricts_the_choice(states, model, expected):
    d = RouterCore(S).route(chat(model), states, {})
    assert d.endpoints == (expected,)


def test_route_records_the_pick_and_the_next_request_has_affinity():
    core = RouterCore(S)
    states = [EndpointState(A), EndpointState(B), EndpointState(C)]
    first = core.route(chat(), states, {})
    assert first.reason == "cold" and core.index.num_entries(first.endpoints[0]) == first.total_blocks
    again = core.route(chat(), states, {})
    assert (again.reason, again.endpoints[0], again.predicted_hit_ratio) == ("affinity", first.endpoints[0], 1.0)


def test_on_decided_sees_the_final_decision_before_the_pick_is_recorded():
    core = RouterCore(S)
    states = [EndpointState(A), EndpointState(B), EndpointState(C)]
    seen = []

    def on_decided(d):
        seen.append((d, core.index.num_entries()))

    d = core.route(chat(), states, {}, on_decided=on_decided)
    assert seen == [(d, 0)] and core.index.num_entries(d.endpoints[0]) == d.total_blocks
    other = core.route(parse_request("GET", "/v1/models", {}, b"", S), states, {}, on_decided=on_decided)
    assert seen[-1][0] is other and len(seen) == 2
    with pytest.raises(OpenAIError):  # a refusal is no decision
        core.route(chat("nope"), [EndpointState(A, models=frozenset({"x"}))], {}, on_decided=on_decided)
    assert len(seen) == 2


def test_other_requests_go_to_the_least_loaded_healthy_endpoint_without_indexing():
    core = RouterCore(S)
    req = parse_request("GET", "/v1/models", {}, b"", S)
    states = [EndpointState(A), EndpointState(B, healthy=False), EndpointState(C, models=frozenset({"z"}))]
    d = core.route(req, states, {A: 5, C: 1})
    assert d.endpoints == (C, A) and core.index.num_entries() == 0
    with pytest.raises(OpenAIError) as info:
        core.route(req, [EndpointState(A, healthy=False)], {})
    assert info.value.status == 503


def test_sync_endpoints_sizes_the_index_and_drops_removed_endpoints():
    core = RouterCore(S)
    states = [EndpointState(A, num_gpu_blocks=1000, block_size=16), EndpointState(B)]
    core.sync_endpoints(states)
    assert core.index.capacity(A) == 1000 * 16 // 16  # 64-char blocks = 16 tokens each
    assert core.index.capacity(B) == S.default_index_capacity_blocks
    d = core.route(chat(), states, {})
    assert core.index.num_entries(d.endpoints[0]) > 0
    remaining = [s for s in states if s.endpoint != d.endpoints[0]]
    core.sync_endpoints(remaining)
    assert core.index.num_entries() == 0
    assert core.route(chat(), remaining, {}).reason == "cold"


def test_capacity_from_scrape_follows_chars_per_token():
    core = RouterCore(RoutingSettings(chars_per_token=2.0))  # 64 chars = 32 tokens per router block
    assert core.capacity_blocks(EndpointState(A, num_gpu_blocks=100, block_size=16)) == 50


def test_a_host_kv_tier_adds_to_the_capacity_the_own_index_remembers():
    # feedback / approximate: a prefix the GPU offloaded to the host tier is still a hit there (issue 25); the
    # events index follows the tiers itself
    core = RouterCore(RoutingSettings(tokenizer="sim", kv_block_tokens=16))
    assert core.capacity_blocks(EndpointState(A, num_gpu_blocks=100, block_size=16, num_cpu_blocks=400)) == 500
    assert core.capacity_blocks(EndpointState(A, num_gpu_blocks=100, block_size=16)) == 100
    assert core.capacity_blocks(EndpointState(A, num_cpu_blocks=400)) == S.default_index_capacity_blocks
    core.sync_endpoints([EndpointState(A, num_gpu_blocks=100, block_size=16)])
    assert core.index.capacity(A) == 100
    core.sync_endpoints([EndpointState(A, num_gpu_blocks=100, block_size=16, num_cpu_blocks=400)])  # tier seen
    assert core.index.capacity(A) == 500


def test_record_failover_teaches_the_index_where_the_cache_is():
    core = RouterCore(S)
    states = [EndpointState(A), EndpointState(B)]
    r = chat()
    d = core.route(r, states, {})
    other = B if d.endpoints[0] == A else A
    core.record_failover(r, other)
    core.on_endpoint_removed(d.endpoints[0])
    d2 = core.route(r, [EndpointState(other)], {})
    assert (d2.reason, d2.endpoints) == ("affinity", (other,))


@pytest.mark.parametrize("track_prefill", [True, False])
def test_on_release_returns_outstanding_prefill_to_zero(track_prefill):
    core = RouterCore(S, track_prefill=track_prefill)
    states = [EndpointState(A), EndpointState(B), EndpointState(C)]
    routed = [(r, core.route(r, states, {})) for r in (chat(), chat(content="another prompt " * 80), chat())]
    outstanding = core.learner.outstanding_prefill_tokens()
    if track_prefill:
        # first request: its whole prompt; second: another prompt; third: the first one's cached blocks saved
        first, _ = routed[0]
        assert sum(outstanding.values()) > first.num_prompt_chars / S.chars_per_token
    else:
        assert outstanding == {}
    for r, d in routed:
        core.learner.on_release(r, d)
    assert core.learner.outstanding_prefill_tokens() == {}


@pytest.mark.parametrize("policy", ["least-load", "round-robin", "random", "consistent-hash"])
def test_releases_and_removals_do_not_change_policies_without_tracking(policy):
    # A baseline has no time model to tell of releases (no learner), and a core told of a removed endpoint
    # decides exactly as its twin that is told nothing (same seed, same requests); the tie breaks draw on the
    # shared rng, so a hook that drew from it or touched the policy's counters would make the two diverge.
    settings = RoutingSettings(policy=policy, rng_seed=5)
    told, twin = RouterCore(settings, track_prefill=True), RouterCore(settings, track_prefill=True)
    states = [EndpointState(EndpointId(f"127.0.0.1:{9000 + i}")) for i in range(4)]
    got, want = [], []
    for i in range(40):
        r = chat(content=f"prompt {i % 6} " * 40)
        d = told.route(r, states, {})
        assert told.learner is None
        told.on_endpoint_removed(EndpointId("127.0.0.1:1"))  # never in the pool: nothing for the index either
        got.append(d.endpoints)
        want.append(twin.route(r, states, {}).endpoints)
    assert got == want
    assert len({d[0] for d in got}) > 1  # the sequence exercises the policy (not one endpoint throughout)


def test_removed_endpoint_drops_its_outstanding_prefill():
    core = RouterCore(S, track_prefill=True)
    states = [EndpointState(A), EndpointState(B)]
    r = chat()
    d = core.route(r, states, {})
    core.route(chat(content="another prompt " * 80), states, {})
    gone = d.endpoints[0]
    assert gone in core.learner.outstanding_prefill_tokens()
    core.sync_endpoints(states)
    core.sync_endpoints([s for s in states if s.endpoint != gone])
    assert gone not in core.learner.outstanding_prefill_tokens()
    core.learner.on_release(r, d)  # a late release for the removed endpoint is absorbed
    assert gone not in core.learner.outstanding_prefill_tokens()


def test_a_restart_epoch_change_clears_that_endpoint_only_and_keeps_its_capacity():
    core = RouterCore(S)
    states = [EndpointState(A, num_gpu_blocks=100, block_size=16), EndpointState(B), EndpointState(C)]
    core.sync_endpoints(states)
    d = core.route(chat(), states, {})
    held = d.endpoints[0]
    other = core.route(chat(content="another prompt " * 60), states, {}).endpoints[0]
    assert core.route(chat(), states, {}).reason == "affinity"
    capacity = core.index.capacity(A)
    core.sync_endpoints(states)  # same epochs: nothing happens
    assert core.index.num_entries(held) > 0 and core.num_caches_cleared == 0
    restarted = [dataclasses.replace(s, restart_epoch=1) if s.endpoint == held else s for s in states]
    core.sync_endpoints(restarted)
    assert core.index.num_entries(held) == 0 and core.num_caches_cleared == 1
    assert other == held or core.index.num_entries(other) > 0  # the others keep theirs
    assert core.index.capacity(A) == capacity
    again = core.route(chat(), restarted, {})
    assert again.reason != "affinity" and again.matched_blocks == 0 and again.predicted_hit_ratio == 0.0
    core.sync_endpoints(restarted)
    assert core.num_caches_cleared == 1  # one clear per epoch change


def test_an_endpoint_first_seen_with_a_nonzero_epoch_is_not_cleared():
    core = RouterCore(S)
    core.sync_endpoints([EndpointState(A, restart_epoch=3)])
    assert core.num_caches_cleared == 0

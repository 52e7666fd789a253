"""Virtual-time fleet: routing callback, results, endpoint states, determinism, prefix-aware vs random."""

from __future__ import annotations

import random

import pytest

from prefixroute.model_servers.virtual import SimRequest, VirtualFleet
from prefixroute.extproc.routing.types import EndpointState


def workload(n=300, rate=40.0, seed=0):
    rng = random.Random(seed)
    prefixes = [f"System prompt {k}. " + "context " * 500 for k in range(8)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        k = rng.randrange(8)
        out.append(SimRequest.from_text(f"r{i}", t, prefixes[k] + f"question {i} " * 20, max_tokens=32, meta=k))
    return out


def test_results_and_states():
    fleet = VirtualFleet(num_servers=4)
    seen = []

    def route(req, f):
        states = f.endpoint_states()
        assert all(isinstance(s, EndpointState) for s in states)
        seen.append(states)
        return min(range(4), key=lambda i: (states[i].num_requests_running, i))

    res = fleet.run(workload(80), route)
    assert len(res) == 80
    assert {s.endpoint for s in seen[0]} == {"sim-0:8000", "sim-1:8000", "sim-2:8000", "sim-3:8000"}
    assert seen[0][0].num_gpu_blocks == 52852 and seen[0][0].block_size == 16
    assert any(s.num_requests_running for st in seen for s in st)
    for r in res:
        assert 0 < r.ttft_s <= r.e2e_s and r.completion_tokens == 32
        assert r.cached_tokens <= r.prompt_tokens - 1 and r.cached_tokens % 16 == 0
        assert r.endpoint == fleet.endpoint_ids[r.server]


def test_deterministic_and_prefix_affinity_beats_random():
    def affinity(req, f):
        return req.meta % f.num_servers

    rng = random.Random(3)

    def rand(req, f):
        return rng.randrange(f.num_servers)

    a1 = VirtualFleet(num_servers=8).run(workload(), affinity)
    a2 = VirtualFleet(num_servers=8).run(workload(), affinity)
    r = VirtualFleet(num_servers=8).run(workload(), rand)
    assert [(x.ttft_s, x.cached_tokens) for x in a1] == [(x.ttft_s, x.cached_tokens) for x in a2]
    hit = lambda res: sum(x.cached_tokens for x in res) / sum(x.prompt_tokens for x in res)  # noqa: E731
    assert hit(a1) > hit(r)
    assert sorted(x.ttft_s for x in a1)[150] < sorted(x.ttft_s for x in r)[150]


def test_route_by_endpoint_id_and_oracle_prefix_lookup():
    fleet = VirtualFleet(num_servers=2)
    reqs = workload(4, rate=1.0)
    fleet.run(reqs[:1], lambda req, f: "sim-1:8000")
    assert fleet.cached_prefix_tokens(reqs[0])[0] == 0
    assert fleet.cached_prefix_tokens(reqs[0])[1] > 0


def test_out_of_order_and_oversized_requests_rejected():
    fleet = VirtualFleet(num_servers=1, num_gpu_blocks=10)
    with pytest.raises(ValueError, match="exceeds"):
        fleet.run([SimRequest.from_text("big", 0.0, "x" * 1000)], lambda r, f: 0)
    fleet.run([SimRequest.from_text("a", 5.0, "hello")], lambda r, f: 0)
    with pytest.raises(ValueError, match="before now"):
        fleet.run([SimRequest.from_text("b", 1.0, "hello")], lambda r, f: 0)


@pytest.mark.parametrize(("blocks", "rate"), [(None, 40.0), (250, 40.0), (140, 40.0), (2000, 5.0)])
def test_decode_runs_equal_step_by_step(blocks, rate):
    """The coalesced decode fast path gives the same results as simulating every step (incl. eviction)."""
    reqs = workload(150, rate=rate, seed=5)

    def route(req, f):
        return req.meta % 3

    fast = VirtualFleet(num_servers=3, num_gpu_blocks=blocks)
    slow = VirtualFleet(num_servers=3, num_gpu_blocks=blocks, coalesce_decode=False)
    a = fast.run(workload(150, rate=rate, seed=5), route)
    b = slow.run(reqs, route)
    assert [(x.request_id, x.server, x.cached_tokens, x.completion_tokens, x.num_preemptions) for x in a] == \
        [(x.request_id, x.server, x.cached_tokens, x.completion_tokens, x.num_preemptions) for x in b]
    for x, y in zip(a, b):
        assert x.ttft_s == pytest.approx(y.ttft_s, rel=1e-9, abs=1e-9)
        assert x.e2e_s == pytest.approx(y.e2e_s, rel=1e-9, abs=1e-9)
    for e, f in zip(fast.engines, slow.engines):
        assert e.stats.num_steps == f.stats.num_steps
        assert e.cache.num_evictions == f.cache.num_evictions
        assert e.stats.busy_s == pytest.approx(f.stats.busy_s, rel=1e-9)
    if blocks == 250:
        assert sum(e.cache.num_evictions for e in slow.engines) > 0
    if blocks == 140:
        assert sum(e.stats.num_preemptions for e in slow.engines) > 0


def test_on_finish_injects_follow_up_turns():
    """Closed loop: each finished turn sends the next turn (with the reply) at once; later turns hit the cache."""
    fleet = VirtualFleet(num_servers=2)
    convs = {f"c{k}": [{"role": "user", "content": f"conversation {k} " + "background " * 300}] for k in range(4)}
    turns = {c: 0 for c in convs}

    def on_finish(res, f):
        conv = res.request_id.split("/")[0]
        turns[conv] += 1
        if turns[conv] == 3:
            return None
        convs[conv] += [{"role": "assistant", "content": "reply " * res.completion_tokens},
                        {"role": "user", "content": f"follow-up {turns[conv]}"}]
        return [SimRequest.from_messages(f"{conv}/{turns[conv]}", 0.0, list(convs[conv]), max_tokens=8)]

    first = [SimRequest.from_messages(f"{c}/0", i * 0.001, list(m), max_tokens=8) for i, (c, m) in
             enumerate(convs.items())]
    res = fleet.run(first, lambda req, f: int(req.request_id[1]) % 2, on_finish=on_finish)
    assert len(res) == 12 and all(t == 3 for t in turns.values())
    by_id = {r.request_id: r for r in res}
    for c in convs:
        assert by_id[f"{c}/1"].arrival_s == pytest.approx(by_id[f"{c}/0"].arrival_s + by_id[f"{c}/0"].e2e_s)
        assert by_id[f"{c}/1"].cached_tokens >= by_id[f"{c}/0"].prompt_tokens - 16
        assert by_id[f"{c}/2"].cached_tokens > by_id[f"{c}/1"].cached_tokens

"""Virtual-time fleet: requests from body bytes (the server's parser), routing callback, results, refusals, timers,
determinism, prefix-aware vs random, one engine spec with the HTTP server."""

from __future__ import annotations

import random

import orjson
import pytest

from prefixroute.model_servers import tokenizer
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ModelServer, ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet
from prefixroute.openai_errors import OpenAIError

SPEC = EngineSpec.from_settings(ServerSettings())


def spec(**settings) -> EngineSpec:
    return EngineSpec.from_settings(ServerSettings(**settings))


def completion(rid: str, t: float, prompt: str, s: EngineSpec = SPEC, **body) -> SimRequest:
    return SimRequest.from_body(rid, t, "/v1/completions", orjson.dumps({"prompt": prompt, **body}), s)


def chat(rid: str, t: float, messages: list, s: EngineSpec = SPEC, **body) -> SimRequest:
    return SimRequest.from_body(rid, t, "/v1/chat/completions", orjson.dumps({"messages": messages, **body}), s)


def workload(n=300, rate=40.0, seed=0, s: EngineSpec = SPEC) -> tuple[list[SimRequest], dict[str, int]]:
    """Requests over 8 shared prefixes, and each request's prefix group."""
    rng = random.Random(seed)
    prefixes = [f"System prompt {k}. " + "context " * 500 for k in range(8)]
    t, out, group = 0.0, [], {}
    for i in range(n):
        t += rng.expovariate(rate)
        k = rng.randrange(8)
        out.append(completion(f"r{i}", t, prefixes[k] + f"question {i} " * 20, s, max_tokens=32))
        group[f"r{i}"] = k
    return out, group


def test_requests_are_parsed_as_the_http_server_parses_them():
    s = spec(lora_modules=("sql",), default_max_tokens=7)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = chat("a", 0.0, messages, s, model="sql", cache_salt="tenant-1")
    assert r.error is None and (r.model, r.cache_salt, r.max_tokens) == ("sql", "tenant-1", 7)
    assert r.prompt_ids.tolist() == tokenizer.encode(tokenizer.render_chat(messages)).tolist()
    assert completion("b", 0.0, "hi", s, max_tokens=3).model == s.served_model_name  # no model: the served one
    refused = {
        "unknown model": (completion("c", 0.0, "hi", s, model="nope"), 404),
        "over the window": (completion("d", 0.0, "hi", spec(max_model_len=8), max_tokens=8), 400),
        "not JSON": (SimRequest.from_body("e", 0.0, "/v1/completions", b"{", s), 400),
    }
    for what, (req, status) in refused.items():
        assert req.error is not None and req.error.status == status, what
    with pytest.raises(ValueError, match="not a generation path"):
        SimRequest.from_body("f", 0.0, "/v1/models", b"", s)


def test_http_server_and_fleet_build_engines_from_one_spec():
    settings = ServerSettings(profile="llama-3.1-70b-h200-tp4", num_gpu_blocks=900, max_num_seqs=7, max_model_len=5000,
                              served_model_name="served", lora_modules=("a",))
    server = ModelServer(settings)
    fleet = VirtualFleet(EngineSpec.from_settings(settings), num_servers=2)
    for engine in fleet.engines:
        assert engine.config == server.core.config
        assert engine.cost == server.core.cost
    assert (fleet.served, fleet.models, fleet.max_model_len) == (server.served, server.models, server.max_model_len)
    assert fleet.max_model_len == 5000 and fleet.models == {"served", "a"}


def test_results_and_engine_state():
    fleet = VirtualFleet(SPEC, num_servers=4)
    busy = []

    def route(req, f):
        busy.append([e.num_running for e in f.engines])
        return min(range(4), key=lambda i: (f.engines[i].num_running + f.engines[i].num_waiting, i))

    res = fleet.run(workload(80)[0], route)
    assert len(res) == 80
    assert fleet.endpoint_ids == ("sim-0:8000", "sim-1:8000", "sim-2:8000", "sim-3:8000")
    assert fleet.engines[0].config.num_gpu_blocks == 52852 and fleet.block_size == 16
    assert any(any(b) for b in busy)
    for r in res:
        assert r.status == 200 and r.error is None
        assert 0 < r.ttft_s <= r.e2e_s and r.completion_tokens == 32
        assert r.cached_tokens <= r.prompt_tokens - 1 and r.cached_tokens % 16 == 0
        assert r.endpoint == fleet.endpoint_ids[r.server]


def test_router_and_server_refusals_finish_at_once_and_are_reported():
    fleet = VirtualFleet(spec(max_model_len=64), num_servers=2)
    reqs = [completion("ok", 0.0, "hello", fleet.spec, max_tokens=4),
            completion("refused-by-router", 0.1, "hello", fleet.spec, max_tokens=4),
            completion("too-long", 0.2, "word " * 200, fleet.spec, max_tokens=4)]
    routed, finished = [], []

    def route(req, f):
        if req.request_id == "refused-by-router":
            raise OpenAIError(429, "shed")
        routed.append(req.request_id)
        return 1

    res = {r.request_id: r for r in fleet.run(reqs, route, on_finish=lambda r, f: finished.append((r.request_id,
                                                                                                     f.now_s)))}
    assert routed == ["ok", "too-long"]  # a server refusal is routed first, as over HTTP
    assert (res["refused-by-router"].status, res["refused-by-router"].server, res["refused-by-router"].endpoint) \
        == (429, -1, None)
    assert res["too-long"].status == 400 and res["too-long"].endpoint == "sim-1:8000"
    assert "maximum context length is 64" in res["too-long"].error
    assert res["too-long"].ttft_s is None and res["too-long"].e2e_s == 0
    assert ("refused-by-router", 0.1) in finished and ("too-long", 0.2) in finished
    assert res["ok"].status == 200 and fleet.engines[1].stats.num_finished == 1


def test_timers_run_at_their_time_and_do_not_keep_a_run_going():
    fleet = VirtualFleet(SPEC, num_servers=1)
    fired = []

    def periodic():
        fired.append((fleet.now_s, fleet.engines[0].num_running))
        fleet.call_at(fleet.now_s + 0.05, periodic)

    fleet.call_at(0.0, periodic)
    res = fleet.run([completion("a", 0.0, "hello " * 100, max_tokens=64)], lambda r, f: 0)
    assert [t for t, _ in fired] == pytest.approx([0.05 * k for k in range(len(fired))])
    assert fired[0][1] == 0 and any(n == 1 for _, n in fired)  # the timer at 0 ran before the arrival at 0
    assert fired[-1][0] <= res[0].finished_s < fired[-1][0] + 0.05  # returned at the last finish


def test_deterministic_and_prefix_affinity_beats_random():
    reqs, group = workload()

    def affinity(req, f):
        return group[req.request_id] % f.num_servers

    rng = random.Random(3)

    def rand(req, f):
        return rng.randrange(f.num_servers)

    a1 = VirtualFleet(SPEC, num_servers=8).run(workload()[0], affinity)
    a2 = VirtualFleet(SPEC, num_servers=8).run(workload()[0], affinity)
    r = VirtualFleet(SPEC, num_servers=8).run(reqs, rand)
    assert [(x.ttft_s, x.cached_tokens) for x in a1] == [(x.ttft_s, x.cached_tokens) for x in a2]
    hit = lambda res: sum(x.cached_tokens for x in res) / sum(x.prompt_tokens for x in res)  # noqa: E731
    assert hit(a1) > hit(r)
    assert sorted(x.ttft_s for x in a1)[150] < sorted(x.ttft_s for x in r)[150]


def test_route_by_endpoint_id_and_oracle_prefix_lookup():
    fleet = VirtualFleet(SPEC, num_servers=2)
    reqs = workload(4, rate=1.0)[0]
    fleet.run(reqs[:1], lambda req, f: "sim-1:8000")
    assert fleet.cached_prefix_tokens(reqs[0])[0] == 0
    assert fleet.cached_prefix_tokens(reqs[0])[1] > 0


def test_lora_and_cache_salt_keep_caches_apart():
    s = spec(lora_modules=("sql",))
    fleet = VirtualFleet(s, num_servers=1)
    text = "shared context " * 200
    reqs = [completion("base", 0.0, text, s, max_tokens=2), completion("lora", 1.0, text, s, max_tokens=2, model="sql"),
            completion("salted", 2.0, text, s, max_tokens=2, cache_salt="x"),
            completion("base-again", 3.0, text, s, max_tokens=2)]
    res = {r.request_id: r.cached_tokens for r in fleet.run(reqs, lambda r, f: 0)}
    assert res["lora"] == res["salted"] == 0 and res["base-again"] > 0


def test_out_of_order_requests_rejected():
    fleet = VirtualFleet(SPEC, num_servers=1)
    fleet.run([completion("a", 5.0, "hello")], lambda r, f: 0)
    with pytest.raises(ValueError, match="before now"):
        fleet.run([completion("b", 1.0, "hello")], lambda r, f: 0)


@pytest.mark.parametrize(("blocks", "rate"), [(None, 40.0), (250, 40.0), (140, 40.0), (2000, 5.0)])
def test_decode_runs_equal_step_by_step(blocks, rate):
    """The coalesced decode fast path gives the same results as simulating every step (incl. eviction)."""
    s = spec(num_gpu_blocks=blocks)
    reqs, group = workload(150, rate=rate, seed=5, s=s)

    def route(req, f):
        return group[req.request_id] % 3

    fast = VirtualFleet(s, num_servers=3)
    slow = VirtualFleet(s, num_servers=3, coalesce_decode=False)
    a = fast.run(workload(150, rate=rate, seed=5, s=s)[0], route)
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
    fleet = VirtualFleet(SPEC, num_servers=2)
    convs = {f"c{k}": [{"role": "user", "content": f"conversation {k} " + "background " * 300}] for k in range(4)}
    turns = {c: 0 for c in convs}

    def on_finish(res, f):
        conv = res.request_id.split("/")[0]
        turns[conv] += 1
        if turns[conv] == 3:
            return None
        convs[conv] += [{"role": "assistant", "content": "reply " * res.completion_tokens},
                        {"role": "user", "content": f"follow-up {turns[conv]}"}]
        return [chat(f"{conv}/{turns[conv]}", 0.0, list(convs[conv]), max_tokens=8)]

    first = [chat(f"{c}/0", i * 0.001, list(m), max_tokens=8) for i, (c, m) in enumerate(convs.items())]
    res = fleet.run(first, lambda req, f: int(req.request_id[1]) % 2, on_finish=on_finish)
    assert len(res) == 12 and all(t == 3 for t in turns.values())
    by_id = {r.request_id: r for r in res}
    for c in convs:
        assert by_id[f"{c}/1"].arrival_s == pytest.approx(by_id[f"{c}/0"].arrival_s + by_id[f"{c}/0"].e2e_s)
        assert by_id[f"{c}/1"].cached_tokens >= by_id[f"{c}/0"].prompt_tokens - 16
        assert by_id[f"{c}/2"].cached_tokens > by_id[f"{c}/1"].cached_tokens


def test_a_held_request_is_dispatched_or_refused_later_and_its_ttft_counts_the_wait():
    """route returning None holds a request (a gateway queue): dispatched from on_step once the engine is done
    with the first one, its TTFT includes the wait; a refused one finishes then with its error."""
    reqs = [completion(f"r{i}", 0.0, f"prompt {i} " * 200, max_tokens=4) for i in range(3)]
    steps: list[int] = []

    def route(req, fleet):
        return 0 if req.request_id == "r0" else None

    def on_step(fleet, i):
        steps.append(i)
        if fleet.num_held and not fleet.engines[0].running and not fleet.engines[0].waiting:
            fleet.dispatch("r1", 0)
            fleet.refuse("r2", OpenAIError(429, "shed"))

    fleet = VirtualFleet(SPEC, 1)
    res = {r.request_id: r for r in fleet.run(reqs, route, on_step=on_step)}
    assert steps and fleet.num_held == 0
    assert res["r1"].status == 200 and res["r1"].arrival_s == 0.0
    assert res["r1"].first_token_s > res["r0"].finished_s  # it started only after r0 ended
    assert res["r2"].status == 429 and res["r2"].finished_s == res["r0"].finished_s
    assert res["r2"].first_token_s is None

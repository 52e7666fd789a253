"""The issue's "what will be checked" list, on a real server at calibrated (1.0) time scale."""

from __future__ import annotations

import json
import random
import time
from importlib import resources

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.model_servers import tokenizer
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.server import ServerSettings
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet

pytestmark = pytest.mark.integration


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = [f"w{i:03d}" for i in range(500)]
    return " ".join(rng.choice(vocab) for _ in range(n))


def eager_point_s(num_tokens: int) -> float:
    """Measured eager prefill seconds for 8B, interpolated linearly between the calibration points."""
    data = json.loads(resources.files("prefixroute.model_servers").joinpath(
        "calibration", "h200_llama31_prefill.json").read_text())
    pts = sorted((p["new_tokens"], p["seconds_full_model"]) for p in data["models"]["llama-3.1-8b"]["prefill"])
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if n0 <= num_tokens <= n1:
            return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)
    raise AssertionError("out of range")


async def stream_ttft(s: aiohttp.ClientSession, url: str, prompt: str) -> tuple[float, dict]:
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if ttft is None and chunk["choices"]:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    assert ttft is not None and usage is not None
    return ttft, usage


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.name.endswith("_bucket")}


async def test_cold_warm_ttft_and_metrics(server_factory):
    srv = server_factory()  # default profile, time scale 1.0
    base = words(6500, 1)  # 5 bytes per word, 4 bytes per token -> ~8.1k tokens
    n_base = len(tokenizer.encode(base))
    assert 7500 < n_base < 8192
    ending = " " + words(200, 2)  # ~256 tokens
    shared = base[: len(base) - len(ending)]
    async with aiohttp.ClientSession() as s:
        await stream_ttft(s, srv.url, words(100, 3))  # warm the process up (imports, tables)
        cold_s, cold = await stream_ttft(s, srv.url, base)
        warm_s, warm = await stream_ttft(s, srv.url, shared + ending)
        async with s.get(srv.url + "/metrics") as r:
            m = samples(await r.text())
    expected = eager_point_s(cold["prompt_tokens"])
    assert abs(cold_s - expected) <= 0.25 * expected, (cold_s, expected)
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    n_shared = len(tokenizer.encode(shared)) - 1
    assert warm["prompt_tokens_details"]["cached_tokens"] >= 0.9 * n_shared
    assert warm_s < 0.2 * cold_s, (warm_s, cold_s)
    assert m["vllm:prefix_cache_hits_total"] == warm["prompt_tokens_details"]["cached_tokens"]
    assert m["vllm:prompt_tokens_total"] == m["vllm:prefix_cache_queries_total"]
    assert m["vllm:prompt_tokens_total"] > cold["prompt_tokens"] + warm["prompt_tokens"]
    assert m["vllm:request_success_total"] == 3
    assert m["vllm:time_to_first_token_seconds_count"] == 3
    assert m["vllm:generation_tokens_total"] == 6


async def test_prompt_set_larger_than_kv_evicts(server_factory):
    srv = server_factory("--num-gpu-blocks", "200", "--time-scale", "0.05")
    prompts = [words(640, 10 + i) for i in range(5)]  # ~50 blocks each, 250 > 200 blocks
    async with aiohttp.ClientSession() as s:
        for p in prompts:
            await stream_ttft(s, srv.url, p)
        _, again_last = await stream_ttft(s, srv.url, prompts[-1])
        _, again_first = await stream_ttft(s, srv.url, prompts[0])
        async with s.get(srv.url + "/metrics") as r:
            m = samples(await r.text())
    assert again_last["prompt_tokens_details"]["cached_tokens"] > 0.9 * again_last["prompt_tokens"]
    assert again_first["prompt_tokens_details"]["cached_tokens"] == 0  # least recently used: evicted
    assert m["prefixroute:kv_block_evictions_total"] > 0
    assert m["vllm:prefix_cache_hits_total"] == again_last["prompt_tokens_details"]["cached_tokens"]


async def test_virtual_and_http_engines_give_same_cache_hits(server_factory):
    """Same request sequence (shared prefixes, small cache so evictions happen) -> same cached_tokens."""
    blocks = 120
    srv = server_factory("--num-gpu-blocks", str(blocks), "--time-scale", "0.02")
    rng = random.Random(7)
    prefixes = [words(300, 100 + i) for i in range(4)]
    msgs = []
    for i in range(24):
        pre = prefixes[rng.randrange(4)]
        msgs.append([{"role": "system", "content": pre},
                     {"role": "user", "content": words(rng.randrange(5, 200), 200 + i)}])
    http_hits = []
    async with aiohttp.ClientSession() as s:
        for mm in msgs:
            async with s.post(srv.url + "/v1/chat/completions", json={"messages": mm, "max_tokens": 4}) as r:
                assert r.status == 200
                http_hits.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    spec = EngineSpec.from_settings(ServerSettings(num_gpu_blocks=blocks))
    fleet = VirtualFleet(spec, num_servers=1)
    reqs = [SimRequest.from_body(f"r{i}", i * 10.0, "/v1/chat/completions",
                                 orjson.dumps({"messages": mm, "max_tokens": 4}), spec) for i, mm in enumerate(msgs)]
    sim_hits = [r.cached_tokens for r in fleet.run(reqs, lambda req, f: 0)]
    assert sum(1 for h in http_hits if h > 0) >= 8  # the sequence really exercises the cache
    assert fleet.engines[0].cache.num_evictions > 0
    assert sim_hits == http_hits

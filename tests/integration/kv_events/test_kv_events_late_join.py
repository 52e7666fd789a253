"""Late join through the real gateway (Envoy + `prefixroute extproc` + simulated servers publishing KV events):
a router restarted under a warm fleet whose publishers are then quiet (a cache hit publishes nothing) rebuilds
its events index from the replay sockets alone, before it trusts events, and the first request of each of 20
warm prefixes goes to the server holding it.

The same with vLLM 0.33's own publisher between each server and the router (tests/helpers/engine_driver.py
``bridge``: every batch of a simulated server republished through the release's event classes and
``ZmqEventPublisher``; one server's hashes as ints, the other's as bytes): 0 decode errors, every block
indexed, live and after the restart. Skipped, saying so, without the vllm 0.33.0 wheel here.
"""

from __future__ import annotations

import json
import urllib.request
from contextlib import ExitStack

import pytest

from helpers import engines
from helpers.fleet import MODEL
from helpers.waiting import until
from prefixroute.bench.fleet import free_port_pairs
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.model_servers.kv_events_publisher import config_json
from prefixroute.procs import ProcessGroup, free_port, http_ok, prefixroute_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NUM_PREFIXES = 20
RELEASE = engines.BY_NAME["vllm-0.33.0"]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _samples(text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels.get("endpoint", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def _states(text: str) -> dict[str, str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["endpoint"]: s.labels["state"] for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "prefixroute_kv_events_state" and s.value}


def _chat(url: str, prefix: int, question: str) -> tuple[str, int]:
    """(served endpoint, cached prompt tokens) of one chat with warm prefix `prefix`."""
    body = {"model": MODEL, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": " ".join(f"p{prefix}-w{j}" for j in range(120))},
                         {"role": "user", "content": question}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        served = r.headers["x-gateway-destination-endpoint-served"]
        text = r.read().decode()
    usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
             if line.startswith("data: {") and '"prompt_tokens"' in line][-1]
    return served, usage["prompt_tokens_details"]["cached_tokens"]


def _run(tmp_path, stack: ExitStack, release_src=None) -> None:
    group = stack.enter_context(ProcessGroup(tmp_path, ready_timeout_s=20.0))
    servers, specs = [], []
    for i, (pub, _) in enumerate(free_port_pairs(2)):
        port = free_port()
        ep = f"127.0.0.1:{port}"
        group.start(f"s{i}", prefixroute_argv("model-server", "--port", str(port), "--id", f"s{i}", "--time-scale",
                                              "0.02", "--kv-events-config", config_json(pub)),
                    ready=lambda ep=ep: http_ok(f"http://{ep}/health", timeout_s=1.0))
        servers.append(ep)
        if release_src is None:
            specs.append(f"{ep}@tcp://127.0.0.1:{pub}")
            continue
        bridge_pub, bridge_replay = free_port_pairs(1)[0]
        bridge = engines.EngineProcess(RELEASE, release_src, "bridge", "--from", f"tcp://127.0.0.1:{pub}",
                                       "--endpoint", f"tcp://127.0.0.1:{bridge_pub}", "--replay",
                                       f"tcp://127.0.0.1:{bridge_replay}", "--topic", "kv-events",
                                       bytes_hashes=i == 1, log_path=tmp_path / f"bridge{i}.log")
        stack.enter_context(bridge)
        specs.append(f"{ep}@tcp://127.0.0.1:{bridge_pub}")
    gw = stack.enter_context(GatewayProcesses(
        GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1",
                        expose_served_endpoint=True),
        RoutingSettings(tokenizer="sim"), PoolSettings(endpoints=tuple(specs)), log_dir=tmp_path))
    metrics_url = f"http://127.0.0.1:{gw.metrics_port}/metrics"

    def server_blocks() -> dict[str, float]:
        return {ep: sum(_samples(_get(f"http://{ep}/metrics"), "prefixroute:kv_cached_blocks").values())
                for ep in servers}

    def in_sync() -> bool:
        return _samples(_get(metrics_url), "prefixroute_kv_event_index_blocks") == server_blocks()

    until(lambda: set(_states(_get(metrics_url)).values()) == {"live"}, 10, message=lambda: _get(metrics_url))
    holders = {p: _chat(gw.url, p, "warm-up")[0] for p in range(NUM_PREFIXES)}
    assert len(set(holders.values())) == 2, holders  # both servers hold some
    until(in_sync, 10,
          message=lambda: (_samples(_get(metrics_url), "prefixroute_kv_event_index_blocks"), server_blocks()))
    before = _get(metrics_url)
    assert sum(_samples(before, "prefixroute_kv_events_decode_errors_total").values()) == 0

    # The router restarts; the servers' publishers stay quiet (nothing is requested meanwhile).
    gw.stop_extproc()
    gw.start_extproc()  # ready once its subscribers replayed the publishers' buffers
    after = _get(metrics_url)
    assert _states(after) == {ep: "live" for ep in servers}, after
    assert _samples(after, "prefixroute_kv_event_index_blocks") == server_blocks(), "rebuilt from the replays alone"
    assert sum(_samples(after, "prefixroute_kv_events_decode_errors_total").values()) == 0
    outcomes = {p: _chat(gw.url, p, "after the restart") for p in range(NUM_PREFIXES)}
    wrong = {p: (served, holders[p]) for p, (served, _) in outcomes.items() if served != holders[p]}
    assert not wrong, f"{len(wrong)} of {NUM_PREFIXES} first requests missed their holder: {wrong}"
    assert all(cached > 0 for _, cached in outcomes.values()), outcomes
    # The requests verified that the servers tokenize as the router does (no token_mismatch can follow).
    until(lambda: _samples(_get(metrics_url), "prefixroute_kv_events_tokens_verified") == {
        ep: 1.0 for ep in servers}, 5, message=lambda: _get(metrics_url))


def test_a_restarted_router_routes_warm_prefixes_to_their_holders(tmp_path):
    with ExitStack() as stack:
        _run(tmp_path, stack)


def test_vllm_033_publisher_a_restarted_router_under_a_warm_fleet(tmp_path):
    wheel = engines.find_wheel(RELEASE)
    if wheel is None:
        pytest.skip(f"{RELEASE.requirement} wheel not found here (PREFIXROUTE_ENGINE_WHEELS, .cache/engine-wheels, "
                    f"pip's cache); tests/data/kv_events/generate.py --download fetches it")
    with ExitStack() as stack:
        _run(tmp_path, stack, engines.extract(wheel, tmp_path / "vllm-0.33.0"))

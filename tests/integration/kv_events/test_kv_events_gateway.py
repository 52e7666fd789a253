"""KV events end to end, through Envoy: simulated servers publish (ZMQ), the router subscribes, matches requests
by token blocks (--tokenizer sim) and its events index holds exactly what each server's cache holds, through
evictions; its predictions match the cached tokens the servers report; a server killed falls back to the
router's own index (feedback) and returns to events, rebuilt, when restarted on the same ports."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from helpers.fleet import MODEL
from helpers.waiting import until
from prefixroute.bench.fleet import free_port_pairs
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.model_servers.kv_events_publisher import config_json
from prefixroute.procs import ProcessGroup, free_port, http_ok, prefixroute_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NUM_GPU_BLOCKS = 700  # ~11k tokens per server: the 6 documents below (~1.9k tokens each) do not all fit on one


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def _samples(text: str, name: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def _chat(url: str, doc: int, q: int) -> tuple[str, int, int]:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
            "messages": [{"role": "system", "content": " ".join(f"doc{doc}-w{j}" for j in range(700))},
                         {"role": "user", "content": f"question {q}"}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        served = r.headers["x-gateway-destination-endpoint-served"]
        text = r.read().decode()
    usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
             if line.startswith("data: {") and '"prompt_tokens"' in line][-1]
    return served, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


class _Server:
    def __init__(self, group: ProcessGroup, name: str, pub: int, block_size: int = 16) -> None:
        self.group, self.name, self.pub = group, name, pub
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = group.start(name, prefixroute_argv(
            "model-server", "--port", str(self.port), "--id", name, "--time-scale", "0.02",
            "--num-gpu-blocks", str(NUM_GPU_BLOCKS * 16 // block_size), "--block-size", str(block_size),
            "--kv-events-config", config_json(pub)),
            ready=lambda: http_ok(f"http://{self.endpoint}/health", timeout_s=1.0))

    def restart(self) -> None:
        self.group.add(self.proc)  # same argv and ports: a new process, a new publisher

    def cached_blocks(self) -> float:
        return sum(_samples(_get(f"http://{self.endpoint}/metrics"), "prefixroute:kv_cached_blocks").values())


class _Fleet:
    """Two simulated servers publishing KV events (`block_size` tokens per block) behind the gateway (the router
    at its default 16), started in `stack`; the router's figures read from its /metrics."""

    def __init__(self, stack: ExitStack, tmp_path, block_size: int = 16) -> None:
        group = stack.enter_context(ProcessGroup(tmp_path, ready_timeout_s=20.0))
        self.servers = [_Server(group, f"s{i}", pub, block_size) for i, (pub, _) in enumerate(free_port_pairs(2))]
        self.gw = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1",
                        expose_served_endpoint=True),
            RoutingSettings(tokenizer="sim"),
            PoolSettings(endpoints=tuple(f"{s.endpoint}@tcp://127.0.0.1:{s.pub}" for s in self.servers)),
            log_dir=tmp_path)
        stack.enter_context(self.gw)
        self.metrics_url = f"http://127.0.0.1:{self.gw.metrics_port}/metrics"

    def by_endpoint(self, name: str, label: str | None = None) -> dict[str, object]:
        """`name`'s samples by endpoint: the value, or with `label` that label of the samples whose value is set."""
        samples = _samples(_get(self.metrics_url), name)
        if label is None:
            return {dict(k)["endpoint"]: v for k, v in samples.items()}
        return {dict(k)["endpoint"]: dict(k)[label] for k, v in samples.items() if v}

    def total_index_clears(self) -> float:
        return sum(_samples(_get(self.metrics_url), "prefixroute_kv_events_index_clears_total").values())

    def router_blocks(self) -> dict[str, object]:
        return self.by_endpoint("prefixroute_kv_event_index_blocks")

    def in_sync(self) -> bool:
        """The router's events index counts exactly the blocks each server's cache holds."""
        blocks = self.router_blocks()
        return all(blocks.get(s.endpoint) == s.cached_blocks() for s in self.servers)


def test_events_index_matches_the_servers_caches_through_envoy(tmp_path):
    with ExitStack() as stack:
        fleet = _Fleet(stack, tmp_path)
        servers, gw, metrics_url, router_blocks, in_sync = (fleet.servers, fleet.gw, fleet.metrics_url,
                                                             fleet.router_blocks, fleet.in_sync)

        def sources() -> dict[str, object]:
            return fleet.by_endpoint("prefixroute_index_source_info", "source")

        until(lambda: set(sources().values()) == {"events"}, 10, message=lambda: sources())
        # Warm-up round, then a sequence over 6 documents that evicts (each server holds ~5 of them).
        outcomes = [_chat(gw.url, d, 0) for d in range(6)]
        with ThreadPoolExecutor(4) as pool:
            outcomes += list(pool.map(lambda i: _chat(gw.url, (i * 7) % 6, i + 1), range(60)))
        until(in_sync, 10, message=lambda: (router_blocks(), [s.cached_blocks() for s in servers]))
        assert sum(s.cached_blocks() for s in servers) > 0
        # The servers evicted (700 blocks each cannot hold what was sent), and the index still agrees.
        total_sent_blocks = sum(p // 16 for _, p, _ in outcomes)
        assert total_sent_blocks > 2 * NUM_GPU_BLOCKS
        # Predictions: the router's predicted cached tokens match what the servers reported within 3 points.
        text = _get(metrics_url)
        prompt = sum(_samples(text, "prefixroute_prompt_tokens_total").values())
        predicted = sum(_samples(text, "prefixroute_predicted_hit_tokens_total").values())
        actual = sum(_samples(text, "prefixroute_actual_hit_tokens_total").values())
        assert prompt > 0 and actual / prompt > 0.3, (prompt, actual)
        assert abs(predicted - actual) / prompt <= 0.03, (predicted, actual, prompt)

        # A server killed: its subscriber loses the connection and the endpoint falls back to feedback.
        victim = servers[0]
        os.kill(victim.proc.pid, signal.SIGKILL)
        until(lambda: sources().get(victim.endpoint) == "feedback", 10, message=lambda: sources())
        # Restarted on the same ports: a new publisher (sequence from 0); the index drops what the old process
        # held and follows the new one, and the endpoint is matched by events again.
        victim.proc.popen.wait()
        victim.restart()
        until(lambda: sources().get(victim.endpoint) == "events", 10, message=lambda: sources())
        for i in range(6):
            _chat(gw.url, i, 100 + i)
        until(in_sync, 10, message=lambda: (router_blocks(), [s.cached_blocks() for s in servers]))


def _follows_servers_at(tmp_path, block_size: int) -> None:
    """Simulated servers at `block_size`-token blocks behind a router at its default 16: the endpoints stay live
    on their events, the index counts the servers' own blocks through evictions, and the predicted cached tokens
    follow what the servers report within 3 points of the prompt tokens."""
    with ExitStack() as stack:
        fleet = _Fleet(stack, tmp_path, block_size=block_size)
        servers, gw, metrics_url, router_blocks, in_sync = (fleet.servers, fleet.gw, fleet.metrics_url,
                                                             fleet.router_blocks, fleet.in_sync)

        def states() -> dict[str, object]:
            return fleet.by_endpoint("prefixroute_kv_events_state", "state")

        until(lambda: set(states().values()) == {"live"}, 10, message=lambda: states())
        outcomes = [_chat(gw.url, d, 0) for d in range(6)]
        with ThreadPoolExecutor(4) as pool:
            outcomes += list(pool.map(lambda i: _chat(gw.url, (i * 7) % 6, i + 1), range(48)))
        until(in_sync, 10, message=lambda: (router_blocks(), [s.cached_blocks() for s in servers]))
        # Sent: more than both servers hold together (each NUM_GPU_BLOCKS x 16 tokens, at any block size).
        assert sum(p for _, p, _ in outcomes) > 2 * NUM_GPU_BLOCKS * 16, "the servers must have evicted"
        # Never block_size_mismatch; a subscriber may be syncing a moment after a gap replay under load.
        until(lambda: set(states().values()) == {"live"}, 10, message=lambda: states())
        text = _get(metrics_url)
        # Each endpoint that served a request published its stores' block size; one that served none (the
        # router may keep six cold documents and their follow-ups on one endpoint: its tie breaks are random)
        # published no store and has no block size, which is right, not a failure.
        served = {ep: sum(1 for o in outcomes if o[0] == ep) for ep in {o[0] for o in outcomes}}
        assert served and set(served) <= {s.endpoint for s in servers}, served
        assert fleet.by_endpoint("prefixroute_kv_events_block_tokens") == {ep: float(block_size)
                                                                          for ep in served}, served
        prompt = sum(_samples(text, "prefixroute_prompt_tokens_total").values())
        predicted = sum(_samples(text, "prefixroute_predicted_hit_tokens_total").values())
        actual = sum(_samples(text, "prefixroute_actual_hit_tokens_total").values())
        print(f"prompt {prompt:.0f}, predicted {predicted:.0f}, actual {actual:.0f} tokens")
        assert prompt > 0 and actual / prompt > 0.3, (prompt, actual)
        assert abs(predicted - actual) / prompt <= 0.03, (predicted, actual, prompt)


def test_servers_at_64_token_blocks_are_matched_by_a_router_at_16(tmp_path):
    """vLLM 0.34's default block size (64): its blocks are split into the router's (the router credits whole
    16-token sub-blocks, a server whole 64-token blocks: at most 48 tokens more per request)."""
    _follows_servers_at(tmp_path, 64)


def test_servers_at_1_token_pages_are_merged_by_a_router_at_16(tmp_path):
    """SGLang's default page (1 token): every prompt forks from the cached documents at a token that is no block
    boundary, and the pages are merged into the router's blocks (the router credits whole 16-token blocks, a
    server every token: at most 15 tokens less per request)."""
    _follows_servers_at(tmp_path, 1)


def test_a_cache_reset_reaches_the_router_with_the_servers_next_step(tmp_path):
    """A server's /reset_prefix_cache empties its cache at once, but its AllBlocksCleared goes out with its next
    engine step, as vLLM's: in between the router still holds the cleared blocks (the stale window). A request
    routed there meanwhile finds nothing cached, and the step that serves it clears the index, which then
    follows the server's blocks again; the document is back in cache for the next request."""
    with ExitStack() as stack:
        fleet = _Fleet(stack, tmp_path)
        until(lambda: set(fleet.by_endpoint("prefixroute_kv_events_state", "state").values()) == {"live"}, 10)
        home, _, _ = _chat(fleet.gw.url, 0, 0)
        until(fleet.in_sync, 10, message=lambda: fleet.router_blocks())
        victim = next(s for s in fleet.servers if s.endpoint == home)
        held = fleet.router_blocks()[home]
        req = urllib.request.Request(f"http://{victim.endpoint}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        assert victim.cached_blocks() == 0
        time.sleep(2.0)  # the router's figures follow its index within ~1 s
        assert fleet.router_blocks()[home] == held > 0  # nothing published yet: the stale window
        assert fleet.total_index_clears() == 0
        served, prompt, cached = _chat(fleet.gw.url, 0, 1)  # the router still believes the document is there
        assert served == home and cached == 0 and prompt > 0
        until(lambda: fleet.total_index_clears() == 1, 10)
        until(fleet.in_sync, 10, message=lambda: (fleet.router_blocks(), [s.cached_blocks() for s in fleet.servers]))
        served, prompt, cached = _chat(fleet.gw.url, 0, 2)
        assert served == home and cached > 0.8 * prompt

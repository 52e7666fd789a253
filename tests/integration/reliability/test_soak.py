"""A 2-minute soak through `prefixroute up` at about half the fleet's capacity, with slow readers mixed in:
nothing is lost, and no process grows without bound (memory sampled after warm-up and at the end), the
prefix index stays within its capacity."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from helpers.stack import LoadGenerator, LocalStack, metric_value, rss_mib, summarize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SOAK_S = 120.0
# Growth allowed between the sample after warm-up and the end, per process (MiB). Python heaps and
# Envoy's allocator settle within the first 30 s; a leak of even 1 KiB per request (~1,400 requests after
# warm-up) is 1.4 MiB, a per-connection buffer left behind by each slow reader is 8 MiB each.
MAX_GROWTH_MIB = {"envoy": 24.0, "extproc": 24.0, "telemetry": 40.0, "server": 24.0}


def _slow_reader(url_port: int, stop: threading.Event) -> None:
    """A client that asks for a long stream and reads 1 byte a second: it must cost bounded memory."""
    import json

    body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "stream": True, "max_tokens": 4000,
                       "ignore_eos": True, "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", url_port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%b" % (len(body), body))
            s.settimeout(2.0)
            while not stop.is_set():
                try:
                    if not s.recv(1):
                        break
                except OSError:
                    break
                time.sleep(1.0)  # the slow reader's pace: 1 byte/s


def test_soak_two_minutes_bounded_and_lossless(tmp_path):
    with LocalStack(tmp_path, num_servers=3) as stack:
        gen = LoadGenerator(stack.url, rate_rps=12.0, num_prefixes=40)
        stop = threading.Event()
        readers = [threading.Thread(target=_slow_reader, args=(stack.gateway_port, stop), daemon=True)
                   for _ in range(4)]
        for r in readers:
            r.start()
        load = threading.Thread(target=lambda: asyncio.run(gen.run(SOAK_S)), daemon=True)
        load.start()
        components = ["envoy", "extproc", "telemetry", *[f"server-{i}" for i in range(stack.num_servers)]]
        pids = {c: stack.pid(c) for c in components}
        time.sleep(30)  # on purpose: memory is compared from after 30 s of warm-up to the end of the soak
        before = {c: rss_mib(p) for c, p in pids.items()}
        load.join(timeout=SOAK_S + 120)
        after = {c: rss_mib(p) for c, p in pids.items()}
        stop.set()
        report = summarize(gen.outcomes)
        print(report)
        print({c: f"{before[c]:.0f} -> {after[c]:.0f} MiB" for c in components})
        assert not load.is_alive()
        assert {c: stack.pid(c) for c in components} == pids, "a component restarted during the soak"
        assert all(o.completed for o in gen.outcomes), report
        assert len(gen.outcomes) > 1000
        for c in components:
            limit = MAX_GROWTH_MIB["server" if c.startswith("server") else c]
            assert after[c] - before[c] < limit, (c, before[c], after[c])
        metrics = stack.router_metrics()
        blocks = metric_value(metrics, "prefixroute_prefix_index_blocks")
        # Events endpoints (the stack's default): what their KV events say they hold, at most each server's KV
        # capacity (the 8B profile's 52,852 blocks); the router's own index would be bounded by its LRU.
        assert 0 < blocks <= stack.num_servers * 52852

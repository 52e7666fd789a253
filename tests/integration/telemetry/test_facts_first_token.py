"""The facts path's early first token report end to end: real Envoy (the facts Lua filter's asynchronous gRPC call
to the replica that routed the request), real `prefixroute extproc` replicas (one, and two: replica k's own
cluster, chosen from the route's name), a real slow simulated model server.

What must hold: a streamed response's first token reaches the router (counted ``early`` in
``prefixroute_facts_first_token_total``: the router's first token call was made) while the stream still runs,
once; the facts record at its end then completes the pick without a second first token.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from helpers.fleet import MODEL, start_fleet
from helpers.stack import metric_value
from helpers.waiting import until
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port

pytestmark = pytest.mark.integration


def metrics(gw: GatewayProcesses, name: str, **labels: str) -> float:
    ports = gw.metrics_ports if gw.num_replicas > 1 else [gw.metrics_port]
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            total += metric_value(r.read().decode(), name, **labels)
    return total


@pytest.fixture(scope="module", params=[1, 2], ids=["one-replica", "two-replicas"])
def gw(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcesses]:
    tmp = tmp_path_factory.mktemp("facts-first-token")
    with ExitStack() as stack:
        # Calibrated time: a 200-token stream decodes for about a second after its first token.
        fleet = start_fleet(stack, 1, tmp, "s", "--time-scale", "1.0")
        g = GatewayProcesses(
            GatewaySettings(port=free_port(), ports="random", extproc_replicas=request.param,
                            listen_address="127.0.0.1", envoy_log_level="info", response_path="facts"),
            RoutingSettings(), PoolSettings(endpoints=tuple(fleet.endpoints)), log_dir=tmp)
        stack.enter_context(g)
        yield g


def test_a_streamed_first_token_reaches_the_router_before_the_stream_ends(gw: GatewayProcesses) -> None:
    early = "prefixroute_facts_first_token_total"
    for i in range(3):
        before = metrics(gw, early, outcome="early")
        matched = metrics(gw, "prefixroute_response_facts_total", outcome="matched")
        conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}: tell me a long story"}],
                "max_tokens": 200, "stream": True, "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data:")  # the first token
        until(lambda: metrics(gw, early, outcome="early") >= before + 1, 5.0, interval_s=0.02,
              message="the early first token report")
        seen = time.perf_counter()
        rest = resp.read()
        ended = time.perf_counter()
        conn.close()
        assert b"[DONE]" in rest
        # The router had the first token while most of the stream was still to come.
        assert ended - seen > 0.3, (ended - seen)
        until(lambda: metrics(gw, "prefixroute_response_facts_total", outcome="matched") >= matched + 1, 5.0,
              message="the facts record")
        assert metrics(gw, early, outcome="early") == before + 1  # once, not again at the record
    assert metrics(gw, early, outcome="unmatched") == 0 and metrics(gw, early, outcome="ignored") == 0
    assert metrics(gw, "prefixroute_response_facts_total", outcome="missing") == 0

"""Endpoint restart detection through the real gateway (issue 11, finding 10): real Envoy + `prefixroute
extproc` + 2 real simulated servers. A prefix is warmed on one server; that server is killed and started again on
the same port (an empty KV cache); the router must notice (its /metrics scrape: counters back near 0, or a new
process_start_time_seconds) and stop predicting a cache hit there. Read from the router's own Prometheus
metrics: decisions by reason, predicted hit tokens, prefix-index blocks per endpoint.
"""

from __future__ import annotations

import http.client
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.fleet import MODEL, start_fleet, start_gateway
from helpers.waiting import until

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"
PROMPT = ("You are the restart-detection assistant; answer tersely and cite the runbook. " * 40).strip()


def ask(gw: object, user: str) -> tuple[str, int]:
    """(server id, cached prompt tokens) of one chat request with the shared prompt."""
    host, port = gw.url.removeprefix("http://").split(":")  # type: ignore[attr-defined]
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": PROMPT},
                                                         {"role": "user", "content": user}]}
    try:
        conn.request("POST", "/v1/chat/completions", body=orjson.dumps(body),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        return resp.getheader(SERVER_ID), orjson.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        conn.close()


def router_metrics(gw: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    url = f"http://127.0.0.1:{gw.metrics_port}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(metrics: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in metrics.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def test_a_restarted_server_is_no_longer_predicted_to_hold_its_old_prefixes(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="r")
    gw = start_gateway(stack, fleet.endpoints, log_dir)
    home, cached = ask(gw, "first")
    assert cached == 0
    home2, cached = ask(gw, "second")
    assert home2 == home and cached > 500  # warm there, and the router knows it
    endpoint = fleet.endpoints[int(home.removeprefix("r"))]
    before = router_metrics(gw)
    assert total(before, "prefixroute_decisions_total", reason="affinity", endpoint=endpoint) >= 1
    assert total(before, "prefixroute_prefix_index_blocks", endpoint=endpoint) > 0

    # Let a scrape see the warm counters (every 100 ms): the simulated server exposes no process start time yet,
    # so the counters going backwards are the evidence, and they need a baseline from the old process. A fixed
    # wait on purpose: five scrape intervals, and nothing outside the pool says when a scrape has landed.
    time.sleep(0.5)
    server = fleet.servers[endpoint]
    server.kill()
    server.spawn()  # same argv: same port, same id, an empty cache
    server.wait_ready(20.0)
    # The pool's next scrape of the new process reports the restart (WARNING in the router's log).
    until(lambda: f"endpoint {endpoint} restarted" in (log_dir / "extproc.log").read_text(), 8.0,
          message=f"the router's log line 'endpoint {endpoint} restarted'")
    after_restart = router_metrics(gw)
    assert total(after_restart, "prefixroute_prefix_index_blocks", endpoint=endpoint) == 0

    who, cached = ask(gw, "third")
    after = router_metrics(gw)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(after_restart, name, **labels)

    assert delta("prefixroute_decisions_total") == 1
    assert delta("prefixroute_decisions_total", reason="affinity") == 0  # not "affinity" with hit 1.0
    assert delta("prefixroute_predicted_hit_tokens_total") == 0
    if who == home:
        assert cached == 0  # the truth the old index entries contradicted: the restarted server held nothing
    # And the index learns again: the next request of the prefix has affinity wherever the third one went.
    who4, cached4 = ask(gw, "fourth")
    assert who4 == who and cached4 > 500

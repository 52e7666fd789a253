"""Routing by Envoy's ext_authz filter (`prefixroute gateway --routing-filter ext_authz_http`): real Envoy 1.40 with
its ext_authz filter in place of the routing ext_proc filter, real `prefixroute extproc` answering its checks over
HTTP/1.1 on a port of its own (authz_http.py), the facts path, simulated model servers and a real `prefixroute
telemetry` receiver.

What must hold: Envoy sends every request where the router picked (its picked route, not the fail-open round
robin), a follow-up of a conversation goes where its prefix is cached, each pick is released by its facts record
(in-flight back to zero, no pick left pending) and its telemetry record gets Envoy's facts; a malformed body gets
the router's OpenAI-format 400 through the denied answer; a body over the limit gets Envoy's 413; with the router
down requests fail open to the round robin; a pick whose record never comes is released after its timeout; the
router's own 503 reaches the client as a 503 with its body (over HTTP it travels at a transport status).
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.fleet import MODEL, Fleet, start_fleet
from helpers.gateway_requests import (client_usage, router_metrics, send, start_facts_gateway,
                                      wait_records)
from helpers.procs import environ_set
from helpers.receiver import ReceiverProc, start_receiver
from helpers.stack import metric_value
from helpers.waiting import until
from prefixroute.extproc.gateway import GatewayProcesses
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import http_get

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"


FILTERS = ("ext_authz_http",)


def start_authz_gateway(stack: ExitStack, endpoints: list[str], log_dir: Path, routing_filter: str, **gateway: object
                        ) -> GatewayProcesses:
    return start_facts_gateway(stack, endpoints, log_dir, routing_filter=routing_filter, envoy_admin="loopback",
                               envoy_log_level="warning", **gateway)


@pytest.fixture(scope="module", params=FILTERS)
def routing_filter(request: pytest.FixtureRequest) -> str:
    return request.param


def envoy_stats(gw: GatewayProcesses) -> dict[str, int]:
    _, text = http_get(f"http://127.0.0.1:{gw.admin_port}/stats?filter=(upstream_rq_total|ext_authz.*)",
                       timeout_s=5)
    return {k: int(v) for k, v in (line.split(": ") for line in text.decode().splitlines() if ": " in line)}


def in_flight(gw: GatewayProcesses) -> float:
    text = router_metrics(gw)
    return sum(v for line in text.splitlines() if line.startswith("prefixroute_endpoint_in_flight{")
               for v in [float(line.rsplit(" ", 1)[1])])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, routing_filter: str
        ) -> Iterator[tuple[ReceiverProc, GatewayProcesses, Fleet]]:
    tmp = tmp_path_factory.mktemp("authz-routing")
    with ExitStack() as stack:
        rcv = start_receiver(tmp / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 3, tmp)
        with environ_set({"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.otlp_url, "OTEL_BSP_SCHEDULE_DELAY": "100"}):
            gw = start_authz_gateway(stack, fleet.endpoints, tmp, routing_filter)
        yield rcv, gw, fleet


def test_the_routing_filter_is_ext_authz_with_the_whole_body(env, routing_filter: str) -> None:
    _, gw, _ = env
    text = gw.config_path.read_text()  # type: ignore[union-attr]
    assert "envoy.filters.http.ext_authz" in text and "with_request_body" in text
    assert "http_service" in text and "grpc_service:\n              envoy_grpc" not in text
    assert "path_prefix: /check" in text and "pack_as_bytes" not in text
    # The ext_proc routing filter is there for the handoff route alone (disabled on every other route).
    assert "name: handoff /v1/chat/completions" in text and "prefixroute.facts" in text


def test_requests_go_where_the_router_picked_and_follow_ups_find_their_prefix(env) -> None:
    rcv, gw, fleet = env
    s0 = envoy_stats(gw)
    matched0 = metric_value(router_metrics(gw), "prefixroute_response_facts_total", outcome="matched")
    homes: dict[int, set[str]] = {}
    sent = []
    conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
    for i in range(12):
        conversation = i % 3
        prompt = f"conversation {conversation}: " + "the quick brown fox jumps over the lazy dog " * 40 + f"turn {i}"
        s = send(gw, prompt, stream=i % 2 == 0, conn=conn)
        sent.append(s)
        assert s.status == 200, s.body[:300]
        homes.setdefault(conversation, set()).add(s.headers[SERVER_ID])
    conn.close()
    s1 = envoy_stats(gw)
    # Every request took the picked route (Envoy's ORIGINAL_DST cluster by the router's header), none the
    # fail-open round robin, and each was one Check answered OK.
    assert s1.get("cluster.picked_endpoint_0.upstream_rq_total", 0) - s0.get(
        "cluster.picked_endpoint_0.upstream_rq_total", 0) == 12, (s0, s1)
    assert s1.get("cluster.endpoint_pool_round_robin.upstream_rq_total", 0) == s0.get(
        "cluster.endpoint_pool_round_robin.upstream_rq_total", 0)
    assert s1["http.gateway.ext_authz.routing.ok"] - s0.get("http.gateway.ext_authz.routing.ok", 0) == 12
    # Prefix affinity: each conversation stayed on one endpoint (its cached prefix).
    assert all(len(h) == 1 for h in homes.values()), homes
    got = wait_records(rcv, [s.trace_id for s in sent])
    for s in sent:
        r, u = got[s.trace_id], client_usage(s)
        assert r["error"] is None and r["status"] == 200, r
        assert r["endpoint"] == s.headers[SERVER_ID] or r["endpoint"] in fleet.endpoints
        assert (r["prompt_tokens"], r["cached_tokens"]) == (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
        assert r["ttft_ms"] is not None and 0 < r["ttft_ms"] <= r["latency_ms"] + 1e-6
    assert any(got[s.trace_id]["cached_tokens"] > 0 for s in sent)
    # Each pick was released by its facts record: nothing in flight, nothing pending, nothing expired.
    until(lambda: metric_value(router_metrics(gw), "prefixroute_response_facts_total", outcome="matched")
          >= matched0 + 12, 5.0, message=lambda: "facts matched")
    until(lambda: in_flight(gw) == 0, 5.0, message=lambda: f"in flight {in_flight(gw)}")
    text = router_metrics(gw)
    assert metric_value(text, "prefixroute_authz_picks_pending") == 0
    assert metric_value(text, "prefixroute_authz_picks_expired_total") == 0


def test_in_flight_counts_a_pick_until_its_response_ends(env) -> None:
    """A slow streamed response holds its endpoint's in-flight count until it ends (the record releases it), as
    the ext_proc stream's close did."""
    _, gw, _ = env
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count slowly " * 50}], "max_tokens": 400,
            "stream": True}
    conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    r.read(64)  # the stream has started
    assert in_flight(gw) == 1
    assert metric_value(router_metrics(gw), "prefixroute_authz_picks_pending") == 1
    r.read()
    conn.close()
    until(lambda: in_flight(gw) == 0, 5.0, message=lambda: f"in flight {in_flight(gw)}")


def test_a_malformed_body_gets_the_routers_openai_400(env) -> None:
    _, gw, _ = env
    s = send(gw, "", raw_body=b'{"model": "m", "messages": [')
    assert s.status == 400
    err = json.loads(s.body)["error"]
    assert err["code"] == 400 and "JSON" in err["message"], err
    assert s.headers["content-type"] == "application/json"
    s = send(gw, "", raw_body=json.dumps({"model": MODEL, "messages": "not a list"}).encode())
    assert s.status == 400 and json.loads(s.body)["error"]["param"] == "messages", s.body


def test_a_body_over_the_limit_gets_envoys_413(env) -> None:
    _, gw, _ = env
    limit = RoutingSettings().max_body_bytes
    s = send(gw, "x" * (limit + 1024))
    assert s.status == 413
    assert json.loads(s.body)["error"]["code"] == 413


@pytest.mark.parametrize("routing_filter", FILTERS)
def test_a_pick_whose_facts_never_come_is_released_after_its_timeout(tmp_path: Path, routing_filter: str) -> None:
    """Envoy's facts logger holds its records 60 s (as if it were down); the router's release timeout is 1 s
    (PREFIXROUTE_EXTPROC_AUTHZ_RELEASE_AFTER_S): the pick is released and counted expired, its record says the facts are
    missing."""
    with ExitStack() as stack:
        rcv = start_receiver(tmp_path / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 2, tmp_path)
        with environ_set({"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.otlp_url, "PREFIXROUTE_EXTPROC_AUTHZ_RELEASE_AFTER_S": "1"}):
            gw = start_authz_gateway(stack, fleet.endpoints, tmp_path, routing_filter, facts_flush_interval_ms=60_000)
        s = send(gw, "lost facts " * 40, stream=True)
        assert s.status == 200
        assert in_flight(gw) == 1  # the response ended, its record has not come
        until(lambda: metric_value(router_metrics(gw), "prefixroute_authz_picks_expired_total") == 1, 10.0,
              message=lambda: "expired pick")
        assert in_flight(gw) == 0
        rec = wait_records(rcv, [s.trace_id])[s.trace_id]
        assert rec["error"] == "response facts missing"


@pytest.mark.parametrize("routing_filter", FILTERS)
def test_with_the_router_down_requests_fail_open_to_the_round_robin(tmp_path: Path, routing_filter: str) -> None:
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = start_authz_gateway(stack, fleet.endpoints, tmp_path, routing_filter)
        assert send(gw, "warm " * 20).status == 200
        assert gw.extproc is not None
        gw.extproc.kill()
        time.sleep(0.3)
        s0 = envoy_stats(gw)
        s = send(gw, "while the router is down " * 20)
        assert s.status == 200
        s1 = envoy_stats(gw)
        assert s1["cluster.endpoint_pool_round_robin.upstream_rq_total"] - s0.get(
            "cluster.endpoint_pool_round_robin.upstream_rq_total", 0) == 1


@pytest.mark.parametrize("routing_filter", FILTERS)
def test_with_two_replicas_each_releases_its_own_picks(tmp_path: Path, routing_filter: str) -> None:
    """Each replica's ok answer names it (x-prefixroute-replica): its picks' facts records come back to it, so
    every pick is released by the replica that made it, none expires and no record goes to the other."""
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = start_authz_gateway(stack, fleet.endpoints, tmp_path, routing_filter, extproc_replicas=2)
        for i in range(16):
            assert send(gw, f"replica picks {i} " + "lorem ipsum " * 30, stream=i % 2 == 0).status == 200

        def per_replica(name: str, **labels: str) -> list[float]:
            out = []
            for port in gw.metrics_ports:
                _, text = http_get(f"http://127.0.0.1:{port}/metrics", timeout_s=5)
                out.append(metric_value(text.decode(), name, **labels))
            return out

        until(lambda: sum(per_replica("prefixroute_response_facts_total", outcome="matched")) >= 16, 5.0,
              message=lambda: f"matched {per_replica('prefixroute_response_facts_total', outcome='matched')}")
        assert all(n > 0 for n in per_replica("prefixroute_response_facts_total", outcome="matched"))
        assert sum(per_replica("prefixroute_response_facts_total", outcome="unmatched")) == 0
        assert per_replica("prefixroute_authz_picks_pending") == [0.0, 0.0]
        assert per_replica("prefixroute_authz_picks_expired_total") == [0.0, 0.0]


@pytest.mark.parametrize("routing_filter", FILTERS)
def test_the_routers_503_reaches_the_client_as_a_503_with_its_body(tmp_path: Path, routing_filter: str) -> None:
    """With its only endpoint down the router refuses with 503 and retry-after. A /tokenize request is refused by
    the check itself: over HTTP Envoy would take a 5xx from the check for the service's failure and fail the
    request open, so it travels at a transport status and the local reply mapping restores it. A chat request is
    one flow control would hold (nothing admits it): handed off, the ext_proc filter's stream refuses it. The
    client sees the same answer either way, and nothing fails open."""
    with ExitStack() as stack:
        fleet = start_fleet(stack, 1, tmp_path)
        gw = start_authz_gateway(stack, fleet.endpoints, tmp_path, routing_filter)
        assert send(gw, "warm " * 20).status == 200
        assert metric_value(router_metrics(gw), "prefixroute_endpoint_healthy") == 1
        (server,) = fleet.servers.values()
        server.kill()
        until(lambda: metric_value(router_metrics(gw), "prefixroute_endpoint_healthy") == 0, 10.0,
              message=lambda: "endpoint still healthy")
        s0 = envoy_stats(gw)
        hold0 = metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="hold")
        tokenize = send(gw, "", method="POST", raw_body=json.dumps({"model": MODEL, "prompt": "hello"}).encode(),
                        path="/tokenize")
        chat = send(gw, "no endpoint left " * 20)
        for s in (tokenize, chat):
            assert s.status == 503, (s.status, s.body[:300])
            err = json.loads(s.body)["error"]
            assert err["code"] == 503 and "no healthy endpoint" in err["message"], err
            assert s.headers["retry-after"] and s.headers["x-prefixroute-refused"] == "503"
            assert s.headers["content-type"] == "application/json"
        s1 = envoy_stats(gw)

        def denied(stats: dict[str, int]) -> int:
            return stats.get("http.gateway.ext_authz.routing.denied", 0)

        assert denied(s1) - denied(s0) == 1  # the /tokenize check
        assert metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="hold") == hold0 + 1
        # Nothing failed open to the round robin.
        assert s1.get("cluster.endpoint_pool_round_robin.upstream_rq_total", 0) == s0.get(
            "cluster.endpoint_pool_round_robin.upstream_rq_total", 0)


def test_a_body_to_parse_off_the_loop_is_handed_to_the_ext_proc_filter(env) -> None:
    """A body of many messages is parsed in the router's worker, which may outlast the ext_authz timeout: the check
    hands it off (its answer names the handoff route alone), the ext_proc routing filter on that route routes it
    by the router's pick, and its record is that stream's (one record, facts matched, nothing pending)."""
    rcv, gw, _ = env
    s0 = envoy_stats(gw)
    handed0 = metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="parse")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(600)]
    s = send(gw, "", raw_body=json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4}).encode())
    assert s.status == 200, s.body[:300]
    s1 = envoy_stats(gw)
    assert s1.get("cluster.picked_endpoint_0.upstream_rq_total", 0) - s0.get(
        "cluster.picked_endpoint_0.upstream_rq_total", 0) == 1
    assert s1.get("cluster.endpoint_pool_round_robin.upstream_rq_total", 0) == s0.get(
        "cluster.endpoint_pool_round_robin.upstream_rq_total", 0)
    assert metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="parse") == handed0 + 1
    rec = wait_records(rcv, [s.trace_id])[s.trace_id]
    assert rec["status"] == 200 and rec["error"] is None and rec["endpoints"], rec
    until(lambda: in_flight(gw) == 0, 5.0, message=lambda: f"in flight {in_flight(gw)}")
    assert metric_value(router_metrics(gw), "prefixroute_authz_picks_pending") == 0


def test_a_body_above_what_the_check_carries_whole_is_handed_off_and_routed(env) -> None:
    """A body over authz_body_bytes (1 MiB: what the router parses on its loop) reaches the check in part only
    (x-envoy-auth-partial-body); the router hands it off at once and the ext_proc filter sends it whole: routed by
    the pick, and whole (1.2 MB of JSON whitespace ahead of a small prompt: any part of it is not JSON, which the
    router and the server would refuse)."""
    _, gw, _ = env
    s0 = envoy_stats(gw)
    handed0 = metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="parse")
    prompt = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a padded request"}],
                         "max_tokens": 4})
    large = send(gw, "", raw_body=b"{" + b" " * 1_200_000 + prompt[1:].encode())
    assert large.status == 200, large.body[:300]
    assert client_usage(large)["prompt_tokens"] > 0
    s1 = envoy_stats(gw)
    assert s1.get("cluster.picked_endpoint_0.upstream_rq_total", 0) - s0.get(
        "cluster.picked_endpoint_0.upstream_rq_total", 0) == 1
    assert metric_value(router_metrics(gw), "prefixroute_authz_handoffs_total", reason="parse") == handed0 + 1

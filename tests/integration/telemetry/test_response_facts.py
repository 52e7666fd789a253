"""The facts path end to end (issue 26 part 1): real Envoy with the facts Lua filter and its OTLP facts logger, no
observing ext_proc filter; real `prefixroute extproc` (which serves OTLP LogsService on its gRPC port), real
simulated model servers and a real `prefixroute telemetry` receiver (the router's records).

What must hold: Envoy's facts records reach the router once per request and do what the observing stream did:
the stored records get status, served endpoint, TTFT and usage with cached tokens; the time model learns first
tokens; a Responses follow-up (``previous_response_id``) goes to the endpoint that holds it without a lookup; and a
pick whose record never comes is recorded with "response facts missing" and counted.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from helpers.fleet import MODEL, Fleet, start_fleet
from helpers.receiver import ReceiverProc, start_receiver
from helpers.stack import metric_value
from helpers.waiting import until
from prefixroute.extproc.gateway import GatewayProcesses
from helpers.gateway_requests import (client_usage, dump, router_metrics, send, start_facts_gateway,
                                      wait_records)
from helpers.procs import environ_set

pytestmark = pytest.mark.integration

SERVER_ID = "x-prefixroute-server-id"


def facts(gw: GatewayProcesses, outcome: str) -> float:
    return metric_value(router_metrics(gw), "prefixroute_response_facts_total", outcome=outcome)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReceiverProc, GatewayProcesses, Fleet]]:
    tmp = tmp_path_factory.mktemp("response-facts")
    with ExitStack() as stack:
        rcv = start_receiver(tmp / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 3, tmp)
        # inherited by the ext_proc child
        with environ_set({"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.otlp_url, "OTEL_BSP_SCHEDULE_DELAY": "100"}):
            gw = start_facts_gateway(stack, fleet.endpoints, tmp)
        yield rcv, gw, fleet


def test_the_gateway_has_no_observing_filter_and_sends_facts_to_the_replica(env) -> None:
    _, gw, _ = env
    s = gw.envoy_settings()
    assert s.response_facts_lua and not s.observe_responses
    text = gw.config_path.read_text()  # type: ignore[union-attr]
    assert "prefixroute.observe_responses" not in text and "prefixroute.facts" in text
    assert "buffer_flush_interval: 0.050s" in text


def test_records_get_envoys_facts_usage_with_cached_tokens_and_a_first_token(env) -> None:
    rcv, gw, fleet = env
    before = facts(gw, "matched")
    learned_before = metric_value(router_metrics(gw), "prefixroute_endpoint_ttft_observations_total")
    delays_before = metric_value(router_metrics(gw), "prefixroute_routing_delay_seconds_count")
    sent = []
    conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
    for i in range(12):
        prompt = f"conversation {i % 3}: " + "the quick brown fox jumps over the lazy dog " * 30 + f"turn {i}"
        sent.append(send(gw, prompt, stream=i % 2 == 0, conn=conn))
    conn.close()
    assert all(s.status == 200 for s in sent)
    got = wait_records(rcv, [s.trace_id for s in sent])
    for s in sent:
        r, u = got[s.trace_id], client_usage(s)
        assert r["error"] is None, r
        assert r["status"] == 200 and r["endpoint"] in fleet.endpoints
        assert (r["prompt_tokens"], r["cached_tokens"]) == (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"])
        assert r["ttft_ms"] is not None and 0 < r["ttft_ms"] <= r["latency_ms"] + 1e-6
        # Envoy's routing delay: the routing filter's round trip, within the request's TTFT
        assert r["routing_ms"] is not None and 0 < r["routing_ms"] < r["ttft_ms"], r
    assert any(got[s.trace_id]["cached_tokens"] > 0 for s in sent)
    until(lambda: facts(gw, "matched") >= before + 12, 5.0, message=lambda: "matched facts")
    # The time model learned from the streamed ones (first token + usage, both from Envoy's record).
    learned = metric_value(router_metrics(gw), "prefixroute_endpoint_ttft_observations_total")
    assert learned >= learned_before + 6, (learned_before, learned)
    assert facts(gw, "missing") == 0
    delays = metric_value(router_metrics(gw), "prefixroute_routing_delay_seconds_count")
    assert delays >= delays_before + 12, (delays_before, delays)


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_follow_up_goes_to_the_endpoint_that_holds_it(env, stream: bool) -> None:
    _, gw, _ = env
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    text = router_metrics(gw)
    learned0 = metric_value(text, "prefixroute_response_ids_learned_total")
    lookups0 = metric_value(text, "prefixroute_response_lookup_requests_total")
    matched0 = metric_value(text, "prefixroute_response_facts_total", outcome="matched")
    homes = []
    for k in range(4):
        raw = c.responses.with_raw_response.create(
            model=MODEL, max_output_tokens=8, stream=stream,
            instructions=f"Agent {k} {stream}: triage incident {k}, answer tersely. " * 30, input=f"Incident {k}?")
        parsed = raw.parse()
        if stream:
            events = list(parsed)
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            parsed = events[-1].response
        homes.append((raw.headers[SERVER_ID], parsed.id))
    # The facts arrive at each stream's end plus the flush interval: the router learns every id.
    until(lambda: metric_value(router_metrics(gw), "prefixroute_response_ids_learned_total") >= learned0 + 4, 5.0,
          message=lambda: "response ids learned")
    for home, rid in homes:
        raw = c.responses.with_raw_response.create(model=MODEL, max_output_tokens=8, previous_response_id=rid,
                                                   input="And next?")
        assert raw.headers[SERVER_ID] == home
    # Pinned from the directory: no fan-out lookup was needed.
    assert metric_value(router_metrics(gw), "prefixroute_response_lookup_requests_total") == lookups0
    # Every fact of this test is in before the next one reads its baseline: the follow-ups' ids arrive after
    # their answers, and would otherwise count as the next test's ids learned while its own are still on the way.
    until(lambda: facts(gw, "matched") >= matched0 + 8, 5.0, message=lambda: "this test's facts matched")


def test_a_responses_stream_ttft_is_its_first_token_event(env) -> None:
    rcv, gw, _ = env
    from prefixroute.telemetry.tracecontext import format_traceparent, new_span_id, new_trace_id

    trace_id = new_trace_id()
    body = {"model": MODEL, "input": "Say something. " * 50, "max_output_tokens": 8, "stream": True}
    conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
    conn.request("POST", "/v1/responses", json.dumps(body), {"content-type": "application/json",
                                                              "traceparent": format_traceparent(trace_id,
                                                                                                new_span_id())})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    assert r.status == 200 and b"response.output_text.delta" in data
    rec = wait_records(rcv, [trace_id])[trace_id]
    assert rec["error"] is None and rec["ttft_ms"] is not None and rec["prompt_tokens"] > 0


def test_a_pick_whose_facts_never_come_is_recorded_and_counted(tmp_path: Path) -> None:
    """Envoy's facts logger holds its records 60 s (as if it were down): the router records the request after its
    2 s timeout with the error "response facts missing", and counts it. Routed by ext_proc, whose stream's end
    releases the pick; behind ext_authz the record is what releases it, and its loss is waited out longer
    (test_authz_routing.py: test_a_pick_whose_facts_never_come_is_released_after_its_timeout)."""
    with ExitStack() as stack:
        rcv = start_receiver(tmp_path / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 2, tmp_path)
        saved = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rcv.otlp_url
        try:
            gw = start_facts_gateway(stack, fleet.endpoints, tmp_path, facts_flush_interval_ms=60_000,
                                     routing_filter="ext_proc")
        finally:
            if saved is None:
                os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            else:
                os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = saved
        s = send(gw, "lost facts " * 40, stream=True)
        assert s.status == 200
        t0 = time.monotonic()
        rec = wait_records(rcv, [s.trace_id])[s.trace_id]
        assert rec["error"] == "response facts missing"
        assert time.monotonic() - t0 >= 1.0  # held for the timeout, not emitted at once
        until(lambda: facts(gw, "missing") >= 1, 5.0, message=lambda: "missing facts metric")
        assert facts(gw, "matched") == 0
        assert dump(rcv.db)[s.trace_id]["endpoints"]  # the decision stays recorded


def test_with_two_replicas_each_gets_the_facts_of_its_own_picks(tmp_path: Path) -> None:
    """One facts logger per replica, filtered on the replica's route: every record reaches the replica that
    routed the request (matched), none the other (unmatched)."""
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        gw = start_facts_gateway(stack, fleet.endpoints, tmp_path, extproc_replicas=2)
        for i in range(16):
            assert send(gw, f"replica facts {i} " + "lorem ipsum " * 30, stream=i % 2 == 0).status == 200

        def counts(outcome: str) -> list[float]:
            out = []
            for port in gw.metrics_ports:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    out.append(metric_value(r.read().decode(), "prefixroute_response_facts_total", outcome=outcome))
            return out

        until(lambda: sum(counts("matched")) >= 16, 5.0, message=lambda: f"matched {counts('matched')}")
        assert sum(counts("unmatched")) == 0 and sum(counts("missing")) == 0

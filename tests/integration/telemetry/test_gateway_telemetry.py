"""Gateway telemetry end to end: real Envoy (routing + observing ext_proc filters), real `prefixroute extproc`,
real simulated model servers and a real `prefixroute telemetry` receiver process.

Requests carry a client `traceparent` with a fresh trace id, so each stored record is matched to the request
that produced it by trace id (and the test checks the router joined the client's trace).
"""

from __future__ import annotations

import http.client
import json
import socket
import sqlite3
import statistics
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from prefixroute.extproc.gateway import GatewayProcesses
from prefixroute.telemetry.tracecontext import parse_traceparent
from helpers.fleet import MODEL, Fleet, start_fleet, start_gateway
from helpers.procs import environ_set, free_port
from helpers.receiver import ReceiverProc, start_receiver
from helpers.waiting import until
from helpers.gateway_requests import Sent, client_usage, send, wait_records

pytestmark = pytest.mark.integration


def span_attrs(db: Path, trace_id: str) -> dict:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (attrs,) = conn.execute("SELECT attrs FROM requests WHERE trace_id = ?", (trace_id,)).fetchone()
    return json.loads(attrs)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReceiverProc, GatewayProcesses, list[str], Fleet]]:
    """Receiver + 3 servers (with their admin listeners) + gateway whose ext_proc child finds the receiver through
    OTEL_* variables."""
    tmp = tmp_path_factory.mktemp("gateway-telemetry")
    with ExitStack() as stack:
        rcv = start_receiver(tmp / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 3, tmp, admin=True)
        # inherited by the ext_proc child
        with environ_set({"OTEL_EXPORTER_OTLP_ENDPOINT": rcv.otlp_url, "OTEL_BSP_SCHEDULE_DELAY": "100"}):
            gw = start_gateway(stack, fleet.endpoints, tmp)
        yield rcv, gw, fleet.endpoints, fleet


def test_user_check_50_requests_give_50_records_matching_the_clients(env) -> None:
    rcv, gw, endpoints, fleet = env
    sent: list[Sent] = []
    conn = http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
    for i in range(50):
        # Five shared prefixes, so later requests hit the cache and cached_tokens vary.
        prompt = f"conversation {i % 5}: " + "the quick brown fox jumps over the lazy dog " * 30 + f"turn {i}"
        sent.append(send(gw, prompt, stream=i % 2 == 0, conn=conn))
    conn.close()
    assert all(s.status == 200 for s in sent)
    got = wait_records(rcv, [s.trace_id for s in sent])
    mine = [got.get(s.trace_id) for s in sent]
    assert sum(r is not None for r in mine) == 50
    for s, r in zip(sent, mine):
        u = client_usage(s)
        assert r["cached_tokens"] == u["prompt_tokens_details"]["cached_tokens"]
        assert (r["prompt_tokens"], r["completion_tokens"]) == (u["prompt_tokens"], u["completion_tokens"])
        assert r["status"] == 200 and r["stream"] is s.stream and r["endpoint"] in endpoints
        assert r["parent_span_id"] == s.client_span_id  # joined the client's trace
        assert r["ttft_ms"] <= r["latency_ms"] + 1e-6
    assert any(r["cached_tokens"] > 0 for r in mine) and any(r["reason"] == "affinity" for r in mine)
    gateway_ttft = statistics.median(r["ttft_ms"] for r in mine)
    client_ttft = statistics.median(s.ttft_ms for s in sent)
    assert abs(gateway_ttft - client_ttft) < 5.0, (gateway_ttft, client_ttft)
    assert statistics.median(abs(r["ttft_ms"] - s.ttft_ms) for s, r in zip(sent, mine)) < 5.0


@pytest.mark.parametrize("stream", [False, True])
def test_span_attributes_and_context_propagation_to_the_model_server(env, stream: bool) -> None:
    rcv, gw, endpoints, fleet = env
    s = send(gw, f"attributes {stream} " + "lorem ipsum dolor sit amet " * 40, stream=stream, max_tokens=8)
    assert s.status == 200
    rec = wait_records(rcv, [s.trace_id])[s.trace_id]
    # The model server received the router's traceparent: same trace, parent = the router's span; the client never
    # sees it (the span id keys the facts records).
    (received,) = [tp for tp in map(parse_traceparent, fleet.received_traceparents())
                   if tp is not None and tp.trace_id == s.trace_id]
    assert received.trace_id == s.trace_id == rec["trace_id"]
    assert received.span_id == rec["span_id"] != s.client_span_id
    assert not any(rec["span_id"] in v for v in s.headers.values())
    attrs = span_attrs(rcv.db, s.trace_id)
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["gen_ai.usage.input_tokens"] == client_usage(s)["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == client_usage(s)["completion_tokens"] == 8
    assert attrs["prefixroute.policy"] == rec["policy"] == gw.routing.policy
    assert attrs["prefixroute.reason"] in ("affinity", "spill", "cold", "load")
    assert attrs["prefixroute.endpoint"] == rec["endpoint"] == rec["endpoints"][0]
    assert rec["endpoints"][1:] and set(rec["endpoints"]) <= set(endpoints)
    assert rec["total_blocks"] > 0 and 0 <= rec["matched_blocks"] <= rec["total_blocks"]
    assert 0.0 <= rec["predicted_hit_ratio"] <= 1.0 and rec["decision_us"] > 0
    assert attrs["http.response.status_code"] == 200 and attrs["prefixroute.stream"] is stream
    assert rec["request_id"]  # Envoy's x-request-id
    # The default policy explains its decision: predicted TTFT there and at the best other endpoint.
    assert rec["predicted_ttft_ms"] > 0 and attrs["prefixroute.predicted_ttft_ms"] == pytest.approx(rec["predicted_ttft_ms"])
    assert attrs["prefixroute.alternative_endpoint"] == rec["alternative_endpoint"] == rec["endpoints"][1]
    assert rec["alternative_ttft_ms"] >= 0


# Not here: a body over Envoy's buffer limit. Envoy answers that 413 itself and resets both ext_proc streams,
# usually before the service has read them, so it is recorded only when the service wins that race.
@pytest.mark.parametrize(("case", "status"), [("bad_json", 400), ("unknown_model", 404), ("wrong_method", 405)])
def test_errors_answered_by_the_router_are_recorded_without_an_endpoint(env, case: str, status: int) -> None:
    rcv, gw, _, _ = env
    s = send(gw, "error case", model="no-such-model" if case == "unknown_model" else MODEL,
             raw_body=b"{not json" if case == "bad_json" else None, method="PUT" if case == "wrong_method" else "POST")
    assert s.status == status
    rec = wait_records(rcv, [s.trace_id]).get(s.trace_id)
    assert rec is not None, "no record for a router-answered error"
    assert rec["status"] == status and rec["endpoint"] is None and rec["endpoints"] == []
    assert rec["error"] and json.loads(s.body)["error"]["message"] == rec["error"]  # the router's own words
    assert rec["ttft_ms"] is None  # the router's reply never reaches the observing filter


def metric_samples(gw: GatewayProcesses) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric_total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_metrics_endpoint(env) -> None:
    rcv, gw, _, _ = env
    before = metric_samples(gw)
    # One prompt three times: the first computes its prefix, the next two find it cached where it went.
    prompt = "metrics " + "alpha beta gamma " * 50
    sent = [send(gw, prompt, stream=i % 2 == 0) for i in range(3)]
    assert all(s.status == 200 for s in sent)
    usage = [client_usage(s) for s in sent]
    want_prompt = sum(u["prompt_tokens"] for u in usage)
    want_cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert want_cached > 0, usage

    def added(samples: dict[str, float], prefix: str) -> float:
        return metric_total(samples, prefix) - metric_total(before, prefix)

    # The observing filter reports a response when it ends, which may be just after the client has read it.
    def counted() -> dict[str, float] | None:
        s = metric_samples(gw)
        return s if added(s, "prefixroute_prompt_tokens_total{") >= want_prompt else None

    samples = until(counted, 10, message="the responses' prompt tokens counted")
    assert added(samples, "prefixroute_prompt_tokens_total{") == want_prompt
    assert added(samples, "prefixroute_actual_hit_tokens_total{") == want_cached
    assert added(samples, "prefixroute_decisions_total{") == 3
    assert any(f'policy="{gw.routing.policy}"' in k for k in samples if k.startswith("prefixroute_decisions"))
    assert added(samples, "prefixroute_decision_duration_seconds_count") == 3
    assert added(samples, "prefixroute_ttft_seconds_count") == 3
    assert added(samples, "prefixroute_request_duration_seconds_count") == 3
    assert any(k.startswith("prefixroute_endpoint_in_flight{") for k in samples)
    assert metric_total(samples, "prefixroute_prefix_index_blocks{") > 0


def test_failover_is_recorded_with_the_served_fallback(tmp_path: Path, receiver: ReceiverProc) -> None:
    with ExitStack() as stack:
        fleet = start_fleet(stack, 2, tmp_path)
        # Probes every 60 s: the router learns of the dead endpoint only through the failover itself.
        gw = start_gateway(stack, fleet.endpoints, tmp_path, pool_overrides={"probe_interval_s": 60.0},
                           extra_extproc_args=["--otlp-endpoint", receiver.otlp_url])
        dead = fleet.endpoints[0]
        fleet.servers[dead].stop()
        sent = [send(gw, f"failover {i} " + "a long shared prompt " * 20) for i in range(12)]
        assert all(s.status == 200 for s in sent)
        got = wait_records(receiver, [s.trace_id for s in sent])
        recs = [got[s.trace_id] for s in sent]
        failed_over = [r for r in recs if r["endpoints"][0] == dead]
        assert failed_over, "no request had the dead endpoint as primary (chance 1/4096)"
        for r in failed_over:
            assert r["reason"] == "failover" and r["endpoint"] == fleet.endpoints[1] and r["status"] == 200
        assert all(r["reason"] != "failover" for r in recs if r["endpoints"][0] != dead)


class _BlackHole:
    """Accepts TCP connections and never answers (a hung collector)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("exporter", ["down", "hung"])
def test_exporter_down_or_hung_never_delays_or_fails_requests(env, tmp_path: Path, exporter: str) -> None:
    _, up_gw, endpoints, _ = env
    with ExitStack() as stack:
        if exporter == "down":
            otlp = f"http://127.0.0.1:{free_port()}"  # nothing listens
        else:
            hole = _BlackHole()
            stack.callback(hole.close)
            otlp = f"http://127.0.0.1:{hole.port}"
        down_gw = start_gateway(stack, endpoints, tmp_path, extra_extproc_args=["--otlp-endpoint", otlp])
        lat: dict[str, list[float]] = {"up": [], "down": []}
        for i in range(25):
            for name, gw in (("up", up_gw), ("down", down_gw)):
                s = send(gw, f"exporter {exporter} {i} " + "words " * 60, stream=i % 2 == 0, max_tokens=6)
                assert s.status == 200
                lat[name].append(s.latency_ms)
        up, down = statistics.median(lat["up"]), statistics.median(lat["down"])
        assert down < up * 1.5 + 5.0, (up, down)
        with urllib.request.urlopen(f"http://127.0.0.1:{down_gw.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "prefixroute_telemetry_spans_exported_total 0.0" in text


def test_the_time_model_learns_from_streamed_responses_through_the_gateway(env) -> None:
    """The observing stream reports each streamed response's first token and usage to the router: its time
    model learns one observation per streamed response (a non-streamed one has no first token to learn from),
    and its queue of pending prefill drains."""
    rcv, gw, _, _ = env
    before = metric_samples(gw)
    sent = [send(gw, f"learn {i} " + "delta epsilon zeta " * 60, stream=i < 4, max_tokens=4) for i in range(6)]
    assert all(s.status == 200 for s in sent)

    def added(samples: dict[str, float]) -> float:
        prefix = "prefixroute_endpoint_ttft_observations_total{"
        return metric_total(samples, prefix) - metric_total(before, prefix)

    def queued(samples: dict[str, float]) -> float:
        return metric_total(samples, "prefixroute_endpoint_queued_prefill_tokens{")

    # Both come from the ext_proc streams, which close after the client has its response (the last request's
    # prefill leaves the queue when its routing stream's end is read): wait for both.
    def learned() -> dict[str, float] | None:
        s = metric_samples(gw)
        return s if added(s) >= 4 and queued(s) == 0 else None

    samples = until(learned, 10, message="4 TTFTs learned and the queue empty")
    assert added(samples) == 4  # the 4 streamed ones
    assert queued(samples) == 0
    rates = [v for k, v in samples.items() if k.startswith("prefixroute_endpoint_prefill_tokens_per_second{")]
    assert rates and all(v > 0 for v in rates)

"""Requests through a gateway and the telemetry store's records of them (the gateway telemetry tests), and the
facts-path gateway those tests start."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port
from prefixroute.telemetry.tracecontext import format_traceparent, new_span_id, new_trace_id
from helpers.fleet import MODEL
from helpers.receiver import ReceiverProc
from helpers.waiting import until


def start_facts_gateway(stack: ExitStack, endpoints: list[str], log_dir: Path, **gateway: object
                        ) -> GatewayProcesses:
    """A gateway on the facts path (one replica, random ports) in front of `endpoints`, stopped with `stack`;
    `gateway` overrides GatewaySettings' fields."""
    gw = GatewayProcesses(
        GatewaySettings(**{"port": free_port(), "ports": "random", "extproc_replicas": 1,  # type: ignore[arg-type]
                           "listen_address": "127.0.0.1", "envoy_log_level": "info", "response_path": "facts",
                           **gateway}),
        RoutingSettings(), PoolSettings(endpoints=tuple(endpoints)), log_dir=log_dir)
    stack.enter_context(gw)
    return gw


def router_metrics(gw: GatewayProcesses) -> str:
    """The gateway's (first) router's /metrics text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5) as r:
        return r.read().decode()


@dataclass
class Sent:
    trace_id: str
    client_span_id: str
    status: int
    ttft_ms: float
    latency_ms: float
    headers: dict[str, str]
    body: bytes
    stream: bool


def send(gw: GatewayProcesses, prompt: str, *, stream: bool = False, include_usage: bool = True,
         max_tokens: int = 12, model: str = MODEL, raw_body: bytes | None = None, method: str = "POST",
         conn: http.client.HTTPConnection | None = None, path: str = "/v1/chat/completions") -> Sent:
    """One request; TTFT = request sent to the first response body bytes received (what a client sees)."""
    trace_id, span_id = new_trace_id(), new_span_id()
    body: dict = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                  "stream": stream}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    c = conn or http.client.HTTPConnection(gw.url.split("//", 1)[1], timeout=30)
    t0 = time.perf_counter()
    c.request(method, path, raw_body if raw_body is not None else json.dumps(body),
              {"content-type": "application/json", "traceparent": format_traceparent(trace_id, span_id)})
    r = c.getresponse()
    first = r.read1(1 << 20)
    ttft_ms = (time.perf_counter() - t0) * 1000
    rest = r.read()
    latency_ms = (time.perf_counter() - t0) * 1000
    if conn is None:
        c.close()
    return Sent(trace_id, span_id, r.status, ttft_ms, latency_ms, {k.lower(): v for k, v in r.getheaders()},
                first + rest, stream)


def client_usage(s: Sent) -> dict:
    if not s.stream:
        return json.loads(s.body)["usage"]
    events = [line[5:].strip() for line in s.body.split(b"\n") if line.startswith(b"data:")]
    return next(json.loads(e)["usage"] for e in reversed(events) if e.startswith(b"{") and b'"usage"' in e)


def dump(db: Path, since_s: float = 60) -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-m", "prefixroute", "telemetry", "dump", "--since", str(since_s),
                          "--db", str(db)], capture_output=True, text=True, timeout=30, check=True).stdout
    return {r["trace_id"]: r for r in map(json.loads, out.splitlines())}


def wait_records(rcv: ReceiverProc, trace_ids: list[str], timeout_s: float = 15.0) -> dict[str, dict]:
    """The store's records once every one of `trace_ids` is among them (fails the test after `timeout_s`)."""
    def complete() -> dict[str, dict] | None:
        got = dump(rcv.db)
        return got if all(t in got for t in trace_ids) else None

    return until(complete, timeout_s, interval_s=0.3,
                 message=lambda: f"records of {sorted(set(trace_ids) - set(dump(rcv.db)))}")

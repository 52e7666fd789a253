"""Flow control through the real gateway (issue 24): real Envoy, the real ext_proc process, real simulated servers
(slow GPUs, so a burst saturates two of them). Held requests wait past Envoy's 500 ms answer timeout (the service
asks Envoy to wait: override_message_timeout; failure mode closed, so a timeout would be a 503) and are served;
the router's /metrics counts them; a request whose deadline is shorter than the queue gets 429 in the OpenAI
format with Retry-After. Each request's record (exported to a real receiver) says how long it waited in the gateway
and why it left the queue (``released:REASON`` / ``shed:deadline``)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.fleet import MODEL, start_fleet, start_gateway
from helpers.receiver import start_receiver
from prefixroute.extproc.gateway import GatewayProcesses

pytestmark = pytest.mark.integration


def _post(gw: GatewayProcesses, i: int, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes, float]:
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": f"request {i}: " + "tell me about flow control. " * 300, "max_tokens": 4}
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, time.monotonic() - t0
    finally:
        conn.close()


def _metric(gw: GatewayProcesses, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.mark.parametrize("routing_filter", ["ext_proc", "ext_authz_http"])
def test_a_burst_past_saturation_is_held_served_and_counted(tmp_path: Path, routing_filter: str) -> None:
    """Behind either ext_authz filter too: a request to hold is handed off to the ext_proc filter on its handoff
    route (authz.py), which holds it; its record is the ext_proc stream's alone (32 records for 32 requests)."""
    with ExitStack() as stack:
        rcv = start_receiver(tmp_path / "telemetry.db")
        stack.callback(rcv.stop)
        fleet = start_fleet(stack, 2, tmp_path, "s", "--time-scale", "3")
        gw = start_gateway(stack, list(fleet.endpoints), tmp_path, failure_mode="closed", routing_filter=routing_filter,
                           extra_extproc_args=["--saturation-queued-s", "0.05", "--deadline-s", "40",
                                               "--otlp-endpoint", rcv.otlp_url])
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: _post(gw, i), range(16)))
        assert [r[0] for r in results] == [200] * 16, [r[2][:200] for r in results if r[0] != 200]
        assert max(r[3] for r in results) > 0.5  # some waited longer than Envoy's own answer timeout
        held = _metric(gw, "prefixroute_flow_held_total")
        assert held > 0 and _metric(gw, "prefixroute_flow_released_total") == held
        assert _metric(gw, "prefixroute_flow_queue_length") == 0

        # A burst again, with a deadline far shorter than the queue: shed with 429, Retry-After, OpenAI body.
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: _post(gw, 100 + i, {"x-prefixroute-deadline-ms": "100"}), range(16)))
        shed = [r for r in results if r[0] == 429]
        assert shed and all(r[0] in (200, 429) for r in results)
        status, headers, body, _ = shed[0]
        assert int(headers["retry-after"]) >= 1
        error = json.loads(body)["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429
        assert _metric(gw, "prefixroute_flow_shed_total") >= len(shed)

        # The records: a held request says how long it waited and what released it; a shed one, why it was shed.
        rcv.wait_rows(32, timeout_s=30.0)
        rows = rcv.api("/api/recent?limit=100")[1]
        assert len(rows) == 32
        released = [r for r in rows if (r["gateway_outcome"] or "").startswith("released:")]
        assert released and all(r["gateway_wait_ms"] > 0 and r["status"] == 200 for r in released)
        assert {r["gateway_outcome"] for r in released} <= {f"released:{x}" for x in
                                                            ("first_token", "release", "scrape", "arrival")}
        never_held = [r for r in rows if r["gateway_outcome"] is None]
        assert all(r["gateway_wait_ms"] == 0 and r["status"] == 200 for r in never_held)
        shed_rows = [r for r in rows if r["status"] == 429]
        assert len(shed_rows) == len(shed) and all((r["gateway_outcome"] or "").startswith("shed:") for r in shed_rows)
        assert any(r["gateway_outcome"] == "shed:deadline" and r["gateway_wait_ms"] > 0 for r in shed_rows)

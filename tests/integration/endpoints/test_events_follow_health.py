"""A server's KV-event state follows its health, through a real `prefixroute extproc` process.

Real vLLM, after ``kill -9`` of its API server, leaves its EngineCore alive with the ZMQ publisher bound and
silent: the subscriber stays connected and nothing says the server is gone. Here each endpoint is a small HTTP
stand-in (the API server: /health, /v1/models, /metrics) beside a real ZMQ publisher (tests/helpers/
kv_publisher.py: the EngineCore's). Killing A's HTTP side while its publisher stays up must turn A's events
state to ``unhealthy`` (matched by feedback: its events' blocks no longer count), keep its events-index entries,
and bring it back to ``live`` with them when A answers again on the same port.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.request

import pytest

from helpers.kv_publisher import KVPublisher
from helpers.waiting import until
from prefixroute.bench.fleet import free_port_pairs
from prefixroute.kv_events_wire import BlockStored
from prefixroute.procs import free_port, prefixroute_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class _Stub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = {"/health": b"", "/v1/models": json.dumps({"object": "list", "data": [{"id": "m"}]}).encode(),
                "/metrics": b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def _serve(port: int = 0) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Stub)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


def _stored(seed: int) -> BlockStored:
    return BlockStored(block_hashes=[seed * 10 + i for i in range(2)], parent_block_hash=None,
                       token_ids=[seed] * 32, block_size=16, lora_id=None, medium="GPU", lora_name=None)


def _figures(port: int) -> dict[str, dict[str, object]]:
    """endpoint -> {state, source, blocks, healthy} from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[str, object]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            ep = s.labels.get("endpoint")
            if ep is None:
                continue
            d = out.setdefault(ep, {})
            if s.name == "prefixroute_kv_events_state" and s.value:
                d["state"] = s.labels["state"]
            elif s.name == "prefixroute_index_source_info" and s.value:
                d["source"] = s.labels["source"]
            elif s.name == "prefixroute_kv_event_index_blocks":
                d["blocks"] = s.value
            elif s.name == "prefixroute_endpoint_healthy":
                d["healthy"] = s.value
    return out


def test_a_killed_api_server_whose_publisher_lives_on_is_unhealthy_not_live(tmp_path):
    servers = [_serve(), _serve()]
    a, b = (f"127.0.0.1:{srv.server_address[1]}" for srv in servers)
    ports = free_port_pairs(2)
    pubs = [KVPublisher(p, r, topic="kv") for p, r in ports]
    proc = None
    try:
        pubs[0].publish([_stored(1)], send=False)  # what each server's cache holds (in its replay buffer)
        pubs[1].publish([_stored(2)], send=False)
        metrics_port = free_port()
        spec = ",".join(f"{ep}@tcp://127.0.0.1:{p}" for ep, (p, _) in zip((a, b), ports))
        with open(tmp_path / "extproc.log", "wb") as log:
            proc = subprocess.Popen(prefixroute_argv(
                "extproc", "--port", str(free_port()), "--listen-address", "127.0.0.1", "--metrics-port",
                str(metrics_port), "--no-traces", "--tokenizer", "sim", "--endpoints", spec, "--kv-events-topic",
                "kv", "--ready-timeout-s", "10", "--probe-interval-s", "0.2"),
                stdout=subprocess.PIPE, stderr=log, text=True)
        ready = proc.stdout.readline()  # type: ignore[union-attr]
        assert "index events x2 (2 live) + feedback" in ready, ready
        live = {"state": "live", "source": "events", "blocks": 2.0, "healthy": 1.0}
        assert _figures(metrics_port) == {a: live, b: live}

        # kill -9 of A's API server: its port refuses connections; its publisher (the EngineCore) lives on.
        port_a = servers[0].server_address[1]
        servers[0].shutdown()
        servers[0].server_close()
        t0 = time.monotonic()
        until(lambda: _figures(metrics_port)[a].get("state") == "unhealthy", 5,
              message=lambda: _figures(metrics_port))
        took = time.monotonic() - t0
        figures = _figures(metrics_port)
        # Matched by feedback while down (its events' blocks never win a pick), its entries kept for its return.
        assert figures[a] == {"state": "unhealthy", "source": "feedback", "blocks": 2.0, "healthy": 0.0}, figures
        assert figures[b] == live
        print(f"A unhealthy {took:.2f} s after its API server died")

        # The same server answers again (only its API side was unreachable): live at once, its blocks intact.
        servers[0] = _serve(port_a)
        until(lambda: _figures(metrics_port)[a] == live, 5, message=lambda: _figures(metrics_port))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for p in pubs:
            p.close()
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    text = (tmp_path / "extproc.log").read_text()
    assert f"KV events of {a} (tcp://127.0.0.1:{ports[0][0]}): unhealthy" in text, text
    assert f"KV events of {a} (tcp://127.0.0.1:{ports[0][0]}): unhealthy -> live" in text, text

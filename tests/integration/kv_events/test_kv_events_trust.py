"""No silent blindness, through a real `prefixroute extproc` process: an endpoint whose KV events cannot be
trusted is matched by the router's own index (feedback) and says why on /metrics, in the ready line, in one
ERROR log line and in the dashboard's endpoint table.

Four endpoints (small HTTP stand-ins for the servers: health, models, metrics) with real ZMQ publishers
(tests/helpers/kv_publisher.py): A publishes valid events; B's replay buffer holds batches of a form no
release speaks (undecodable from the start); C stores 32-token blocks while the router hashes 16-token blocks;
D is valid at first and turns undecodable while the router runs: it must be in feedback within 2 s.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.request

import msgspec
import pytest

from helpers.kv_publisher import KVPublisher
from helpers.waiting import until
from prefixroute.bench.fleet import free_port_pairs
from prefixroute.dashboard import data as D
from prefixroute.dashboard import router_metrics as RM
from prefixroute.kv_events_wire import BlockStored
from prefixroute.procs import free_port, prefixroute_argv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

MODEL = "m"


class _Stub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = {"/health": b"", "/v1/models": json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode(),
                "/metrics": b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def _stub_server() -> tuple[http.server.ThreadingHTTPServer, str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"127.0.0.1:{srv.server_address[1]}"


def _stored(seed: int, block_size: int = 16) -> BlockStored:
    return BlockStored(block_hashes=[seed * 10 + i for i in range(2)], parent_block_hash=None,
                       token_ids=[seed] * (2 * block_size), block_size=block_size, lora_id=None, medium="GPU",
                       lora_name=None)


# A batch of a form no release publishes: a versioned map envelope (the decoder's message names what is missing).
FUTURE = msgspec.msgpack.encode({"version": 2, "batch": {"ts": 1.0, "events": []}})


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _states(text: str) -> dict[str, tuple[str, str]]:
    """endpoint -> (events state, index source) from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    state, source = {}, {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "prefixroute_kv_events_state" and s.value:
                state[s.labels["endpoint"]] = s.labels["state"]
            if s.name == "prefixroute_index_source_info" and s.value:
                source[s.labels["endpoint"]] = s.labels["source"]
    return {ep: (state.get(ep, ""), source.get(ep, "")) for ep in source}


def test_untrusted_events_are_feedback_and_say_why(tmp_path):
    servers = [_stub_server() for _ in range(4)]
    a, b, c, d = (ep for _, ep in servers)
    ports = free_port_pairs(4)
    pubs = [KVPublisher(p, r, topic="kv") for p, r in ports]
    proc = None
    try:
        pa, pb, pc, pd = pubs
        pa.publish([_stored(1)], send=False)  # history in the replay buffers (a warm, quiet publisher)
        pb.publish_raw(FUTURE, send=False)
        pb.publish_raw(FUTURE, send=False)
        pc.publish([_stored(3, block_size=24)], send=False)  # 64 would be split, 24 cannot
        pd.publish([_stored(4)], send=False)
        metrics_port = free_port()
        spec = ",".join(f"{ep}@tcp://127.0.0.1:{p}" for ep, (p, _) in zip((a, b, c, d), ports))
        log_path = tmp_path / "extproc.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(prefixroute_argv(
                "extproc", "--port", str(free_port()), "--listen-address", "127.0.0.1", "--metrics-port",
                str(metrics_port), "--no-traces", "--tokenizer", "sim", "--endpoints", spec, "--kv-events-topic",
                "kv", "--ready-timeout-s", "10"), stdout=subprocess.PIPE, stderr=log, text=True)
        ready = proc.stdout.readline()  # type: ignore[union-attr]
        assert "index events x4 (2 live, 1 undecodable, 1 block_size_mismatch) + feedback" in ready, ready
        assert _states(_metrics(metrics_port)) == {a: ("live", "events"), b: ("undecodable", "feedback"),
                                                   c: ("block_size_mismatch", "feedback"), d: ("live", "events")}
        # D turns undecodable while the router runs: feedback within 2 s of its first bad batches.
        for p in pubs:
            p.wait_subscribed(5)
        t0 = time.monotonic()
        pd.publish_raw(FUTURE)
        pd.publish_raw(FUTURE)
        until(lambda: _states(_metrics(metrics_port))[d] == ("undecodable", "feedback"), 2.0,
              message=lambda: _states(_metrics(metrics_port)))
        print(f"D in feedback {time.monotonic() - t0:.3f} s after its first undecodable batch")
        text = _metrics(metrics_port)
        # The dashboard's endpoint table, from the same /metrics text.
        frame = D.endpoint_frame([{"endpoint": ep, "num_requests": 0} for ep in (a, b, c, d)],
                                 live=RM.parse_router_metrics(text))
        assert dict(zip(frame["endpoint"], frame["index_source"])) == {
            a: "events", b: "events (undecodable)", c: "events (block size mismatch)", d: "events (undecodable)"}
        time.sleep(0.3)  # lets time pass on purpose: a second ERROR for the same cause (asserted below) would come
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        for p in pubs:
            p.close()
        for srv, _ in servers:
            srv.shutdown()
    errors = [line for line in log_path.read_text().splitlines() if " ERROR " in line]
    # One ERROR per endpoint and cause, naming it, its payload's first bytes and the decoder's message.
    for ep in (b, d):
        lines = [e for e in errors if f"KV events of {ep} " in e and "do not decode" in e]
        assert len(lines) == 1, errors
        assert FUTURE[:24].hex() in lines[0] and "missing required field `ts`" in lines[0], lines[0]
    assert len([e for e in errors if f"KV events of {c} " in e and "24 tokens" in e]) == 1, errors
    assert not [e for e in errors if a in e], errors

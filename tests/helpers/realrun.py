"""Fill a telemetry store with a short real run, through the real telemetry path.

Real parts: simulated model servers (`prefixroute model-server` processes), the real router core
(`RouterCore` with the prefix policy: parse -> block hashes -> prefix index -> decision), streamed HTTP
requests with usage, `TelemetryRecorder` exporting OTLP/gRPC to a real `prefixroute telemetry` receiver
process, which writes the SQLite store. Only Envoy + the ext_proc service are left out (the record is
built here, from the client's measurements, the way the servicer builds it), so the test does not
depend on the gateway stack.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from prefixroute.extproc.routing.request import CHAT_PATH, parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import EndpointId, EndpointState
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from helpers.procs import free_port, prefixroute_cmd, start_process, stop_group
from helpers.waiting import until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_BANNER = re.compile(r"OTLP/gRPC on [\d.]+:(\d+), HTTP API on http://[\d.]+:(\d+)")


def start_receiver(stack: ExitStack, db: Path, log_dir: Path) -> tuple[int, int]:
    """A `prefixroute telemetry` process on free ports; returns (otlp_port, http_port)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(prefixroute_cmd("telemetry", "--port", "0", "--http-port", "0", "--db", str(db)),
                            stdout=subprocess.PIPE, stderr=open(log_dir / "telemetry.log", "wb"),  # noqa: SIM115
                            text=True, start_new_session=True)
    stack.callback(stop_group, proc, 10.0)
    line = proc.stdout.readline()
    m = _BANNER.search(line)
    if not m:
        raise AssertionError(f"receiver did not start: {line!r}; see {log_dir / 'telemetry.log'}")
    return int(m.group(1)), int(m.group(2))


def _prompts(num_groups: int, per_group: int, first_question: int = 0) -> list[list[dict]]:
    """Shared system prompts (one per group, ~1,500 words) + a unique question each, interleaved."""
    out = []
    for q in range(first_question, first_question + per_group):
        for g in range(num_groups):
            system = " ".join(f"rule{g}-{i} applies to every answer from assistant {g}." for i in range(250))
            out.append([{"role": "system", "content": system},
                        {"role": "user", "content": f"Question {q} for group {g}: what is {q * 7 + g}?"}])
    return out


def _stream_chat(endpoint: str, body: bytes) -> tuple[float, float, dict, int]:
    """POST a streamed chat request; returns (ttft_ms, latency_ms, usage, status) measured here."""
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://{endpoint}{CHAT_PATH}", data=body,
                                 headers={"content-type": "application/json"})
    ttft_ms = None
    usage: dict = {}
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback
        status = resp.status
        for line in resp:
            if ttft_ms is None and line.strip():
                ttft_ms = (time.perf_counter() - t0) * 1000
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return ttft_ms or 0.0, (time.perf_counter() - t0) * 1000, usage, status


class RealFleet:
    """Model servers + receiver (started on the caller's ExitStack) and a client that routes with the
    real `RouterCore` and records each request with `TelemetryRecorder` -> OTLP -> the receiver."""

    def __init__(self, stack: ExitStack, tmp_path: Path, *, num_servers: int = 3) -> None:
        log_dir = tmp_path / "logs"
        self.db = tmp_path / "telemetry.db"
        otlp_port, http_port = start_receiver(stack, self.db, log_dir)
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.endpoints: list[str] = []
        for i in range(num_servers):
            port = free_port()
            stack.enter_context(start_process(
                prefixroute_cmd("model-server", "--port", str(port), "--id", f"s{i}", "--time-scale", "0.2",
                                "--shutdown-grace-s", "0.2"),
                ready_url=f"http://127.0.0.1:{port}/health", log_dir=log_dir, name=f"s{i}", timeout_s=30))
            self.endpoints.append(f"127.0.0.1:{port}")
        self.routing = RoutingSettings(policy="prefix", rng_seed=1)
        self.router = RouterCore(self.routing)
        self.states = [EndpointState(endpoint=EndpointId(e)) for e in self.endpoints]
        self.in_flight = {EndpointId(e): 0 for e in self.endpoints}
        self.lock = threading.Lock()  # RouterCore is single-threaded
        self.recorder = TelemetryRecorder(environ={}, endpoint=f"http://127.0.0.1:{otlp_port}",
                                          schedule_delay_ms=200)
        stack.callback(self.recorder.shutdown, 5.0)
        self.num_sent = 0

    def _one(self, messages: list[dict]) -> None:
        body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        start_time = time.time()
        t = time.perf_counter()
        with self.lock:
            request = parse_request("POST", CHAT_PATH, {"content-type": "application/json"}, body, self.routing)
            decision = self.router.route(request, self.states, dict(self.in_flight))
            primary = decision.endpoints[0]
            self.in_flight[primary] += 1
        decision_us = (time.perf_counter() - t) * 1e6
        try:
            ttft_ms, latency_ms, usage, status = _stream_chat(primary, body)
        finally:
            with self.lock:
                self.in_flight[primary] -= 1
        self.recorder.record(RequestRecord(
            trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8), start_time=start_time,
            request_id=secrets.token_hex(8), model=MODEL, policy=decision.policy, reason=decision.reason,
            endpoint=primary, endpoints=tuple(decision.endpoints), matched_blocks=decision.matched_blocks,
            total_blocks=decision.total_blocks, predicted_hit_ratio=decision.predicted_hit_ratio,
            predicted_ttft_ms=decision.predicted_ttft_ms, alternative_endpoint=decision.alternative_endpoint,
            alternative_ttft_ms=decision.alternative_ttft_ms,
            decision_us=decision_us, ttft_ms=ttft_ms, latency_ms=latency_ms,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            stream=True, status=status, path=CHAT_PATH))

    def record_refused(self, n: int) -> None:
        """Record `n` requests the router refused before choosing an endpoint (a 400 for a missing 'messages'),
        as the servicer records its refusals: no endpoint, status and message; returns once they are stored."""
        for _ in range(n):
            self.recorder.record(RequestRecord(
                trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8), start_time=time.time(),
                request_id=secrets.token_hex(8), model=MODEL, policy=self.routing.policy, status=400,
                error="'messages' is required", path=CHAT_PATH, latency_ms=0.5))
        self.num_sent += n
        assert self.recorder.force_flush(20.0), "recorder did not flush"
        self.wait_stored(self.num_sent)

    def send(self, *, num_groups: int = 6, per_group: int = 4, spread_s: float = 0.0, concurrency: int = 4,
             first_question: int = 0) -> int:
        """Send num_groups x per_group requests (shared system prompt per group), starts spread evenly over
        `spread_s`; returns once every record is in the store."""
        prompts = _prompts(num_groups, per_group, first_question)
        t0 = time.monotonic()

        def paced(item: tuple[int, list[dict]]) -> None:
            i, messages = item
            delay = t0 + spread_s * i / len(prompts) - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self._one(messages)

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(paced, enumerate(prompts)))
        self.num_sent += len(prompts)
        assert self.recorder.force_flush(20.0), "recorder did not flush"
        self.wait_stored(self.num_sent)
        return len(prompts)

    def num_stored(self) -> int:
        with urllib.request.urlopen(f"{self.http_url}/api/stats", timeout=5) as r:  # noqa: S310
            return json.loads(r.read())["num_requests"]

    def wait_stored(self, n: int, timeout_s: float = 20.0) -> None:
        until(lambda: self.num_stored() >= n, timeout_s, interval_s=0.1,
              message=lambda: f"{n} records in the store (it has {self.num_stored()})")


if __name__ == "__main__":  # manual use: python tests/helpers/realrun.py DIR (keeps sending until Ctrl-C/SIGTERM)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with ExitStack() as st:
        fleet = RealFleet(st, Path(sys.argv[1]))
        print(f"store {fleet.db} endpoints {fleet.endpoints}", flush=True)
        try:
            q = 0
            while True:
                fleet.send(spread_s=10.0, first_question=q)
                q += 4
        except KeyboardInterrupt:
            pass

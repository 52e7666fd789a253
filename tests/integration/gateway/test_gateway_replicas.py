"""Several ext_proc replicas behind one real Envoy (issue 15): each request's two streams reach one replica, the
replicas agree through a real nats-server, NATS going down leaves them routing alone until it is back, and a
replica killed under load costs no client request while the supervisor restarts it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import free_port, http_get, prefixroute_cmd
from helpers.fleet import MODEL, chat_once, start_fleet
from helpers.leftovers import find_pid, kill_marked, marked_env, new_marker, wait_none_left
from helpers.waiting import until
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import tcp_open

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SERVED = "x-gateway-destination-endpoint-served"


def _samples(metrics_port: int, name: str) -> dict[str, float]:
    """``name``'s samples on one replica's /metrics, keyed by their label text ("" without labels); {} when the
    replica does not answer."""
    status, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    if status != 200:
        return {}
    return {m.group(1) or "": float(m.group(2)) for m in
            re.finditer(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", body.decode(), re.M)}


def _total(metrics_port: int, name: str) -> float:
    return sum(_samples(metrics_port, name).values())


def _stream_chat(port: int, text: str) -> tuple[int, str]:
    """One streamed chat request with usage through the gateway: (status, served endpoint)."""
    body = json.dumps({"model": MODEL, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - loopback
        resp.read()
        return resp.status, resp.headers.get(SERVED, "")


def _prompts(num_prefixes: int, per_prefix: int, tag: str) -> list[str]:
    # Each prefix spans several router blocks (so the index records something), each request its own tail.
    return [f"{tag} document {p}: " + f"paragraph {p} of the shared context. " * 60 + f"question {i}"
            for i in range(per_prefix) for p in range(num_prefixes)]


def test_two_replicas_observe_their_own_picks_and_share_them_through_nats(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="r")
    gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=2, expose_served_endpoint=True),
                          RoutingSettings(), PoolSettings(endpoints=tuple(fleet.endpoints)), log_dir=log_dir)
    stack.callback(gw.stop)
    gw.start()
    assert gw.nats is not None and gw.peers_url.startswith("nats://127.0.0.1:")
    ports = gw.metrics_ports
    assert len(ports) == 2 and len(set(gw.extproc_ports)) == 2
    until(lambda: all(_total(p, "prefixroute_peer_connected") == 1 for p in ports), 10,
          message="replicas connected")

    prompts = _prompts(6, 6, "first")
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda t: _stream_chat(gw.gateway.port, t), prompts))
    assert all(status == 200 for status, _ in results), results
    decisions = [_total(p, "prefixroute_decisions_total") for p in ports]
    assert all(d > 0 for d in decisions) and sum(decisions) == len(prompts), decisions  # both routed
    # Each replica measured the TTFT of every request it routed: Envoy sent each observing stream to the replica
    # that routed the request (with the streams spread independently, each would attach about half).
    until(lambda: [_total(p, "prefixroute_ttft_seconds_count") for p in ports] == decisions, 5,
          message=lambda: ([_total(p, "prefixroute_ttft_seconds_count") for p in ports], decisions))
    # They agree: each recorded the other's picks in its prefix index, so both hold the same blocks per endpoint.
    def indexes() -> list[dict[str, float]]:
        return [_samples(p, "prefixroute_prefix_index_blocks") for p in ports]
    until(lambda: indexes()[0] == indexes()[1] and sum(indexes()[0].values()) > 0, 5, message=indexes)
    assert all(_total(p, 'prefixroute_peer_messages_total{direction="received",kind="pick"}') > 0 for p in ports)
    # Affinity holds across replicas: each prefix's requests, whichever replica routed them, went to one endpoint.
    by_prefix: dict[str, set[str]] = {}
    for text, (_, served) in zip(prompts, results):
        by_prefix.setdefault(text.split(":")[0], set()).add(served)
    assert sum(len(s) for s in by_prefix.values()) <= len(by_prefix) + 1, by_prefix  # one spill at most

    # NATS down: every request is still routed (each replica alone), the replicas say they are disconnected.
    assert gw.nats is not None
    gw.nats.kill()
    until(lambda: all(_total(p, "prefixroute_peer_connected") == 0 for p in ports), 10,
          message="replicas disconnected")
    with ThreadPoolExecutor(4) as pool:
        alone = list(pool.map(lambda t: _stream_chat(gw.gateway.port, t), _prompts(4, 3, "alone")))
    assert all(status == 200 for status, _ in alone), alone
    # NATS back on its port: both reconnect, and the next picks are shared again.
    gw.group.add(gw.nats, wait=False)
    until(lambda: all(_total(p, "prefixroute_peer_connected") == 1 for p in ports), 15,
          message="replicas reconnected")
    received = [_total(p, 'prefixroute_peer_messages_total{direction="received",kind="pick"}') for p in ports]
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda t: _stream_chat(gw.gateway.port, t), _prompts(4, 4, "again")))
    assert all(status == 200 for status, _ in again), again
    until(lambda: sum(_total(p, 'prefixroute_peer_messages_total{direction="received",kind="pick"}')
                      for p in ports) >= sum(received) + 8, 5, message="picks shared after the reconnect")


def test_a_replica_killed_under_load_costs_no_request_and_is_restarted(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="k")
    port, extproc_port, metrics_port = free_port(), free_port(), free_port()
    while not (extproc_port + 1 < 65536 and metrics_port + 1 < 65536) or {extproc_port + 1, metrics_port + 1} & {
            port, extproc_port, metrics_port} or tcp_open(extproc_port + 1) or tcp_open(metrics_port + 1):
        extproc_port, metrics_port = free_port(), free_port()
    marker = new_marker()
    out = open(log_dir / "gateway-output.txt", "w")  # noqa: SIM115 - closed by the stack
    stack.callback(out.close)
    proc = subprocess.Popen(
        prefixroute_cmd("gateway", "--port", str(port), "--ports", "random", "--endpoints", ",".join(fleet.endpoints),
                        "--extproc-replicas", "2", "--extproc-port", str(extproc_port),
                        "--metrics-port", str(metrics_port), "--no-telemetry"),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=marked_env(marker))
    stack.callback(kill_marked, marker)

    def said() -> str:
        return (log_dir / "gateway-output.txt").read_text(errors="replace")

    until(lambda: "prefixroute gateway ready" in said() or proc.poll() is not None, 90, message=said)
    assert proc.poll() is None, said()
    assert "2 ext_proc replicas" in said() and "peers nats://127.0.0.1:" in said(), said()

    results: list[tuple[float, int]] = []
    stop = threading.Event()
    stack.callback(stop.set)

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            results.append((t0, chat_once(port, f"client {k} question {i}")[0]))  # 0: no HTTP answer at all
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    until(lambda: len(results) >= 10, 10, message="requests before the kill")
    killed_at = time.monotonic()
    os.kill(find_pid(marker, "extproc", "--port", str(extproc_port), "--replica-index"), signal.SIGKILL)  # replica 0
    until(lambda: "extproc-0 is back (restart 1" in said(), 30, message=said)
    back_s = time.monotonic() - killed_at
    back_at = time.monotonic()
    until(lambda: sum(r[0] >= back_at for r in results) >= 10, 15, message="requests after the restart")
    stop.set()
    for t in threads:
        t.join(timeout=15)

    during = [r for r in results if r[0] >= killed_at]
    assert len(during) >= 20, (len(during), said())
    assert [r for r in results if r[1] != 200] == [], said()  # not one request failed
    assert "extproc-0 exited with signal SIGKILL" in said() and "restart 1 in 0.2 s" in said(), said()
    # The restarted replica routes again (Envoy's health check let it back in): its fresh counter grows.
    before = max(_total(metrics_port, "prefixroute_decisions_total"), 0.0)
    until(lambda: (chat_once(port, "after the restart")[0] == 200
                   and _total(metrics_port, "prefixroute_decisions_total") > before), 20,
          message=lambda: ("the restarted replica routing", back_s, said()))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, said()
    assert wait_none_left(marker, 5.0) == {}  # nats-server and both replicas stopped too

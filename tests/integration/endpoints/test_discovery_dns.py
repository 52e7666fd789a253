"""`prefixroute extproc --endpoints-dns` against a real DNS server on loopback and real model servers, as a
Kubernetes headless Service behaves: one A record per ready pod, every pod on the same port, each on its own
address (127.0.0.2, .3, .4 are all loopback here). Pods that come and go are followed, with their KV-event
subscriptions; a DNS outage and an empty answer keep the last known set."""

from __future__ import annotations

import re
import sys
import urllib.request

import pytest

from helpers import free_ports
from helpers.dns_server import LocalDns
from helpers.model_server import start_server
from helpers.procs import start_process
from helpers.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NAME = "model-server.prefixroute.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def _metrics(url: str) -> dict[str, dict[str, float]]:
    """metric name -> {endpoint label: value}, for the per-endpoint families."""
    out: dict[str, dict[str, float]] = {}
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for m in re.finditer(r'^(prefixroute_[a-z_]+)\{[^}]*endpoint="([^"]+)"[^}]*\} (\S+)$', text, re.M):
        out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return out


def _wait_for(url: str, want: dict[str, float], family: str = "prefixroute_endpoint_healthy",
              timeout_s: float = 20.0) -> dict[str, float]:
    until(lambda: _metrics(url).get(family, {}) == want, timeout_s, interval_s=0.1,
          message=lambda: f"{family}: wanted {want}, got {_metrics(url).get(family, {})}")
    return want


def test_extproc_follows_the_headless_service_records():
    port, grpc_port, metrics_port = free_ports(3)
    servers = {}
    try:
        for host in HOSTS:
            kv = (f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://{host}:{port + 1}", '
                  f'"replay_endpoint": "tcp://{host}:{port + 2}", "topic": "kv-events"}}')
            servers[host] = start_server("--host", host, "--port", str(port), "--kv-events-config", kv)
        # start_server passes --port 0 first; the later --port wins: each server on the shared port.
        assert {s.port for s in servers.values()} == {port}
        eps = {h: f"{h}:{port}" for h in HOSTS}
        with LocalDns() as dns:
            dns.set(NAME, HOSTS[0], HOSTS[1])
            cmd = [sys.executable, "-m", "prefixroute", "extproc", "--listen-address", "127.0.0.1",
                   "--port", str(grpc_port), "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
                   "--endpoints-dns", f"{NAME}:{port}", "--endpoints-dns-nameservers", dns.address,
                   "--endpoints-dns-timeout-s", "0.3", "--resolve-interval-s", "0.2",
                   "--kv-events-port-offset", "1", "--tokenizer", "sim", "--policy", "prefix"]
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            with start_process(cmd, ready_port=grpc_port, timeout_s=60, name="extproc-dns"):
                _wait_for(url, {eps[HOSTS[0]]: 1.0, eps[HOSTS[1]]: 1.0})
                _wait_for(url, {eps[HOSTS[0]]: 1.0, eps[HOSTS[1]]: 1.0}, "prefixroute_kv_events_connected")

                dns.set(NAME, *HOSTS)  # a pod came: routed to once it answers its probe, its events followed
                _wait_for(url, {e: 1.0 for e in eps.values()})
                _wait_for(url, {e: 1.0 for e in eps.values()}, "prefixroute_kv_events_connected")

                dns.set(NAME, HOSTS[1], HOSTS[2])  # a pod went (its process still answers: DNS alone decides)
                _wait_for(url, {eps[HOSTS[1]]: 1.0, eps[HOSTS[2]]: 1.0})
                _wait_for(url, {eps[HOSTS[1]]: 1.0, eps[HOSTS[2]]: 1.0}, "prefixroute_kv_events_connected")

                for outage in ("drop", "servfail", "empty"):  # the last known set stays, still healthy
                    if outage == "empty":
                        dns.mode = "answer"
                        dns.set(NAME)
                    else:
                        dns.mode = outage
                    queries = dns.num_queries
                    until(lambda: dns.num_queries >= queries + 6, 30, interval_s=0.1,  # a few rounds of the outage
                          message="six DNS queries during the outage")
                    assert _metrics(url)["prefixroute_endpoint_healthy"] == {eps[HOSTS[1]]: 1.0, eps[HOSTS[2]]: 1.0}

                dns.mode = "answer"
                dns.set(NAME, HOSTS[0])  # the next answer wins again
                _wait_for(url, {eps[HOSTS[0]]: 1.0})
    finally:
        for s in servers.values():
            s.stop()

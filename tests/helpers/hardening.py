"""Helpers of the issue 27 reliability tests (tests/integration/reliability/test_hardening_findings.py): a gateway
like `prefixroute up`'s over simulated servers, the processes' RSS, listening sockets by pid, and a steady
client that records latency and the endpoint that served each request."""

from __future__ import annotations

import http.client
import json
import os
import statistics
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from helpers.stack import _socket_inodes
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def gateway(stack: ExitStack, endpoints: list[str], log_dir: Path, *, replicas: int = 1,
            routing: RoutingSettings | None = None, envoy_overrides: dict | None = None,
            **gateway_settings) -> GatewayProcesses:  # noqa: ANN003
    gw = GatewayProcesses(
        GatewaySettings(**{"port": free_port(), "ports": "random", "extproc_replicas": replicas,  # type: ignore[arg-type]
                           "listen_address": "127.0.0.1", "expose_served_endpoint": True, **gateway_settings}),
        routing or RoutingSettings(), PoolSettings(endpoints=tuple(endpoints)), log_dir=log_dir, peers=PeerSettings(),
        envoy_overrides=envoy_overrides)
    stack.enter_context(gw)
    return gw


def tree_rss_bytes(pid: int) -> int:
    """RSS of `pid` and its descendants (the router and its parse worker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
        todo += children.get(p, [])
    return total


def listening_ports(pid: int) -> set[int]:
    """TCP ports `pid` listens on."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def post(port: int, path: str, body: dict | bytes, headers: dict[str, str] | None = None,
         timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@dataclass
class SteadyClient:
    """Threads sending short chats with a few long shared prefixes, one connection each, back to back:
    latency and served endpoint per request, by phase."""

    port: int
    num_threads: int = 2
    num_prefixes: int = 8
    phase: str = "warmup"
    samples: list[tuple[str, int, float, str, int]] = field(default_factory=list)  # phase, prefix, s, served, status
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def body(self, prefix: int, i: int) -> bytes:
        system = f"You are assistant number {prefix}. " + "Follow these rules carefully. " * 100
        return json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]}).encode()

    def _run(self, k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        i = 0
        while not self._stop.is_set():
            prefix = (i * self.num_threads + k) % self.num_prefixes
            t0 = time.perf_counter()
            try:
                conn.request("POST", "/v1/chat/completions", self.body(prefix, i),
                             {"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                status, served = r.status, r.getheader("x-gateway-destination-endpoint-served", "")
            except OSError:
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                status, served = 0, ""
            self.samples.append((self.phase, prefix, time.perf_counter() - t0, served, status))
            i += 1
        conn.close()

    def start(self) -> SteadyClient:
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(self.num_threads)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def latencies(self, phase: str) -> list[float]:
        return [s[2] for s in self.samples if s[0] == phase and s[4] == 200]

    def p(self, phase: str, q: float) -> float:
        xs = sorted(self.latencies(phase))
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def affinity(self, phase: str) -> float:
        """Share of the phase's requests served by their prefix's most common endpoint."""
        by_prefix: dict[int, Counter] = {}
        for ph, prefix, _, served, status in self.samples:
            if ph == phase and status == 200:
                by_prefix.setdefault(prefix, Counter())[served] += 1
        total = sum(sum(c.values()) for c in by_prefix.values())
        return sum(c.most_common(1)[0][1] for c in by_prefix.values()) / total if total else 0.0

    def holders(self, phase: str) -> dict[int, str]:
        by_prefix: dict[int, Counter] = {}
        for ph, prefix, _, served, status in self.samples:
            if ph == phase and status == 200:
                by_prefix.setdefault(prefix, Counter())[served] += 1
        return {p: c.most_common(1)[0][0] for p, c in by_prefix.items()}

    def summary(self, phase: str) -> str:
        xs = self.latencies(phase)
        errors = sum(1 for s in self.samples if s[0] == phase and s[4] != 200)
        if not xs:
            return f"{phase}: no answers ({errors} errors)"
        return (f"{phase}: n={len(xs)} errors={errors} p50={statistics.median(xs) * 1e3:.1f} ms "
                f"p99={self.p(phase, 0.99) * 1e3:.1f} ms max={max(xs) * 1e3:.1f} ms "
                f"affinity={self.affinity(phase):.3f}")

"""Correctness of each routing-filter processing mode (EnvoySettings.routing_processing) on Envoy 1.40 ('authz':
Envoy's ext_authz filter in place of ext_proc; its answered Check calls count as its routing streams).

For every mode: a real gateway (Envoy + `prefixroute extproc`, telemetry on) on one fast upstream, then
- 64 KiB and 1 MiB bodies: status, and whether Envoy sent them by the router's pick (cluster picked_endpoint) or by
  the fail-open round robin (cluster endpoint_pool_round_robin: the pick was not honoured);
- a body over max_request_body_bytes (9 MiB): refused with 413 (BUFFERED) or not;
- a slow upload: half the 64 KiB body, a pause of 1.2 s (> the 500 ms message timeout), the rest;
- the router down (its process killed): the request fails open (200 through the round robin), as today.
Usage: .venv/bin/python bench-results/routing-modes/check_modes.py [mode ...]
"""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from pathlib import Path

from prefixroute.bench.http_load import build_request
from prefixroute.bench.overhead import _body, _detached, _wait_listening
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_config.listener import ROUTING_PROCESSING
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import free_port, http_get, stop_group


def _clusters(admin: int) -> tuple[int, int, int]:
    """(requests sent by the pick, by the round robin, routing-filter gRPC streams started) so far."""
    _, text = http_get(f"http://127.0.0.1:{admin}/stats?filter=(upstream_rq_total|streams_started|ext_authz.*)$",
                       timeout_s=2)
    stats = dict(line.split(": ") for line in text.decode().splitlines() if ": " in line)
    # 'authz' (Envoy's ext_authz filter, stat prefix "routing"): its Check calls answered, allowed or denied
    checks = sum(int(stats.get(f"http.gateway.ext_authz.routing.{k}", 0)) for k in ("ok", "denied"))
    return (int(stats.get("cluster.picked_endpoint_0.upstream_rq_total", 0)),
            int(stats.get("cluster.endpoint_pool_round_robin.upstream_rq_total", 0)),
            int(stats.get("http.gateway.ext_proc.streams_started", 0)) + checks)


def _send(port: int, request: bytes, pause_at: int | None = None, pause_s: float = 0.0) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:  # Envoy may answer (413) and close before the whole body is sent
            if pause_at is None:
                sock.sendall(request)
            else:
                sock.sendall(request[:pause_at])
                time.sleep(pause_s)
                sock.sendall(request[pause_at:])
        except OSError:
            pass
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return 0
            data += chunk
        return int(data.split(b" ", 2)[1])


def _check(gw: GatewayProcesses, name: str, request: bytes, **kw: object) -> str:
    p0, r0, s0 = _clusters(gw.admin_port)
    status = _send(gw.gateway.port, request, **kw)  # type: ignore[arg-type]
    time.sleep(0.2)
    p1, r1, s1 = _clusters(gw.admin_port)
    how = "picked" if p1 > p0 else "round-robin" if r1 > r0 else "no upstream"
    return f"{name}: {status} {how}" + ("" if s1 > s0 else " (no routing stream)")


def check(mode: str, endpoint: str, tmp: Path) -> list[str]:
    # 'authz-http' is a gateway setting (the router serves a port of its own); the others are Envoy's alone.
    gateway = {"routing_filter": "ext_authz_http"} if mode == "authz-http" else {}
    gw = GatewayProcesses(
        GatewaySettings(port=free_port(), ports="random", listen_address="127.0.0.1", telemetry=True,  # type: ignore[arg-type]
                        extproc_replicas=1, embedded_nats=False, envoy_admin="loopback", **gateway),
        RoutingSettings(), PoolSettings(endpoints=(endpoint,)), log_dir=tmp / mode,
        envoy_overrides={} if gateway else {"routing_processing": mode},
        extra_extproc_args=["--otlp-endpoint", f"http://127.0.0.1:{free_port()}"])
    out = []
    with gw:
        time.sleep(1.0)  # the pool's first probe
        r64 = build_request("/v1/chat/completions", _body(64 * 1024))
        out.append(_check(gw, "64KB", r64))
        out.append(_check(gw, "1MB", build_request("/v1/chat/completions", _body(1024 * 1024))))
        out.append(_check(gw, "9MB", build_request("/v1/chat/completions", _body(9 * 1024 * 1024))))
        out.append(_check(gw, "slow-upload", r64, pause_at=len(r64) // 2, pause_s=1.2))
        assert gw.extproc is not None
        gw.extproc.kill()
        time.sleep(0.3)
        out.append(_check(gw, "router-down", r64))
    return out


def main() -> int:
    modes = sys.argv[1:] or list(ROUTING_PROCESSING)
    tmp = Path(tempfile.mkdtemp(prefix="routing-modes-"))
    up_port = free_port()
    upstream = _detached([sys.executable, "-m", "prefixroute.bench.fast_upstream", str(up_port)])
    try:
        _wait_listening(up_port, upstream, "fast upstream did not start", timeout_s=10)
        for mode in modes:
            try:
                print(f"{mode:>17}: " + "; ".join(check(mode, f"127.0.0.1:{up_port}", tmp)), flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next mode
                print(f"{mode:>17}: failed to run: {exc!r} (logs {tmp / mode})", flush=True)
    finally:
        stop_group(upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())

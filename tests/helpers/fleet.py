"""Fleets of simulated model servers and gateways for integration tests (always cleaned up via an ExitStack)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.procs import ManagedProcess, ProcessGroup, free_port, http_ok, prefixroute_argv

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulated server's default served model
MAX_BODY_BYTES = 256 * 1024  # small, so the 413 test sends little


@dataclass
class Fleet:
    """Simulated model servers, keyed by endpoint; server i of a fleet started with prefix P has id Pi."""

    servers: dict[str, ManagedProcess] = field(default_factory=dict)  # "127.0.0.1:port" -> process
    admin_urls: dict[str, str] = field(default_factory=dict)  # endpoint -> its admin listener (start_fleet admin)

    def received_traceparents(self) -> list[str]:
        """Every traceparent the servers received lately (their admin listeners' /admin/traceparents)."""
        out: list[str] = []
        for url in self.admin_urls.values():
            with urllib.request.urlopen(url + "/admin/traceparents", timeout=5) as r:  # noqa: S310 - loopback
                out += json.loads(r.read())
        return out

    @property
    def endpoints(self) -> list[str]:
        return list(self.servers)


def start_fleet(stack: ExitStack, n: int, log_dir: Path, prefix: str = "s", *extra_args: str,
                admin: bool = False) -> Fleet:
    """Start `n` simulated servers (time_scale 0.02: fast tests) in parallel, all ready on return; `stack`
    stops them on exit. Server i logs to `log_dir`/`prefix`i.log. `admin`: each with its admin listener
    (`Fleet.admin_urls`)."""
    group = stack.enter_context(ProcessGroup(log_dir, ready_timeout_s=20.0))
    fleet = Fleet()
    for i in range(n):
        port = free_port()
        admin_args: tuple[str, ...] = ()
        if admin:
            admin_port = free_port()
            fleet.admin_urls[f"127.0.0.1:{port}"] = f"http://127.0.0.1:{admin_port}"
            admin_args = ("--admin-port", str(admin_port))
        fleet.servers[f"127.0.0.1:{port}"] = group.start(
            f"{prefix}{i}", prefixroute_argv("model-server", "--port", str(port), "--id", f"{prefix}{i}",
                                             "--time-scale", "0.02", "--shutdown-grace-s", "0.2", *admin_args,
                                             *extra_args),
            ready=lambda port=port: http_ok(f"http://127.0.0.1:{port}/health", timeout_s=1.0), wait=False)
    group.wait_ready()
    return fleet


def start_gateway(stack: ExitStack, endpoints: list[str], log_dir: Path, *, failure_mode: str = "open",
                  extra_extproc_args: list[str] | None = None, pool_overrides: dict | None = None,
                  **gateway: object) -> GatewayProcesses:
    """Start Envoy + ext_proc in front of `endpoints` (logs in `log_dir`/envoy.log, extproc.log); `gateway`
    overrides GatewaySettings' fields."""
    gw = GatewayProcesses(
        GatewaySettings(**{"port": free_port(), "ports": "random", "extproc_replicas": 1,  # type: ignore[arg-type]
                           "listen_address": "127.0.0.1", "failure_mode": failure_mode, "envoy_log_level": "info",
                           "expose_served_endpoint": True, **gateway}),
        RoutingSettings(max_body_bytes=MAX_BODY_BYTES),
        PoolSettings(endpoints=tuple(endpoints), **(pool_overrides or {})),
        log_dir=log_dir, extra_extproc_args=extra_extproc_args)
    stack.enter_context(gw)
    return gw


class SpyListener:
    """A TCP listener on 127.0.0.1 that records every connection it accepts (it must see none)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.num_connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.num_connections += 1
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-spy: yes\r\n\r\nSPIED")
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()


def chat_once(port: int, content: str, *, timeout_s: float = 10.0) -> tuple[int, str]:
    """One short chat through the gateway on 127.0.0.1:`port`: (status, the endpoint that served it) for an
    HTTP answer, (0, the error) when none came (connection refused, reset, timeout)."""
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            r.read()
            return r.status, r.headers.get("x-gateway-destination-endpoint-served", "")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError as exc:
        return 0, repr(exc)

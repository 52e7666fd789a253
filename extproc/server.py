"""The grpc.aio server hosting the ext_proc servicer, and its settings.

What the port serves: ext_proc (``Process``), Envoy's facts (OTLP ``LogsService.Export`` and the early reports,
envoy_facts.py) and the gRPC health check. Envoy's ext_authz over HTTP, an option, has a port of its own
(authz_http.py: `start_authz_http`).

Authentication (both optional, independent, and invisible to the servicers):
- TLS: `tls_cert_file` + `tls_key_file` serve TLS; with `tls_client_ca_file` every client must present a
  certificate signed by that CA (mutual TLS: Envoy's ``extproc_tls_cert_file``), else the handshake fails.
- Bearer token: with `auth_token` (or `auth_token_file`) set, every call but the health check must carry gRPC
  metadata ``authorization: Bearer <token>`` (Envoy's ``extproc_auth_token``, on both ext_proc filters and the
  facts logger); any other call is refused with UNAUTHENTICATED on its metadata, before
  its first message is read, so it can neither route nor report. The check is one metadata scan and a
  constant-time compare per call, never per message, done by the handler itself (`StreamAuth` for ext_proc
  streams, grpc_auth.unary_after_auth for the unary methods (the facts), served as stream-unary so that they run
  before the message is read; no grpc.aio interceptor, which would cost every call a round through its chain).
  The gRPC health check (``/grpc.health.v1.Health/Check``) is exempt: Envoy's health checker and kubelet probes
  carry no token, and it answers only serving / not serving.
- No token and no client CA on an address other than loopback: refused at start (`check_exposure`), unless
  `allow_unauthenticated` says the network in front does the authenticating (a GIE gateway, which presents
  neither, behind a NetworkPolicy: deploy/kubernetes/inferencepool.yaml). Loopback without a token is allowed
  (a developer's own machine; `prefixroute gateway` and `up` always draw one).

Bounds (what a caller can make the port hold; docs/security.md):
- One message at most the body limit plus `MESSAGE_HEADROOM_BYTES` (``grpc.max_receive_message_length``; gRPC
  refuses a longer one on its length prefix, RESOURCE_EXHAUSTED, before buffering it); per method less: a facts
  batch `envoy_facts.MAX_EXPORT_BYTES`, an early report `envoy_facts.MAX_EARLY_REPORT_BYTES`, refused before
  decoding.
- What a caller sends before it is refused: at most the stream window (``grpc.http2.lookahead_bytes``, 256 KiB)
  per stream, freed at the refusal.

Protocols: one server speaks prefixroute's own ext_proc protocol and the Gateway API Inference Extension's,
per stream (`protocol`; servicer.py, gie.py), so one picker serves our Envoy and a GIE gateway alike. The gRPC
health service (health.py) is registered beside ext_proc, and with `health_port` on a plaintext port of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import grpc

from prefixroute import grpc_auth
from prefixroute.extproc import envoy_facts, wire
from prefixroute.extproc.health import HealthServicer
from prefixroute.extproc.authz import AuthzServicer
from prefixroute.extproc.authz_http import (MAX_HEADER_BYTES, AuthzHttpService, server_ssl_context,
                                            start_authz_http_server)
from prefixroute.extproc.exchange import RELEASE_AFTER_S
from prefixroute.extproc.servicer import DEFAULT_MAX_BODY_BYTES, PROTOCOLS, ExtProcServicer, RouterService
from prefixroute.extproc.tracking import NULL_TRACKER, Tracker
from prefixroute.grpc_auth import CallAuth, read_token
from prefixroute.settings import Settings, setting

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExtprocSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_EXTPROC_"
    TITLE: ClassVar[str] = "ext_proc service"

    port: int = setting(9002, "gRPC port Envoy's ext_proc filter connects to (9002: the endpoint-picker "
                        "reference port).")
    listen_address: str = setting("127.0.0.1", "Address to listen on (loopback: only a local Envoy reaches the "
                                  "routing service; a deployment with Envoy in another container sets its private "
                                  "network address or 0.0.0.0 explicitly, with auth_token and/or TLS).")
    ready_timeout_s: float = setting(10.0, "At start, wait up to this long for every endpoint to pass its first "
                                     "health probe before serving (requests before that would get 503); "
                                     "serving starts anyway when it expires.")
    uvloop: bool = setting(True, "Run on uvloop instead of asyncio's default loop (measured faster with "
                           "grpc.aio; see overhead-bench).")
    tls_cert_file: str = setting("", "PEM certificate chain to serve TLS with (with tls_key_file); empty = "
                                 "plaintext gRPC (fine on loopback).")
    tls_key_file: str = setting("", "PEM private key of tls_cert_file.")
    tls_client_ca_file: str = setting("", "PEM CA bundle; set = mutual TLS: a client (Envoy) without a certificate "
                                      "signed by it fails the handshake. Needs tls_cert_file.")
    auth_token: str = setting("", "Bearer token every ext_proc stream must present (gRPC metadata `authorization: "
                              "Bearer <token>`; Envoy's extproc_auth_token); others get UNAUTHENTICATED. Give it "
                              "by environment (PREFIXROUTE_EXTPROC_AUTH_TOKEN) or auth_token_file, not on the "
                              "command line (visible in ps). Empty = no token check.")
    auth_token_file: str = setting("", "File holding auth_token (surrounding whitespace ignored), instead of "
                                   "auth_token (giving both is an error).")
    allow_unauthenticated: bool = setting(
        False, "Serve on an address other than loopback with neither auth_token nor tls_client_ca_file (otherwise "
        "refused at start: anyone who reaches the port could route and report). Only where the network in front "
        "authenticates the callers, e.g. a GIE gateway, which presents neither, behind a NetworkPolicy "
        "(deploy/kubernetes/inferencepool.yaml).")
    replica_index: int = setting(-1, "This process's index k among the ext_proc replicas behind one Envoy (0..N-1, the "
                                 "order of Envoy's extproc_replica_addresses): its routing responses set "
                                 "x-prefixroute-replica: k, so Envoy sends each request's observing stream to the "
                                 "replica that routed it. -1 = the only replica (no header).")
    protocol: str = setting("auto", "Endpoint-picker protocol of each ext_proc stream: 'prefixroute' (our own Envoy "
                            "configuration: request body BUFFERED plus an observing filter), 'gie' (the Gateway API "
                            "Inference Extension's: request and response bodies FULL_DUPLEX_STREAMED on one stream, "
                            "as GIE's reference Envoy and GIE gateways send), or 'auto': read from each stream's "
                            "first message (Envoy's protocol_config), prefixroute when it has none.")
    gie_fallback_list: bool = setting(False, "GIE streams: name the decision's fallbacks too, as GIE's ordered comma "
                                      "list 'primary,fallback,...' in x-gateway-destination-endpoint and its "
                                      "envoy.lb metadata (for gateways that walk the list, e.g. Envoy's "
                                      "override_host load balancing policy). Off: the primary alone, which GIE's "
                                      "reference Envoy (an ORIGINAL_DST cluster on the header) needs: it answers "
                                      "503 to a list.")
    grpc_options: tuple[str, ...] = setting((), "gRPC server channel arguments over the defaults (GRPC_OPTIONS), "
                                            "each NAME=VALUE, e.g. grpc.max_concurrent_streams=1000 or "
                                            "grpc.http2.lookahead_bytes=65536 (an integer VALUE is passed as one); "
                                            "for measuring (overhead-bench --extproc-variants) and tuning.")
    health_port: int = setting(-1, "Also serve the gRPC health service (grpc.health.v1: liveness, readiness, "
                               "envoy.service.ext_proc.v3.ExternalProcessor) on this plaintext port, for kubelet "
                               "grpc probes, which speak neither TLS nor bearer tokens (9003 in GIE's charts). "
                               "-1 = only on the ext_proc port (where Envoy's health check calls it).")
    authz_release_after_s: float = setting(
        RELEASE_AFTER_S, "When Envoy routes by ext_authz (gateway --routing-filter ext_authz_http): the longest a pick "
        "waits for its facts record, which releases it, before it is released anyway and counted in "
        "prefixroute_authz_picks_expired_total (660 s: Envoy's 600 s whole-response timeout and a margin, so only a "
        "lost record waits this long).")
    authz_http_port: int = setting(
        -1, "Also serve Envoy's ext_authz filter over plain HTTP/1.1 on this port (gateway --routing-filter "
        "ext_authz_http; extproc/authz_http.py): the same decision as the ext_proc stream's in one HTTP exchange "
        "(measured ~0.5 ms less added latency, and ~0.7-1.0 ms less after an idle gap: "
        "bench-results/extproc-default/). Same listen address, TLS files and bearer token "
        "as the gRPC port. -1 = not served; 0 = any free port (printed in the ready line).")
    authz_http_max_header_kb: int = setting(
        MAX_HEADER_BYTES // 1024, "authz_http_port: the most a check's request line and headers may take, in KiB "
        "(431 and the connection closed above it, before the token is known). Envoy forwards a client's headers "
        "up to its max_request_headers_kb (32 KiB in the gateway's configuration) plus ~1 KiB of its own: keep "
        "this above that.")
    facts_first_token: str = setting(
        "early", "On the facts path (Envoy's facts records), when the router learns a streamed response's first "
        "token: 'early' = when it happens (the facts Lua filter's asynchronous report to this port: flow control "
        "waits on it, as on the observing path); 'end' = with the request's facts record (the early reports are "
        "ignored, counted; flow control drains a pick's prefill at the predicted rate instead). docs/telemetry.md.")

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {self.protocol!r}")
        if self.facts_first_token not in FACTS_FIRST_TOKEN:
            raise ValueError(f"facts_first_token must be one of {', '.join(FACTS_FIRST_TOKEN)}; "
                             f"got {self.facts_first_token!r}")
        grpc_options(self.grpc_options)  # ValueError now, not at start
        if self.authz_http_max_header_kb < 1:
            raise ValueError(f"authz_http_max_header_kb must be at least 1, got {self.authz_http_max_header_kb}")


FACTS_FIRST_TOKEN = ("early", "end")

MESSAGE_HEADROOM_BYTES = 1024 * 1024
"""What one gRPC message may carry beyond the request body limit (RoutingSettings.max_body_bytes, which the gateway
also gives Envoy as max_request_body_bytes): an ext_proc body message carries a few bytes of framing, a GIE stream's
messages the request's headers beside it."""

GRPC_OPTIONS: dict[str, int | str] = {
    # Many concurrent HTTP requests = many concurrent streams on Envoy's one HTTP/2 connection. Not a memory bound
    # worth having against a caller without the token: a lower cap only moves it to more connections (gRPC has no
    # connection cap); its streams are refused at their metadata, and the stream window below is what each holds.
    "grpc.max_concurrent_streams": 100000,
    # Bodies arrive whole (BUFFERED) in one message: the body limit and MESSAGE_HEADROOM_BYTES (start_server sets
    # it from the router's max_body_bytes). gRPC refuses a longer message on its length prefix, before reading it.
    "grpc.max_receive_message_length": DEFAULT_MAX_BODY_BYTES + MESSAGE_HEADROOM_BYTES,
    "grpc.so_reuseport": 0,
    # The stream window: what a caller may send on a stream before the server reads it, so also what a caller
    # without the token can make the router hold per stream before its refusal (measured on a bare grpc.aio
    # server: 8 connections x 200 unauthenticated streams of 8 MB took +1,080 MiB at 16 MiB, +80 MiB at 256 KiB;
    # the router, 4 x 100 such calls: +3 MiB). A larger message still flows: gRPC widens the window of a stream
    # whose message is being read. Through Envoy (overhead-bench --routing-filter ext_proc, this and a 16 MiB
    # window in the same rounds) 256 KiB added no latency or CPU beyond noise at 4 and 64 KB; BDP probing stays off.
    "grpc.http2.lookahead_bytes": 256 * 1024,
    "grpc.http2.bdp_probe": 0,
    "grpc.optimization_target": "latency",
}
"""The ext_proc server's gRPC channel arguments (ExtprocSettings.grpc_options overrides or adds to them)."""


def grpc_options(overrides: tuple[str, ...], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                 ) -> list[tuple[str, int | str]]:
    """`GRPC_OPTIONS` for a body limit of `max_body_bytes`, with `overrides` ("NAME=VALUE"; an integer VALUE as an
    int) applied; ValueError on an entry without "=", a NAME outside the ``grpc.`` namespace (a typo would be
    silently ignored by gRPC), or an unbounded (-1 or 0) ``grpc.max_receive_message_length``."""
    options = dict(GRPC_OPTIONS)
    options["grpc.max_receive_message_length"] = max_body_bytes + MESSAGE_HEADROOM_BYTES
    for entry in overrides:
        name, sep, value = entry.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name.startswith("grpc.") or not value:
            raise ValueError(f"grpc_options: expected grpc.NAME=VALUE, got {entry!r}")
        options[name] = int(value) if value.lstrip("-").isdigit() else value
    limit = options["grpc.max_receive_message_length"]
    if not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"grpc_options: grpc.max_receive_message_length must be a positive byte count (what one "
                         f"caller can make the router hold), got {limit!r}")
    return list(options.items())


class StreamAuth(CallAuth):
    """The bearer-token check of every call but the health check (grpc_auth.CallAuth), done in the handlers
    themselves: ext_proc streams through `guard` (a refused stream gets UNAUTHENTICATED before its first message
    is read, so it never reaches the servicer), the unary methods (the facts) through
    grpc_auth.unary_after_auth. No grpc.aio interceptor, which costs every call a coroutine round through the
    interceptor chain. The health service is
    simply not wrapped (exempt)."""

    def guard(self, process: Callable[[Any, grpc.aio.ServicerContext], Awaitable[None]]) -> Callable[..., Any]:
        """`process` (a stream handler), refusing streams without the token."""
        allows = self.allows

        async def guarded(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            if allows(context.invocation_metadata()):
                await process(request_iterator, context)
                return
            await self.refuse(context)

        return guarded


def is_loopback(address: str) -> bool:
    """True for a listen address only local processes reach: 127.0.0.0/8, ::1, localhost, a Unix socket."""
    host = address.strip("[]")
    if host in ("localhost", "::1") or host.startswith("unix:"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(s: ExtprocSettings) -> None:
    """ValueError when the router would serve an address other than loopback with no way to tell its callers
    apart (no token, no client CA) and `allow_unauthenticated` is off (module docstring)."""
    if is_loopback(s.listen_address) or s.allow_unauthenticated:
        return
    if resolved_auth_token(s) is None and not s.tls_client_ca_file:
        raise ValueError(f"listen_address {s.listen_address} is not loopback and neither auth_token(_file) nor "
                         "tls_client_ca_file is set: anyone who reaches the port could route and report. Set a token "
                         "(Envoy's extproc_auth_token_file), mutual TLS, or allow_unauthenticated where the network "
                         "in front authenticates the callers (a NetworkPolicy).")


def _always() -> bool:
    return True


def resolved_auth_token(s: ExtprocSettings) -> str | None:
    """The bearer token streams must present (None: no check); ValueError on a bad combination or file."""
    return read_token(s.auth_token, s.auth_token_file)


def server_credentials(s: ExtprocSettings) -> grpc.ServerCredentials | None:
    """TLS credentials per the settings (None = plaintext); ValueError on an incomplete combination or an
    unreadable file."""
    return grpc_auth.server_credentials(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)


async def start_server(router: RouterService, s: ExtprocSettings, tracker: Tracker = NULL_TRACKER, *,
                       ready: Callable[[], bool] = _always, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                       can_hold: bool = False, add_services: Callable[[grpc.aio.Server], None] | None = None,
                       facts: Any = None) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the started server (call `stop(grace)` on it) and its port (port 0 = any).
    Telemetry: a `RequestTracker`, or the default `NULL_TRACKER` for none. TLS and the bearer token per `s`
    (module doc); ValueError/OSError when their settings or files are wrong. The gRPC health service
    (health.py) is served beside ext_proc, over `ready` (the picker can route), without the bearer token.
    ValueError too when the address is exposed without authentication (`check_exposure`).
    `max_body_bytes`: the body limit (RoutingSettings.max_body_bytes): GIE streams' limit, and with
    `MESSAGE_HEADROOM_BYTES` the largest message the port reads. `can_hold`: the router holds requests past
    saturation (flow control: `ExtProcServicer`). `add_services`: adds other services to the server before it
    starts. `facts`: Envoy's response facts receiver (envoy_facts.FactsReceiver), served on the port behind the
    token."""
    token = resolved_auth_token(s)
    credentials = server_credentials(s)
    check_exposure(s)
    options = grpc_options(s.grpc_options, max_body_bytes)
    server = grpc.aio.server(options=options)
    replica = s.replica_index if s.replica_index >= 0 else None
    servicer = ExtProcServicer(router, tracker, replica_index=replica, protocol=s.protocol,
                               gie_fallback_list=s.gie_fallback_list, max_body_bytes=max_body_bytes,
                               can_hold=can_hold, facts_first_token_live=s.facts_first_token == "early",
                               ended_picks=facts.ended_picks if facts is not None else None)
    auth = StreamAuth(token) if token else None
    process = servicer.Process
    wire.add_to_server(server, auth.guard(process) if auth is not None else process)
    if facts is not None:
        envoy_facts.add_to_server(server, facts, auth=auth)
    wire.add_health_to_server(server, HealthServicer(ready).Check)
    if add_services is not None:
        add_services(server)
    address = f"{s.listen_address}:{s.port}"
    bound = (server.add_secure_port(address, credentials) if credentials is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot listen on {s.listen_address}:{s.port}")
    await server.start()
    return server, bound


async def start_authz_http(router: RouterService, s: ExtprocSettings, tracker: Tracker, *, facts: Any,
                           ready: Callable[[], bool], max_body_bytes: int, can_hold: bool = False
                           ) -> tuple[asyncio.Server, int] | None:
    """Envoy's ext_authz over HTTP on `s.authz_http_port` (None when -1): each check decided by `router` (an
    `AuthzServicer`, authz.py), tracked by `tracker`, its pick released by its facts record (`facts`, the
    `FactsReceiver` served by `start_server`, with its table of unary picks), with the same token and TLS files
    as the gRPC port. `can_hold`: as `start_server`'s. OSError when the port cannot be bound; ValueError when
    there is no facts receiver with its pick table (there is no ext_authz routing without it) or the TLS files
    are incomplete."""
    if s.authz_http_port < 0:
        return None
    if facts is None or facts.unary_picks is None:
        raise ValueError("authz_http_port needs the facts receiver with its pick table (the ext_authz picks are "
                         "released by facts records)")
    authz = AuthzServicer(router, tracker, facts.unary_picks, can_hold=can_hold,
                          first_token_live=s.facts_first_token == "early")
    server_credentials(s)  # the same completeness checks as the gRPC port's
    ctx = server_ssl_context(s.tls_cert_file, s.tls_key_file, s.tls_client_ca_file)
    svc = AuthzHttpService(authz, token=resolved_auth_token(s), ready=ready, max_body_bytes=max_body_bytes,
                           replica_index=s.replica_index if s.replica_index >= 0 else None,
                           max_header_bytes=s.authz_http_max_header_kb * 1024)
    try:
        return await start_authz_http_server(svc, s.listen_address, s.authz_http_port, ctx)
    except OSError as exc:
        raise OSError(f"cannot listen on {s.listen_address}:{s.authz_http_port} (authz_http_port): {exc}") from exc


async def start_health_server(s: ExtprocSettings, ready: Callable[[], bool]) -> grpc.aio.Server | None:
    """The plaintext health-only server on `s.health_port` (None when -1; 0 = any port, read back with
    `bound_port`), for kubelet grpc probes. OSError when the port cannot be bound."""
    if s.health_port < 0:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    wire.add_health_to_server(server, HealthServicer(ready).Check)
    bound = server.add_insecure_port(f"{s.listen_address}:{s.health_port}")
    if bound == 0:
        raise OSError(f"cannot listen on {s.listen_address}:{s.health_port} (health_port)")
    server.bound_port = bound  # type: ignore[attr-defined]
    await server.start()
    return server


def new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            pass
    return asyncio.new_event_loop()

"""`prefixroute telemetry`: the OTLP receiver + request store, and `telemetry dump`.

Run the receiver (OTLP/gRPC on --port, SQLite store at --db, JSON query API on --http-port)::

    prefixroute telemetry --port 4317 --db telemetry.db --http-port 4320

Point the router at it (standard OpenTelemetry variables, read by the ext_proc service, or its
``--otlp-endpoint`` flag / PREFIXROUTE_EXTPROC_OTLP_ENDPOINT)::

    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:4317 prefixroute gateway ...

The router exports one span ``prefixroute.route`` (kind SERVER) per routed request. It joins the
client's W3C ``traceparent`` when there is one and passes ``traceparent`` on to the model server with
its own span as the parent. Attributes: ``gen_ai.request.model``, ``gen_ai.operation.name``,
``gen_ai.usage.input_tokens`` / ``output_tokens`` / ``cache_read.input_tokens``, ``server.address`` /
``server.port`` (served endpoint), ``http.response.status_code``, ``url.path``, ``error.type``, and
``prefixroute.{request_id, tenant_hash, policy, reason, endpoint, endpoints, fallback_endpoints,
matched_blocks, total_blocks, predicted_hit_ratio, predicted_ttft_ms, alternative_endpoint,
alternative_ttft_ms, decision_us, ttft_ms, latency_ms, cached_tokens, stream, status}``; the time
model's predictions (``predicted_ttft_ms``, ``alternative_*``) are omitted when the routing policy has
none. Its Prometheus metrics are on ``--metrics-port`` (default 9464, ``/metrics``).

Securing it (the port may be reachable by others: the store believes what it is sent)::

    PREFIXROUTE_TELEMETRY_AUTH_TOKEN=$(cat token) prefixroute telemetry --host 0.0.0.0 \
        --tls-cert-file server.crt --tls-key-file server.key --tls-client-ca-file ca.crt
    # the router (standard OpenTelemetry variables):
    OTEL_EXPORTER_OTLP_ENDPOINT=https://telemetry:4317 OTEL_EXPORTER_OTLP_CERTIFICATE=ca.crt \
    OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE=client.crt OTEL_EXPORTER_OTLP_CLIENT_KEY=client.key \
    OTEL_EXPORTER_OTLP_HEADERS="authorization=Bearer%20$(cat token)" prefixroute gateway ...
    # the dashboard / dump over the HTTP API send the same token:
    PREFIXROUTE_DASHBOARD_TELEMETRY_TOKEN=$(cat token) prefixroute dashboard --telemetry http://127.0.0.1:4320

Without the client certificate the TLS handshake fails; without the token every OTLP call is answered
UNAUTHENTICATED and every HTTP API route but /healthz 401. Either way nothing is stored.

Print the routed requests of the last minute, one JSON object per line (from the file or the API)::

    prefixroute telemetry dump --since 60 --db telemetry.db
    prefixroute telemetry dump --since 60 --url http://127.0.0.1:4320

Each line has: trace_id, span_id, parent_span_id, request_id, start_time (unix s), model, tenant_hash,
policy, reason, endpoint (served), endpoints (decision: primary, then fallbacks), matched_blocks,
total_blocks, predicted_hit_ratio, predicted_ttft_ms (the time model's predicted TTFT at the primary, ms),
alternative_endpoint and alternative_ttft_ms (the best other endpoint it scored and its predicted TTFT; all
three null for a policy without a time model), decision_us, ttft_ms, latency_ms, prompt_tokens,
completion_tokens, cached_tokens, stream, status, error, path, end_time.

Sending the same traces to Jaeger, Tempo or an OpenTelemetry Collector
-----------------------------------------------------------------------
The router exports plain OTLP/gRPC, so any OTLP backend works; only the endpoint changes:

- Jaeger (v1.35+ / v2 accept OTLP natively)::

      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://jaeger:4317

- Grafana Tempo (OTLP receiver enabled in its distributor)::

      OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://tempo:4317

- Other useful variables: OTEL_SERVICE_NAME (default ``prefixroute-router``), OTEL_RESOURCE_ATTRIBUTES,
  OTEL_EXPORTER_OTLP_HEADERS (e.g. an auth token), OTEL_EXPORTER_OTLP_CERTIFICATE / an ``https://``
  endpoint for TLS, OTEL_EXPORTER_OTLP_COMPRESSION=gzip, OTEL_BSP_MAX_QUEUE_SIZE / _MAX_EXPORT_BATCH_SIZE /
  _SCHEDULE_DELAY / _EXPORT_TIMEOUT, OTEL_SDK_DISABLED=true (or OTEL_TRACES_EXPORTER=none) to turn tracing off.

To keep the prefixroute dashboard *and* a tracing backend, point the router at an OpenTelemetry
Collector that fans the stream out to both (this receiver speaks OTLP like any backend)::

    receivers:
      otlp:
        protocols:
          grpc:
            endpoint: 0.0.0.0:4317
    processors:
      batch: {}
    exporters:
      otlp/prefixroute:            # prefixroute telemetry --port 14317 --db telemetry.db
        endpoint: 127.0.0.1:14317
        tls:
          insecure: true
      otlp/jaeger:
        endpoint: jaeger:4317
        tls:
          insecure: true
    service:
      pipelines:
        traces:
          receivers: [otlp]
          processors: [batch]
          exporters: [otlp/prefixroute, otlp/jaeger]

The receiver stores only the router's request spans (named ``prefixroute.route``); spans from other
services in the same stream are counted and ignored, and OTLP metrics and logs are accepted and
discarded, so a Collector may send it everything.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, ClassVar

import orjson

from prefixroute import settings
from prefixroute.settings import Settings, setting
from prefixroute.state import default_db, ensure_dir, new_run_id
from prefixroute.telemetry.store import DEFAULT_MAX_BYTES

if TYPE_CHECKING:  # the receiver (grpc) is imported when it starts
    from prefixroute.telemetry.receiver import ServerTls

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # = receiver.DEFAULT_MAX_MESSAGE_BYTES (grpc not imported here)

log = logging.getLogger("prefixroute.telemetry")


@dataclasses.dataclass(frozen=True)
class ReceiverSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_TELEMETRY_"
    TITLE: ClassVar[str] = "Telemetry receiver"

    host: str = setting("127.0.0.1", "Address to bind the OTLP/gRPC server (loopback: nothing is exposed unless "
                                     "asked; use 0.0.0.0 to accept remote senders, with TLS and a token).")
    port: int = setting(4317, "OTLP/gRPC port (4317 is the OTLP standard port, so SDK defaults reach it).")
    http_host: str = setting("", "Address of the HTTP query API; empty: the same as --host (so a receiver on a "
                                 "private container network serves its dashboard there).")
    db: str = setting("", "SQLite file of the request store (created if absent; WAL files sit beside it); empty: "
                          "telemetry.db in the state folder ($PREFIXROUTE_STATE_DIR, else $XDG_STATE_HOME/prefixroute, "
                          "else ~/.local/state/prefixroute), where the dashboard looks by default.")
    run_id: str = setting("", "Run id written into every request stored, so the dashboard can show one run apart "
                              "from earlier ones in the same store (`prefixroute up` gives one per start); empty: "
                              "a new one per receiver start (UTC start time + 4 hex digits).")
    http_port: int = setting(4320, "Port of the HTTP JSON query API for the dashboard and `dump --url` "
                                   "(next to OTLP's 4317/4318); -1 disables it, 0 picks a free port.")
    max_age_s: float = setting(86400.0, "Retention: rows older than this are deleted (a day covers a benchmark "
                                        "session and a day of dashboards); <= 0 keeps all.")
    max_rows: int = setting(500_000, "Retention: at most this many rows, oldest deleted first (about an hour at "
                                     "140 requests/s; 1.1 GB at the ~2.2 KB a typical row takes, measured, so "
                                     "--max-bytes binds just before it by default); <= 0 means no limit.")
    max_bytes: int = setting(DEFAULT_MAX_BYTES, "Retention: the store's pages in use (rows, indexes, attributes) "
                                                "stay under this many bytes, oldest rows deleted first (1 GiB, "
                                                "measured: ~485,000 typical rows of ~2.2 KB, ~30,000 rows of "
                                                "~35 KB whose every attribute is at its size cap); the file "
                                                "exceeds it by at most one retention interval of inserts plus the "
                                                "WAL (<= 64 MiB after a checkpoint); <= 0 means no limit.")
    retention_interval_s: float = setting(10.0, "How often retention runs (a DELETE per 10 s costs nothing "
                                                "visible; per insert it would).")
    envoy_record_hold_s: float = setting(15.0, "How long Envoy's record of a request (its OTLP log, envoy-config "
                                               "--records-otlp-address) waits for the router's own record of the "
                                               "same request id before it is stored instead: the router exports "
                                               "within ~5 s of a response's end.")
    max_pending_batches: int = setting(1024, "OTLP export requests queued for the store writer before new ones "
                                             "are answered with partial success (rejected spans, counted).")
    max_pending_bytes: int = setting(256 << 20, "Bytes (wire size) of queued OTLP requests before new ones are "
                                                "rejected likewise: bounds the receiver's memory to a small "
                                                "multiple of this (parsed messages take ~2-3x their wire size).")
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, "Largest OTLP request accepted (16 MiB: 4x the "
                                                                "4 MiB OTLP exporters send by default); bigger "
                                                                "ones get RESOURCE_EXHAUSTED, and the router "
                                                                "splits them in halves.")
    tls_cert_file: str = setting("", "PEM certificate (chain) of the OTLP server: serve TLS (senders use "
                                     "https://HOST:PORT and trust its CA). Needs --tls-key-file.")
    tls_key_file: str = setting("", "PEM private key of --tls-cert-file.")
    tls_client_ca_file: str = setting("", "PEM CA bundle: require a client certificate signed by it (mutual TLS; "
                                          "a sender without one fails the handshake). Needs --tls-cert-file.")
    auth_token: str = setting("", "Bearer token required on every OTLP call (UNAUTHENTICATED otherwise) and on "
                                  "the HTTP API's data routes (401); senders set OTEL_EXPORTER_OTLP_HEADERS="
                                  "authorization=Bearer%20TOKEN. Prefer the env var or --auth-token-file to "
                                  "the flag (a flag shows in `ps`).")
    auth_token_file: str = setting("", "File holding the bearer token (surrounding whitespace ignored), instead "
                                       "of --auth-token.")

    def resolved_token(self) -> str | None:
        """The bearer token (from auth_token or auth_token_file), None when none is configured; raises
        ValueError for both at once or an empty / unreadable file."""
        from prefixroute.grpc_auth import read_token  # lazily: `dump` needs no grpc

        return read_token(self.auth_token, self.auth_token_file)

    def server_tls(self) -> ServerTls | None:
        """The TLS configuration, None without --tls-cert-file; ValueError for an incomplete one."""
        if not (self.tls_cert_file or self.tls_key_file or self.tls_client_ca_file):
            return None
        if not (self.tls_cert_file and self.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together (--tls-client-ca-file needs both)")
        for name, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file),
                           ("--tls-client-ca-file", self.tls_client_ca_file)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path}")
        from prefixroute.telemetry.receiver import ServerTls

        return ServerTls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file or None)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, ReceiverSettings)
    parser.add_argument("--log-level", default="INFO", help="Python logging level [default INFO].")
    sub = parser.add_subparsers(dest="telemetry_command", metavar="{dump}")
    dump = sub.add_parser("dump", help="Print stored requests, one JSON object per line, oldest first.",
                          description="Print stored requests, one JSON object per line, oldest first.")
    dump.add_argument("--since", dest="since_s", type=float, required=True, metavar="SECONDS",
                      help="Requests that started in the last SECONDS.")
    src = dump.add_mutually_exclusive_group()
    src.add_argument("--db", dest="dump_db", metavar="PATH",
                     help="Read this SQLite store [default: $PREFIXROUTE_TELEMETRY_DB or the receiver default].")
    src.add_argument("--url", dest="dump_url", metavar="URL",
                     help="Read from a receiver's HTTP API instead, e.g. http://127.0.0.1:4320.")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.telemetry_command == "dump":
        return dump(args)
    try:
        cfg = settings.from_namespace(ReceiverSettings, args)
        token = cfg.resolved_token()
        tls = cfg.server_tls()
    except ValueError as exc:
        print(f"prefixroute telemetry: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg, tls, token))


def dump(args: argparse.Namespace) -> int:
    from prefixroute.telemetry.client import HttpStoreClient, TelemetryUnavailable
    from prefixroute.telemetry.store_reader import StoreReader
    from prefixroute.telemetry.store_schema import StoreMissing

    if not args.since_s > 0:
        print("prefixroute telemetry dump: --since must be > 0", file=sys.stderr)
        return 2
    try:
        if args.dump_url:
            # The receiver's own token setting (PREFIXROUTE_TELEMETRY_AUTH_TOKEN / _FILE) authenticates dump.
            token = settings.from_namespace(ReceiverSettings, args).resolved_token()
            reader = HttpStoreClient(args.dump_url, token=token)
        else:
            db = args.dump_db or settings.from_namespace(ReceiverSettings, args).db or default_db()
            reader = StoreReader(db)
        out = sys.stdout.buffer
        with reader:
            for row in reader.iter_requests(args.since_s):
                out.write(orjson.dumps(row) + b"\n")
        out.flush()
    except (StoreMissing, TelemetryUnavailable, ValueError) as exc:
        print(f"prefixroute telemetry dump: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `dump | head` is fine
        return 0
    return 0


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


async def _serve(cfg: ReceiverSettings, tls: ServerTls | None = None, token: str | None = None) -> int:
    from prefixroute.telemetry.receiver import Receiver

    http_host = cfg.http_host or cfg.host
    db, run_id = cfg.db or default_db(), cfg.run_id or new_run_id()
    if not cfg.db:
        ensure_dir(os.path.dirname(db))  # the state folder: owner-only when we create it
    receiver = Receiver(db, host=cfg.host, port=cfg.port, http_port=None if cfg.http_port < 0 else cfg.http_port,
                        http_host=http_host, max_age_s=cfg.max_age_s, max_rows=cfg.max_rows, max_bytes=cfg.max_bytes,
                        retention_interval_s=cfg.retention_interval_s, max_pending_batches=cfg.max_pending_batches,
                        max_pending_bytes=cfg.max_pending_bytes, max_message_bytes=cfg.max_message_bytes,
                        tls=tls, auth_token=token, run_id=run_id,
                        envoy_record_hold_s=cfg.envoy_record_hold_s)
    try:
        await receiver.start()
    except (OSError, ValueError) as exc:  # ValueError: grpc rejecting a malformed PEM file
        log.error("cannot start: %s", exc)
        return 1
    if not _is_loopback(cfg.host) and not (tls or token):
        log.warning("OTLP on %s accepts spans from anyone who reaches it: set --tls-cert-file/--tls-client-ca-file "
                    "and/or PREFIXROUTE_TELEMETRY_AUTH_TOKEN", cfg.host)
    http = f", HTTP API on http://{http_host}:{receiver.http_port}" if receiver.http_port is not None else ""
    security = ", ".join(x for x in ("mTLS" if tls and tls.client_ca_file else "TLS" if tls else "",
                                     "bearer token" if token else "") if x) or "no TLS, no token"
    # One parseable line so scripts and tests can find the bound ports (0 = pick a free port).
    print(f"prefixroute telemetry: OTLP/gRPC on {cfg.host}:{receiver.port}{http}, store {db} "
          f"(run {run_id}; {security})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await receiver.stop()
    log.info("stopped: %s", receiver.stats.as_dict())
    return 0

"""HTTP JSON query API over the store, served by the receiver (stdlib server, one thread per request).

Routes (GET; every parameter optional unless marked; times in seconds; bad input -> 400 in the
OpenAI error format, a missing store -> 503, an unknown route -> 404):

    /api/summary?window_s=300                          -> StoreReader.summary
    /api/timeseries?window_s=300&bucket_s=5&by_endpoint=0|1 -> StoreReader.timeseries
    /api/breakdown?window_s=300&by=endpoint            -> StoreReader.breakdown (by=gateway_outcome: flow control)
    /api/endpoints?window_s=300                        -> StoreReader.endpoints
    /api/reasons?window_s=300[&bucket_s=5]             -> StoreReader.reasons
    /api/histogram?window_s=300&column=ttft_ms[&bin_width=10&num_bins=30] -> StoreReader.histogram
                                                          (column=gateway_wait_ms: time held in the gateway queue;
                                                           column=routing_ms: Envoy's routing delay)
    /api/ttft_predictions?window_s=300                 -> StoreReader.ttft_predictions
    /api/requests?since_s=60[&limit=10000]             -> StoreReader.iter_requests (oldest first), JSON array of
                                                          at most limit rows (1..MAX_ROWS): a window holding more
                                                          is cut (read the rest with a later now= or shorter
                                                          since_s), so no query holds the receiver's memory
    /api/recent?limit=100[&endpoint=host:port][&run_id=ID] -> StoreReader.recent_requests (newest first)
    /api/runs                                          -> StoreReader.runs (newest first)
    /api/request?trace_id=HEX(required)[&span_id=HEX]  -> StoreReader.request (404 when absent)
    /api/stats                                         -> receiver counters + num_requests in the store
    /healthz                                           -> {"status": "ok"}

Request rows (/api/requests, /api/recent, /api/request) carry every record column, among them
``gateway_wait_ms`` and ``gateway_outcome`` (flow control: store_schema.py) and ``routing_ms`` (Envoy's routing
delay).

Every query route accepts ``now=`` (unix s) to query a fixed instant, like the reader methods.

With an `auth_token`, every route but /healthz (which says nothing about the data, for health checks)
requires ``Authorization: Bearer <token>``: 401 in the OpenAI error format otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar, Protocol
from urllib.parse import parse_qs, urlsplit

from prefixroute.grpc_auth import bearer_matches

from prefixroute.openai_errors import error_body
from prefixroute.telemetry.store_reader import StoreReader
from prefixroute.telemetry.store_schema import StoreMissing

log = logging.getLogger(__name__)


MAX_ROWS = 10_000
"""Most request rows one query returns (/api/requests, /api/recent): ~10-20 MB of JSON, built in memory per
query. A window of a busy fleet holds far more (1,000 req/s: 60,000 a minute), and an unbounded answer made one
caller hold the receiver's memory."""


def _limit(q: dict[str, list[str]], default: int) -> int:
    limit = _num(q, "limit", default, kind=int)
    if limit < 1 or limit > MAX_ROWS:
        raise _BadRequest(f"limit must be in 1..{MAX_ROWS}", "limit")
    return limit


class _BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _num(q: dict[str, list[str]], name: str, default: float | None, *, kind: type = float) -> Any:
    raw = q.get(name)
    if not raw:
        return default
    try:
        v = kind(raw[-1])
    except ValueError:
        raise _BadRequest(f"{name} must be a number, got {raw[-1]!r}", name) from None
    if v != v or v in (float("inf"), float("-inf")):
        raise _BadRequest(f"{name} must be finite", name)
    return v


def _flag(q: dict[str, list[str]], name: str) -> bool:
    raw = (q.get(name) or ["0"])[-1].lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("0", "false", "no", ""):
        return False
    raise _BadRequest(f"{name} must be 0 or 1", name)


def query(reader: StoreReader, path: str, q: dict[str, list[str]]) -> Any:
    """Run one API route against a reader; raises _BadRequest / KeyError (unknown route) / LookupError."""
    now = _num(q, "now", None)
    window_s = _num(q, "window_s", 300.0)
    if path == "/api/summary":
        return reader.summary(window_s, now=now)
    if path == "/api/timeseries":
        return reader.timeseries(window_s, _num(q, "bucket_s", 5.0), by_endpoint=_flag(q, "by_endpoint"), now=now)
    if path == "/api/breakdown":
        return reader.breakdown(window_s, (q.get("by") or ["endpoint"])[-1], now=now)
    if path == "/api/endpoints":
        return reader.endpoints(window_s, now=now)
    if path == "/api/reasons":
        return reader.reasons(window_s, _num(q, "bucket_s", None), now=now)
    if path == "/api/histogram":
        return reader.histogram(window_s, (q.get("column") or ["ttft_ms"])[-1], bin_width=_num(q, "bin_width", None),
                                num_bins=_num(q, "num_bins", 30, kind=int), now=now)
    if path == "/api/ttft_predictions":
        return reader.ttft_predictions(window_s, now=now)
    if path == "/api/requests":
        return list(reader.iter_requests(_num(q, "since_s", 60.0), now=now,
                                         limit=_limit(q, MAX_ROWS)))
    if path == "/api/recent":
        limit = _limit(q, 100)
        return reader.recent_requests(limit, endpoint=(q.get("endpoint") or [None])[-1],
                                      run_id=(q.get("run_id") or [None])[-1])
    if path == "/api/runs":
        return reader.runs()
    if path == "/api/request":
        trace_id = (q.get("trace_id") or [None])[-1]
        if not trace_id:
            raise _BadRequest("trace_id is required", "trace_id")
        found = reader.request(trace_id, (q.get("span_id") or [None])[-1])
        if found is None:
            raise LookupError(f"no request with trace_id {trace_id}")
        return found
    raise KeyError(path)


class ApiStats(Protocol):
    """The receiver's counters as the API reports them (`receiver.ReceiverStats`)."""

    def count_unauthenticated(self) -> None: ...

    def as_dict(self) -> dict[str, int]: ...


@dataclasses.dataclass(frozen=True)
class ApiConfig:
    """What one API server answers from: the store file, the receiver's counters (None: only the store's
    figures in /api/stats) and the bearer token its data routes require (None: none)."""

    db_path: str
    stats: ApiStats | None = None
    token: bytes | None = None


class StoreApiHandler(BaseHTTPRequestHandler):
    """The API's request handler (routes: module docstring); `make_handler` gives it its `ApiConfig`. Each GET
    opens its own read-only `StoreReader` (a reader is single-thread; the server runs a thread per request)."""

    protocol_version = "HTTP/1.1"
    config: ClassVar[ApiConfig]

    def log_message(self, fmt: str, *args: object) -> None:  # the default writes every hit to stderr
        log.debug("http api: " + fmt, *args)

    def _send(self, status: int, payload: object) -> None:
        self._send_bytes(status, json.dumps(payload, default=str).encode())

    def _send_bytes(self, status: int, body: bytes) -> None:
        self.send_response(status)
        if status == 401:
            self.send_header("www-authenticate", 'Bearer realm="prefixroute telemetry"')
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self._send_bytes(status, error_body(status, message, param=param))

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (an unsupported method: 501, a malformed request line: 400, a header
        # block too large: 431) in the API's JSON error format, not its HTML page.
        self.close_connection = True
        status = code if code in (400, 404, 405, 408, 414, 431, 501, 505) else 400
        text = message or self.responses.get(code, ("error",))[0]
        with contextlib.suppress(OSError):
            self._send_bytes(status, error_body(status, f"{text} (this API serves GET only)"
                                                if status == 501 else text))

    def _method_not_allowed(self) -> None:  # noqa: N802 - every method but GET
        self.close_connection = True
        body = error_body(405, f"method {self.command} is not allowed: this API serves GET only")
        self.send_response(405)
        self.send_header("allow", "GET")
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed  # noqa: N815

    def do_HEAD(self) -> None:  # noqa: N802
        self._method_not_allowed()

    def do_GET(self) -> None:  # noqa: N802
        parts = urlsplit(self.path)
        q = parse_qs(parts.query, keep_blank_values=True)
        if parts.path == "/healthz":
            return self._send(200, {"status": "ok"})
        if not self._authorized():
            return self._error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        try:
            reader = StoreReader(self.config.db_path)
        except StoreMissing as exc:
            return self._error(503, str(exc))
        try:
            return self._send(200, self._answer(reader, parts.path, q))
        except _BadRequest as exc:
            return self._error(400, str(exc), exc.param)
        except ValueError as exc:  # the reader's own argument checks
            return self._error(400, str(exc))
        except KeyError:
            return self._error(404, f"no route {parts.path}")
        except LookupError as exc:
            return self._error(404, str(exc))
        finally:
            reader.close()

    def _authorized(self) -> bool:
        """The request carries the bearer token, or none is required (a refusal is counted)."""
        token, stats = self.config.token, self.config.stats
        if token is None or bearer_matches(self.headers.get("authorization"), token):
            return True
        if stats is not None:
            stats.count_unauthenticated()
        return False

    def _answer(self, reader: StoreReader, path: str, q: dict[str, list[str]]) -> object:
        stats = self.config.stats
        if path == "/api/stats":
            return {**(stats.as_dict() if stats else {}), "num_requests": reader.num_requests()}
        return query(reader, path, q)


def make_handler(db_path: str, stats: ApiStats | None, auth_token: str | None = None) -> type[StoreApiHandler]:
    """The handler class of one API server over `db_path` (`auth_token`: required as a bearer token)."""
    class Handler(StoreApiHandler):
        config = ApiConfig(db_path, stats, auth_token.encode() if auth_token else None)

    return Handler


def start_http_api(db_path: str, host: str, port: int, *, stats: ApiStats | None = None,
                   auth_token: str | None = None) -> ThreadingHTTPServer:
    """Serve the API on a daemon thread; returns the server (server_address has the bound port;
    call shutdown() then server_close() to stop). `auth_token`: required as a bearer token."""
    server = ThreadingHTTPServer((host, port), make_handler(db_path, stats, auth_token))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="prefixroute-telemetry-http", daemon=True).start()
    return server

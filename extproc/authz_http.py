"""The router behind Envoy's ext_authz filter over plain HTTP/1.1 (routing_processing 'authz-http').

The same decision as the gRPC ``Check`` (authz.py: `AuthzServicer.start/finish/settle`), carried by Envoy's HTTP
authorization service instead of gRPC: Envoy sends each request's method, path (under `CHECK_PATH_PREFIX`),
headers and body (whole up to EnvoySettings.authz_body_bytes; a larger one's first part, which is handed off) as one
HTTP/1.1 request on a kept-alive connection, and takes the routing headers from a 200 answer. No gRPC core and no protobuf on either side: an answer is a few pre-built bytes written from the event
loop's own thread, where grpc.aio hands every message between its poller thread and the loop. Measured on a bare
server (bench-results/routing-authz-http/): ~0.2 ms added against ~0.45 ms for the gRPC Check back to back, and
~0.3 ms against ~1.1 ms for the first request after an idle gap, which is what a request of a real workload meets.

Contract (Envoy's side is envoy_config/listener.py `authz_http_filter`):

- ``POST|GET... /check<path>``: the check of one client request. Answers:
  - 200 with the routing headers (destination, fallbacks, replica, ``traceparent``): Envoy sets them on the request
    (``allowed_upstream_headers``) and routes again by them (``clear_route_cache``); the pick is held until the
    request's facts record (exchange.py `FactsWaits`). The 200 is written as soon as the decision is final, before the
    pick is recorded, counted and tracked (`AuthzServicer.start`'s ``early_answer``): that work follows on the
    loop before anything else runs, so it no longer delays Envoy; a failure in it costs no second answer;
  - a refusal (`OpenAIError`) with its status, JSON body, ``content-type``, ``x-prefixroute-refused`` and
    ``retry-after``, which Envoy returns to the client as is (``allowed_client_headers``). Envoy's HTTP client takes
    any 5xx from the authorization service for a failure of the service (then it fails the request open), so a 5xx
    refusal travels as `transport_status` (470 + the 5xx's last digit) and Envoy's local reply mapping restores it
    (envoy_config/replies.py): the client sees the router's 503, never the transport code;
  - 500 on a missing or wrong token or an error of the router itself: Envoy's failure mode applies (open: the
    round-robin pool; closed: 503), as for a gRPC error.
- ``GET /health``: 200 while the router can route (an endpoint healthy), else 503; no token (Envoy's health check).
- Anything else: 404. A malformed request: 400 and the connection closed.
- The bearer token, when set, must come in `TOKEN_HEADER` (``Bearer <token>``; Envoy's credential injector sets
  it): not ``authorization``, which carries the client's own key to the Responses API lookups.
- The facts path: Envoy adds ``x-prefixroute-observed: facts`` (OBSERVED_METADATA) to every check, as the gRPC
  filter's initial metadata says it; without it a pick is released at its decision (authz.py `settle`). Likewise
  ``x-prefixroute-handoff: ext_proc`` says Envoy has the handoff route: a request to hold or a large body is then
  answered with that header alone (authz.py `AuthzServicer.start`).
- One request at a time per connection (Envoy does not pipeline; a pipelined request waits its turn, and past
  `MAX_PIPELINED` waiting the connection is read no further until they are answered). A decision that waits (a
  response-id lookup, a large body parsed off the loop) runs as a task, cancelled if Envoy closes the connection
  (its timeout) before the answer.

The caller is checked before the port holds anything of a check (docs/security.md, "The router's ports"):
- The token is checked as soon as its header arrives (a wrong one: 500 and the connection closed at once, the rest
  of the request unread) and at the end of the headers (none: the same), before any body byte is kept. A
  connection that presented it (with no token configured: that sent a whole check) is *trusted*; the others may
  ask only ``/health`` (and get 404s), their bodies never kept.
- The request line and headers: at most `AuthzHttpService.max_header_bytes` (checked per read: at most one read
  beyond) and `MAX_HEADERS` lines, else 431 and the connection closed; a repeated header's values are kept in a
  list and joined once (linear in the headers' size, where joining as they came was quadratic).
- Time: a request must arrive whole within `REQUEST_TIMEOUT_S` of its first byte, a new connection must start a
  request within it, and a trusted connection may stay idle `IDLE_TIMEOUT_S` (Envoy's pool closes its idle
  connections first: envoy_config/clusters.py); checked by one sweep a second, nothing per request but a clock
  read. TLS handshakes get `REQUEST_TIMEOUT_S` too.
- Connections: at most `MAX_UNTRUSTED_CONNECTIONS` not yet trusted and `MAX_CONNECTIONS` in all; beyond either,
  the untrusted connection idle the longest is closed (a new one is the least idle, so a flood of them cannot keep
  Envoy's new connections out, which are trusted at their first check), and with none to close a new connection is
  closed at once. Envoy's HTTP health checker (several replicas) sends no token: its connection, asking every
  0.25 s, is closed only if that many untrusted connections are busier (it reconnects at its next interval). A
  client that does not read its answers is read no further while its unsent answers pass the transport's
  high-water mark.

Async safety: every callback runs on the router's event loop; nothing blocks.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import httptools

from prefixroute.extproc.authz import HANDOFF, AuthzServicer
from prefixroute.extproc.headers import (AUTHZ_BODY_BYTES_HEADER, AUTHZ_CHECK_PATH_PREFIX, AUTHZ_TOKEN_HEADER,
                                         HANDOFF_HEADER, HANDOFF_VALUE, OBSERVED_METADATA, transport_status)
from prefixroute.extproc.answers import MAX_CACHED_ANSWERS
from prefixroute.extproc.exchange import Wait
from prefixroute.extproc.servicer import ResponseCache
from prefixroute.grpc_auth import bearer_matches
from prefixroute.openai_errors import error_body

log = logging.getLogger(__name__)

CHECK_PATH_PREFIX = AUTHZ_CHECK_PATH_PREFIX
_CHECK_PREFIX = CHECK_PATH_PREFIX.encode()
HEALTH_PATH = b"/health"
TOKEN_HEADER = AUTHZ_TOKEN_HEADER
_TOKEN = TOKEN_HEADER.encode()
_HANDOFF = HANDOFF_HEADER.encode()
_BODY_CAP = AUTHZ_BODY_BYTES_HEADER.encode()
_INTERNAL = {OBSERVED_METADATA.encode(), _TOKEN, _HANDOFF, _BODY_CAP}
_HANDOFF_ANSWER = f"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n{HANDOFF_HEADER}: {HANDOFF_VALUE}\r\n\r\n".encode()
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Payload Too Large",
            431: b"Request Header Fields Too Large", 500: b"Internal Error", 503: b"Service Unavailable"}

MAX_HEADER_BYTES = 96 * 1024
"""Default of the request line and headers' limit (ExtprocSettings.authz_http_max_header_kb): Envoy forwards a
client's headers up to its max_request_headers_kb (32 KiB in our configuration) and adds a few of its own (~1 KiB);
3x that, so an operator may double Envoy's limit before raising this one."""
MAX_HEADERS = 256
"""Most header lines a check may carry: Envoy forwards at most max_headers_count client headers (its default, 100,
which our configuration keeps) and adds about ten."""
REQUEST_TIMEOUT_S = 5.0
"""A request's first byte to its last, and a new connection's accept to its first byte: Envoy sends a check at once
and gives up on it after its answer timeout (0.5 s), so only a client that is not Envoy (or a host stalled for
seconds) takes longer."""
IDLE_TIMEOUT_S = 120.0
"""How long a trusted kept-alive connection may wait for its next check: twice Envoy's idle timeout for the
check cluster (clusters.py AUTHZ_HTTP_IDLE_TIMEOUT_S), so Envoy always closes an idle connection first and never
sends a check on one this side is closing."""
MAX_CONNECTIONS = 4096
"""Open connections at most (each costs a file descriptor and ~10 KiB): above Envoy's HTTP/1.1 pool at thousands
of concurrent checks."""
MAX_UNTRUSTED_CONNECTIONS = 128
"""Connections not yet trusted at most (beyond, the one idle the longest is closed). Envoy's new connections send
their first check within microseconds of connecting, so only a flood of 128 connections in that time could close
one (its check then meets a reset, Envoy's failure mode)."""
MAX_PIPELINED = 16
"""Requests that may wait behind the one being decided on a connection before it is read no further."""
SWEEP_INTERVAL_S = 1.0
"""How often the timeouts are checked (the timeouts above are met within this)."""


class AuthzHttpResponses:
    """Pre-built 200 answers per endpoint list: the status line and the ext_proc answer's headers (ResponseCache);
    `ok` adds the per-request ``traceparent`` and the blank line, so an answer is two byte concatenations."""

    def __init__(self, replica_index: int | None = None) -> None:
        self._headers = ResponseCache(replica_index)
        self._cache: dict[tuple[str, ...], bytes] = {}

    def head(self, endpoints: tuple[str, ...]) -> bytes:
        cached = self._cache.get(endpoints)
        if cached is None:
            if len(self._cache) >= MAX_CACHED_ANSWERS:
                self._cache.clear()
            routed = self._headers.routing_response(endpoints, False)
            cached = self._cache[endpoints] = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" + _header_lines(
                routed.request_body.response.header_mutation.set_headers)
        return cached

    def ok(self, endpoints: tuple[str, ...], traceparent: str | None) -> bytes:
        if traceparent is None:
            return self.head(endpoints) + b"\r\n"
        return self.head(endpoints) + b"traceparent: " + traceparent.encode("latin-1") + b"\r\n\r\n"


def refusal(immediate: Any) -> bytes:
    """An ext_proc ImmediateResponse (answers.immediate_response: a refusal) as the check's HTTP answer."""
    ir = immediate.immediate_response
    body = ir.body if isinstance(ir.body, bytes) else ir.body.encode()
    return (b"HTTP/1.1 %d Refused\r\ncontent-length: %d\r\n" % (transport_status(ir.status.code), len(body))
            + _header_lines(ir.headers.set_headers) + b"\r\n" + body)


def _header_lines(options: Any) -> bytes:
    """ext_proc header options (answers.header_option: the value in ``raw_value``) as HTTP/1.1 header lines."""
    return b"".join(o.header.key.encode("latin-1") + b": " + (o.header.raw_value or o.header.value.encode("latin-1"))
                    + b"\r\n" for o in options)


def _plain(status: int, message: str, *, close: bool = False) -> bytes:
    body = error_body(status, message)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (status, _REASONS.get(status, b"Error"), len(body), b"connection: close\r\n" if close else b"")) + body


class AuthzHttpService:
    """What the connections share: the decision (`AuthzServicer`), the pre-built answers, the token, readiness,
    the body limit, and counters for /metrics and tests."""

    def __init__(self, authz: AuthzServicer, *, token: str | None, ready: Callable[[], bool], max_body_bytes: int,
                 replica_index: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES) -> None:
        self.authz = authz
        self.responses = AuthzHttpResponses(replica_index)
        self._token = token.encode() if token else None
        self.ready = ready
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.connections: set[AuthzHttpConnection] = set()
        self.untrusted: dict[AuthzHttpConnection, None] = {}  # insertion order: the oldest first
        self.num_refused_token = 0
        self.num_errors = 0
        self.num_refused_connections = 0
        """Closed at once (over `MAX_CONNECTIONS`) or as the oldest untrusted one (over
        `MAX_UNTRUSTED_CONNECTIONS`)."""
        self.num_too_large_headers = 0
        self.num_timeouts = 0
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def token_ok(self, value: bytes | None) -> bool:
        if self._token is None:
            return True
        if value is not None and bearer_matches(value, self._token):
            return True
        self.num_refused_token += 1
        if self.num_refused_token in (1, 10, 100) or self.num_refused_token % 1000 == 0:
            log.warning("ext_authz (HTTP): refused %d check(s) without the right bearer token",
                        self.num_refused_token)
        return False

    def opened(self, conn: AuthzHttpConnection) -> bool:
        """Count a new (untrusted) connection in; over `MAX_UNTRUSTED_CONNECTIONS` or `MAX_CONNECTIONS`, close the
        untrusted connection idle the longest; False when that would be `conn` itself (the caller closes it)."""
        self.connections.add(conn)
        self.untrusted[conn] = None
        if len(self.untrusted) > MAX_UNTRUSTED_CONNECTIONS or len(self.connections) > MAX_CONNECTIONS:
            idlest = min(self.untrusted, key=_since)
            self._refused_connection()
            if idlest is conn:
                self.closed(conn)
                return False
            idlest.abort()
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(SWEEP_INTERVAL_S, self._sweep)
        return True

    def trusted(self, conn: AuthzHttpConnection) -> None:
        self.untrusted.pop(conn, None)

    def closed(self, conn: AuthzHttpConnection) -> None:
        self.connections.discard(conn)
        self.untrusted.pop(conn, None)

    def _refused_connection(self) -> None:
        self.num_refused_connections += 1
        if self.num_refused_connections in (1, 10, 100) or self.num_refused_connections % 1000 == 0:
            log.warning("ext_authz (HTTP): closed %d connection(s) over the limits (%d open, %d not yet "
                        "authenticated)", self.num_refused_connections, MAX_CONNECTIONS, MAX_UNTRUSTED_CONNECTIONS)

    def _sweep(self) -> None:
        """Close the connections past their timeout (module docstring); runs every `SWEEP_INTERVAL_S` while any
        connection is open."""
        self._sweeper = None
        if not self.connections:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self.connections if c.expired(now)]:
            self.num_timeouts += 1
            conn.abort()
        self._sweeper = loop.call_later(SWEEP_INTERVAL_S, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


def _since(conn: AuthzHttpConnection) -> float:
    return conn.since


class _Stop(Exception):
    """Raised from a parser callback to stop parsing (the reason is in `AuthzHttpConnection.stop`: the exception
    itself is never kept, since its traceback holds the connection's frames)."""


_STOP_TOKEN = "token"
_IDLE, _HEAD, _BODY = 0, 1, 2
"""A connection's phase: between requests, in a request's line and headers, in its body."""


class AuthzHttpConnection(asyncio.Protocol):
    """One connection from Envoy's ext_authz HTTP client (module docstring)."""

    __slots__ = ("svc", "parser", "transport", "url", "headers", "repeated", "body", "body_size", "token",
                 "observed", "handoff", "body_cap", "busy", "pending", "task", "closed", "too_large", "answered",
                 "early", "is_trusted", "phase", "since", "head_bytes", "num_headers", "is_check", "loop",
                 "reading_paused", "stop")

    def __init__(self, svc: AuthzHttpService) -> None:
        self.svc = svc
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: dict[str, str] = {}
        self.repeated: dict[str, list[str]] | None = None  # a repeated header's values, joined once at the end
        self.body: list[bytes] = []
        self.body_size = 0
        self.token: bytes | None = None
        self.observed: str | None = None
        self.handoff = False
        self.body_cap: int | None = None
        self.busy = False
        self.pending: list[tuple[bytes, bytes, dict[str, str], bytes, bytes | None, str | None, bool, int | None]] = []
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.too_large = False
        self.answered = False  # the current check's answer went out at its decision (`_early`)
        self.early = self._early  # bound once: passed to every check
        self.is_trusted = False
        self.phase = _IDLE
        self.loop = asyncio.get_running_loop()
        self.since = self.loop.time()
        self.head_bytes = 0
        self.num_headers = 0
        self.is_check = False
        self.reading_paused = False
        self.stop: str | None = None  # why a callback stopped the parser: _STOP_TOKEN, or a 431's message

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.svc.opened(self):
            self.closed = True
            transport.abort()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.svc.closed(self)
        self.pending.clear()
        if self.task is not None:  # Envoy gave up (its timeout): the decision is not wanted any more
            self.task.cancel()
        # The parser and this protocol refer to each other (its callbacks are bound methods here), and the parser
        # holds what it was fed of an unfinished header: break the cycle so a closed connection is freed at once,
        # not at the garbage collector's next full pass (the router collects rarely: cli.py's thresholds), which a
        # flood of connections would otherwise outgrow by megabytes.
        self.parser = None  # type: ignore[assignment]
        self.early = None  # type: ignore[assignment]
        self.body = []
        self.headers = {}

    def pause_writing(self) -> None:  # a client that does not read its answers: read no more of its requests
        self._pause_reading()

    def resume_writing(self) -> None:
        self._resume_reading()

    def abort(self) -> None:
        """Close at once (a timeout, a limit), dropping what is unsent."""
        if not self.closed:
            self.closed = True
            self.svc.closed(self)
            if self.transport is not None:
                self.transport.abort()

    def expired(self, now: float) -> bool:
        """Past its timeout (module docstring): a request not whole `REQUEST_TIMEOUT_S` after its first byte, a
        connection idle longer than `IDLE_TIMEOUT_S` (trusted) or `REQUEST_TIMEOUT_S` (not yet trusted). A
        connection whose check is being decided is not timed out here (the decision has its own bounds)."""
        if self.busy or self.closed:
            return False
        if self.phase == _IDLE and self.head_bytes == 0:
            return now - self.since > (IDLE_TIMEOUT_S if self.is_trusted else REQUEST_TIMEOUT_S)
        return now - self.since > REQUEST_TIMEOUT_S

    def data_received(self, data: bytes) -> None:
        if self.too_large or self.closed:
            return
        if self.phase != _BODY:
            if self.phase == _IDLE and self.head_bytes == 0:
                self.since = self.loop.time()  # a request's first byte: its time starts
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:  # not bound: a kept exception would hold this frame in a cycle
            stop, self.stop = self.stop, None
            if stop == _STOP_TOKEN:
                self._refuse_token()
            elif stop is not None:
                self._too_large_headers(stop)
            elif not self.closed:
                self._write(_plain(400, "Malformed HTTP request", close=True), close=True)
            return
        except httptools.HttpParserError as exc:
            self._write(_plain(400, f"Malformed HTTP request: {exc}", close=True), close=True)
            return
        if self.phase != _BODY and self.head_bytes > self.svc.max_header_bytes and not self.closed:
            self._too_large_headers(f"Request line and headers over {self.svc.max_header_bytes} bytes.")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.repeated = None
        self.body = []
        self.body_size = 0
        self.token = None
        self.observed = None
        self.handoff = False
        self.body_cap = None
        self.num_headers = 0
        self.is_check = False
        if self.phase == _IDLE:
            self.phase = _HEAD
            if self.head_bytes == 0:  # pipelined behind another request in the same read
                self.since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self.url += url  # bounded: the request line counts in max_header_bytes

    def on_header(self, name: bytes, value: bytes) -> None:
        self.num_headers += 1
        if self.num_headers > MAX_HEADERS:
            self.stop = f"More than {MAX_HEADERS} header lines."
            raise _Stop
        key = name.lower()
        if key in _INTERNAL:
            if key == _TOKEN:
                if not self.svc.token_ok(value):
                    self.stop = _STOP_TOKEN
                    raise _Stop
                self.token = value
            elif key == _HANDOFF:
                self.handoff = True
            elif key == _BODY_CAP:
                self.body_cap = int(value) if value.isdigit() else None
            else:
                self.observed = value.decode("latin-1")
            return
        k = key.decode("latin-1")
        v = value.decode("latin-1")
        headers = self.headers
        if k not in headers:
            headers[k] = v
            return
        # Repeated (as Envoy's CheckRequest joins them, with ","): the values in a list, joined once at the end.
        repeated = self.repeated
        if repeated is None:
            repeated = self.repeated = {}
        values = repeated.get(k)
        if values is None:
            repeated[k] = [headers[k], v]
        else:
            values.append(v)

    def on_headers_complete(self) -> None:
        self.phase = _BODY
        self.head_bytes = 0
        if self.repeated is not None:
            for k, values in self.repeated.items():
                self.headers[k] = ",".join(values)
            self.repeated = None
        self.is_check = self.url.startswith(_CHECK_PREFIX)
        if not self.is_check:
            return  # /health and 404s: no token needed, and their body is never kept
        if self.svc.has_token and self.token is None:
            self.svc.token_ok(None)  # counted
            self.stop = _STOP_TOKEN
            raise _Stop
        if not self.is_trusted:
            self.is_trusted = True
            self.svc.trusted(self)

    def on_body(self, body: bytes) -> None:
        if self.too_large or not self.is_check:
            return
        self.body_size += len(body)
        if self.body_size > self.svc.max_body_bytes:
            # Envoy sends a check at most authz_body_bytes of a body (the rest of a larger one never comes here):
            # this bounds what another client of this port could make the router hold.
            self.too_large = True
            self._write(_plain(413, f"Request body larger than {self.svc.max_body_bytes} bytes.", close=True),
                        close=True)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.phase = _IDLE
        self.head_bytes = 0
        self.since = self.loop.time()
        if self.too_large or self.closed:
            return
        item = (self.parser.get_method(), self.url, self.headers, b"".join(self.body), self.token, self.observed,
                self.handoff, self.body_cap)
        if self.busy:
            self.pending.append(item)
            if len(self.pending) >= MAX_PIPELINED:
                self._pause_reading()
        else:
            self._run(item)

    def _too_large_headers(self, message: str) -> None:
        self.svc.num_too_large_headers += 1
        self.too_large = True
        self._write(_plain(431, message, close=True), close=True)

    def _refuse_token(self) -> None:
        """A check without the right token: 500 (Envoy's failure mode applies, as for a gRPC UNAUTHENTICATED;
        never a client-facing 401) and the connection closed, the rest of the request unread."""
        self.too_large = True
        self._write(_plain(500, "missing or wrong bearer token", close=True), close=True)

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.closed:
            self.reading_paused = False
            self.transport.resume_reading()

    # the check
    def _run(self, item: tuple[bytes, bytes, dict[str, str], bytes, bytes | None, str | None, bool, int | None]
             ) -> None:
        method, url, headers, body, token, observed, handoff, body_cap = item
        svc = self.svc
        prefix = _CHECK_PREFIX
        if not url.startswith(prefix):
            if url == HEALTH_PATH:
                self._answer(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n" if svc.ready()
                             else _plain(503, "not ready: no endpoint healthy"))
            else:
                self._answer(_plain(404, "no such path: checks go to " + CHECK_PATH_PREFIX + "<path>"))
            return
        path = url[len(prefix):].decode("latin-1") or "/"
        m = method.decode("latin-1")
        headers[":method"] = m
        headers[":path"] = path
        host = headers.get("host")
        if host is not None:
            headers.setdefault(":authority", host)
        metadata = ((OBSERVED_METADATA, observed),) if observed is not None else ()
        self.answered = False
        try:
            stream, resp = svc.authz.start(headers, m, path, body, lambda: metadata, handoff, body_cap, self.early)
            if resp is HANDOFF:
                self._answer(_HANDOFF_ANSWER)
                return
            if resp.__class__ is Wait:
                self.busy = True
                self.task = asyncio.get_running_loop().create_task(self._finish(stream, resp))
                return
            if self.answered:
                # The answer went out when the decision was final; what is left is bookkeeping (the pick
                # recorded, counted, tracked and held for its facts record), done before the loop runs on.
                svc.authz.settle(stream, resp)
                self._next()
            else:
                self._answer(self._settled(stream, resp))
        except Exception:  # noqa: BLE001 - a bug must cost one request (Envoy's failure mode), never the connection
            self._error()

    def _early(self, endpoints: tuple[str, ...], traceparent: str | None) -> None:
        """`AuthzServicer.start`'s early answer: the 200 `settle` would lead to, written now."""
        self._write(self.svc.responses.ok(endpoints, traceparent))
        self.answered = True

    async def _finish(self, stream: Any, resp: Any) -> None:
        try:
            resp = await self.svc.authz.finish(stream, resp)
            answer = self._settled(stream, resp)
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001 - as in _run
            self.task = None
            self._error()
            return
        self.task = None
        self._answer(answer)

    def _settled(self, stream: Any, resp: Any) -> bytes:
        endpoints, outcome = self.svc.authz.settle(stream, resp)
        if endpoints is None:
            return refusal(outcome)
        return self.svc.responses.ok(endpoints, outcome)

    def _error(self) -> None:
        self.svc.num_errors += 1
        if self.answered:  # routed already: only the bookkeeping after its answer failed (one answer per check)
            log.exception("ext_authz (HTTP) check's bookkeeping failed after its answer; the request is routed")
            self._next()
            return
        log.exception("ext_authz (HTTP) check failed; Envoy's failure mode applies to the request")
        self._answer(_plain(500, "the router failed to decide; see its log"))

    def _answer(self, data: bytes) -> None:
        self._write(data)
        self._next()

    def _next(self) -> None:
        """The current check is answered: take the next one Envoy sent on this connection, if any."""
        self.busy = False
        if self.pending and not self.closed:
            self._run(self.pending.pop(0))
        elif self.reading_paused and self.transport is not None and \
                self.transport.get_write_buffer_size() == 0:
            self._resume_reading()

    def _write(self, data: bytes, *, close: bool = False) -> None:
        t = self.transport
        if t is None or self.closed:
            return
        t.write(data)
        if close:
            self.closed = True
            t.close()


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str) -> ssl.SSLContext | None:
    """TLS for the HTTP port from the ext_proc server's files (None without a certificate): the same certificate,
    and with a client CA every client must present a certificate it signed (mutual TLS, as on the gRPC port)."""
    if not cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def start_authz_http_server(svc: AuthzHttpService, host: str, port: int,
                                  ssl_context: ssl.SSLContext | None = None) -> tuple[asyncio.Server, int]:
    """Serve `svc` on host:port (0 = any free port); returns the server and its bound port. OSError when it cannot
    listen."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: AuthzHttpConnection(svc), host, port, ssl=ssl_context,
                                      reuse_address=True,
                                      **({"ssl_handshake_timeout": REQUEST_TIMEOUT_S} if ssl_context else {}))
    bound = server.sockets[0].getsockname()[1]
    return server, bound

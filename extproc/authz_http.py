"""The router behind Envoy's ext_authz filter over plain HTTP/1.1 (routing_processing 'authz-http'; issue 26).

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
    request's facts record (authz.py `UnaryPicks`). The 200 is written as soon as the decision is final, before the
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
- One request at a time per connection (Envoy does not pipeline; a pipelined request waits its turn). A decision
  that waits (a response-id lookup, a large body parsed off the loop) runs as a task, cancelled if Envoy closes
  the connection (its timeout) before the answer.

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
from prefixroute.extproc.servicer import _NEEDS_HOLD, _NEEDS_LOOKUP, ResponseCache
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
_MAX_CACHED = 4096
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 413: b"Payload Too Large", 500: b"Internal Error",
            503: b"Service Unavailable"}


class AuthzHttpResponses:
    """Pre-built 200 answers per endpoint list: the status line and the ext_proc answer's headers (ResponseCache);
    `ok` adds the per-request ``traceparent`` and the blank line, so an answer is two byte concatenations."""

    def __init__(self, replica_index: int | None = None) -> None:
        self._headers = ResponseCache(replica_index)
        self._cache: dict[tuple[str, ...], bytes] = {}

    def head(self, endpoints: tuple[str, ...]) -> bytes:
        cached = self._cache.get(endpoints)
        if cached is None:
            if len(self._cache) >= _MAX_CACHED:
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
                 replica_index: int | None = None) -> None:
        self.authz = authz
        self.responses = AuthzHttpResponses(replica_index)
        self._token = token.encode() if token else None
        self.ready = ready
        self.max_body_bytes = max_body_bytes
        self.num_refused_token = 0
        self.num_errors = 0

    def token_ok(self, value: bytes | None) -> bool:
        if self._token is None:
            return True
        if value is not None and bearer_matches(value.decode("latin-1"), self._token):
            return True
        self.num_refused_token += 1
        if self.num_refused_token in (1, 10, 100) or self.num_refused_token % 1000 == 0:
            log.warning("ext_authz (HTTP): refused %d check(s) without the right bearer token",
                        self.num_refused_token)
        return False


class AuthzHttpConnection(asyncio.Protocol):
    """One connection from Envoy's ext_authz HTTP client (module docstring)."""

    __slots__ = ("svc", "parser", "transport", "url", "headers", "body", "body_size", "token", "observed",
                 "handoff", "body_cap", "busy", "pending", "task", "closed", "too_large", "answered", "early")

    def __init__(self, svc: AuthzHttpService) -> None:
        self.svc = svc
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: dict[str, str] = {}
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

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pending.clear()
        if self.task is not None:  # Envoy gave up (its timeout): the decision is not wanted any more
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        if self.too_large or self.closed:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._write(_plain(400, f"Malformed HTTP request: {exc}", close=True), close=True)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.body = []
        self.body_size = 0
        self.token = None
        self.observed = None
        self.handoff = False
        self.body_cap = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key in _INTERNAL:
            if key == _TOKEN:
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
        old = self.headers.get(k)
        self.headers[k] = v if old is None else f"{old},{v}"  # as Envoy's CheckRequest joins repeated headers

    def on_body(self, body: bytes) -> None:
        if self.too_large:
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
        if self.too_large or self.closed:
            return
        item = (self.parser.get_method(), self.url, self.headers, b"".join(self.body), self.token, self.observed,
                self.handoff, self.body_cap)
        if self.busy:
            self.pending.append(item)
        else:
            self._run(item)

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
        if not svc.token_ok(token):
            self._answer(_plain(500, "missing or wrong bearer token"))
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
            if resp is _NEEDS_LOOKUP or resp is _NEEDS_HOLD:
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
                                      reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    return server, bound

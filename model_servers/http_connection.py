"""One client connection of the simulated server: HTTP/1.1 keep-alive parsed by httptools, responses written
whole (`respond`) or as a chunked stream (`start_stream`, then the sinks' writes), and flow control for clients
that do not read (sinks.py writes through it). What the connection needs of its server is `ConnectionOwner`
(server.py `ModelServer` is one)."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

import httptools

from prefixroute import identity
from prefixroute.model_servers import protocol
from prefixroute.model_servers.engine import EngineRequest
from prefixroute.model_servers.runtime import AsyncEngine
from prefixroute.model_servers.server_settings import ServerSettings
from prefixroute.openai_errors import error_body

log = logging.getLogger("prefixroute.model_server")

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 409: b"Conflict",
            413: b"Payload Too Large", 415: b"Unsupported Media Type", 500: b"Internal Server Error",
            503: b"Service Unavailable"}
WRITE_HIGH_WATER_BYTES = 64 * 1024
"""Transport write-buffer level that pauses a connection (asyncio's default; the low mark is a quarter). It
is capped at `max_stream_buffer_bytes`, so a small limit still pauses first."""
SLOW_CLIENT_REASONS = ("buffer_full", "stalled")


class ConnectionOwner(Protocol):
    """The server a connection belongs to: its settings and engine (a request of a connection that closes or
    stalls is aborted there), the set of its open connections, and the request dispatcher."""

    settings: ServerSettings
    engine: AsyncEngine
    connections: set[HttpConnection]
    slow_client_aborts: dict[str, int]
    """Requests given up per reason (`SLOW_CLIENT_REASONS`)."""
    common_headers: bytes
    """Header lines every response carries (``x-prefixroute-server-id``)."""
    received_traceparents: collections.deque[bytes]
    """The W3C ``traceparent`` of the latest requests that carried one (bounded; GET /admin/traceparents on the
    admin listener): what a test reads to see the context reached the server. Never echoed to the client."""
    closing: bool
    refusing: bool

    def dispatch(self, conn: HttpConnection, method: bytes, path: bytes, body: bytes) -> None:
        """Answer one request on `conn` (never raises)."""


class HttpConnection(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time (pipelined ones queue).

    Flow control: asyncio calls `pause_writing` when the transport's buffer passes its high mark and
    `resume_writing` when it drains below the low mark. While paused the connection reads no more requests,
    a stream may add at most `max_stream_buffer_bytes` to the buffer, and a timer gives up after
    `stall_timeout_s` (`give_up`). On the admin listener (`admin`) only the admin routes exist.
    """

    def __init__(self, app: ConnectionOwner, *, admin: bool = False) -> None:
        self.app = app
        self.admin = admin
        self.paused = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self.content_encoding: bytes | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.url = b""
        self.query = b""  # the current request's query string (set by ModelServer.dispatch)
        self.body: list[bytes] = []
        self.traceparent: bytes | None = None
        self.keep_alive = True
        self.active: EngineRequest | None = None
        self.busy = False
        self.pending: list[tuple[bytes, bytes, bytes, bytes | None, bool, bytes | None, bytes | None]] = []
        self.cur_traceparent: bytes | None = None
        self.cur_keep_alive = True
        self.challenge: bytes | None = None  # the router's identity challenge (x-prefixroute-challenge)
        self.cur_challenge: bytes | None = None
        self.closed = False
        self.body_size = 0
        self.too_large = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        high = min(WRITE_HIGH_WATER_BYTES, self.app.settings.max_stream_buffer_bytes)
        self.transport.set_write_buffer_limits(high=high, low=high // 4)
        self.app.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_stall_timer()
        self.app.connections.discard(self)
        if self.active is not None:
            self.app.engine.abort(self.active)
            self.active = None

    def pause_writing(self) -> None:
        self.paused = True
        if not self.transport.is_closing():
            self.transport.pause_reading()  # no new requests while their responses could not be written
        if self._stall_timer is None and self.app.settings.stall_timeout_s > 0:
            self._stall_timer = asyncio.get_running_loop().call_later(self.app.settings.stall_timeout_s,
                                                                      self.give_up, "stalled")

    def resume_writing(self) -> None:
        self.paused = False
        self._cancel_stall_timer()
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def _cancel_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def give_up(self, reason: str) -> None:
        """The client does not read: abort its request in the engine (frees its KV blocks), count it under
        `reason`, and reset the connection (`abort`, not `close`: close would wait for the buffer to drain,
        which a stalled client never lets happen, so the buffer would stay allocated)."""
        self._cancel_stall_timer()
        if self.closed:
            return
        req = self.active
        if req is not None:
            self.app.engine.abort(req)
            self.active = None
        self.app.slow_client_aborts[reason] += 1
        log.warning("slow client: %s after %d bytes buffered; request %s aborted, connection reset", reason,
                    self.transport.get_write_buffer_size(), req.request_id if req is not None else "-")
        self.closed = True
        self.pending.clear()
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.too_large:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.cur_keep_alive = False
            self.busy = True
            self.respond(400, error_body(400, f"Malformed HTTP request: {exc}"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []
        self.body_size = 0
        self.traceparent = None
        self.content_encoding = None
        self.challenge = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 11 and name.lower() == b"traceparent":
            self.traceparent = value
        elif len(name) == 16 and name.lower() == b"content-encoding":
            self.content_encoding = value
        elif len(name) == 23 and name.lower() == b"x-prefixroute-challenge":
            self.challenge = value[:identity.MAX_CHALLENGE_CHARS]

    def on_body(self, body: bytes) -> None:
        if self.too_large:
            return
        self.body.append(body)
        self.body_size += len(body)
        if self.body_size > self.app.settings.max_body_bytes:
            self.too_large = True
            self.cur_keep_alive = False
            self.busy = True
            self.pending.clear()
            self.respond(413, error_body(413, f"Request body larger than {self.app.settings.max_body_bytes} bytes."))

    def on_message_complete(self) -> None:
        if self.too_large:
            return
        item = (self.parser.get_method(), self.url, b"".join(self.body), self.traceparent,
                self.parser.should_keep_alive(), self.content_encoding, self.challenge)
        if self.busy:
            self.pending.append(item)
        else:
            self._run(item)

    def _run(self, item: tuple[bytes, bytes, bytes, bytes | None, bool, bytes | None, bytes | None]) -> None:
        method, url, body, self.cur_traceparent, self.cur_keep_alive, encoding, self.cur_challenge = item
        self.busy = True
        if self.cur_traceparent is not None and not self.admin:
            self.app.received_traceparents.append(self.cur_traceparent)
        if body and encoding is not None and encoding.strip().lower() not in (b"identity", b""):
            # decoding it ourselves would be a decompression-bomb surface; vLLM does not decode either
            self.respond(415, error_body(415, f"Unsupported Content-Encoding "
                                              f"'{protocol.clip(encoding.decode(errors='replace'))}': send the "
                                              "request body uncompressed (identity)."))
            return
        self.app.dispatch(self, method, url, body)

    # responses
    def _head(self, status: int, extra: bytes) -> bytes:
        # No request header is echoed: the router-drawn traceparent (its span id keys the facts records) must never
        # reach a client (received_traceparents keeps it for the admin listener instead).
        return b"".join((b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Error")), extra,
                         self.app.common_headers,
                         b"" if self.cur_keep_alive else b"connection: close\r\n", b"\r\n"))

    def respond(self, status: int, body: bytes, content_type: bytes = b"application/json",
                extra_headers: bytes = b"") -> None:
        if self.transport.is_closing():
            return
        self.transport.write(self._head(status, b"content-type: %b\r\ncontent-length: %d\r\n%b"
                                        % (content_type, len(body), extra_headers)) + body)
        self.finish_response()

    def start_stream(self) -> None:
        self.transport.write(self._head(200, b"content-type: text/event-stream; charset=utf-8\r\n"
                                             b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"))

    def finish_response(self) -> None:
        self.active = None
        self.busy = False
        if not self.cur_keep_alive or self.app.closing or (self.app.refusing and not self.admin):
            self.transport.close()
            return
        if self.pending:
            self._run(self.pending.pop(0))

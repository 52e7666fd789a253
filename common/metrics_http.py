"""The router's Prometheus endpoint (``/metrics``): a small HTTP/1.1 server on a thread of its own, with bounds.

prometheus_client's own server (``start_http_server``: a thread per connection, no timeouts, up to 100 header lines
of 64 KiB each) let any client that reaches the port hold a thread and megabytes per connection for as long as it
liked, and make the router render its metrics as often as it asked, on the router's process (the rendering holds
the GIL the event loop needs). This one serves the same answers (prometheus_client's WSGI app: any path but
``/favicon.ico``, ``name[]`` filters, gzip when asked, OPTIONS) within:

- `MAX_CONNECTIONS` connections at once (one thread each); beyond, the connection that has been sending its request
  the longest is closed to make room (a slow or stalled client cannot keep a scraper out: a scraper's request
  arrives whole at once), and with none sending one the new connection is closed at once (counted);
- one request per connection, whole within `REQUEST_TIMEOUT_S` of the accept, its request line and headers at most
  `MAX_HEAD_BYTES` and `MAX_HEADERS` lines (431 beyond), no body read (a GET has none; another method gets 405);
  the answer written within `REQUEST_TIMEOUT_S` too (a client that does not read is dropped);
- one rendering at a time, at most `RENDERS_PER_S` a second after a burst of `RENDER_BURST` (a token bucket: a few
  scrapes in a row, as a test or a person makes them, are rendered at once): concurrent scrapes share a rendering
  that began after they arrived (never an older one), so a flood of scrapes costs the router at most that many
  renderings (measured on the router with 16 clients scraping in a loop for 6 s: the gateway's chats ~1.2x slower at
  the median than in a quiet run beside it, where without the limit they were ~2.8x slower).

Thread-safety: the accept loop and the connection threads share only the counters (under `_lock`) and the
rendering (under `_render_lock`); the registry's collectors are read on these threads, as before.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
"""Connections served at once: a Prometheus server or two, the dashboard and a person with curl."""
REQUEST_TIMEOUT_S = 5.0
"""From the accept to the whole request, and again for the whole answer to be written."""
MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers: a scraper sends a few hundred bytes."""
MAX_HEADERS = 64
"""Header lines a request may carry."""
RENDERS_PER_S = 20.0
"""Renderings a second at most, sustained (a scrape waits its turn), whoever asks."""
RENDER_BURST = 10
"""Renderings that may follow one another at once before `RENDERS_PER_S` applies."""

_REASONS = {200: "OK", 400: "Bad Request", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large"}

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MetricsHttpServer:
    """Serves `app` (a WSGI app: prometheus_client.make_wsgi_app) on host:port (module docstring). Start with
    `start()`; `server_address` is the bound (host, port); `shutdown()` then `server_close()` stop it (the names of
    socketserver's, which callers used)."""

    def __init__(self, app: WsgiApp, host: str, port: int) -> None:
        self.app = app
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(0.5)  # the accept loop looks at `_stopping` this often
        self.server_address: tuple[str, int] = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._last: tuple[float, tuple[str, str, str], tuple[int, list[tuple[str, str]], bytes]] | None = None
        self._render_tokens = float(RENDER_BURST)
        self._refilled = time.monotonic()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._reading: dict[socket.socket, float] = {}  # connections still sending their request: since when
        self.num_active = 0
        self.num_refused_connections = 0
        self.num_refused_requests = 0
        self.num_renders = 0

    def start(self) -> MetricsHttpServer:
        self._thread = threading.Thread(target=self._accept_loop, name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def server_close(self) -> None:
        self._sock.close()

    # -- connections ---------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)  # out of descriptors, or a transient error: do not spin
                continue
            with self._lock:
                full = self.num_active >= MAX_CONNECTIONS
                evicted = None
                if full:
                    self.num_refused_connections += 1
                    refused = self.num_refused_connections
                    if self._reading:  # make room: the one sending its request the longest goes
                        evicted = min(self._reading, key=self._reading.__getitem__)
                        del self._reading[evicted]
                        full = False
                if not full:
                    self.num_active += 1
                    self._reading[conn] = time.monotonic()
            if evicted is not None:
                try:
                    evicted.shutdown(socket.SHUT_RDWR)  # its thread's recv returns: it closes and leaves
                except OSError:
                    pass
            if full:
                conn.close()
                if refused in (1, 10, 100) or refused % 1000 == 0:
                    log.warning("metrics: closed %d connection(s) over the limit of %d at once", refused,
                                MAX_CONNECTIONS)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="metrics-http-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            try:
                method, target, headers = _read_head(conn, deadline)
                with self._lock:
                    if self._reading.pop(conn, None) is None:
                        return  # evicted meanwhile
            except _Refused as exc:
                with self._lock:
                    self.num_refused_requests += 1
                _send(conn, exc.status, [("Content-Type", "text/plain; charset=utf-8")], f"{exc}\n".encode(),
                      time.monotonic() + REQUEST_TIMEOUT_S)
                return
            except (TimeoutError, OSError):
                return
            arrived = time.monotonic()
            status, out_headers, body = self._answer(method, target, headers, arrived)
            _send(conn, status, out_headers, b"" if method == "HEAD" else body, time.monotonic() + REQUEST_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a bug costs one scrape, never the server
            log.exception("metrics: a scrape failed")
        finally:
            conn.close()
            with self._lock:
                self._reading.pop(conn, None)
                self.num_active -= 1

    # -- answers -------------------------------------------------------------------------------------------------
    def _answer(self, method: str, target: str, headers: dict[str, str], arrived: float
                ) -> tuple[int, list[tuple[str, str]], bytes]:
        path, _, query = target.partition("?")
        if method not in ("GET", "HEAD", "OPTIONS"):
            return 405, [("Allow", "OPTIONS,GET")], (f"# HTTP 405 Method Not Allowed: {method[:16]}; use OPTIONS or "
                                                     "GET\n").encode()
        if method == "OPTIONS" or path == "/favicon.ico":
            return self._call_app("GET" if method == "HEAD" else method, path, query, headers)
        key = (query, headers.get("accept", ""), headers.get("accept-encoding", ""))
        with self._render_lock:
            last = self._last
            if last is not None and last[0] >= arrived and last[1] == key:
                return last[2]  # a rendering that began after this scrape arrived: as fresh as its own
            now = time.monotonic()
            self._render_tokens = min(float(RENDER_BURST),
                                      self._render_tokens + (now - self._refilled) * RENDERS_PER_S)
            self._refilled = now
            if self._render_tokens < 1.0:
                time.sleep((1.0 - self._render_tokens) / RENDERS_PER_S)
                self._render_tokens = 1.0
                self._refilled = time.monotonic()
            self._render_tokens -= 1.0
            started = time.monotonic()
            result = self._call_app("GET", path, query, headers)
            self._last = (started, key, result)
            self.num_renders += 1
            return result

    def _call_app(self, method: str, path: str, query: str, headers: dict[str, str]
                  ) -> tuple[int, list[tuple[str, str]], bytes]:
        started: list[Any] = []
        environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query, "SERVER_PROTOCOL": "HTTP/1.1",
                   **({"HTTP_ACCEPT": headers["accept"]} if "accept" in headers else {}),
                   **({"HTTP_ACCEPT_ENCODING": headers["accept-encoding"]} if "accept-encoding" in headers else {})}
        body = b"".join(self.app(environ, lambda status, hs, *_: started.extend((status, hs))))
        status, out_headers = started
        return int(status.split()[0]), list(out_headers), body


def _read_head(conn: socket.socket, deadline: float) -> tuple[str, str, dict[str, str]]:
    """The request line and headers, read within `deadline` (TimeoutError) and the size and count bounds
    (`_Refused` 431); `_Refused` 400 for a malformed one."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        conn.settimeout(remaining)
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("closed before the request was whole")
        buf += chunk
        if len(buf) > MAX_HEAD_BYTES and b"\r\n\r\n" not in buf[:MAX_HEAD_BYTES + 4]:
            raise _Refused(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
    head = buf.split(b"\r\n\r\n", 1)[0]
    if len(head) > MAX_HEAD_BYTES:
        raise _Refused(431, f"request line and headers over {MAX_HEAD_BYTES} bytes")
    request_line, *lines = head.decode("latin-1").split("\r\n")
    if len(lines) > MAX_HEADERS:
        raise _Refused(431, f"more than {MAX_HEADERS} header lines")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        raise _Refused(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _Refused(400, "malformed header line")
        headers[name.lower()] = value.strip()
    return parts[0], parts[1], headers


def _send(conn: socket.socket, status: int, headers: list[tuple[str, str]], body: bytes, deadline: float) -> None:
    """The answer (then the connection is closed), written within `deadline`."""
    head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'OK' if status < 400 else 'Error')}",
            *(f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection")),
            f"Content-Length: {len(body)}", "Connection: close", "", ""]
    data = "\r\n".join(head).encode("latin-1") + body
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        conn.settimeout(remaining)
        try:
            sent = conn.send(view)
        except (TimeoutError, OSError):
            return
        view = view[sent:]


def start_metrics_http_server(app: WsgiApp, port: int, host: str = "127.0.0.1") -> MetricsHttpServer:
    """Serve `app` on host:port (0 = any free port) on a daemon thread; OSError when it cannot listen."""
    return MetricsHttpServer(app, host, port).start()

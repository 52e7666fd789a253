"""Model-server stand-ins on threads of their own, for the endpoint pool's tests against real HTTP on loopback:
stalling the test's event loop (where the pool runs) starves the router only, as a busy router process is."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import time

METRICS = b'vllm:num_requests_running{model_name="m"} 4.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'


class ThreadedEndpoint:
    """A model-server stand-in on its own threads: /health (status and delay settable), /v1/models, /metrics."""

    def __init__(self) -> None:
        self.health_status = 200
        self.health_delay_s = 0.0
        self.num_probes = 0
        self.connections: set = set()  # open client connections (closed by `stop`, as a dying process's are)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            # One request per connection: each probe connects anew, so its steps (connect, send, read) span
            # loop iterations, as they did for the starved router that ejected a whole real-vLLM fleet.
            protocol_version = "HTTP/1.0"

            def setup(self) -> None:
                super().setup()
                outer.connections.add(self.connection)

            def finish(self) -> None:
                outer.connections.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                status, body = 200, b""
                if self.path == "/health":
                    outer.num_probes += 1
                    if outer.health_delay_s:
                        time.sleep(outer.health_delay_s)
                    status = outer.health_status
                elif self.path == "/v1/models":
                    body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
                elif self.path == "/metrics":
                    body = METRICS
                else:
                    status = 404
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self.server: http.server.ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None  # a late answer to a probe that timed out: a broken pipe
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        """Close the listening socket: connections are refused from now on (a dead process)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


async def stall_loop(seconds: float, stall_s: float) -> int:
    """Block this event loop for `stall_s` at a time, yielding in between, for `seconds`; the stalls made."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        time.sleep(stall_s)  # blocks the loop on purpose: the router's own stall
        n += 1
        await asyncio.sleep(0)
    return n

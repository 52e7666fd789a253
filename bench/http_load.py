"""A small HTTP/1.1 load client for the overhead benchmark: raw sockets, pre-built requests, keep-alive.

The client must cost far less than what it measures, so it does no HTTP library work: the request bytes are
built once, a response is read by Content-Length (Envoy sends one for our upstream's small bodies), or chunked
when a proxy dropped it (GIE's configuration: its ext_proc filter may rewrite the response body).
`latency_ms` uses one blocking connection (the client's own cost is a few microseconds per request);
`max_rate` uses many asyncio connections in this process (it competes for the same 2 cores as Envoy and
ext_proc, equally for both configurations being compared, so ratios stay meaningful).
"""

from __future__ import annotations

import asyncio
import socket
import time


def build_request(path: str, body: bytes, host: str = "gateway") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _read_response(sock: socket.socket, buf: bytearray) -> int:
    """Read one response from `sock` (leftover bytes kept in `buf`); returns the status code."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    i = head.find(b"content-length:")
    if i < 0 and b"transfer-encoding: chunked" in head:
        del buf[:end + 4]
        _read_chunked(sock, buf)
        return status
    n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) >= 0 else len(head)]) if i >= 0 else 0
    total = end + 4 + n
    while len(buf) < total:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    del buf[:total]
    return status


def _read_chunked(sock: socket.socket, buf: bytearray) -> None:
    """Consume a chunked body (no trailers) from `buf`/`sock`: a response whose length a proxy did not keep
    (Envoy drops content-length when an ext_proc filter may rewrite the body, as GIE's configuration lets it)."""
    pos = 0
    while True:
        line_end = buf.find(b"\r\n", pos)
        while line_end < 0:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError("connection closed")
            buf += more
            line_end = buf.find(b"\r\n", pos)
        size = int(bytes(buf[pos:line_end]).split(b";", 1)[0], 16)
        need = line_end + 2 + size + 2
        while len(buf) < need:
            more = sock.recv(65536)
            if not more:
                raise ConnectionError("connection closed")
            buf += more
        pos = need
        if size == 0:
            del buf[:pos]
            return


def latency_ms(port: int, request: bytes, num_requests: int, num_warmup: int = 200) -> list[float]:
    """Per-request latencies (ms) of `num_requests` sequential requests on one keep-alive connection."""
    out: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        for i in range(num_warmup + num_requests):
            t0 = time.perf_counter()
            sock.sendall(request)
            status = _read_response(sock, buf)
            dt = (time.perf_counter() - t0) * 1000.0
            if status != 200:
                raise RuntimeError(f"status {status}")
            if i >= num_warmup:
                out.append(dt)
    return out


async def _worker(port: int, request: bytes, deadline: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < deadline:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            i = lower.find(b"content-length:")
            n = int(lower[i + 15:lower.index(b"\r\n", i)]) if i >= 0 else 0
            if n:
                await reader.readexactly(n)
            elif i < 0 and b"transfer-encoding: chunked" in lower:
                while True:  # chunked (module docstring: no content-length kept), no trailers
                    size = int((await reader.readline()).split(b";", 1)[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            if head[9:12] == b"200":
                counts[0] += 1
            else:
                counts[1] += 1
    finally:
        writer.close()


async def _rate(port: int, request: bytes, num_connections: int, duration_s: float) -> tuple[float, int]:
    counts = [0, 0]
    # Warm the connections first so connect cost is not measured.
    warm = time.perf_counter() + 0.3
    await asyncio.gather(*(_worker(port, request, warm, [0, 0]) for _ in range(num_connections)))
    t0 = time.perf_counter()
    await asyncio.gather(*(_worker(port, request, t0 + duration_s, counts) for _ in range(num_connections)))
    return counts[0] / (time.perf_counter() - t0), counts[1]


def max_rate(port: int, request: bytes, num_connections: int = 32, duration_s: float = 3.0) -> tuple[float, int]:
    """(successful requests per second, number of non-200 answers) over `num_connections` connections."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_rate(port, request, num_connections, duration_s))
    finally:
        loop.close()


def stream_token_times(port: int, request: bytes) -> tuple[int, list[float]]:
    """Send one streamed (SSE, chunked) request on a new connection; returns (status, arrival time in
    perf_counter seconds of each ``data:`` event). Events arriving in one read share its time."""
    times: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(request)
        buf = bytearray()
        status = 0
        while True:
            chunk = sock.recv(65536)
            now = time.perf_counter()
            if not chunk:
                break
            if not status:
                buf += chunk
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    continue
                status = int(buf[9:12])
                chunk = bytes(buf[end + 4:])
            times.extend([now] * chunk.count(b"data: "))
            if b"[DONE]" in chunk or chunk.endswith(b"0\r\n\r\n"):
                break
    return status, times

"""Backpressure (issue 11 finding 4): a client that does not read its SSE stream must not grow the server.

Real server processes; the slow clients are raw sockets with a small SO_RCVBUF, so the kernel buffers fill
quickly and the server's transport pauses. Before the fix a never-reading client grew the server by ~12 MB/s
at time scale 0.01 (46 -> 152 MB in 10 s) and its request ran to the end holding its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import statistics
import threading
import time

import aiohttp
import orjson
import pytest

from helpers.waiting import until

pytestmark = pytest.mark.integration

# 0.01: ~14k tokens/s for one stream (~3 MB/s of SSE), so the kernel's socket buffers (~2.5 MB on loopback)
# fill in about a second and the long generation below would run ~9 s unimpeded.
FAST = ("--time-scale", "0.01")
LONG = {"prompt": "tell me a very long story " * 40, "max_tokens": 120_000, "stream": True}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def scrape(url: str) -> dict[str, float]:
    """Metric samples by name (labels folded into the key for the slow-client counter)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        m = re.search(r'[{,]reason="(\w+)"', name)
        key = name.split("{")[0] + (f"{{{m.group(1)}}}" if m else "")
        out[key] = float(value)
    return out


def stalled_client(host: str, port: int, body: dict) -> socket.socket:
    """Send a streamed request on a socket with a tiny receive buffer, and never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: sets the TCP window
    sock.connect((host, port))
    raw = orjson.dumps(body)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(raw), raw))
    return sock


def drain(sock: socket.socket) -> bytes:
    """Whatever the server left on `sock` until it is closed or reset."""
    sock.settimeout(5)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            data += chunk
    sock.close()
    return data


def scrape_until(url: str, cond, timeout_s: float) -> tuple[dict[str, float], float]:  # noqa: ANN001
    """The server's metrics once `cond(metrics)` holds, and the seconds that took (fails after `timeout_s`)."""
    t0 = time.monotonic()

    def met() -> dict[str, float] | None:
        m = scrape(url)
        return m if cond(m) else None

    m = until(met, timeout_s, interval_s=0.1, message=lambda: f"metrics condition (now: {scrape(url)})")
    return m, time.monotonic() - t0


async def ttfts_s(url: str, n: int) -> list[float]:
    """TTFT of `n` short streamed requests, one after the other."""
    out = []
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            t0 = time.monotonic()
            async with s.post(url + "/v1/completions",
                              json={"prompt": f"short request {i} " * 30, "max_tokens": 4, "stream": True}) as r:
                assert r.status == 200
                await r.content.readline()
                out.append(time.monotonic() - t0)
                await r.read()
    return out


def idle(m: dict[str, float]) -> bool:
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 and \
        m["vllm:kv_cache_usage_perc"] == 0


def assert_idle(m: dict[str, float]) -> None:
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0


async def test_never_reading_client_is_aborted_at_the_buffer_limit(server_factory):
    srv = server_factory(*FAST)  # defaults: 256 KiB buffer, 30 s stall limit (the buffer fills in ~1 s)
    baseline = await ttfts_s(srv.url, 8)  # also warms the process up before measuring its memory
    rss_before = rss_bytes(srv.proc.pid)
    sock = stalled_client(srv.host, srv.port, LONG)
    t0 = time.monotonic()
    during = await ttfts_s(srv.url, 8)  # while the stalled stream is still generating
    m, _ = scrape_until(srv.url, lambda m: m.get("prefixroute:slow_client_aborts_total{buffer_full}", 0) >= 1, 15)
    aborted_after_s = time.monotonic() - t0
    rss_growth = rss_bytes(srv.proc.pid) - rss_before
    m, _ = scrape_until(srv.url, idle, 5)  # the aborted request has freed its blocks
    after = await ttfts_s(srv.url, 4)
    left = drain(sock)
    print(f"\nbuffer_full abort after {aborted_after_s:.1f} s, {m['vllm:generation_tokens_total']:.0f} tokens "
          f"generated, RSS {rss_before / 1e6:.1f} -> +{rss_growth / 1e6:.1f} MB; TTFT p50 ms baseline "
          f"{statistics.median(baseline) * 1e3:.1f} during {statistics.median(during) * 1e3:.1f} "
          f"after {statistics.median(after) * 1e3:.1f}")
    assert m["prefixroute:slow_client_aborts_total{buffer_full}"] == 1
    assert m["prefixroute:slow_client_aborts_total{stalled}"] == 0
    assert m["prefixroute:requests_aborted_total"] == 1 and m["vllm:request_success_total"] == 8 + 8
    assert m["vllm:generation_tokens_total"] < LONG["max_tokens"] / 2  # it stopped producing
    assert_idle(m)
    assert rss_growth < 16e6  # kernel socket buffers are outside RSS; the process holds <= 256 KiB + slack
    assert not left.endswith(b"0\r\n\r\n")  # the stream was cut, not completed
    # other clients were served normally throughout (generous bound: 2 shared cores)
    assert statistics.median(during) < 3 * statistics.median(baseline) + 0.05
    assert statistics.median(after) < 3 * statistics.median(baseline) + 0.05


async def test_one_byte_per_second_reader_is_aborted_at_the_stall_limit(server_factory):
    """The issue's exact case: a client that reads 1 byte at a time never lets the buffer drain below the low
    mark, so the connection stays paused until `stall_timeout_s`."""
    srv = server_factory(*FAST, "--stall-timeout-s", "2", "--max-stream-buffer-bytes", str(64 << 20))
    rss_before = rss_bytes(srv.proc.pid)
    sock = stalled_client(srv.host, srv.port, LONG)
    stop = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and sock.recv(1):
                time.sleep(0.2)  # 5 bytes/s: faster than the reader, still hopeless

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    try:
        m, took_s = scrape_until(srv.url, lambda m: m["prefixroute:slow_client_aborts_total{stalled}"] >= 1, 20)
    finally:
        stop.set()
        reader.join(5)
        sock.close()
    rss_growth = rss_bytes(srv.proc.pid) - rss_before
    print(f"\nstalled abort after {took_s:.1f} s, RSS growth {rss_growth / 1e6:.1f} MB")
    assert took_s >= 2  # not before the stall limit
    assert m["prefixroute:slow_client_aborts_total{buffer_full}"] == 0
    assert m["vllm:generation_tokens_total"] < LONG["max_tokens"] / 2
    scrape_until(srv.url, idle, 5)


async def test_stalled_client_that_disconnects_is_aborted_at_once(server_factory):
    """A paused connection stops reading requests; its client closing must still abort the request at once
    (not wait for the stall limit) and count as a disconnect, not a slow client."""
    srv = server_factory(*FAST, "--stall-timeout-s", "600", "--max-stream-buffer-bytes", str(64 << 20))
    sock = stalled_client(srv.host, srv.port, LONG)
    scrape_until(srv.url, lambda m: m["vllm:generation_tokens_total"] > 20_000, 15)  # well past the pause
    sock.close()  # unread data: the kernel sends a RST
    m, took_s = scrape_until(srv.url, lambda m: m["prefixroute:requests_aborted_total"] >= 1, 5)
    assert took_s < 2
    assert m["prefixroute:slow_client_aborts_total{buffer_full}"] == 0
    assert m["prefixroute:slow_client_aborts_total{stalled}"] == 0
    assert_idle(m)

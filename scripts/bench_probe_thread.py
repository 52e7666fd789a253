#!/usr/bin/env python3
"""Would health probes off the router's event loop (a thread with a loop of its own) pay? Measured, not built.

Three stub servers (the stdlib's threading HTTP server: /health in about a millisecond). Phase 1: the main loop
(uvloop, as the router) runs Python-bound stalls (the GIL held) of `--stall-s` per iteration for 6 s while probes
(every 1 s, 0.5 s timeout, aiohttp) run (a) on the main loop, (b) in a thread with its own loop: verdicts each got.
Phase 2, no stalls: a main loop busy 50% (1 ms of Python work every 2 ms, as a router under load) measures its own
timer lateness (what a decision waits) with the probe thread on and off, alternated twice.

Usage: .venv/bin/python scripts/bench_probe_thread.py [--stall-s 1.2]
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import statistics
import threading
import time

import aiohttp
import uvloop


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def prober(urls: list[str], out: list[tuple[str, float]], stop: threading.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for url in urls:
                t0 = time.monotonic()
                try:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                        await r.read()
                    out.append(("ok", time.monotonic() - t0))
                except asyncio.TimeoutError:
                    out.append(("timeout", time.monotonic() - t0))
            await asyncio.sleep(1.0)


def probe_thread(urls: list[str], out: list, stop: threading.Event) -> threading.Thread:
    t = threading.Thread(target=lambda: uvloop.run(prober(urls, out, stop)), daemon=True)
    t.start()
    return t


async def lateness(seconds: float) -> list[float]:
    """The main loop's timer lateness while it is busy half the time."""
    async def work() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            spin(0.001)
            await asyncio.sleep(0.001)

    busy = asyncio.create_task(work())
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        due = time.monotonic() + 0.002
        await asyncio.sleep(0.002)
        out.append(time.monotonic() - due)
    await busy
    return out


async def main(args: argparse.Namespace) -> None:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}/health" for s in servers]
    on_loop: list = []
    in_thread: list = []
    stop_loop, stop_thread = threading.Event(), threading.Event()
    t = probe_thread(urls, in_thread, stop_thread)
    task = asyncio.create_task(prober(urls, on_loop, stop_loop))
    await asyncio.sleep(1.0)
    on_loop.clear()
    in_thread.clear()
    end = time.monotonic() + 6.0
    while time.monotonic() < end:
        spin(args.stall_s)  # holds the GIL, as Python work on the loop does
        await asyncio.sleep(0)
    for name, out in (("on the main loop", on_loop), ("in a probe thread", in_thread)):
        ok = [d for o, d in out if o == "ok"]
        print(f"stalled {args.stall_s} s per iteration for 6 s, probes {name}: {len(ok)} ok, "
              f"{len(out) - len(ok)} timed out, slowest ok {max(ok, default=0) * 1e3:.0f} ms")
    stop_loop.set()
    await task
    stop_thread.set()
    t.join()
    for label in ("thread on", "thread off", "thread on", "thread off"):
        stop_thread.clear()
        t = probe_thread(urls, [], stop_thread) if label == "thread on" else None
        lat = await lateness(5.0)
        stop_thread.set()
        if t is not None:
            t.join()
        q = statistics.quantiles(lat, n=100)
        print(f"busy main loop, probe {label}: timer lateness p50 {q[49] * 1e3:.2f} ms, p99 {q[98] * 1e3:.2f} ms")
    for s in servers:
        s.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stall-s", type=float, default=1.2)
    uvloop.run(main(ap.parse_args()))

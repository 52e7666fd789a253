#!/usr/bin/env python3
"""What does a Python gRPC server cost per routed request, whatever it does? (the ext_proc's floor.)

    .venv/bin/python scripts/bench_grpc_servers.py 2000 [aio,uvloop,uvloop-rw,uvloop-spin,sync,grpclib] [GAP_MS]

Per simulated request one bidirectional stream with 2 round trips (4 KB up, 200 B down: the routing stream's
headers and body messages), from a grpc.aio client in another process, 3 rounds alternating the servers. Servers:
grpc.aio on asyncio ("aio"), on uvloop ("uvloop", as the router runs; "uvloop-rw": context.read/write instead of
the iterator; "uvloop-spin": the event loop kept busy for SPIN_US microseconds, default 300, after each
answer, by a task that yields without sleeping: whether keeping the loop warm saves the wake-up from idle),
grpcio's threaded server ("sync"), and grpclib (pure-Python HTTP/2 on uvloop; only when installed:
`pip install grpclib`). Printed per server: round-trip p50/p99 and the server's CPU per request (/proc). The
servers echo and do nothing else, so the CPU is the floor any Python ext_proc on that stack pays. GAP_MS (default 0:
back to back) idles the client that long after each request, as a gateway at a few requests per second per
process does: the round trips then include each server's wake-up from idle. The p50 of each stream's first and
second round trip is printed apart: the idle time before a stream falls on its first."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpc_transport import client, cpu_of  # noqa: E402

REPLY = b"x" * 200
SPIN_US = float(os.environ.get("SPIN_US", "300"))
_spin_until = [0.0]  # perf_counter() until which "uvloop-spin" keeps its loop busy


async def _spinner() -> None:
    while True:
        # sleep(0) polls the loop's selector with no timeout: the loop thread never blocks while it spins
        await asyncio.sleep(0 if time.perf_counter() < _spin_until[0] else 0.001)


def _handler(kind: str) -> grpc.GenericRpcHandler:
    if kind == "sync":
        def stream(it, ctx):
            for _ in it:
                yield REPLY
    elif kind.endswith("-rw"):
        async def stream(it, ctx):
            while (await ctx.read()) is not grpc.aio.EOF:
                await ctx.write(REPLY)
    elif kind.endswith("-spin"):
        async def stream(it, ctx):
            async for _ in it:
                yield REPLY
                _spin_until[0] = time.perf_counter() + SPIN_US / 1e6
    else:
        async def stream(it, ctx):
            async for _ in it:
                yield REPLY
    return grpc.method_handlers_generic_handler("bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream)})


def _grpclib_main(port: int, ready) -> None:
    import uvloop
    from grpclib.const import Cardinality, Handler
    from grpclib.encoding.base import CodecBase
    from grpclib.server import Server

    class Raw(CodecBase):
        __content_subtype__ = "proto"

        def encode(self, message, message_type):
            return message

        def decode(self, data, message_type):
            return data

    class Echo:
        async def stream(self, s):
            async for _ in s:
                await s.send_message(REPLY)

        def __mapping__(self):
            return {"/bench.Echo/Stream": Handler(self.stream, Cardinality.STREAM_STREAM, bytes, bytes)}

    async def main():
        server = Server([Echo()], codec=Raw())
        await server.start("127.0.0.1", port)
        ready.set()
        await server.wait_closed()
    uvloop.run(main())


def serve(kind: str, port: int, ready) -> None:
    if kind == "grpclib":
        _grpclib_main(port, ready)
        return
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((_handler(kind),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        ready.set()
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handler(kind),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        if kind.endswith("-spin"):
            spinner = asyncio.get_running_loop().create_task(_spinner())  # noqa: F841 (held while serving)
        ready.set()
        await server.wait_for_termination()
    if kind.startswith("uvloop"):
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    kinds = (sys.argv[2] if len(sys.argv) > 2 else "aio,uvloop,uvloop-rw,sync,grpclib").split(",")
    gap_s = float(sys.argv[3]) / 1e3 if len(sys.argv) > 3 else 0.0
    try:
        import grpclib  # noqa: F401
    except ImportError:
        kinds = [k for k in kinds if k != "grpclib"]
    port = 50918
    for rnd in range(3):
        for kind in kinds:
            ready = mp.Event()
            p = mp.Process(target=serve, args=(kind, port, ready))
            p.start()
            ready.wait(10)
            time.sleep(0.3)
            addr = f"127.0.0.1:{port}"
            asyncio.run(client(addr, 200, 1))  # warm
            s0 = cpu_of(p.pid)
            lat, _, wall = asyncio.run(client(addr, n, 1, gap_s))
            s1 = cpu_of(p.pid)
            p.terminate()
            p.join()
            first, second = statistics.median(lat[0::2]), statistics.median(lat[1::2])
            lat.sort()
            print(f"round {rnd + 1} {kind:11s}: round trip p50 {statistics.median(lat) * 1e6:6.1f} us (first "
                  f"{first * 1e6:6.1f}, second {second * 1e6:6.1f}) p99 {lat[int(len(lat) * 0.99)] * 1e6:6.1f} us; "
                  f"server CPU {(s1 - s0) / n * 1e6:7.1f} us/request, wall {wall / n * 1e6:7.1f} us/request",
                  flush=True)

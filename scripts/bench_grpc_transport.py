#!/usr/bin/env python3
"""Would a Unix socket between Envoy and the ext_proc cut the hop? grpc.aio bidi streams over TCP loopback and
over a Unix socket, alternating, 3 rounds ("a Unix-socket ext_proc was not tried").

    .venv/bin/python scripts/bench_grpc_transport.py 2000

A server process (grpc.aio, as the ext_proc) and a client process; per simulated request one stream with 2 round
trips of 4 KB up and 200 B down (the routing stream: request headers, then the body). Printed per transport:
round-trip latency p50/p99, and per request the server's CPU (from /proc), the client's and the wall time. The
client is grpc.aio too (Envoy's C++ client would cost less), so the server's CPU is the figure that matters."""
import asyncio, os, sys, time, multiprocessing as mp, statistics
import grpc

def handler():
    async def stream(request_iterator, context):
        async for req in request_iterator:
            yield b"x" * 200
    return grpc.method_handlers_generic_handler("bench.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)})

def serve(addr, ready):
    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler(),))
        server.add_insecure_port(addr)
        await server.start()
        ready.set()
        await server.wait_for_termination()
    asyncio.run(main())

async def client(addr, n, streams, gap_s=0.0):
    # gap_s: idle time after each request (0: back to back), the shape a gateway at a few requests per second sees
    async with grpc.aio.insecure_channel(addr) as ch:
        call_factory = ch.stream_stream("/bench.Echo/Stream")
        payload = b"y" * 4096
        lat = []
        # each "request": one stream, 2 round trips (headers, body) like the routing stream
        c0 = time.process_time(); t0 = time.perf_counter()
        for i in range(n):
            call = call_factory()
            for _ in range(2):
                s = time.perf_counter()
                await call.write(payload)
                await call.read()
                lat.append(time.perf_counter() - s)
            await call.done_writing()
            await call.code()
            if gap_s:
                await asyncio.sleep(gap_s)
        return lat, time.process_time() - c0, time.perf_counter() - t0

def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().split(")")[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    sock = f"/tmp/prefixroute-bench-grpc-{os.getpid()}.sock"
    for rnd in range(3):
        for label, addr in (("tcp", "127.0.0.1:50917"), ("unix", f"unix:{sock}")):
            if os.path.exists(sock): os.unlink(sock)
            ready = mp.Event(); p = mp.Process(target=serve, args=(addr, ready)); p.start(); ready.wait(10)
            time.sleep(0.2)
            asyncio.run(client(addr, 200, 1))  # warm
            s0 = cpu_of(p.pid)
            lat, ccpu, wall = asyncio.run(client(addr, n, 1))
            s1 = cpu_of(p.pid)
            p.terminate(); p.join()
            lat.sort()
            p99 = lat[int(len(lat) * 0.99)]
            print(f"round {rnd + 1} {label:4s}: round trip p50 {statistics.median(lat) * 1e6:6.1f} us p99 "
                  f"{p99 * 1e6:6.1f} us; per request (stream + 2 round trips): client CPU {ccpu / n * 1e6:6.1f} us, "
                  f"server CPU {(s1 - s0) / n * 1e6:6.1f} us, wall {wall / n * 1e6:6.1f} us")

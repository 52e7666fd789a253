#!/usr/bin/env python3
"""Benchmark of KV-event ingestion in the router (extproc/kv_events): throughput, and the latency it adds to
routing decisions sharing the event loop.

A publisher *process* (vLLM's protocol, pre-encoded batches) sends engine-step batches: each a BlockStored of
`--blocks-per-batch` new 16-token blocks plus a BlockRemoved of as many old ones (a full cache: every store
evicts), so "block events" = stored + removed blocks. The router side runs one `KVEventsManager` on its event
loop (uvloop when installed, as the router does) and, concurrently, answers decisions: a client *process* sends
UDP requests on loopback at Poisson times (`--decisions-per-s`), the loop answers each after an `index.match` of a
256-block prompt two endpoints hold entirely (the costliest match), and the client measures each round trip.
Any time the loop spends ingesting while a request waits shows up in its round trip, as it would for a gRPC
request from Envoy.

Phases: (1) decisions alone (the publisher process runs as in (2), but on a topic the router does not subscribe
to, so the machine is equally loaded); (2) decisions while ingesting at `--rate` block events/s, alternating with (1) for
`--rounds`; (3) ingestion unthrottled over ZMQ (throughput); (4) in-process decode + apply, timing each stretch
of loop time between two yields (what a decision can wait behind ingestion, free of socket and scheduler noise). Usage: .venv/bin/python scripts/bench_kv_events.py [--rate 50000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import numpy as np

BS = 16


def publisher_main(args: argparse.Namespace) -> None:
    import zmq

    from prefixroute.kv_events_wire import BlockRemoved, BlockStored, EventBatch, encode_batch, seq_to_bytes

    rng = random.Random(1)
    n = args.blocks_per_batch
    ring, held_batches = 512, 100  # batch k stores new blocks chained to batch k-1 and evicts batch k-100's
    hashes = [[rng.getrandbits(63) for _ in range(n)] for _ in range(ring)]
    payloads = []
    for k in range(ring):
        ev = [BlockStored(block_hashes=hashes[k], parent_block_hash=None if k == 0 else hashes[k - 1][-1],
                          token_ids=[rng.randrange(128000) for _ in range(n * BS)], block_size=BS, lora_id=None,
                          medium="GPU", lora_name=None),
              BlockRemoved(block_hashes=hashes[(k - held_batches) % ring], medium="GPU")]
        payloads.append(encode_batch(EventBatch(ts=time.time(), events=ev, data_parallel_rank=0)))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.bind(f"tcp://127.0.0.1:{args.port}")
    time.sleep(0.5)  # let the subscriber connect
    per_batch = 2 * n
    interval = per_batch / args.rate if args.rate > 0 else 0.0
    start = time.perf_counter()
    seq = 0
    deadline = start + args.seconds
    while time.perf_counter() < deadline:
        pub.send_multipart([b"kv-events", seq_to_bytes(seq), payloads[seq % len(payloads)]])
        seq += 1
        if interval:
            ahead = start + seq * interval - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
    print(json.dumps({"batches": seq}), flush=True)
    time.sleep(0.5)
    pub.close(linger=1000)
    ctx.term()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def client_main(args: argparse.Namespace) -> None:
    """Send Poisson-timed UDP requests to the router side, print round-trip times (us) as JSON."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1.0)
    rng = random.Random(3)
    rtts: list[float] = []
    lost = 0
    end = time.perf_counter() + args.seconds
    due = time.perf_counter()
    while True:
        due += rng.expovariate(args.decisions_per_s)
        if due > end:
            break
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        a = time.perf_counter()
        sock.sendto(b"x", ("127.0.0.1", args.port))
        try:
            sock.recv(16)
        except TimeoutError:
            lost += 1
            continue
        rtts.append((time.perf_counter() - a) * 1e6)
    print(json.dumps({"rtts": rtts, "lost": lost}), flush=True)


async def router_side(args: argparse.Namespace, rate: float | None, subscribe: bool = True) -> dict:
    from prefixroute.extproc.kv_events import KVEventIndex, KVEventsManager
    from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
    from prefixroute.kv_events_wire import BlockStored, EventBatch
    from prefixroute.procs import free_port

    index = KVEventIndex(BS)
    ep, other = "127.0.0.1:9000", "127.0.0.1:9001"
    rng = random.Random(2)
    prompt = [rng.randrange(128000) for _ in range(256 * BS)]
    for e in (ep, other):  # both hold the decision prompt: two holders scanned per match
        index.apply_batch(e, EventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[rng.getrandbits(63) for _ in range(256)], parent_block_hash=None, token_ids=prompt,
            block_size=BS, lora_id=None, medium="GPU", lora_name=None)]))
    query = hash_token_blocks(prompt, BS, token_seed_for(None, None))
    assert index.match(query) == {ep: 256, other: 256}
    match_s: list[float] = []

    class Decide(asyncio.DatagramProtocol):
        def connection_made(self, transport):
            self.transport = transport

        def datagram_received(self, data, addr):
            a = time.perf_counter()
            index.match(query)
            match_s.append(time.perf_counter() - a)
            self.transport.sendto(b"ok", addr)

    loop = asyncio.get_running_loop()
    udp_port = free_port()
    transport, _ = await loop.create_datagram_endpoint(Decide, local_addr=("127.0.0.1", udp_port))
    manager = proc = None
    if rate is not None:
        # subscribe=False: the control phase. The same publisher process runs at the same rate, but the topic
        # matches nothing (ZMQ filters at the publisher), so both phases share the machine alike and differ
        # only in the loop's ingestion work.
        manager = KVEventsManager(index, topic="kv" if subscribe else "none", chunk_blocks=args.chunk_blocks)
        manager.sync({"events": (f"tcp://127.0.0.1:{args.port}", None)})
        proc = subprocess.Popen([sys.executable, __file__, "--role", "publisher", "--port", str(args.port),
                                 "--rate", str(rate), "--seconds", str(args.seconds + 1.0),
                                 "--blocks-per-batch", str(args.blocks_per_batch)], stdout=subprocess.PIPE)
        await asyncio.sleep(0.7)
    t0 = loop.time()
    b0 = manager.stats()["events"].num_batches if manager else 0
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--role", "client", "--port", str(udp_port), "--seconds", str(args.seconds),
        "--decisions-per-s", str(args.decisions_per_s), stdout=asyncio.subprocess.PIPE)
    stdout, _ = await client.communicate()
    wall = loop.time() - t0
    transport.close()
    got = json.loads(stdout.decode())
    rtts = got["rtts"]
    out: dict = {"decisions": len(rtts), "lost": got["lost"], "p50_us": round(pct(rtts, 50), 1),
                 "p99_us": round(pct(rtts, 99), 1), "p999_us": round(pct(rtts, 99.9), 1),
                 "match_p50_us": round(pct(match_s, 50) * 1e6, 1)}
    if manager is not None:
        st = manager.stats()["events"]
        out.update(block_events_per_s=round((st.num_batches - b0) * 2 * args.blocks_per_batch / wall),
                   gaps=st.num_gaps)
        await asyncio.to_thread(proc.communicate)
        await manager.close()
    return out


async def ingest_only(args: argparse.Namespace) -> dict:
    """Unthrottled: the publisher sends as fast as it can; block events/s applied while it does."""
    from prefixroute.extproc.kv_events import KVEventIndex, KVEventsManager

    index = KVEventIndex(BS)
    manager = KVEventsManager(index, topic="kv", chunk_blocks=args.chunk_blocks)
    ep = "127.0.0.1:9000"
    manager.sync({ep: (f"tcp://127.0.0.1:{args.port}", None)})
    proc = subprocess.Popen([sys.executable, __file__, "--role", "publisher", "--port", str(args.port), "--rate", "0",
                             "--seconds", str(args.seconds), "--blocks-per-batch", str(args.blocks_per_batch)],
                            stdout=subprocess.PIPE)
    loop = asyncio.get_running_loop()
    while manager.stats()[ep].num_batches == 0:
        await asyncio.sleep(0.01)
    t0, b0 = loop.time(), manager.stats()[ep].num_batches
    await asyncio.sleep(args.seconds - 1.0)
    t1, b1 = loop.time(), manager.stats()[ep].num_batches
    await asyncio.to_thread(proc.communicate)
    await manager.close()
    return {"block_events_per_s": round((b1 - b0) * 2 * args.blocks_per_batch / (t1 - t0)),
            "batches_per_s": round((b1 - b0) / (t1 - t0))}


def chunk_costs(args: argparse.Namespace) -> dict:
    """In-process, no sockets: decode + apply the publisher's batches, timing each stretch of work between two
    yields of the event loop (the longest a decision can wait behind ingestion), and the cost per block event."""
    from prefixroute.extproc.kv_events import KVEventIndex
    from prefixroute.kv_events_wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

    rng = random.Random(1)
    n, ring = args.blocks_per_batch, 512
    hashes = [[rng.getrandbits(63) for _ in range(n)] for _ in range(ring)]
    payloads = [encode_batch(EventBatch(ts=0.0, events=[
        BlockStored(block_hashes=hashes[k], parent_block_hash=None if k == 0 else hashes[k - 1][-1],
                    token_ids=[rng.randrange(128000) for _ in range(n * BS)], block_size=BS, lora_id=None,
                    medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=hashes[(k - 100) % ring], medium="GPU")])) for k in range(ring)]
    index = KVEventIndex(BS)
    stretches: list[float] = []
    t0 = time.perf_counter()
    for p in payloads * 4:
        a = time.perf_counter()
        gen = index.apply_events("e", decode_batch(p).events, args.chunk_blocks)  # the decode joins chunk 1
        while True:
            try:
                next(gen)
            except StopIteration:
                break
            stretches.append(time.perf_counter() - a)
            a = time.perf_counter()
    total = time.perf_counter() - t0
    events = len(payloads) * 4 * 2 * n
    return {"us_per_block_event": round(total / events * 1e6, 2), "block_events_per_s": round(events / total),
            "stretch_p50_us": round(pct(stretches, 50) * 1e6, 1), "stretch_p99_us": round(pct(stretches, 99) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="bench", choices=["bench", "publisher", "client"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", type=float, default=50_000.0, help="block events/s in phase 2")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--blocks-per-batch", type=int, default=32, help="stored (and as many removed) per batch")
    ap.add_argument("--decisions-per-s", type=float, default=500.0)
    ap.add_argument("--chunk-blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.role == "publisher":
        publisher_main(args)
        return
    if args.role == "client":
        client_main(args)
        return
    if not args.port:
        from prefixroute.procs import free_port
        args.port = free_port()
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    # Alternate the two decision phases (A B A B ...) so drifting machine load hits both alike; report pooled
    # figures of each.
    alone, ingesting = [], []
    for _ in range(args.rounds):
        alone.append(runner(router_side(args, args.rate, subscribe=False)))
        ingesting.append(runner(router_side(args, args.rate)))
    results = {
        "decisions_alone": alone,
        "decisions_while_ingesting": ingesting,
        "ingestion_unthrottled": runner(ingest_only(args)),
        "in_process": chunk_costs(args),
    }
    a = {k: float(np.median([r[k] for r in alone])) for k in ("p50_us", "p99_us")}
    b = {k: float(np.median([r[k] for r in ingesting])) for k in ("p50_us", "p99_us")}
    results["median_of_rounds"] = {"alone": a, "ingesting": b}
    results["p99_raised_ratio"] = round(b["p99_us"] / a["p99_us"] - 1, 3)
    results["p50_raised_ratio"] = round(b["p50_us"] / a["p50_us"] - 1, 3)
    results["settings"] = {k: v for k, v in vars(args).items() if k not in ("role",)}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

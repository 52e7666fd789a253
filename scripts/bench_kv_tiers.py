#!/usr/bin/env python3
"""Does ingesting CPU-tier KV events delay routing decisions? (p99 decision time within 10% of the
GPU-only run.)

One asyncio loop (uvloop when installed, as the router runs) holds a `TieredKVEventIndex` of `--endpoints`
endpoints and does two things at once, as the router does:

- ingestion: engine-step batches arrive for the endpoints in turn at `--batches-per-s`, each applied with the
  subscriber's chunking (`apply_events(..., chunk_blocks)`, an ``await asyncio.sleep(0)`` between chunks).
  GPU-only phase: a batch = BlockStored of `--blocks-per-batch` new blocks (token ids, chained) + BlockRemoved of
  as many old ones (a full cache). Tiered phase: the same, plus what a server with a CPU tier publishes for the
  evicted blocks (one placeholder BlockStored per block, medium CPU) and a CPU BlockRemoved of as many older
  ones (a full host tier): about twice the event rate;
- decisions at Poisson times (`--decisions-per-s`): each is a `match` of a 256-block prompt (the costliest: two
  endpoints hold it on the GPU, a third its first half, and in the tiered phase its second half on the CPU), measured
  from its scheduled time to the end of the match: what a request from Envoy would wait behind ingestion, plus
  the match itself.

Phases alternate (`--rounds` x each, `--seconds` per phase) so drift on a shared machine hits both alike; the
figure is the ratio of their p99 decision times. Usage: .venv/bin/python scripts/bench_kv_tiers.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import numpy as np

from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
from prefixroute.kv_events_wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

BS = 16


def make_batches(n: int, ring: int, tiered: bool, seed: int) -> list[bytes]:
    """Pre-encoded batches (the router decodes them as the subscriber does)."""
    rng = random.Random(seed)
    hashes = [[rng.getrandbits(63) for _ in range(n)] for _ in range(ring)]
    gpu_held, cpu_held = ring // 4, ring // 2
    out = []
    for k in range(ring):
        ev = [BlockStored(hashes[k], None if k == 0 else hashes[k - 1][-1],
                          [rng.randrange(128000) for _ in range(n * BS)], BS, None, "GPU"),
              BlockRemoved(hashes[(k - gpu_held) % ring], "GPU")]
        if tiered:  # the evicted blocks go to the host tier; the host tier drops older ones
            ev += [BlockStored([h], None, [], 0, None, "CPU", group_idx=0) for h in hashes[(k - gpu_held) % ring]]
            ev.append(BlockRemoved(hashes[(k - gpu_held - cpu_held) % ring], "CPU", 0))
        out.append(encode_batch(EventBatch(time.time(), ev, 0)))
    return out


async def phase(index: TieredKVEventIndex, endpoints: list[str], batches: list[bytes], prompt: list[int],
                args: argparse.Namespace, rng: random.Random) -> list[float]:
    stop = time.perf_counter() + args.seconds
    lat: list[float] = []

    async def ingest() -> None:
        k = 0
        interval = 1.0 / args.batches_per_s
        nxt = time.perf_counter()
        while time.perf_counter() < stop:
            ep = endpoints[k % len(endpoints)]
            batch = decode_batch(batches[(k // len(endpoints)) % len(batches)])
            for _ in index.apply_events(ep, batch.events, args.chunk_blocks):
                await asyncio.sleep(0)
            k += 1
            nxt += interval
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    async def decide() -> None:
        nxt = time.perf_counter()
        while True:
            nxt += rng.expovariate(args.decisions_per_s)
            if nxt >= stop:
                return
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            index.match(prompt)
            lat.append(time.perf_counter() - nxt)

    await asyncio.gather(ingest(), decide())
    return lat


def seed_prompt(index: TieredKVEventIndex, endpoints: list[str], tiered: bool) -> list[int]:
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 128000, 256 * BS).tolist()
    server = [int(x) for x in rng.integers(1, 1 << 62, 256)]
    stored = BlockStored(server, None, tokens, BS, None, "GPU")
    for ep in ("holder-0", "holder-1", "holder-2"):
        index.apply_batch(ep, EventBatch(0.0, [stored]))
    # the third holder evicted its second half from the GPU: gone (GPU-only) or moved to its host tier (tiered)
    events: list = [BlockRemoved(server[128:], "GPU")]
    if tiered:
        events += [BlockStored([h], None, [], 0, None, "CPU") for h in server[128:]]
    index.apply_batch("holder-2", EventBatch(0.0, events))
    return hash_token_blocks(token_bytes(tokens), BS, token_seed_for(None, None))


def stretches_and_match(args: argparse.Namespace, tiered: bool, batches: list[bytes]) -> dict:
    """Without sockets or timers (free of scheduler noise): each stretch of loop time ingestion holds between two
    yields (decode included: what a decision can wait behind), and the match's own time."""
    endpoints = [f"ep-{i}" for i in range(args.endpoints)]
    index = TieredKVEventIndex(BS)
    prompt = seed_prompt(index, endpoints, tiered)
    stretch: list[float] = []
    for k in range(2000):
        t0 = time.perf_counter()
        batch = decode_batch(batches[(k // len(endpoints)) % len(batches)])
        for _ in index.apply_events(endpoints[k % len(endpoints)], batch.events, args.chunk_blocks):
            t1 = time.perf_counter()
            stretch.append(t1 - t0)
            t0 = t1
    match = []
    for _ in range(2000):
        t0 = time.perf_counter()
        index.match(prompt)
        match.append(time.perf_counter() - t0)
    return {"stretch_p50_us": round(pct(stretch, 0.5) * 1e6, 1), "stretch_p99_us": round(pct(stretch, 0.99) * 1e6, 1),
            "stretch_max_us": round(max(stretch) * 1e6, 1), "match_p50_us": round(pct(match, 0.5) * 1e6, 1),
            "match_p99_us": round(pct(match, 0.99) * 1e6, 1)}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main_async(args: argparse.Namespace) -> dict:
    endpoints = [f"ep-{i}" for i in range(args.endpoints)]
    runs: dict[str, list[float]] = {"gpu": [], "tiered": []}
    rng = random.Random(args.seed)
    batches = {"gpu": make_batches(args.blocks_per_batch, 256, False, 1),
               "tiered": make_batches(args.blocks_per_batch, 256, True, 1)}
    events = {k: sum(len(decode_batch(b).events) for b in v) / len(v) for k, v in batches.items()}
    for _ in range(args.rounds):
        for name in ("gpu", "tiered"):
            index = TieredKVEventIndex(BS)
            prompt = seed_prompt(index, endpoints, name == "tiered")
            runs[name] += await phase(index, endpoints, batches[name], prompt, args, rng)
    out = {"events_per_batch": events, "batches_per_s": args.batches_per_s, "decisions_per_s": args.decisions_per_s}
    for name, lat in runs.items():
        out[name] = {"decisions": len(lat), "p50_ms": round(pct(lat, 0.5) * 1e3, 4),
                     "p99_ms": round(pct(lat, 0.99) * 1e3, 4), "max_ms": round(max(lat) * 1e3, 4)}
    out["p99_ratio_tiered_over_gpu"] = round(out["tiered"]["p99_ms"] / out["gpu"]["p99_ms"], 3)
    for name in ("gpu", "tiered"):
        out[name]["in_process"] = stretches_and_match(args, name == "tiered", batches[name])
    out["p50_ratio_tiered_over_gpu"] = round(out["tiered"]["p50_ms"] / out["gpu"]["p50_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=8)
    ap.add_argument("--blocks-per-batch", type=int, default=32)
    ap.add_argument("--batches-per-s", type=float, default=400.0)
    ap.add_argument("--decisions-per-s", type=float, default=500.0)
    ap.add_argument("--chunk-blocks", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    print(json.dumps(asyncio.run(main_async(args)), indent=1))


if __name__ == "__main__":
    main()

"""Prefix index at fleet scale: memory per (block, endpoint) entry, decision time, event ingestion, for 64 to
1,024 endpoints. Not a test: it prints figures.

    python -m prefixroute.bench.index_scale [--endpoints 64,256,1024] [--blocks 31250] [--kinds own,events]

Each (index kind, endpoints) configuration runs in a fresh process, so its resident-memory growth is the index's:

- ``own``: the router's own `PrefixIndex` (approximate / feedback source), filled by recording picks;
- ``events``: the KV-events index the router builds when servers publish events (`TieredKVEventIndex`), filled
  by applying encoded `BlockStored` batches through the decoder, as the subscriber does.

Fill: every endpoint holds `--blocks` blocks (31,250 = what vLLM publishes for a large GPU cache), in chains of
`CHAIN_BLOCKS` blocks: a quarter of them in shared chains (system prompts), each shared chain held by about
`SHARED_HOLDERS` endpoints, the rest in chains only that endpoint holds. Hashes are fresh Python ints per endpoint,
as decoding or parsing makes them. When the projected memory of a configuration exceeds `--max-gb`, it is filled
with fewer blocks per endpoint and bytes per entry are measured there (the table says so): per-entry cost does
not depend on how full each endpoint is.

Figures per configuration:

- bytes per (block, endpoint) entry: resident-set growth over the fill / entries (also counts allocator slack);
- decision: `RouterCore.route` (index match, time-model scheduling over the pool, recording the pick), the
  router's decision path after parsing, on requests that hit a shared chain (many holders), an endpoint's own
  chain, or nothing (cold), p50 / p99 in microseconds;
- ingestion (events only): blocks applied per second (stores + removes, decode included) on a full index;
- decision under events: one asyncio loop (uvloop when installed, as the router runs) makes decisions at Poisson
  times while batches arrive from every endpoint at `--batches-per-s-per-endpoint` (each a BlockStored of
  `--blocks-per-batch` new blocks and a BlockRemoved of as many old ones), applied in the subscriber's chunks; the
  decision's latency counts from its scheduled time. Idle and loaded phases alternate; the figure is the ratio
  of their p99s and the share of the offered event rate the loop kept up with.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

CHAIN_BLOCKS = 128
"""Blocks per chain in the fill (a 2,048-token prompt at 16-token blocks)."""
SHARED_RATIO = 0.25
"""Share of each endpoint's blocks in chains several endpoints hold."""
SHARED_HOLDERS = 8
"""Endpoints holding each shared chain, on average."""
BS = 16
RING = 64  # ingestion ring: batch k stores chain k and removes chain k - RING/2 (a full cache)
BYTES_PER_ENTRY_GUESS = {"own": 140, "events": 130}  # to size the fill under --max-gb before measuring


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _endpoints(n: int):
    from prefixroute.types import EndpointId, EndpointState
    eps = tuple(EndpointState(EndpointId(f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000"), models=frozenset({"m"}),
                              num_requests_waiting=i % 3, kv_cache_usage_ratio=0.5) for i in range(n))
    return eps, {s.endpoint: i % 5 for i, s in enumerate(eps)}


def _plan(n: int, blocks: int, seed: int) -> tuple[int, int, list[list[int]]]:
    """(shared chains in the pool, distinct chains per endpoint, shared chain ids per endpoint)."""
    per_ep_chains = max(1, blocks // CHAIN_BLOCKS)
    shared_per_ep = max(1, round(per_ep_chains * SHARED_RATIO))
    distinct_per_ep = per_ep_chains - shared_per_ep
    num_shared = max(shared_per_ep, shared_per_ep * n // SHARED_HOLDERS)
    rng = random.Random(seed)
    return num_shared, distinct_per_ep, [rng.sample(range(num_shared), shared_per_ep) for _ in range(n)]


# --- own index ---------------------------------------------------------------------------------------------------
def _own(n: int, blocks: int, args: argparse.Namespace) -> dict:
    from prefixroute.extproc.routing.request import InferenceRequest
    from prefixroute.extproc.routing.router import RouterCore
    from prefixroute.extproc.routing.settings import RoutingSettings

    settings = RoutingSettings(policy="prefix", rng_seed=1, default_index_capacity_blocks=blocks)
    eps, in_flight = _endpoints(n)
    num_shared, distinct_per_ep, shared_of = _plan(n, blocks, 1)
    rng = np.random.default_rng(2)
    shared = rng.integers(1, 1 << 63, (num_shared, CHAIN_BLOCKS), dtype=np.int64)
    core = RouterCore(settings)
    core.sync_endpoints(eps)
    index = core.index
    gc.collect()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    own_chains = {}
    for i, s in enumerate(eps):
        ep = s.endpoint
        distinct = rng.integers(1, 1 << 63, (distinct_per_ep, CHAIN_BLOCKS), dtype=np.int64)
        own_chains[ep] = distinct[:4].copy()
        order = [shared[c] for c in shared_of[i]] + list(distinct)
        for chain in order:
            index.record(chain.tolist(), ep)  # fresh ints, as a parsed request's hashes are
    fill_s = time.perf_counter() - t0
    gc.collect()
    entries = index.num_entries()
    rss = _rss_bytes() - rss0

    def request(hashes: list[int]) -> InferenceRequest:
        return InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", stream=True,
                                block_hashes=hashes, num_prompt_chars=len(hashes) * settings.block_chars)

    return _decisions(core, eps, in_flight, shared, own_chains, request, entries, rss, fill_s, n, blocks, args)


# --- events index ------------------------------------------------------------------------------------------------
def _events(n: int, blocks: int, args: argparse.Namespace) -> dict:
    from prefixroute.extproc.kv_events import tiers
    from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
    from prefixroute.extproc.routing.hashing import hash_token_blocks, token_bytes, token_seed_for
    from prefixroute.extproc.routing.request import InferenceRequest
    from prefixroute.extproc.routing.router import RouterCore
    from prefixroute.extproc.routing.settings import RoutingSettings
    from prefixroute.kv_events_wire import BlockRemoved, BlockStored, EventBatch, decode_batch, encode_batch

    settings = RoutingSettings(policy="prefix", rng_seed=1, index_source="events", tokenizer="sim",
                               kv_block_tokens=BS)
    eps, in_flight = _endpoints(n)
    num_shared, distinct_per_ep, shared_of = _plan(n, blocks, 1)
    index = TieredKVEventIndex(BS, settings.kv_cpu_load_us_per_token)
    core = RouterCore(settings, event_index=index, note_routed=index.note_routed)
    core.sync_endpoints(eps)
    core.set_event_endpoints([s.endpoint for s in eps])
    tiers.attach(index, core)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 128000, CHAIN_BLOCKS * BS).tolist()  # every chain's tokens; the salt tells them apart
    tok_bytes = token_bytes(tokens)

    def stored(salt: str, server: list[int], num_blocks: int = CHAIN_BLOCKS) -> BlockStored:
        # vLLM's form: the salt is the first block's last extra key.
        return BlockStored(server, None, tokens[:num_blocks * BS], BS, None, "GPU", extra_keys=[[salt]])

    def router_hashes(salt: str) -> list[int]:
        return hash_token_blocks(tok_bytes, BS, token_seed_for(None, salt))

    # One encoded batch per shared chain (every holder decodes it: fresh ints, as from its own socket).
    shared_batches = [encode_batch(EventBatch(0.0, [stored(f"s{c}", rng.integers(1, 1 << 62, CHAIN_BLOCKS).tolist())]))
                      for c in range(num_shared)]
    gc.collect()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    own_salts = {}
    for i, s in enumerate(eps):
        ep = s.endpoint
        for c in shared_of[i]:
            index.apply_batch(ep, decode_batch(shared_batches[c]))
        salts = [f"e{i}-{k}" for k in range(distinct_per_ep)]
        own_salts[ep] = salts[:4]
        server = rng.integers(1, 1 << 62, (distinct_per_ep, CHAIN_BLOCKS))
        for salt, srv in zip(salts, server):
            index.apply_batch(ep, decode_batch(encode_batch(EventBatch(0.0, [stored(salt, srv.tolist())]))))
    fill_s = time.perf_counter() - t0
    gc.collect()
    entries = sum(index.num_blocks_by_endpoint().values())
    rss = _rss_bytes() - rss0
    shared_hashes = np.array([router_hashes(f"s{c}") for c in range(min(num_shared, 64))], dtype=np.uint64)
    own_chains = {ep: np.array([router_hashes(s) for s in salts], dtype=np.uint64) for ep, salts in own_salts.items()}

    # Ingestion ring: batch k stores chain k and removes chain k - RING/2; every endpoint starts half-way.
    nb = args.blocks_per_batch
    ring_server = rng.integers(1, 1 << 62, (RING, nb)).tolist()
    ring = [encode_batch(EventBatch(0.0, [stored(f"r{k}", ring_server[k], nb),
                                          BlockRemoved(ring_server[(k - RING // 2) % RING], "GPU")]))
            for k in range(RING)]
    for s in eps:
        for k in range(RING // 2):
            index.apply_batch(s.endpoint, decode_batch(ring[k]))

    def request(hashes: list[int]) -> InferenceRequest:
        return InferenceRequest(kind="chat", path="/v1/chat/completions", model="m", stream=True,
                                block_hashes=hashes, num_prompt_chars=len(hashes) * 4 * BS,
                                num_prompt_tokens=len(hashes) * BS)

    out = _decisions(core, eps, in_flight, shared_hashes, own_chains, request, entries, rss, fill_s, n, blocks, args)
    # Ingestion rate on the full index (decode included), each endpoint continuing its ring.
    ep_ids = [s.endpoint for s in eps]
    pos = dict.fromkeys(ep_ids, RING // 2)
    chunk = args.chunk_blocks
    num_blocks = 0
    gc.disable()
    t0 = time.perf_counter()
    k = 0
    stretch = []  # loop time held between two yields (decode included): what a decision can wait behind
    t1 = t0
    while t1 - t0 < args.ingest_s:
        ep = ep_ids[k % n]
        batch = decode_batch(ring[pos[ep] % RING])
        pos[ep] += 1
        for m in index.apply_events(ep, batch.events, chunk):
            num_blocks += m
            t2 = time.perf_counter()
            stretch.append((t2 - t1) * 1e6)
            t1 = t2
        k += 1
    dt = t1 - t0
    gc.enable()
    counters = [index.counters(ep) for ep in ep_ids]
    out["ingest_check"] = {f: sum(getattr(c, f) for c in counters) for f in
                           ("num_stored_blocks", "num_removed_blocks", "num_unknown_removed_blocks", "num_orphan_blocks")}
    out["ingest_blocks_per_s"] = round(num_blocks / dt)
    out["ingest_batches_per_s"] = round(k / dt)
    out["ingest_stretch_p50_us"] = round(_pct(stretch, 0.5), 1)
    out["ingest_stretch_p99_us"] = round(_pct(stretch, 0.99), 1)
    out.update(_under_events(core, eps, in_flight, request, shared_hashes, own_chains, ring, pos, index, args))
    return out


def _queries(shared, own_chains, rng: random.Random, num: int, kinds: list[str] | None = None) -> list[list[int]]:
    """Prompt block hashes: 40% a shared chain (whole or a leading part), 40% an endpoint's own chain, 20% cold
    (each query's kind appended to `kinds` when given)."""
    own = [c for chains in own_chains.values() for c in chains]
    out = []
    for _ in range(num):
        r = rng.random()
        n = rng.choice((CHAIN_BLOCKS, CHAIN_BLOCKS // 2, CHAIN_BLOCKS + 16))
        if r < 0.4:
            kind, base = "shared", shared[rng.randrange(len(shared))].tolist()
        elif r < 0.8:
            kind, base = "own", own[rng.randrange(len(own))].tolist()
        else:
            kind, base = "cold", [rng.getrandbits(63)]
        base = base[:n]
        out.append(base + [rng.getrandbits(63) for _ in range(n - len(base))])
        if kinds is not None:
            kinds.append(kind)
    return out


def _decisions(core, eps, in_flight, shared, own_chains, request, entries, rss, fill_s, n, blocks, args) -> dict:
    rng = random.Random(3)
    kinds: list[str] = []
    queries = [request(q) for q in _queries(shared, own_chains, rng, args.decisions, kinds)]
    holders = [len(core.sourced.match(q.block_hashes)) for q in queries]  # before routing records anything
    for q in queries[:50]:  # warm the scheduler's memo tables
        core.route(q, eps, in_flight)
    lat = []
    gc.disable()
    try:
        for q in queries:
            t0 = time.perf_counter_ns()
            core.route(q, eps, in_flight)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
    finally:
        gc.enable()
    return {"endpoints": n, "blocks_per_endpoint": blocks, "entries": entries, "rss_growth_mb": round(rss / 2**20),
            "bytes_per_entry": round(rss / max(1, entries), 1), "fill_s": round(fill_s, 1),
            "decision_p50_us": round(_pct(lat, 0.5), 1), "decision_p99_us": round(_pct(lat, 0.99), 1),
            "by_query": {k: {"num": sum(1 for x in kinds if x == k),
                             "mean_holders": round(statistics.fmean(h for h, x in zip(holders, kinds) if x == k), 2),
                             "p50_us": round(_pct([t for t, x in zip(lat, kinds) if x == k], 0.5), 1),
                             "p99_us": round(_pct([t for t, x in zip(lat, kinds) if x == k], 0.99), 1)}
                         for k in ("shared", "own", "cold")}}


def _under_events(core, eps, in_flight, request, shared, own_chains, ring, pos, index, args) -> dict:
    """Decision latency from its scheduled time with and without ingestion, phases alternating."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        loop_factory = asyncio.new_event_loop
    rng = random.Random(4)
    ep_ids = [s.endpoint for s in eps]
    offered_per_s = args.batches_per_s_per_endpoint * len(ep_ids)
    lat: dict[str, list[float]] = {"idle": [], "events": []}
    applied = {"batches": 0, "seconds": 0.0}

    async def phase(name: str) -> None:
        stop = time.perf_counter() + args.seconds
        queries = [request(q) for q in _queries(shared, own_chains, rng, int(args.decisions_per_s * args.seconds * 2))]

        async def ingest() -> None:
            interval = 1.0 / offered_per_s
            nxt = start = time.perf_counter()
            k = 0
            while time.perf_counter() < stop:
                ep = ep_ids[k % len(ep_ids)]
                batch = decode_batch_(ring[pos[ep] % RING])
                pos[ep] += 1
                for _ in index.apply_events(ep, batch.events, args.chunk_blocks):
                    await asyncio.sleep(0)
                k += 1
                nxt += interval
                delay = nxt - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            applied["batches"] += k
            applied["seconds"] += time.perf_counter() - start

        async def decide() -> None:
            nxt = time.perf_counter()
            i = 0
            while True:
                nxt += rng.expovariate(args.decisions_per_s)
                if nxt >= stop:
                    return
                # Sleep to just before the arrival, then yield until it (timers have ~1 ms resolution): the
                # decision waits for whatever the loop runs at its arrival, as a request from Envoy would.
                early = nxt - time.perf_counter() - 0.005
                if early > 0:
                    await asyncio.sleep(early)
                while time.perf_counter() < nxt:
                    await asyncio.sleep(0)
                core.route(queries[i % len(queries)], eps, in_flight)
                i += 1
                lat[name].append((time.perf_counter() - nxt) * 1e6)

        await asyncio.gather(decide(), *([ingest()] if name == "events" else []))

    from prefixroute.kv_events_wire import decode_batch as decode_batch_
    # The router's collector settings (extproc/cli.py): what exists at start-up is frozen, young objects are
    # collected less often. The longest collection of each phase is reported: a pause every decision then waiting.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)
    gc_max_ms = {"idle": 0.0, "events": 0.0}
    gc_start = [0.0]
    current = ["idle"]

    def on_gc(stage: str, info: dict) -> None:
        if stage == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_max_ms[current[0]] = max(gc_max_ms[current[0]], (time.perf_counter() - gc_start[0]) * 1e3)

    gc.callbacks.append(on_gc)
    loop = loop_factory()
    try:
        for _ in range(args.rounds):
            for name in ("idle", "events"):
                current[0] = name
                loop.run_until_complete(phase(name))
    finally:
        loop.close()
        gc.callbacks.remove(on_gc)
    kept = applied["batches"] / max(1e-9, applied["seconds"]) / offered_per_s
    return {"offered_batches_per_s": round(offered_per_s), "kept_up_ratio": round(min(kept, 9.99), 3),
            "idle_p50_us": round(_pct(lat["idle"], 0.5), 1), "idle_p99_us": round(_pct(lat["idle"], 0.99), 1),
            "events_p50_us": round(_pct(lat["events"], 0.5), 1), "events_p99_us": round(_pct(lat["events"], 0.99), 1),
            "idle_gc_max_ms": round(gc_max_ms["idle"], 1), "events_gc_max_ms": round(gc_max_ms["events"], 1),
            "p99_ratio_events_over_idle": round(_pct(lat["events"], 0.99) / _pct(lat["idle"], 0.99), 2)}


def _one(args: argparse.Namespace) -> None:
    kind, n, blocks = args.one
    fn = {"own": _own, "events": _events}[kind]
    out = fn(int(n), int(blocks), args)
    out["kind"] = kind
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", default="64,256,1024", help="comma-separated pool sizes")
    parser.add_argument("--blocks", type=int, default=31250, help="blocks each endpoint holds")
    parser.add_argument("--kinds", default="own,events", help="index kinds: own, events")
    parser.add_argument("--max-gb", type=float, default=6.0,
                        help="largest index to build; beyond it fewer blocks per endpoint (shared machine)")
    parser.add_argument("--decisions", type=int, default=2000, help="decisions timed per configuration")
    parser.add_argument("--ingest-s", type=float, default=3.0, help="seconds of back-to-back ingestion timed")
    parser.add_argument("--blocks-per-batch", type=int, default=32,
                        help="blocks stored (and as many removed) per event batch")
    parser.add_argument("--batches-per-s-per-endpoint", type=float, default=10.0,
                        help="event batches each endpoint publishes per second (10 x 32 blocks x 16 tokens = "
                             "5,120 new prompt tokens/s: a busy server at 5 requests/s with ~1,000 uncached tokens)")
    parser.add_argument("--decisions-per-s", type=float, default=500.0)
    parser.add_argument("--chunk-blocks", type=int, default=64, help="blocks applied between yields (subscriber's)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per idle / events phase")
    parser.add_argument("--rounds", type=int, default=2, help="idle / events phase pairs")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "ENDPOINTS", "BLOCKS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        _one(args)
        return 0
    rows = []
    for kind in args.kinds.split(","):
        for n in (int(x) for x in args.endpoints.split(",")):
            blocks = args.blocks
            if n * blocks * BYTES_PER_ENTRY_GUESS[kind] > args.max_gb * 2**30:
                blocks = int(args.max_gb * 2**30 / BYTES_PER_ENTRY_GUESS[kind] / n) // CHAIN_BLOCKS * CHAIN_BLOCKS
            cmd = [sys.executable, "-m", "prefixroute.bench.index_scale", "--one", kind, str(n), str(blocks)]
            cmd += [a for a in (argv if argv is not None else sys.argv[1:])]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                print(res.stderr, file=sys.stderr)
                return res.returncode
            row = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"{'kind':>6} {'endpoints':>9} {'blocks/ep':>9} {'entries':>11} {'B/entry':>8} {'p50 us':>7} {'p99 us':>7} "
          f"{'ingest blk/s':>12} {'idle p99':>8} {'events p99':>10} {'ratio':>6} {'kept up':>7}")
    for r in rows:
        print(f"{r['kind']:>6} {r['endpoints']:>9} {r['blocks_per_endpoint']:>9} {r['entries']:>11,} "
              f"{r['bytes_per_entry']:>8} {r['decision_p50_us']:>7} {r['decision_p99_us']:>7} "
              f"{r.get('ingest_blocks_per_s', '-'):>12} {r.get('idle_p99_us', '-'):>8} {r.get('events_p99_us', '-'):>10} "
              f"{r.get('p99_ratio_events_over_idle', '-'):>6} {r.get('kept_up_ratio', '-'):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

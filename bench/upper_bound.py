"""The workload's prefix-reuse upper bounds: one infinite cache, and Belady's MIN at the fleet's KV capacity.

Replays the requests in order through a single, never-evicting set of block hashes, with the same
accounting as the simulated model servers (and vLLM): prompts are rendered with the servers' chat
template and tokenizer (`prefixroute.model_servers.tokenizer`), cut into 16-token blocks, chained-hashed;
a request's hit is its leading blocks already in the set, capped so at least one prompt token is
computed (vLLM recomputes the last token of a fully cached prompt); then all its full prompt blocks are
added. Generated tokens are not added: the workloads resend synthetic answers, not the servers' text.

No router can beat this figure on the same request sequence: any real fleet splits and evicts the cache.

Capacity-aware bound (`replay_belady`, `capacity_bound`): the same block reference sequence (every request's
full prompt blocks, in send order, each request's blocks in chain order) replayed through ONE cache of the
fleet's total KV capacity ``C = num_servers x num_gpu_blocks`` blocks, evicting by Belady's MIN (on a miss with
the cache full, evict the cached block whose next reference is farthest in the future; never again = farthest;
which of several dead blocks goes first changes nothing, they are never referenced again). The exact model bounded, and why it is an upper bound on every router
in front of servers that evict by LRU (or by anything else):

1. A fleet request's hit counts the *leading* blocks its server holds (capped at n - 1 tokens). Each of those
   blocks is in the *union* of the servers' caches at that moment, so the fleet's hits are at most the number
   of the request's blocks present in the union (in any position: not only leading ones).
2. The union holds at most C distinct blocks (duplicates on two servers only waste room), and after a request
   runs, all its blocks are in it (its server computed and held them). So the union evolves like a cache of
   C blocks serving the flat reference sequence, with some eviction and even prefetching policy (a server
   may hold generated-token blocks too; they only take room).
3. Belady's MIN has the fewest misses of any such policy on the flat sequence, prefetching ones included (any
   policy can be made demand-paging without adding misses), so its count of *present* blocks (`cached_tokens`)
   bounds every fleet's cached tokens. That is the figure reported as the bound (``hit_ratio``); its count of
   *leading* present blocks (`leading_cached_tokens`) is reported too, for information: with chained hashes a
   block's ancestors are always referenced before it, so MIN almost never keeps a child without its parent and
   the two figures nearly agree.

Scope: the bound is over the *send order*. A real fleet looks requests up in the order they reach the
engines: overlapping requests can only lose hits by that (a request arriving while another still prefills
the same prefix misses it), but a router that reorders requests (queues) is in principle bounded by MIN of
its own order, which can differ slightly. No router can beat min(infinite-cache bound, MIN bound); the
report shows both. Generated tokens are not referenced (the workloads resend synthetic answers). Cost:
O(total blocks x log C) with a heap of next-use positions (lazy deletion, compacted at 2 C entries).

`replay_lru` replays the same sequence through one LRU cache of C blocks (leading hits, capped like a
server): what a perfectly pooled fleet would reach with the servers' own eviction. Not a bound on routers
(a router's partition can beat LRU-on-the-pool); a reference point between the fleet and MIN.

Pure functions of the workload; no I/O.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import xxhash

from prefixroute.bench.workload_spec import CHARS_PER_TOKEN, RequestSpec, Workload

CACHE_BLOCK_TOKENS = 16
"""vLLM's default KV block size; the simulated servers cache in blocks of the same size."""

_xxh3 = xxhash.xxh3_64_intdigest

try:  # The model servers' tokenizer and chat template, so the bound matches the servers' accounting.
    from prefixroute.model_servers.tokenizer import encode as _encode, render_chat as _render_chat
    TOKENIZER = "prefixroute.model_servers.tokenizer"
except ImportError:  # pragma: no cover - only when the model-server package is absent
    _encode = None
    _render_chat = None
    TOKENIZER = "approx-4-chars"


def prompt_token_ids(req: RequestSpec) -> np.ndarray:
    """The prompt token ids a simulated server would compute for `req` (template + tools + tokenizer)."""
    if req.messages is not None:
        # Tools render into the system text, as the servers' chat template does (agents workload).
        text = (_render_chat([dict(m) for m in req.messages], tools=[dict(t) for t in req.tools or ()] or None)
                if _render_chat is not None
                else "".join(m["role"] + ":" + str(m.get("content") or "") for m in req.messages))
    else:
        text = req.prompt or ""
    if _encode is not None:
        return _encode(text)
    raw = text.encode("utf-8")
    raw += b"\0" * (-len(raw) % CHARS_PER_TOKEN)
    return np.frombuffer(raw, dtype="<u4").astype(np.int64)


def chained_block_hashes(tokens: np.ndarray, block_tokens: int = CACHE_BLOCK_TOKENS) -> list[int]:
    """Chained xxh3-64 of each full block of token ids (a hash names the whole prefix up to its block)."""
    n = len(tokens) // block_tokens
    data = np.ascontiguousarray(tokens[: n * block_tokens], dtype="<i8").tobytes()
    step = block_tokens * 8
    out = []
    h = 0
    for start in range(0, n * step, step):
        h = _xxh3(data[start:start + step], h)
        out.append(h)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class UpperBound:
    """Totals of the infinite-cache replay; hit_ratio = cached prompt tokens / prompt tokens (0 if none)."""

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    block_tokens: int
    tokenizer: str

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_infinite_cache(token_lists: Iterable[np.ndarray],
                          block_tokens: int = CACHE_BLOCK_TOKENS) -> Iterator[tuple[int, int]]:
    """Yield (prompt_tokens, cached_tokens) per request through one never-evicting prefix cache."""
    seen: set[int] = set()
    for tokens in token_lists:
        hashes = chained_block_hashes(tokens, block_tokens)
        n = len(tokens)
        matched = 0
        for h in hashes:
            if h not in seen:
                break
            matched += 1
        # At least one token must be computed to produce logits: cap the hit at n - 1 tokens (in blocks).
        matched = min(matched, max(0, (n - 1) // block_tokens))
        seen.update(hashes)
        yield n, matched * block_tokens


def upper_bound(workload: Workload, block_tokens: int = CACHE_BLOCK_TOKENS) -> UpperBound:
    """The infinite-cache hit ratio of the workload's request sequence, in send order."""
    total = cached = 0
    for n, c in replay_infinite_cache((prompt_token_ids(r) for r in workload.requests), block_tokens):
        total += n
        cached += c
    return UpperBound(len(workload.requests), total, cached, block_tokens, TOKENIZER)


# ------------------------------------------------------------------------------------- capacity-aware bound


@dataclasses.dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request of the replayed sequence: its prompt length in tokens and its chained full-block hashes."""

    num_tokens: int
    hashes: tuple[int, ...]


def request_blocks(workload: Workload, block_tokens: int = CACHE_BLOCK_TOKENS) -> list[RequestBlocks]:
    """Every request's prompt length and block hashes, in send order (tokenizing is the expensive part: compute
    once, replay through as many caches as needed)."""
    out = []
    for r in workload.requests:
        tokens = prompt_token_ids(r)
        out.append(RequestBlocks(len(tokens), tuple(chained_block_hashes(tokens, block_tokens))))
    return out


def _cap_blocks(num_tokens: int, block_tokens: int) -> int:
    # At least one token must be computed to produce logits (vLLM recomputes the last token of a cached prompt).
    return max(0, (num_tokens - 1) // block_tokens)


def replay_belady(requests: Sequence[RequestBlocks], capacity_blocks: int,
                  block_tokens: int = CACHE_BLOCK_TOKENS) -> Iterator[tuple[int, int, int]]:
    """Yield (prompt_tokens, present_tokens, leading_tokens) per request through one cache of `capacity_blocks`
    blocks under Belady's MIN (see module doc for the model and why `present_tokens` summed is an upper bound).

    present = the request's blocks found cached when referenced (any position, uncapped); leading = the
    consecutive found blocks from its first one, capped at n - 1 tokens like a server's hit.
    """
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    # Flatten to integer ids; next_use[p] = position of the next reference of the same block (never = inf).
    ids: dict[int, int] = {}
    flat: list[int] = []
    for req in requests:
        for h in req.hashes:
            flat.append(ids.setdefault(h, len(ids)))
    inf = len(flat)
    next_use = [inf] * len(flat)
    last: dict[int, int] = {}
    for p in range(len(flat) - 1, -1, -1):
        x = flat[p]
        next_use[p] = last.get(x, inf)
        last[x] = p
    cached: dict[int, int] = {}  # block id -> the position of its next reference (its eviction key)
    # Max-heap of next uses (negated). A hit re-keys its block; the old entry (a past position) then ranks below
    # every live one, and is skipped if it ever surfaces.
    heap: list[tuple[int, int]] = []
    compact_at = 2 * capacity_blocks + 1024
    p = 0
    for req in requests:
        present = leading = 0
        in_lead = True
        for _ in req.hashes:
            x, nxt = flat[p], next_use[p]
            p += 1
            if x in cached:
                present += 1
                leading += in_lead
            else:
                in_lead = False
                if len(cached) >= capacity_blocks:
                    while True:
                        neg_next, victim = heapq.heappop(heap)
                        if cached.get(victim) == -neg_next:
                            del cached[victim]
                            break
            cached[x] = nxt
            heapq.heappush(heap, (-nxt, x))
            if len(heap) > compact_at:
                heap = [e for e in heap if cached.get(e[1]) == -e[0]]
                heapq.heapify(heap)
        yield req.num_tokens, present * block_tokens, min(leading, _cap_blocks(req.num_tokens, block_tokens)) * block_tokens


def replay_lru(requests: Sequence[RequestBlocks], capacity_blocks: int,
               block_tokens: int = CACHE_BLOCK_TOKENS) -> Iterator[tuple[int, int]]:
    """Yield (prompt_tokens, cached_tokens) per request through one LRU cache of `capacity_blocks` blocks with a
    server's accounting: leading blocks found, capped at n - 1 tokens; then every block of the request becomes
    the most recently used (a chain longer than the cache keeps its last blocks)."""
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    for req in requests:
        matched = 0
        for h in req.hashes:
            if h not in lru:
                break
            matched += 1
        for h in req.hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if len(lru) > capacity_blocks:
                    lru.popitem(last=False)
        yield req.num_tokens, min(matched, _cap_blocks(req.num_tokens, block_tokens)) * block_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class CapacityBound:
    """Belady MIN (and LRU) replays at one capacity. ``hit_ratio`` (MIN, present blocks) is the upper bound;
    ``leading_hit_ratio`` and ``lru_hit_ratio`` are for information (module doc)."""

    capacity_blocks: int
    block_tokens: int
    prompt_tokens: int
    cached_tokens: int
    leading_cached_tokens: int
    lru_cached_tokens: int

    def _ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_ratio(self) -> float:
        return self._ratio(self.cached_tokens)

    @property
    def leading_hit_ratio(self) -> float:
        return self._ratio(self.leading_cached_tokens)

    @property
    def lru_hit_ratio(self) -> float:
        return self._ratio(self.lru_cached_tokens)


def capacity_bound(requests: Sequence[RequestBlocks], capacity_blocks: int,
                   block_tokens: int = CACHE_BLOCK_TOKENS) -> CapacityBound:
    """MIN and LRU totals of `requests` on one cache of `capacity_blocks` blocks."""
    total = present = leading = 0
    for n, c, lead in replay_belady(requests, capacity_blocks, block_tokens):
        total += n
        present += c
        leading += lead
    lru = sum(c for _, c in replay_lru(requests, capacity_blocks, block_tokens))
    return CapacityBound(capacity_blocks, block_tokens, total, present, leading, lru)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkingSet:
    """Distinct blocks of the request sequence: all of them, and those referenced by two requests or more (the
    part worth caching; one-off blocks such as unique questions only pass through)."""

    distinct_blocks: int
    shared_blocks: int


def working_set(requests: Sequence[RequestBlocks]) -> WorkingSet:
    counts: collections.Counter[int] = collections.Counter()
    for req in requests:
        counts.update(set(req.hashes))
    return WorkingSet(len(counts), sum(1 for c in counts.values() if c >= 2))


def gpu_blocks_for(workload: Workload, num_servers: int, kv_ratio: float = 0.5,
                   block_tokens: int = CACHE_BLOCK_TOKENS) -> int:
    """--num-gpu-blocks per server so that `num_servers` servers hold `kv_ratio` of the workload's shared working
    set (blocks referenced by two requests or more; `working_set`), but at least one longest prompt (a server
    must fit every request it is sent)."""
    if num_servers < 1 or not kv_ratio > 0:
        raise ValueError(f"num_servers must be >= 1 and kv_ratio > 0; got {num_servers}, {kv_ratio}")
    reqs = request_blocks(workload, block_tokens)
    longest = max((-(-r.num_tokens // block_tokens) + 1 for r in reqs), default=1)
    return max(longest, round(working_set(reqs).shared_blocks * kv_ratio / num_servers))


def fleet_bounds(workload: Workload, num_servers: int, profile: str = "",
                 server_args: Sequence[str] = ()) -> dict:
    """The report's bounds for `workload` on `num_servers` simulated servers started with `profile` and
    `server_args`: a JSON-able dict (results.json ``bounds``).

    Keys: block_tokens, num_gpu_blocks and its source ("--num-gpu-blocks" in the server args or "profile
    default"), capacity_blocks (num_servers x num_gpu_blocks), working_set_blocks / shared_working_set_blocks,
    capacity_over_working_set, infinite_cache_hit_ratio, belady_hit_ratio (MIN at capacity_blocks: the
    capacity-aware upper bound), belady_leading_hit_ratio, lru_pooled_hit_ratio, and note. When the servers'
    capacity is unknown (flags this fleet's spec cannot parse) the capacity figures are None and note says why.
    With a CPU tier (``--kv-offloading-size`` in the server args): num_cpu_blocks per server,
    gpu_cpu_capacity_blocks = num_servers x (num_gpu_blocks + num_cpu_blocks), belady_gpu_cpu_hit_ratio (MIN
    at that capacity: a bound on any router in front of tiered servers, CPU-tier hits counted as hits) and
    lru_pooled_gpu_cpu_hit_ratio (one pooled LRU of that size); None without a tier.
    """
    from prefixroute.bench.virtual_run import engine_spec

    note = ""
    try:
        spec = engine_spec(profile, tuple(server_args), allow_unsimulated=True)
        num_gpu_blocks: int | None = spec.config.num_gpu_blocks
        num_cpu_blocks = spec.config.num_cpu_blocks
        block_tokens = spec.config.block_size
    except ValueError as exc:
        num_gpu_blocks, num_cpu_blocks, block_tokens = None, 0, CACHE_BLOCK_TOKENS
        note = f"KV capacity unknown, capacity bound skipped: {exc}"
    source = ("--num-gpu-blocks" if any(a.startswith("--num-gpu-blocks") for a in server_args)
              else "profile default")
    reqs = request_blocks(workload, block_tokens)
    total = sum(r.num_tokens for r in reqs)
    inf_cached = sum(c for _, c in replay_infinite_cache_blocks(reqs, block_tokens))
    ws = working_set(reqs)
    out: dict = {"block_tokens": block_tokens, "num_servers": num_servers,
                 "num_gpu_blocks": num_gpu_blocks, "num_gpu_blocks_source": source if num_gpu_blocks else None,
                 "capacity_blocks": None, "working_set_blocks": ws.distinct_blocks,
                 "shared_working_set_blocks": ws.shared_blocks, "capacity_over_working_set": None,
                 "infinite_cache_hit_ratio": round(inf_cached / total, 6) if total else 0.0,
                 "belady_hit_ratio": None, "belady_leading_hit_ratio": None, "lru_pooled_hit_ratio": None,
                 "num_cpu_blocks": num_cpu_blocks or None, "gpu_cpu_capacity_blocks": None,
                 "belady_gpu_cpu_hit_ratio": None, "lru_pooled_gpu_cpu_hit_ratio": None,
                 "tokenizer": TOKENIZER, "note": note}
    if num_gpu_blocks:
        cap = num_servers * num_gpu_blocks
        b = capacity_bound(reqs, cap, block_tokens)
        out.update(capacity_blocks=cap,
                   capacity_over_working_set=round(cap / ws.distinct_blocks, 4) if ws.distinct_blocks else None,
                   belady_hit_ratio=round(min(b.hit_ratio, out["infinite_cache_hit_ratio"]), 6),
                   belady_leading_hit_ratio=round(b.leading_hit_ratio, 6),
                   lru_pooled_hit_ratio=round(b.lru_hit_ratio, 6))
        if num_cpu_blocks:
            cap2 = num_servers * (num_gpu_blocks + num_cpu_blocks)
            b2 = capacity_bound(reqs, cap2, block_tokens)
            out.update(gpu_cpu_capacity_blocks=cap2,
                       belady_gpu_cpu_hit_ratio=round(min(b2.hit_ratio, out["infinite_cache_hit_ratio"]), 6),
                       lru_pooled_gpu_cpu_hit_ratio=round(b2.lru_hit_ratio, 6))
    return out


def replay_infinite_cache_blocks(requests: Sequence[RequestBlocks],
                                 block_tokens: int = CACHE_BLOCK_TOKENS) -> Iterator[tuple[int, int]]:
    """`replay_infinite_cache` over precomputed `RequestBlocks` (same figures)."""
    seen: set[int] = set()
    for req in requests:
        matched = 0
        for h in req.hashes:
            if h not in seen:
                break
            matched += 1
        seen.update(req.hashes)
        yield req.num_tokens, min(matched, _cap_blocks(req.num_tokens, block_tokens)) * block_tokens

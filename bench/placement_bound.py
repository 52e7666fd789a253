"""What placement alone can do under cache pressure: a request sequence through S per-server LRU caches, each
request's new blocks placed by a strategy, no queues and no time.

The servers evict by LRU; a router decides only *where* each request goes. A request whose prompt a server
holds for at least `SIGNIFICANT_RATIO` of its blocks goes to the server holding most of it (affinity: moving it
would cost its whole prefill); any other request is *placed*, and the strategies differ only there:

- ``rendezvous``: by a hash of its prefix (what the router does on an idle fleet);
- ``victims``: where its new blocks evict the least reuse value, the blocks' uses counted by the router's own
  count-min sketch (`routing.scheduling.placement`, the ``placement_victims=all`` pricing without the time
  model's load);
- ``future``: where the victims' next uses are farthest (each victim priced 1 / requests until its next use):
  a placement that knows the future, so an estimate of the most any placement of new prefixes can give;
- ``probation``: segments across servers, as SLRU segments one cache: server 0 takes every prefix seen for the
  first time; a prefix seen before goes to the other servers (priced as ``victims``) even when server 0 holds it
  (promotion: one more prefill, so the others keep only prefixes used twice or more). Four servers or more;
- ``admission``: TinyLFU's admission rule across servers: a prefix the main servers (all but 0) do not hold goes
  to the one its blocks would evict least from when its own use count is at least its victims' mean count, else
  to server 0 (which also keeps the first-time prefixes it holds). Four servers or more;
- ``static-top``: no placement at all but a bound of another kind: the fleet's capacity filled once with the
  prefixes used most in the whole sequence (hindsight counts), each hit after its first use; what perfect
  popularity knowledge would give a frequency-based (LFU-like) cache.

Beside them, the report's bounds: one pooled LRU of the fleet's capacity and Belady's MIN. Hit ratio = cached
prompt tokens / prompt tokens, a server's accounting (leading blocks, capped at n - 1 tokens).

    python -m prefixroute.bench.placement_bound --servers 4 --num-gpu-blocks 2498      # capacity-pressure
    python -m prefixroute.bench.placement_bound --num-groups 96 --min-prefix-tokens 6144 --max-prefix-tokens 6144 \\
        --zipf-s 0 --num-requests 576 --num-gpu-blocks 2304

Pure computation, a few seconds; prints a table.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from prefixroute.bench import upper_bound as ub
from prefixroute.bench.workloads import capacity_pressure
from prefixroute.extproc.routing.scheduling.placement import REUSE_MAX_COUNT, FrequencySketch

SIGNIFICANT_RATIO = 0.3  # as the router's scorer (scorers.SIGNIFICANT_MATCH_RATIO)
Choose = Callable[[int, ub.RequestBlocks, list[collections.OrderedDict]], int]


def _match(lru: collections.OrderedDict, hashes: Sequence[int]) -> int:
    return sum(1 for _ in itertools.takewhile(lru.__contains__, hashes))


Route = Callable[[int, ub.RequestBlocks, list[collections.OrderedDict], list[int]], int]


def replay(requests: Sequence[ub.RequestBlocks], num_servers: int, capacity_blocks: int, place: Choose,
           observe: Callable[[ub.RequestBlocks], None] = lambda r: None,
           route: Route | None = None) -> tuple[float, list[int]]:
    """(hit ratio, requests per server) of `requests` through `num_servers` LRU caches of `capacity_blocks`
    blocks, affinity first (module docstring), `place` for the rest; `observe` sees each request after its
    choice. `route`, when given, chooses every request instead (from the caches and each one's leading blocks
    held): a strategy that overrides affinity. A request's blocks become the most recently used, its first block
    last (vLLM frees tail first)."""
    caches: list[collections.OrderedDict] = [collections.OrderedDict() for _ in range(num_servers)]
    counts = [0] * num_servers
    total = cached = 0
    for t, r in enumerate(requests):
        ms = [_match(c, r.hashes) for c in caches]
        best = max(ms)
        if route is not None:
            i = route(t, r, caches, ms)
        else:
            i = ms.index(best) if best and best >= SIGNIFICANT_RATIO * len(r.hashes) else place(t, r, caches)
        observe(r)
        counts[i] += 1
        lru = caches[i]
        for h in reversed(r.hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
        total += r.num_tokens
        cached += min(ms[i], ub._cap_blocks(r.num_tokens, ub.CACHE_BLOCK_TOKENS)) * ub.CACHE_BLOCK_TOKENS
    return (cached / total if total else 0.0), counts


def _victims(lru: collections.OrderedDict, r: ub.RequestBlocks, capacity_blocks: int) -> list[int]:
    need = len(r.hashes) - _match(lru, r.hashes)
    k = len(lru) + need - capacity_blocks
    if k <= 0:
        return []
    own = set(r.hashes)
    return [h for h in itertools.islice(lru, k + len(r.hashes)) if h not in own][:k]


def strategies(requests: Sequence[ub.RequestBlocks], num_servers: int, capacity_blocks: int,
               ) -> dict[str, tuple[float, list[int]]]:
    """Every strategy of the module docstring but static-top: name -> (hit ratio, requests per server)."""
    def key_of(r: ub.RequestBlocks) -> int:
        return r.hashes[min(len(r.hashes) - 1, 8)]

    out = {"rendezvous": replay(requests, num_servers, capacity_blocks,
                                lambda t, r, cs: hash(key_of(r)) % num_servers)}
    sketch = FrequencySketch()

    def by_value(t: int, r: ub.RequestBlocks, caches: list) -> int:
        def cost(j: int) -> float:
            v = _victims(caches[j], r, capacity_blocks)
            return float(np.minimum(sketch.estimate(v), REUSE_MAX_COUNT).sum()) if v else 0.0
        return min(range(num_servers), key=lambda j: (cost(j), (hash(key_of(r)) + j) % num_servers))
    out["victims"] = replay(requests, num_servers, capacity_blocks, by_value, lambda r: sketch.add(r.hashes))
    if num_servers >= 4:
        for name in ("probation", "admission"):
            out[name] = _segmented(requests, num_servers, capacity_blocks, key_of, admission=name == "admission")

    uses: dict[int, list[int]] = collections.defaultdict(list)
    for t, r in enumerate(requests):
        for h in r.hashes:
            uses[h].append(t)

    def by_future(t: int, r: ub.RequestBlocks, caches: list) -> int:
        def cost(j: int) -> float:
            c = 0.0
            for h in _victims(caches[j], r, capacity_blocks):
                p = uses[h]
                i = bisect.bisect_right(p, t)
                if i < len(p):
                    c += 1.0 / (p[i] - t)
            return c
        return min(range(num_servers), key=cost)
    out["future"] = replay(requests, num_servers, capacity_blocks, by_future)
    return out


def _segmented(requests: Sequence[ub.RequestBlocks], num_servers: int, capacity_blocks: int,
               key_of: Callable[[ub.RequestBlocks], int], *, admission: bool) -> tuple[float, list[int]]:
    """``probation`` (`admission` False) or ``admission`` (module docstring): server 0 the probation segment, the
    others the main one, priced as ``victims`` with the same sketch; a prefix's use count is its key block's."""
    sketch = FrequencySketch()
    seen: collections.Counter[int] = collections.Counter()
    main = range(1, num_servers)

    def value(victims: list[int]) -> np.ndarray:
        return np.minimum(sketch.estimate(victims), REUSE_MAX_COUNT)

    def cheapest(r: ub.RequestBlocks, caches: list) -> int:
        def cost(j: int) -> float:
            v = _victims(caches[j], r, capacity_blocks)
            return float(value(v).sum()) if v else 0.0
        return min(main, key=lambda j: (cost(j), (hash(key_of(r)) + j) % num_servers))

    def route(t: int, r: ub.RequestBlocks, caches: list, ms: list[int]) -> int:
        significant = SIGNIFICANT_RATIO * len(r.hashes)
        held = max(main, key=ms.__getitem__)
        if ms[held] and ms[held] >= significant:
            return held
        uses = seen[key_of(r)]
        on_probation = ms[0] and ms[0] >= significant
        if not admission:
            return cheapest(r, caches) if uses else 0
        if on_probation and not uses:
            return 0
        j = cheapest(r, caches)
        v = _victims(caches[j], r, capacity_blocks)
        return j if not v or uses >= float(value(v).mean()) else 0

    def observe(r: ub.RequestBlocks) -> None:
        sketch.add(r.hashes)
        seen[key_of(r)] += 1

    return replay(requests, num_servers, capacity_blocks, lambda t, r, cs: 0, observe, route)


def static_top(requests: Sequence[ub.RequestBlocks], capacity_blocks: int) -> float:
    """The static-top bound (module docstring): prompts grouped by their middle block (the shared prefix); the
    groups with the most uses fill the capacity (each taking its first prompt's blocks); a later use of a kept
    group hits its leading blocks that earlier uses of the group had (capped at n - 1 tokens, a server's
    accounting)."""
    groups: dict[int, list[ub.RequestBlocks]] = collections.defaultdict(list)
    for r in requests:
        groups[r.hashes[len(r.hashes) // 2]].append(r)
    used = hit = 0
    bt = ub.CACHE_BLOCK_TOKENS
    for members in sorted(groups.values(), key=lambda m: -len(m)):
        size = len(members[0].hashes)
        if used + size > capacity_blocks:
            continue
        used += size
        seen: set[int] = set(members[0].hashes)
        for r in members[1:]:
            m = sum(1 for _ in itertools.takewhile(seen.__contains__, r.hashes))
            hit += min(m, ub._cap_blocks(r.num_tokens, bt)) * bt
            seen.update(r.hashes)
    total = sum(r.num_tokens for r in requests)
    return hit / total if total else 0.0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--num-gpu-blocks", type=int, default=2498, help="blocks per server")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--num-groups", type=int, default=128)
    p.add_argument("--min-prefix-tokens", type=int, default=2048)
    p.add_argument("--max-prefix-tokens", type=int, default=8192)
    p.add_argument("--zipf-s", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    wl = capacity_pressure(num_groups=a.num_groups, min_prefix_tokens=a.min_prefix_tokens,
                           max_prefix_tokens=a.max_prefix_tokens, zipf_s=a.zipf_s, num_requests=a.num_requests,
                           seed=a.seed)
    reqs = ub.request_blocks(wl)
    fleet = a.servers * a.num_gpu_blocks
    total = sum(r.num_tokens for r in reqs)
    lru = sum(c for _, c in ub.replay_lru(reqs, fleet)) / total
    mn = sum(c for _, c, _ in ub.replay_belady(reqs, fleet)) / total
    print(f"{len(reqs)} requests, {a.servers} servers x {a.num_gpu_blocks} blocks")
    print("| placement | hit ratio | share of the pooled-LRU-to-MIN gap | requests per server |")
    print("| --- | --- | --- | --- |")
    print(f"| one pooled LRU | {lru:.3f} | 0% | |")
    for name, (hit, counts) in strategies(reqs, a.servers, a.num_gpu_blocks).items():
        print(f"| {name} | {hit:.3f} | {(hit - lru) / (mn - lru):+.0%} | {counts} |")
    top = static_top(reqs, fleet)
    print(f"| static-top (hindsight counts) | {top:.3f} | {(top - lru) / (mn - lru):+.0%} | |")
    print(f"| Belady MIN | {mn:.3f} | 100% | |")


if __name__ == "__main__":
    main()

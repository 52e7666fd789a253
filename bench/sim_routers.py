"""Models of other routers for `prefixroute bench --virtual` (``sim:NAME``), run on the same requests as ours.

`SglangCacheAwareModel` is our model of sglang-router's ``cache_aware`` policy (written from its public
description, not their code); `OracleModel` is the limit no real router can be: it sees each simulated
server's true state. bench/virtual_run.py runs them by name (`SIM_ROUTERS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from prefixroute.extproc.routing.prefix_index import num_leading_held
from prefixroute.model_servers.virtual_fleet import SimRequest, VirtualFleet


class SglangCacheAwareModel:
    """OUR MODEL of sglang-router's ``cache_aware`` policy (field notes section 3), written from its public
    description, not their code, for side-by-side comparisons in virtual time:

    - each endpoint has a tree of the request texts sent to it (characters; here approximated by chained
      hashes of `block_chars`-character blocks, so matches are counted in whole blocks);
    - load = requests in flight on the endpoint (the router's own count); if ``max - min >
      balance_abs_threshold`` (64) and ``max > balance_rel_threshold x min`` (1.5), the least-loaded endpoint is
      chosen;
    - else, if the longest prefix match / text length > ``cache_threshold`` (0.3), the endpoint with the
      longest match; else the endpoint with the smallest tree (fewest characters stored);
    - the chosen endpoint's tree then gets the text. Ties go to the first endpoint in fleet order (the
      behaviour field notes section 5 reports at zero load). Trees are not evicted (theirs evict by size
      well beyond these runs' text volume).

    Text routed on (from the request body): the completion prompt, or the chat messages' contents joined by
    newlines (an assumption about their text extraction).
    """

    def __init__(self, endpoint_ids: Sequence[str], *, block_chars: int = 16, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5) -> None:
        self.endpoint_ids = list(endpoint_ids)
        self.block_chars = block_chars
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        # Per endpoint, the chained block hashes of every text sent there: the tree, as its prefix paths. A set,
        # not an LRU: nothing is evicted, and a text's hashes then go in as one C-level update.
        self.trees: dict[str, set[int]] = {ep: set() for ep in self.endpoint_ids}

    def match(self, hashes: Sequence[int]) -> list[int]:
        """Per endpoint (fleet order), how many leading blocks of `hashes` its tree holds (the trees are closed
        under prefixes: a chained hash names its whole prefix, recorded with it)."""
        return [num_leading_held(hashes, self.trees[ep]) for ep in self.endpoint_ids]

    @staticmethod
    def request_text(body: bytes) -> str:
        data = orjson.loads(body)
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            return prompt
        return "\n".join(str(m.get("content", "")) for m in data.get("messages") or ())

    def choose(self, text: str, in_flight: Sequence[int]) -> int:
        from prefixroute.extproc.routing.hashing import hash_blocks, seed_for

        hashes = hash_blocks(text, seed_for(None, None), self.block_chars, 1 << 30)
        lo, hi = min(in_flight), max(in_flight)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            i = in_flight.index(lo)
        else:
            matches = self.match(hashes)
            best = max(matches)
            if text and best * self.block_chars / len(text) > self.cache_threshold:
                i = matches.index(best)
            else:
                sizes = [len(self.trees[ep]) for ep in self.endpoint_ids]
                i = sizes.index(min(sizes))
        self.trees[self.endpoint_ids[i]].update(hashes)
        return i


class OracleModel:
    """A router no real one can be ("limit"): it sees each simulated server's true state. For each
    server: the true prefix-cache hit (`VirtualFleet.cached_prefix_tokens`) or the blocks it shares with a
    request still prefilling there (it will be cached first), whichever is longer; the true prefill tokens left
    of the requests there that have no first token yet; the decoding requests. It prices them with the
    server's own cost model (steps of ``max_num_batched_tokens`` tokens; each decoding request adds one
    sequence to each step) and picks the least score = true TTFT + `work_weight` x the request's own prefill
    seconds (the work it adds for later requests: with 0 it is greedy least-TTFT, which replicates every
    prefix under load; 2 = the ``prefix`` policy's default ``ttft_work_weight``, so the gap measures what the
    router does not know, not a different objective). Ties: longest true hit, then the first server.

    Greedy with true state, not a proven optimum: a better schedule might exist, so a policy may beat it at
    some points (the sweep then shows a negative gap)."""

    def __init__(self, fleet: VirtualFleet, *, work_weight: float = 2.0) -> None:
        self.fleet = fleet
        self.work_weight = work_weight
        cfg = fleet.spec.config
        self._chunk = cfg.max_num_batched_tokens
        self._scale = cfg.time_scale
        self._cost = fleet.engines[0].cost
        self._full_step_s = self._cost.prefill_time_s(self._chunk) * self._scale
        # Per server: block hash -> count of unfinished-prefill requests routed there carrying it.
        self._prefilling: list[dict[int, int]] = [{} for _ in fleet.engines]
        self._pending: dict[str, tuple[int, list[int]]] = {}
        self._own: dict[str, int] = {}  # request id -> uncached prompt tokens at its pick (until it ends)

    def _time_s(self, tokens: float, num_decoding: int) -> float:
        full, rest = divmod(max(tokens, 1.0), self._chunk)
        t = full * self._full_step_s + self._cost.prefill_time_s(int(rest) or 1) * self._scale
        steps = full + 1
        if num_decoding:  # each step also carries the decoding sequences: their marginal cost per step
            t += steps * (self._cost.decode_time_s(num_decoding + 1, 1024)
                          - self._cost.decode_time_s(1, 1024)) * self._scale
        return t

    def _settle(self) -> None:
        """Requests past their first token stop counting as prefilling (their blocks are in the cache)."""
        done = []
        for rid, (i, hashes) in self._pending.items():
            for r in self.fleet.engines[i].running:
                if r.request_id == rid and r.first_token_s is not None:
                    done.append(rid)
                    break
        for rid in done:
            self.forget(rid)

    def forget(self, request_id: str, *, ended: bool = False) -> None:
        if ended:
            self._own.pop(request_id, None)
        item = self._pending.pop(request_id, None)
        if item is None:
            return
        i, hashes = item
        pre = self._prefilling[i]
        for h in hashes:
            c = pre.get(h, 0) - 1
            if c > 0:
                pre[h] = c
            else:
                pre.pop(h, None)

    def choose(self, req: SimRequest) -> int:
        self._settle()
        fleet = self.fleet
        bs = fleet.block_size
        hits = fleet.cached_prefix_tokens(req)
        hashes = fleet._hashes(req)
        max_hit = (len(req.prompt_ids) - 1) // bs
        n_prompt = len(req.prompt_ids)
        best: tuple[float, int, int] | None = None
        for i, core in enumerate(fleet.engines):
            pre = self._prefilling[i]
            shared = 0
            if pre:
                for h in hashes[:max_hit]:
                    if h not in pre:
                        break
                    shared += 1
            cached = max(hits[i], shared * bs)
            own = n_prompt - cached
            queued = 0
            decoding = 0
            for r in core.running:
                if r.first_token_s is None:
                    queued += r.num_prompt_tokens - r.num_computed
                else:
                    decoding += 1
            own_of = self._own
            for r in core.waiting:  # not admitted yet: its hit was known at its pick
                queued += own_of.get(r.request_id, r.num_prompt_tokens)
            ttft = self._time_s(queued + own, decoding)
            score = ttft + self.work_weight * self._time_s(own, 0)
            key = (score, -cached, i, own)
            if best is None or key < best:
                best = key
        i = best[2]  # type: ignore[index]
        kept = hashes[:max_hit]
        pre = self._prefilling[i]
        for h in kept:
            pre[h] = pre.get(h, 0) + 1
        self._pending[req.request_id] = (i, kept)
        self._own[req.request_id] = best[3]  # type: ignore[index]
        return i


SIM_ROUTERS: dict[str, Callable[[Sequence[str]], Any]] = {
    "sim:sglang-cache-aware": SglangCacheAwareModel,
    "sim:oracle": OracleModel,
    "sim:oracle+flow": OracleModel,
}
"""Models of other routers that --virtual can run by name (``sim:NAME``). ``sim:oracle`` is built on the fleet
itself (`ORACLES`), the others on its endpoint ids."""

ORACLES = frozenset({"sim:oracle", "sim:oracle+flow"})
FLOW_SIM_ROUTERS = frozenset({"sim:oracle+flow"})
"""``sim:`` routers that run behind flow control (the gateway's queue with the oracle's true view)."""

"""Pickers: ordered endpoint lists (primary first, then fallbacks).

- `least_load_order`: fewest in flight, then fewest waiting, ties broken randomly with the injected
  `random.Random`, so idle endpoints share new work instead of the first one in configuration order taking
  all of it (the hot spot seen with other routers).
- `rendezvous_order`: highest-random-weight (HRW) hashing: weight(endpoint, key) = mix64(seed(endpoint) ^ key),
  seed = xxh3_64(endpoint id), mix64 = the splitmix64 finaliser (a bijection of 64-bit words). Deterministic
  across processes; removing an endpoint moves only the keys it ranked first, adding one takes about 1/N of
  the keys. `RendezvousTable` holds the seeds of one endpoint tuple in a numpy array so the weights of all
  endpoints are computed at C speed (a few microseconds for 256 endpoints instead of one Python call each).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import xxhash

from prefixroute.types import EndpointId, EndpointState

_xxh3 = xxhash.xxh3_64_intdigest
_encoded: dict[str, bytes] = {}


def _key_bytes(endpoint: EndpointId) -> bytes:
    b = _encoded.get(endpoint)
    if b is None:
        if len(_encoded) > 65536:  # endpoints churn over a long run; keep the cache bounded
            _encoded.clear()
        b = _encoded[endpoint] = endpoint.encode()
    return b


_MASK64 = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_UM1, _UM2 = np.uint64(_M1), np.uint64(_M2)


def endpoint_seed(endpoint: EndpointId) -> int:
    """The per-endpoint 64-bit rendezvous seed: xxh3_64 of the id (stable across processes)."""
    return _xxh3(_key_bytes(endpoint))


def hrw_weight(key: int, endpoint: EndpointId) -> int:
    """The rendezvous weight of `endpoint` for `key` (a 64-bit block hash), in [0, 2**64): the scalar twin of
    `RendezvousTable.weights` (same figures)."""
    x = (endpoint_seed(endpoint) ^ key) & _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


class RendezvousTable:
    """HRW over one fixed tuple of endpoints (built once per pool snapshot; immutable afterwards).

    `ranked(key)` is the tuple in decreasing weight order; `rendezvous_order` of any subset of the tuple is that
    order filtered to the subset. Cost: O(N) numpy work (C speed) + O(N) to list the
    order; weights equal to 64 bits are broken by position (probability ~N^2 / 2^64)."""

    __slots__ = ("_int_seeds", "_objects", "_seeds", "endpoints")

    SMALL = 12
    """Up to this many endpoints the weights are computed with Python ints: numpy's fixed cost per call
    exceeds the per-endpoint cost of Python ints there (`python -m prefixroute.bench.decision`). Same figures,
    same order."""

    def __init__(self, endpoints: Sequence[EndpointState]) -> None:
        self.endpoints = tuple(endpoints)
        n = len(self.endpoints)
        self._seeds = np.fromiter((endpoint_seed(s.endpoint) for s in self.endpoints), dtype=np.uint64, count=n)
        self._int_seeds = [int(x) for x in self._seeds] if n <= self.SMALL else None
        self._objects = np.empty(n, dtype=object)
        for i, s in enumerate(self.endpoints):  # element-wise: numpy must not unpack the states
            self._objects[i] = s

    def weights(self, key: int) -> np.ndarray:
        """`hrw_weight(key, e)` for every endpoint, in tuple order (uint64 arithmetic wraps mod 2**64)."""
        x = self._seeds ^ np.uint64(key & _MASK64)
        x = (x ^ (x >> _U30)) * _UM1
        x = (x ^ (x >> _U27)) * _UM2
        return x ^ (x >> _U31)

    def ranked(self, key: int) -> list[EndpointState]:
        """Every endpoint of the table by decreasing weight for `key`."""
        if not self.endpoints:
            return []
        if self._int_seeds is not None:
            key &= _MASK64
            ws = []
            for seed in self._int_seeds:
                x = seed ^ key
                x = ((x ^ (x >> 30)) * _M1) & _MASK64
                x = ((x ^ (x >> 27)) * _M2) & _MASK64
                ws.append(x ^ (x >> 31))
            # ties as the stable argsort reversed below: the later position first
            return [self.endpoints[i] for i in sorted(range(len(ws)), key=lambda i: (ws[i], i), reverse=True)]
        idx = np.argsort(self.weights(key), kind="stable")[::-1]
        return self._objects[idx].tolist()


def rendezvous_order(key: int, endpoints: Sequence[EndpointState], k: int | None = None) -> list[EndpointId]:
    """Endpoints by decreasing HRW weight for `key` (the first `k` only when given)."""
    order = RendezvousTable(endpoints).ranked(key)
    return [s.endpoint for s in (order if k is None else order[:k])]


def least_load_order(endpoints: Sequence[EndpointState], in_flight: Mapping[EndpointId, int],
                     rng: random.Random, k: int) -> list[EndpointId]:
    """The `k` endpoints with fewest in-flight requests, then fewest waiting (scraped), then random."""
    get = in_flight.get
    rand = rng.random
    keyed = [(get(s.endpoint, 0), s.num_requests_waiting or 0, rand(), s.endpoint) for s in endpoints]
    return [t[3] for t in heapq.nsmallest(k, keyed)]



TTFT_TIE_S = 0.001
TTFT_TIE_RATIO = 0.05
"""Scores within 5% + 1 ms of the best are a tie (then: the longest match, then rendezvous order). Rates
learned on identical GPUs differ by a few percent (noise of ~64 responses), and without a relative margin the
endpoint that happens to look fastest took every cold prefix of an idle fleet (1.6x its fair share at 20% load
in the shared-prompts sweep); within 5% placement stays rendezvous and affinity stays with the holder."""


Scored = tuple[float, float, EndpointState, float, int, float]
"""A scored candidate (`scorers.Scored`: score, predicted TTFT s, state, own tokens, decoding, own work); the pickers
read its score [0] and its state [2]."""


def tied_best(scored: Sequence[Scored], matches: Mapping[EndpointId, int], longest: bool) -> list[Scored]:
    """The candidates tied with the best of `scored` (sorted by score): within `TTFT_TIE_RATIO` +
    `TTFT_TIE_S` of it; with `longest`, only those of them with the longest match. A prefix of `scored`'s
    order, never empty when `scored` is not."""
    bound = scored[0][0] * (1.0 + TTFT_TIE_RATIO) + TTFT_TIE_S
    if len(scored) < 2 or scored[1][0] > bound:
        return [scored[0]]
    tied = [x for x in scored if x[0] <= bound]
    if longest and len(tied) > 1:
        get = matches.get
        most = max(get(x[2].endpoint, 0) for x in tied)
        tied = [x for x in tied if get(x[2].endpoint, 0) == most]
    return tied


def pick_tied(tied: Sequence[Scored], *, session: EndpointId | None, has_prefix: bool, cold: bool,
              top: Sequence[EndpointState] | None, in_flight: Mapping[EndpointId, int], rng: random.Random,
              rendezvous: Callable[[], tuple[np.ndarray, Mapping[EndpointId, int]]]) -> Scored:
    """The primary among `tied` (non-empty, as `tied_best` returns). Contract, first rule that decides:
    a session's endpoint among them (staying keeps its next turns together); without a prefix to keep together
    (`has_prefix` False), the fewest in flight, then at random (`rng`, as `least_load_order`); a prefix seen
    nowhere (`cold`), the fewest in flight, if that leaves one; in a sampled pool (`top`: the rendezvous top-k,
    in order) the first of `top` that is tied; else the highest rendezvous weight (`rendezvous()`: the weights
    of the table for the request's key and each endpoint's position in it; equal weights: the later position).
    Draws from `rng` only in the no-prefix case."""
    if len(tied) == 1:
        return tied[0]
    if session is not None:
        for x in tied:
            if x[2].endpoint == session:
                return x
    get_in_flight = in_flight.get
    if not has_prefix:
        rand = rng.random
        return min(tied, key=lambda x: (get_in_flight(x[2].endpoint, 0), rand()))
    if cold:
        # Rendezvous alone let new prefixes bunch on one endpoint in short runs (mix, 200 requests at 80% load:
        # P50 2.7x sglang-router's model; with this, 0.8x).
        least = min(get_in_flight(x[2].endpoint, 0) for x in tied)
        tied = [x for x in tied if get_in_flight(x[2].endpoint, 0) == least]
        if len(tied) == 1:
            return tied[0]
    elif top is not None:
        by_name = {x[2].endpoint: x for x in tied}
        for s in top:
            found = by_name.get(s.endpoint)
            if found is not None:
                return found
    weights, pos = rendezvous()
    return max(tied, key=lambda x: (int(weights[pos[x[2].endpoint]]), pos[x[2].endpoint]))

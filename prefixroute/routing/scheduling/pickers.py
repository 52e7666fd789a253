"""Pickers: turn scores into an ordered endpoint list (primary first, then fallbacks).

- `max_score_order`: highest weighted score; ties (equal within 1e-9) broken by fewer in-flight requests, then
  randomly with the injected `random.Random`, so idle endpoints with equal scores share new work instead of
  the first one in configuration order taking all of it (the hot spot seen with other routers).
- `rendezvous_order`: highest-random-weight (HRW) hashing: weight(endpoint) = xxh3_64(endpoint id, seed=key).
  Deterministic across processes; removing an endpoint moves only the keys it ranked first, adding one takes
  about 1/N of the keys.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence

import xxhash

from prefixroute.routing.types import EndpointId, EndpointState

_xxh3 = xxhash.xxh3_64_intdigest
_TIE_EPS = 1e-9
_encoded: dict[str, bytes] = {}


def _key_bytes(endpoint: EndpointId) -> bytes:
    b = _encoded.get(endpoint)
    if b is None:
        if len(_encoded) > 65536:  # endpoints churn over a long run; keep the cache bounded
            _encoded.clear()
        b = _encoded[endpoint] = endpoint.encode()
    return b


def hrw_weight(key: int, endpoint: EndpointId) -> int:
    """The rendezvous weight of `endpoint` for `key` (a 64-bit block hash)."""
    return _xxh3(_key_bytes(endpoint), key)


def rendezvous_order(key: int, endpoints: Sequence[EndpointState], k: int | None = None) -> list[EndpointId]:
    """Endpoints by decreasing HRW weight for `key` (the first `k` only when given)."""
    pairs = [(_xxh3(_key_bytes(s.endpoint), key), s.endpoint) for s in endpoints]
    if k is not None and k < len(pairs):
        return [ep for _, ep in heapq.nlargest(k, pairs)]
    pairs.sort(reverse=True)
    return [ep for _, ep in pairs]


def max_score_order(endpoints: Sequence[EndpointState], scores: Sequence[float],
                    in_flight: Mapping[EndpointId, int], rng: random.Random, k: int) -> list[EndpointId]:
    """The `k` best endpoints: score desc, then in-flight asc, then random (scores within 1e-9 tie)."""
    n = len(endpoints)
    if n == 0 or k <= 0:
        return []
    if k < n:
        # Only endpoints scoring at least the k-th best (minus the tie tolerance) can be in the answer: the
        # costly tie-break keys are built for that group only (usually a handful; all of them when all tie).
        floor = heapq.nlargest(k, scores)[-1] - _TIE_EPS
        idx = [i for i, sc in enumerate(scores) if sc >= floor]
    else:
        idx = list(range(n))
    get = in_flight.get
    rand = rng.random
    top = max(scores[i] for i in idx)
    # Quantise to the tie tolerance relative to the best score so near-equal floats compare equal.
    keyed = [(round((top - scores[i]) / _TIE_EPS), get(endpoints[i].endpoint, 0), rand(), endpoints[i].endpoint)
             for i in idx]
    if k < len(keyed):
        return [t[3] for t in heapq.nsmallest(k, keyed)]
    keyed.sort()
    return [t[3] for t in keyed]


def least_load_order(endpoints: Sequence[EndpointState], in_flight: Mapping[EndpointId, int],
                     rng: random.Random, k: int) -> list[EndpointId]:
    """The `k` endpoints with fewest in-flight requests, then fewest waiting (scraped), then random."""
    get = in_flight.get
    rand = rng.random
    keyed = [(get(s.endpoint, 0), s.num_requests_waiting or 0, rand(), s.endpoint) for s in endpoints]
    return [t[3] for t in heapq.nsmallest(k, keyed)]

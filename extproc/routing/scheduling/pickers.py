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
from collections.abc import Mapping, Sequence

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


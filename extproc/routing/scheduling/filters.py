"""Filters: which endpoints may take a request. Each keeps the input order (the pool's configured order)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from prefixroute.extproc.routing.scheduling.pickers import RendezvousTable, endpoint_seed
from prefixroute.types import EndpointId, EndpointState


def serves_model(state: EndpointState, model: str | None) -> bool:
    """True when `state` may serve `model`: no model asked, models unknown (empty), or listed."""
    return model is None or not state.models or model in state.models


def filter_model(endpoints: Sequence[EndpointState], model: str | None) -> list[EndpointState]:
    """Endpoints that serve `model` (healthy or not): decides 404 vs 503 in the router."""
    if model is None:
        return list(endpoints)
    return [s for s in endpoints if not s.models or model in s.models]


def eligible(endpoints: Sequence[EndpointState], model: str | None) -> list[EndpointState]:
    """Healthy endpoints that serve `model`: the candidates every policy chooses from."""
    if model is None:
        return [s for s in endpoints if s.healthy]
    return [s for s in endpoints if s.healthy and (not s.models or model in s.models)]


class EligibleView:
    """What a pool snapshot offers one model: the eligible endpoints (a tuple, pool order), their positions,
    and, built on first use, their rendezvous table. Immutable once built; derived from an immutable snapshot
    (a tuple of frozen `EndpointState`), so it is valid for as long as that snapshot object is the pool's."""

    __slots__ = ("_scan", "_table", "_top", "endpoints", "position")

    MAX_TOP_KEYS = 4096
    """Prefix keys whose rendezvous top-k a view remembers (a view lives until the next scrape, ~1 s)."""

    def __init__(self, endpoints: Sequence[EndpointState]) -> None:
        self.endpoints: tuple[EndpointState, ...] = tuple(endpoints)
        self.position: dict[EndpointId, int] = {s.endpoint: i for i, s in enumerate(self.endpoints)}
        self._table: RendezvousTable | None = None
        self._scan: tuple[EndpointState, ...] | None = None
        self._top: dict[tuple[int, int], tuple[EndpointState, ...]] = {}

    @property
    def rendezvous(self) -> RendezvousTable:
        if self._table is None:
            self._table = RendezvousTable(self.endpoints)
        return self._table

    @property
    def scan_order(self) -> tuple[EndpointState, ...]:
        """The eligible endpoints in a fixed pseudo-random order (by rendezvous seed), for sampling a large
        pool in windows: neighbours in the configured order (one host, one rack, often busy together) are not
        neighbours here, and a rotating window visits every endpoint in len / window decisions."""
        if self._scan is None:
            self._scan = tuple(sorted(self.endpoints, key=lambda s: endpoint_seed(s.endpoint)))
        return self._scan

    def rendezvous_top(self, key: int, k: int) -> tuple[EndpointState, ...]:
        """The first `k` endpoints in rendezvous order for `key`, in that order (`RendezvousTable.ranked`'s),
        memoised per key: requests of one prefix ask again and again."""
        got = self._top.get((key, k))
        if got is None:
            if len(self._top) >= self.MAX_TOP_KEYS:
                self._top.clear()
            table = self.rendezvous
            if k >= len(self.endpoints):
                got = tuple(table.ranked(key))
            else:
                w = table.weights(key)
                top = np.argpartition(w, -k)[-k:]
                # decreasing weight, equal weights by the later position first (as `ranked`)
                got = tuple(table.endpoints[i] for i in sorted(top.tolist(), key=lambda i: (int(w[i]), i),
                                                               reverse=True))
            self._top[(key, k)] = got
        return got

    def in_pool_order(self, names: object) -> list[EndpointState]:
        """The eligible endpoints named in `names` (an iterable of ids; others ignored), in pool order:
        O(len(names)), not O(eligible)."""
        pos = self.position
        eps = self.endpoints
        return [eps[i] for i in sorted(pos[n] for n in names if n in pos)]  # type: ignore[attr-defined]


class EligibleCache:
    """Memo of `EligibleView` per (snapshot, model) for the snapshot seen last. The pool replaces its snapshot
    tuple whole when a probe or scrape lands and returns the same object until then, so the key is the
    snapshot's identity; the cache holds the snapshot, so that identity cannot be reused while cached. Only
    tuples are memoised (a list could be changed in place): other sequences get a fresh view per call. At most
    `max_models` views per snapshot (model names come from requests). Not thread-safe; one event loop."""

    def __init__(self, max_models: int = 256) -> None:
        self._snapshot: Sequence[EndpointState] | None = None
        self._views: dict[str | None, EligibleView] = {}
        self._max_models = max_models

    def view(self, endpoints: Sequence[EndpointState], model: str | None) -> EligibleView:
        """The view of `endpoints` for `model`: ``view.endpoints == tuple(eligible(endpoints, model))``."""
        if type(endpoints) is not tuple:
            return EligibleView(eligible(endpoints, model))
        if endpoints is not self._snapshot:
            self._snapshot = endpoints
            self._views = {}
        v = self._views.get(model)
        if v is None:
            if len(self._views) >= self._max_models:
                self._views.clear()
            v = self._views[model] = EligibleView(eligible(endpoints, model))
        return v


def sample_candidates(view: EligibleView, holders: Sequence[EndpointState], matches: Mapping[EndpointId, int],
                      top: Sequence[EndpointState], session: EndpointId | None, limit_n: int,
                      scan_offset: int) -> tuple[list[EndpointState], int]:
    """The subset filter of a pool larger than ``max_scored_endpoints`` (`limit_n`): (candidates, next scan
    offset). Contract: the candidates are distinct eligible endpoints, at most `limit_n` unless the holders
    alone are more; always the holders (endpoints in `matches`), then the rendezvous top-k `top` (so on an
    idle fleet a cold prefix goes where rendezvous puts it, whichever sample is drawn), then the session's
    endpoint (credited nothing, still scored), then a window of `view.scan_order` starting at `scan_offset`
    (power-of-d choices; the caller keeps the returned offset for its next decision, so the window rotates and
    visits every endpoint in len / window decisions). Pure."""
    candidates = [*holders, *(s for s in top if s.endpoint not in matches)]
    taken = {s.endpoint for s in candidates}
    if session is not None and session not in taken and session in view.position:
        candidates.append(view.endpoints[view.position[session]])
        taken.add(session)
    scan = view.scan_order
    want = limit_n - len(candidates)
    if want <= 0:
        return candidates, scan_offset
    n = len(view.endpoints)
    start = scan_offset % n
    window = scan[start:start + want + len(taken)]
    if len(window) < want + len(taken):
        window += scan[:want + len(taken) - len(window)]
    for s in window:
        if s.endpoint not in taken:
            candidates.append(s)
            want -= 1
            if not want:
                break
    return candidates, start + (limit_n - len(taken))

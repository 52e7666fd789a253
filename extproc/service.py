"""`PoolRouter`: the router service behind the ext_proc servicer (RouterCore + a `Pool`), no gRPC.

Contract with the servicer (`servicer.RouterService`):
- `route(method, path, headers, body)` parses the request (`parse_request`), asks `RouterCore.route` for a
  `Decision` over the pool's snapshot and in-flight counts, counts the primary as in flight, and returns a
  `lifecycle.Pick` (the request's one record, extproc/lifecycle.py) whose ``endpoints`` are *addresses* (``ip:port``, what Envoy's ORIGINAL_DST needs), primary
  first. Raises `OpenAIError` (400/404/405/413/503) to refuse.
- `served(pick, served)`: Envoy's ``x-gateway-destination-endpoint-served``. When a different endpoint
  served (the primary refused the connection and a fallback took it): the primary, and any fallback tried
  before the one that served, are reported failed to the pool, the prefix is recorded on the endpoint that
  really holds it, and the in-flight count moves to that endpoint.

  Trust rule (whoever reaches the ext_proc port can open streams, so a report may be forged):
  a report counts only when it names one of *this pick's fallbacks* (Envoy's retries can produce nothing
  else), and only the first report of a pick counts; any other address (an endpoint outside the pick, "-"
  on Envoy's local replies, a fail-open host) is ignored and counted in `num_ignored_reports`. Even a
  counted report marks nothing down by itself: the pool's `report_failure` is a suspicion that the pool
  confirms with a probe of its own (endpoints/pool.py). So a forged report costs at most a probe, and no
  stream, forged or real, can take down an endpoint that answers its health probe. (Observing streams reach
  here only through a pick they correlate to by the router's unguessable span id: tracking.py.)
- `endpoint_of(address)`: the endpoint id behind an address it handed out (telemetry maps Envoy's served
  address back to the endpoint). A pick also carries its `Decision`, `decision_us` (parse + schedule) and
  the parsed request, for telemetry.
- `release(pick)`: once per pick, when the HTTP request ends for any reason.
- `first_token(pick, ttft_s)`: the response's first token came `ttft_s` after the request arrived (streamed
  responses only: a non-streamed body arrives whole, so its first chunk is no first token); at most once per
  pick, before or after `release` (the observing stream may lag the routing stream's end on a short
  response). The prefix policy's queue of pending prefill empties there (or at `release`, whichever comes
  first), not at the end of the response (tracking.py calls it from the observing stream).
- `usage(pick, prompt_tokens, cached_tokens)`: the response ended, with its usage figures (None when the
  response carried none, e.g. a stream without ``stream_options.include_usage``); at most once per pick,
  after `first_token`, before or after `release` (two streams, no order between them). The prefix policy
  learns the endpoint's rate from it.

- Responses API state (extproc/response_directory.py): a request with ``response_ref`` (a follow-up's
  ``previous_response_id``, or the id of ``/v1/responses/{id}...``) is *pinned*: it is routed over a snapshot
  holding only the endpoint the directory names, so the decision lists that endpoint alone (no fallback, no
  silent reroute). That endpoint unhealthy: 503 with Retry-After, naming no id (its store may come
  back with it; an error text reaches records and dashboards, and a response id reads its response). An id
  the directory does not know: `route` raises `NeedsLookup` and the servicer awaits
  `resolve(response_id, headers)` (a bounded fan-out of ``GET /v1/responses/{id}``: 404 when no endpoint has
  it, 503 when some did not answer), then routes again. An endpoint that left the pool or restarted takes its
  ids with it (the directory follows the pool's snapshots), so its follow-ups get the 404 of the lookup.
  `learn_response(pick, response_id)`: the observing stream (tracking.py) or Envoy's facts record saw `pick`'s
  response id; a claim that does not fit (a second id for the pick, an id held at another endpoint) is refused.

- Other replicas (extproc/peers): with `peers` set (a `PeerPublisher`, the gateway's NATS bus), each
  pick with block hashes or queued prefill is published (`codec.Pick`: primary, block hashes, the policy's
  pending prefill, the session), its first token (`codec.Done`), its end (`codec.Release`), a failover (`codec.Failover`), each learned response id (`codec.Response`, again with
  its prompt tokens at `usage`) and what the policy learned from each response (`codec.Observed`: every
  replica's rate estimates learn from every response, not 1/N of them). `apply_peer_batch` applies the other replicas' messages (the bus calls it on
  the event loop: their picks count in the pool's in-flight counts until their ``release`` message, so the
  pool's in-flight figures are the fleet's), `expire_peers` drops their stale state (TTLs, a silent replica).
  Publishing never awaits.

- Large bodies (extproc/parse_offload.py): with `offload` set, a body its `heavy` names is not
  parsed here: `route` raises `NeedsParse` (a `NeedsLookup` without an id), the servicer awaits
  `parse_off_loop` (a worker process parses it), then calls `route` again with the parsed
  `InferenceRequest` in place of the body.
- Trust in other replicas: a peer's message changes this replica's state only within what that
  peer could know: a response id only for the endpoint its own pick went to (and never over an id this
  replica knows elsewhere), a failover only for a pick of its in flight here, at most
  `PeerSettings.max_in_flight_per_peer` of its requests counted in flight, figures in range
  (`num_ignored_peer_messages` counts the rest).

Endpoint ids are ``host:port`` as configured; the addresses handed to Envoy (ORIGINAL_DST takes addresses
only) are those the pool publishes in its snapshot (`EndpointState.address`: the pool resolves names off the
event loop and follows moves), read in the pool's listener, so a decision does no lookup. After a move the old
address still maps to its endpoint (`endpoint_of`, `served`) for the requests sent there before it.

The pool is any `prefixroute.extproc.endpoints.Pool`: the live `EndpointPool`, or the virtual-time
`bench.sim_pool.SimulatedPool` (the benchmarks' fleet simulation runs this same class).
Single event loop; not thread-safe (like RouterCore and the pools).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from prefixroute.extproc.endpoints import Pool
from prefixroute.extproc.flow.control import NeedsHold
from prefixroute.extproc.kv_events.tiers import TieredKVEventIndex
from prefixroute.extproc.lifecycle import Lifecycle, LifecycleListener, Phase, Pick
from prefixroute.extproc.lifecycle_listeners import (IndexListener, PeerPublisher, PeersListener, PoolListener,
                                                     ResponsesListener, TierPredictionListener, TimeModelListener)
from prefixroute.extproc.peers import codec
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.response_directory import NeedsLookup, ResponseDirectory, ResponseLookup
from prefixroute.extproc.routing.request import InferenceRequest, parse_request
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.text_hash_cache import TextHashCache
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.extproc.tenants import Tenants
from prefixroute.types import EndpointId, EndpointState
from prefixroute.openai_errors import OpenAIError
from prefixroute import responses_prompt


MAX_PEER_TTFT_S = 3600.0
MAX_PEER_TOKENS = 1e8
"""Figures in another replica's messages outside [0, these] are ignored (no real prompt or first token is
larger), so one message cannot throw this replica's time model or queues far off."""
MAX_RECENT_PEER_PICKS = 65536
"""Other replicas' recent picks remembered after their end (their endpoint), for the response ids they learn
at the response's end: a Response names the pick it came from, and counts only for that pick's endpoint."""


class NeedsParse(NeedsLookup):
    """Raised by `PoolRouter.route` for a body to parse off the event loop: await
    ``router.parse_off_loop(method, path, headers, body)``, then route again (servicer.py)."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]


class FlowPort(Protocol):
    """What the router service asks of flow control (extproc/flow/hold.py `FlowHold`)."""

    def admits_now(self) -> bool: ...

    async def hold(self, request: InferenceRequest, headers: Mapping[str, str]) -> Any: ...

    def placed(self, ticket: Any) -> None: ...

    def deadline_s(self, headers: Mapping[str, str]) -> float: ...


class PoolRouter:
    """RouterCore + a `Pool` behind the servicer's `RouterService` interface (see module docstring). Requests
    are parsed with the core's own settings (``core.settings``): one settings object parses and routes."""

    def __init__(self, core: RouterCore, pool: Pool, *, clock: Callable[[], float] = time.monotonic,
                 tenants: Tenants | None = None, offload: Any = None,
                 flow: Callable[[PoolRouter], FlowPort] | None = None,
                 peers: Callable[[PoolRouter], PeerPublisher] | None = None,
                 peer_settings: PeerSettings | None = None) -> None:
        """Built complete, by `factory.build_router` (the one wiring place). `clock`: monotonic seconds for the
        time model (a simulation passes its virtual clock). `tenants`: who sent each request (extproc/tenants.py;
        default: no table, no tenant header trusted). `offload`: large bodies parsed off the loop
        (extproc/parse_offload.py; None: every body here). `flow`: builds flow control's port for this router
        (extproc/flow/hold.py, `flow_for`; None: every request is routed at once). `peers`: builds the
        publisher of this router's picks to the other replicas (extproc/peers; None: it routes alone), applied
        within `peer_settings`' limits."""
        self.core = core
        self.clock = clock
        self.pool = pool
        self.settings = core.settings
        # Token mode (``--tokenizer``): built once; a tokenizer that cannot load fails startup (TokenizerLoadError).
        self.hasher = PromptHasher.from_settings(core.settings)
        # Text blocks (text mode, and what token mode hashes by text) with repeated spans cached.
        self.text_cache = TextHashCache.from_settings(core.settings)
        self._adapters = pool.adapters  # the pool's live set of LoRA adapter names (None: it lists none)
        self._addr: dict[EndpointId, str] = {}
        self._id_of_addr: dict[str, EndpointId] = {}
        self._addrs_cache: dict[tuple[EndpointId, ...], tuple[str, ...]] = {}
        self.num_failovers = 0
        self.num_ignored_reports = 0  # served reports naming no fallback of their pick, or repeated (docstring)
        s = core.settings
        self.responses = ResponseDirectory(core.memory.max_response_ids, s.response_id_ttl_s, clock=clock)
        self.lookup = ResponseLookup(self.responses, timeout_s=s.response_lookup_timeout_s,
                                     max_in_flight=s.max_response_lookups, retry_after_s=core.retry_after_s)
        self._states: dict[EndpointId, EndpointState] = {}
        self._states_of: object = None  # the snapshot `_states` was built from (its identity)
        # One dispatcher of each request's phases (extproc/lifecycle.py) to the listeners, in this order.
        self.lifecycle = Lifecycle()
        self._peers = PeersListener(core)
        for listener in (PoolListener(pool), ResponsesListener(self.responses, self._set_known_prefix),
                         IndexListener(core), *([TimeModelListener(core.learner, clock)] if core.learner else []),
                         self._peers):
            self.lifecycle.add(listener)
        # The hit prediction by KV tier, for /metrics: only with a tier-aware events index.
        self.tier_prediction = TierPredictionListener(core, core.event_index) \
            if isinstance(core.event_index, TieredKVEventIndex) else None
        if self.tier_prediction is not None:
            self.lifecycle.add(self.tier_prediction)
        ps = peer_settings or PeerSettings()
        self.peer_pending_ttl_s = ps.pending_ttl_s
        self.peer_in_flight_ttl_s = ps.in_flight_ttl_s
        self.peer_timeout_s = ps.peer_timeout_s
        # Other replicas' requests in flight here: (replica, incarnation, seq) -> [endpoint, expiry], oldest
        # first; counted in the pool's in-flight counts (so every replica prices the fleet's load), and when
        # each origin was last heard from.
        self._peer_in_flight: dict[tuple, list] = {}
        self._peer_seen: dict[tuple[str, int], float] = {}
        self._peer_counts: dict[tuple[str, int], int] = {}  # origin -> its requests counted in flight here
        self._peer_recent: dict[tuple, EndpointId] = {}  # ended peer picks -> endpoint, oldest first
        self.max_peer_in_flight = core.memory.max_peer_in_flight
        self.max_in_flight_per_peer = ps.max_in_flight_per_peer
        self.num_ignored_peer_messages = 0
        self.offload = offload
        # Its tenant salts a request's hashes and sessions; a client's own tenant header counts only where the
        # operator trusts an ingress to set it.
        self.tenants = tenants if tenants is not None else Tenants(tenant_header=s.tenant_header)
        pool.add_listener(self._on_pool_change)
        # Last: both are built over the router they serve (its pool, its time model, its listeners).
        self.flow: FlowPort | None = flow(self) if flow is not None else None
        self._peers.publisher = peers(self) if peers is not None else None

    @property
    def peers(self) -> PeerPublisher | None:
        """Where picks are published to the other replicas (extproc/peers); None (the default): this replica
        routes alone (no message, no cost)."""
        return self._peers.publisher

    def add_listener(self, listener: LifecycleListener) -> None:
        """Register another lifecycle listener (extproc/lifecycle.py), told after the router's own."""
        self.lifecycle.add(listener)

    def _on_pool_change(self, snapshot: Sequence[EndpointState]) -> None:
        """Structural pool change (the pool calls this on every address change, among others)."""
        addr = {s.endpoint: s.address for s in snapshot if s.address is not None}
        if addr != self._addr:
            self._addr = addr
            self._addrs_cache = {}
            for ep, a in addr.items():
                self._id_of_addr[a] = ep  # old addresses stay: requests sent there may still report back
        self.core.sync_endpoints(snapshot)
        self.responses.sync(snapshot)

    def _addresses(self, ids: tuple[EndpointId, ...]) -> tuple[str, ...]:
        addrs = self._addrs_cache.get(ids)
        if addrs is None:
            addr = self._addr  # decisions name healthy endpoints only, and a healthy endpoint has an address
            if len(self._addrs_cache) > 4096:
                self._addrs_cache.clear()
            addrs = self._addrs_cache[ids] = tuple(addr[ep] for ep in ids)
        return addrs

    def endpoint_of(self, address: str) -> EndpointId | None:
        """The endpoint id behind an ``ip:port`` this router handed to Envoy (None if it never did)."""
        return self._id_of_addr.get(address)

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes | InferenceRequest,
              subset: Collection[str] | None = None, *, can_hold: bool = False, ticket: Any = None,
              first_token_live: bool = True,
              on_endpoints: Callable[[tuple[str, ...]], None] | None = None) -> Pick:
        """See the module docstring. `body`: the request body, or the `InferenceRequest` `parse_off_loop` made of
        it. `subset`: the gateway's subset hint (GIE's ``x-gateway-destination-endpoint-subset``): pick only
        among the endpoints whose address (``ip:port``, or a bare ``ip``: every port of it) it lists; 503 when
        none of them is healthy. None: the whole pool. `can_hold`: the caller can hold the request (it awaits
        `hold` on `NeedsHold`); with flow control on and the fleet saturated, `NeedsHold` is raised. `ticket`:
        the request was held and released (`hold`'s ticket): routed now, and the gate told it is placed.
        `first_token_live`: False when a streamed response's first token will be reported only at the request's
        end (the facts path), so flow control does not wait on it (`Pick.first_token_live`). `on_endpoints`:
        called with the pick's addresses (`Pick.endpoints`) as soon as the decision is final, before the pick is
        recorded and counted (`RouterCore.route`'s ``on_decided``): the HTTP check answers Envoy then."""
        t0 = time.perf_counter()
        if type(body) is InferenceRequest:
            request = body
        elif self.offload is not None and self.offload.heavy(path, body):
            raise NeedsParse()
        else:
            request = parse_request(method, path, self.tenants.parse_headers(headers), body, self.settings,
                                    self.hasher, self._adapters, self.text_cache)
        flow = self.flow
        if flow is not None:
            if ticket is not None:
                try:
                    return self._route(request, subset, t0, ticket, first_token_live, on_endpoints)
                finally:
                    flow.placed(ticket)  # placed or refused: the next held request may go
            if can_hold and request.kind != "other" and not flow.admits_now():
                raise NeedsHold(request)
        return self._route(request, subset, t0, None, first_token_live, on_endpoints)

    async def hold(self, request: InferenceRequest, headers: Mapping[str, str]) -> Any:
        """After `route` raised `NeedsHold`: wait in the gateway queue (flow control). Returns the ticket to route
        with; raises the shed answer (`OpenAIError` 429/503 with retry_after_s)."""
        assert self.flow is not None
        return await self.flow.hold(request, headers)

    def hold_deadline_s(self, headers: Mapping[str, str]) -> float:
        """The longest a request with these headers may be held (its queue deadline)."""
        assert self.flow is not None
        return self.flow.deadline_s(headers)

    def _route(self, request: InferenceRequest, subset: Collection[str] | None, t0: float, ticket: Any,
               first_token_live: bool = True,
               on_endpoints: Callable[[tuple[str, ...]], None] | None = None) -> Pick:
        pool = self.pool
        snapshot = pool.snapshot()
        if request.response_ref is not None:
            snapshot = self._pinned(request.response_ref, snapshot)
            self._set_known_prefix(request)
        if subset is not None:  # after pinning: the holder of a response id is looked up in the whole pool
            snapshot = self._subset(subset, snapshot)
        decision = self.core.route(request, snapshot, pool.in_flight, self.clock(),
                                   on_decided=None if on_endpoints is None
                                   else lambda d: on_endpoints(self._addresses(d.endpoints)))
        decision_us = (time.perf_counter() - t0) * 1e6
        ids = decision.endpoints
        pick = Pick(self._addresses(ids), ids, request, decision, decision_us)
        pick.index_source = self.core.index_source_of(decision)
        pick.first_token_live = first_token_live
        if ticket is not None and ticket.held:
            pick.flow_wait_s, pick.flow_released_by = ticket.wait_s, ticket.released_by.value
        pool.acquire(ids[0])
        self.lifecycle.decided(pick)
        return pick

    async def parse_off_loop(self, method: str, path: str, headers: Mapping[str, str],
                             body: bytes) -> InferenceRequest:
        """After `route` raised `NeedsParse`: `body` parsed in a worker (raises its `OpenAIError`), for `route`."""
        assert self.offload is not None
        tenants = self.tenants
        return await self.offload.parse(method, path, tenants.parse_headers(headers), body, self._adapters,
                                        client=tenants.resolve(headers).flow)

    # --- other replicas (extproc/peers: PeerBus calls these on the event loop) ----------------------------
    def apply_peer_batch(self, origin: tuple[str, int], messages: Sequence[codec.Message], now_s: float) -> None:
        """Apply another replica's messages (`origin`: its (replica id, incarnation)), in order, each by its
        type's method (`_PEER_APPLY`): picks and failovers through the core's one apply path (the same
        `RouterCore.apply_pick` / `apply_failover` as this replica's own), responses to the directory. A
        message outside what that peer could know is ignored and counted (module docstring: trust)."""
        seen = self._peer_seen
        if origin not in seen and len(seen) >= 256:  # a flood of invented senders: the oldest are forgotten
            self._forget_origin(next(iter(seen)))
        seen.pop(origin, None)
        seen[origin] = now_s  # an empty batch is a heartbeat; most recent last
        ignored = 0
        apply = _PEER_APPLY
        for m in messages:
            if not apply[type(m)](self, origin, m, now_s):
                ignored += 1
        self.num_ignored_peer_messages += ignored
        flying = self._peer_in_flight
        while len(flying) > self.max_peer_in_flight:
            self._end_peer_pick(next(iter(flying)))

    def _peer_pick(self, origin: tuple[str, int], m: codec.Pick, now_s: float) -> bool:
        key = (*origin, m.seq)
        pending = m.pending_tokens
        counts = self._peer_counts
        core = self.core
        if key in self._peer_in_flight or counts.get(origin, 0) >= self.max_in_flight_per_peer or (
                pending is not None and not 0.0 <= pending <= core.settings.max_input_chars) or \
                len(m.block_hashes) > core.memory.max_blocks_per_request:
            return False  # a repeat, more in flight than a replica routes, or figures out of range
        if core.apply_peer_pick(key, m.endpoint, m.block_hashes, pending, m.session, now_s,
                                now_s + self.peer_pending_ttl_s):
            self.pool.acquire(m.endpoint)
            self._peer_in_flight[key] = [m.endpoint, now_s + self.peer_in_flight_ttl_s]
            counts[origin] = counts.get(origin, 0) + 1
        return True

    def _peer_done(self, origin: tuple[str, int], m: codec.Done, now_s: float) -> bool:
        self._peer_pending_done((*origin, m.seq))
        return True

    def _peer_release(self, origin: tuple[str, int], m: codec.Release, now_s: float) -> bool:
        key = (*origin, m.seq)
        self._peer_pending_done(key)
        self._end_peer_pick(key)
        return True

    def _peer_pending_done(self, key: tuple) -> None:
        """Another replica's pick `key` got its first token or ended: it leaves the time model's queue."""
        if self.core.learner is not None:
            self.core.learner.apply_peer_done(key)

    def _peer_failover(self, origin: tuple[str, int], m: codec.Failover, now_s: float) -> bool:
        entry = self._peer_in_flight.get((*origin, m.seq))
        core = self.core
        if entry is None or not core.knows(m.endpoint) or len(m.block_hashes) > core.memory.max_blocks_per_request:
            return False  # only a pick of its in flight here can have failed over
        core.apply_peer_failover(m.endpoint, m.block_hashes, m.session)
        if entry[0] != m.endpoint:
            self.pool.release(entry[0])
            self.pool.acquire(m.endpoint)
            entry[0] = m.endpoint
        return True

    def _peer_response(self, origin: tuple[str, int], m: codec.Response, now_s: float) -> bool:
        key = (*origin, m.seq)
        entry = self._peer_in_flight.get(key)
        ep = entry[0] if entry is not None else self._peer_recent.get(key)
        # not where that peer's pick went, or known here elsewhere: ignored
        return ep == m.endpoint and (m.prompt_tokens is None or 0 <= m.prompt_tokens <= self.settings.max_input_chars) \
            and self.responses.apply_peer(m.key, m.endpoint, m.prompt_tokens)

    def _peer_observed(self, origin: tuple[str, int], m: codec.Observed, now_s: float) -> bool:
        if not (0.0 < m.ttft_s <= MAX_PEER_TTFT_S and 0.0 <= m.cached_tokens <= m.prompt_tokens <= MAX_PEER_TOKENS
                and 0.0 <= m.queued_tokens <= MAX_PEER_TOKENS and 0 <= m.num_decoding <= 1_000_000):
            return False
        if self.core.learner is not None:
            self.core.learner.apply_peer_observation(m.endpoint, m.prompt_tokens, m.cached_tokens, m.ttft_s,
                                                     m.queued_tokens, m.num_decoding)
        return True

    def _end_peer_pick(self, key: tuple) -> None:
        """A peer's pick ended (its Release, expiry, or its sender gone): out of the in-flight counts; its
        endpoint remembered a while for the response id learned at its end."""
        entry = self._peer_in_flight.pop(key, None)
        if entry is None:
            return
        self.pool.release(entry[0])
        origin = key[:2]
        n = self._peer_counts.get(origin, 0) - 1
        if n > 0:
            self._peer_counts[origin] = n
        else:
            self._peer_counts.pop(origin, None)
        recent = self._peer_recent
        recent[key] = entry[0]
        while len(recent) > MAX_RECENT_PEER_PICKS:
            del recent[next(iter(recent))]

    def _forget_origin(self, origin: tuple[str, int]) -> None:
        self._peer_seen.pop(origin, None)
        for key in [k for k in self._peer_in_flight if k[:2] == origin]:
            self._peer_pending_done(key)
            self._end_peer_pick(key)

    def expire_peers(self, now_s: float) -> None:
        """The bus calls this every second: drop the other replicas' pending picks older than their TTL, their
        in-flight requests older than theirs (a lost Release), and everything of a replica not heard from for
        `peer_timeout_s` (it died, or this replica lost NATS: their Releases would not reach it)."""
        if self.core.learner is not None:
            self.core.learner.expire_peers(now_s)
        flying = self._peer_in_flight
        gone = {o for o, t in self._peer_seen.items() if now_s - t > self.peer_timeout_s}
        for o in gone:
            del self._peer_seen[o]
        for key in [k for k, (_, exp) in flying.items() if exp <= now_s or k[:2] in gone]:
            self._peer_pending_done(key)
            self._end_peer_pick(key)

    def num_peer_in_flight(self) -> int:
        """Other replicas' requests counted in flight here (a metric)."""
        return len(self._peer_in_flight)

    def _set_known_prefix(self, request: InferenceRequest) -> None:
        """A Responses follow-up's prompt starts with the previous request's prompt, which its holder cached:
        that many tokens (from the previous response's usage, when reported) less one block (that prompt ended
        with the assistant header in a partial block)."""
        prev = self.responses.prompt_tokens(request.response_ref) if request.kind == "responses" else None
        if prev is not None:
            request.known_prefix_tokens = max(0, prev - self.settings.kv_block_tokens)

    def _subset(self, subset: Collection[str], snapshot: Sequence[EndpointState]) -> list[EndpointState]:
        """The endpoints of `snapshot` inside the gateway's subset hint (`route`), as a list (not a tuple: like
        `_pinned`, it must not evict the scheduler's memo of the pool's snapshot). Raises `OpenAIError` 503 when
        none of them is healthy (GIE: "none of the endpoints in the list is eligible")."""
        allowed = set(subset)
        chosen = [st for st in snapshot if st.address is not None and (
            st.address in allowed or st.address.rpartition(":")[0].strip("[]") in allowed)]
        if not any(st.healthy for st in chosen):
            raise OpenAIError(503, f"no healthy endpoint in the gateway's subset of {len(allowed)} endpoint(s)",
                              retry_after_s=self.core.retry_after_s)
        return chosen

    def _pinned(self, response_id: str, snapshot: Sequence[EndpointState]) -> list[EndpointState]:
        """The one-endpoint snapshot a request needing `response_id` is routed over (module docstring). A
        list, not a tuple: the scheduler memoises views per snapshot tuple, and a pinned request must not
        evict the pool snapshot's. Raises `NeedsLookup`, or `OpenAIError` 404 (known missing, or its endpoint
        is gone) / 503 (its endpoint is unhealthy)."""
        ep = self.responses.endpoint_of(response_id)
        if ep is None:
            if self.responses.is_missing(response_id):
                raise responses_prompt.not_found(response_id)
            raise NeedsLookup(response_id)
        if snapshot is not self._states_of:
            self._states = {st.endpoint: st for st in snapshot}
            self._states_of = snapshot
        state = self._states.get(ep)
        if state is None:  # left the pool between the snapshot the directory followed and this one
            self.responses.forget_endpoint(ep)
            raise responses_prompt.not_found(response_id)
        if not state.healthy or state.address is None:
            # No id in the text: it lands in records and dashboards, and a response id reads its response.
            raise OpenAIError(503, "the endpoint holding this response is unavailable; retry later",
                              retry_after_s=self.core.retry_after_s, param="previous_response_id")
        return [state]

    async def resolve(self, response_id: str, headers: Mapping[str, str]) -> EndpointId:
        """Find the endpoint holding `response_id` (a `NeedsLookup` from `route`): asks every healthy endpoint
        (`ResponseLookup.resolve`, which raises `OpenAIError` 404/503); the id is then known to `route`. The
        client's ``authorization`` goes with the lookups (endpoints started with an API key ask for it)."""
        candidates = [(st.endpoint, st.address) for st in self.pool.snapshot() if st.healthy and st.address]
        auth = headers.get("authorization")
        return await self.lookup.resolve(response_id, candidates, {"authorization": auth} if auth else None)

    def learn_response(self, pick: Pick, response_id: str, served: str | None = None) -> bool:
        """`pick`'s response carries `response_id` (the observing stream or Envoy's facts record read it): the
        endpoint that served it holds it. `served`: Envoy's served address when known; as in `served`, only an
        endpoint of this pick counts (else the primary, or the fallback a counted failover report named). True
        when learned. A claim that does not fit is refused and counted (the directory's ``num_refused``): a second,
        different id for the same pick (a response has one), or an id the directory holds at another endpoint
        (an id is produced once: whoever names someone else's id learns nothing, and the conversation stays
        where it is)."""
        ep = self._id_of_addr.get(served) if served else None
        if ep is None or ep not in pick.endpoint_ids:
            ep = pick.counted
        responses = self.responses
        if pick.response_id is not None and pick.response_id != response_id:
            responses.num_refused += 1
            return False
        holder = responses.holder(response_id)
        if holder is not None and holder != ep:
            responses.num_refused += 1
            return False
        self.lifecycle.response_id(pick, response_id, ep)
        return True

    def served(self, pick: Pick, served: str | None, status: int | None = None) -> None:
        """The served-endpoint report for `pick` (module docstring: the trust rule); `status`: the response's
        HTTP status when the caller knows it. A pinned pick (Responses follow-up) has no fallback, so when its
        holder refuses or resets the connection Envoy answers 503 itself with the holder as the served host:
        that 503 asks the pool to probe the holder now (at most once per pick; the probe decides), so clients
        get the router's own 503 naming the response within milliseconds rather than after the next
        scheduled probes."""
        if not served or served == pick.endpoints[0]:
            if status == 503 and pick.request.response_ref is not None and not pick.phases & Phase.SERVED_REPORT:
                pick.phases |= Phase.SERVED_REPORT
                self.pool.report_failure(pick.endpoint_ids[0])
            return
        try:
            k = pick.endpoints.index(served, 1)
        except ValueError:
            self.num_ignored_reports += 1  # not a fallback of this pick: "-" on a local reply, fail-open, forged
            return
        if pick.phases & Phase.SERVED_REPORT:
            self.num_ignored_reports += 1
            return
        pick.phases |= Phase.SERVED_REPORT
        self.num_failovers += 1
        # Envoy tried the list in order: every endpoint before the one that served refused or reset.
        for ep in pick.endpoint_ids[:k]:
            self.pool.report_failure(ep)
        self.lifecycle.failed_over(pick, pick.endpoint_ids[k])

    def first_token(self, pick: Pick, ttft_s: float) -> None:
        """`pick`'s response produced its first token `ttft_s` after the request arrived (module docstring).
        At most one report per pick counts; it may come after `release`."""
        self.lifecycle.first_token(pick, ttft_s)

    def usage(self, pick: Pick, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """`pick`'s response ended with these usage figures (module docstring), once. The time model learns a
        rate only after a `first_token` report (from a TTFT); the hit statistics and feedback take every
        report."""
        self.lifecycle.usage(pick, prompt_tokens, cached_tokens)

    def release(self, pick: Pick) -> None:
        """Once per pick, when the HTTP request ends for any reason (repeats are ignored)."""
        self.lifecycle.released(pick)


_PEER_APPLY: dict[type, Callable[[PoolRouter, tuple[str, int], codec.Message, float], bool]] = {
    codec.Pick: PoolRouter._peer_pick, codec.Done: PoolRouter._peer_done, codec.Release: PoolRouter._peer_release,
    codec.Failover: PoolRouter._peer_failover, codec.Response: PoolRouter._peer_response,
    codec.Observed: PoolRouter._peer_observed,
}
"""How each message type of another replica is applied (`PoolRouter.apply_peer_batch`); True: applied (or
absorbed), False: ignored as outside what that peer could know."""

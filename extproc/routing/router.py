"""`RouterCore`: request -> Decision, plus the prefix index it maintains. Knows nothing of gRPC or HTTP.

Used by the ext_proc servicer (live) and by simulations. Single event loop, not thread-safe.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence

from prefixroute.openai_errors import OpenAIError
from prefixroute.extproc.routing import index_sources, memory
from prefixroute.extproc.routing.index_sources import BlockIndex, SourcedIndex
from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.extproc.routing.request import InferenceRequest, clip
from prefixroute.extproc.routing.scheduling import filters, pickers
from prefixroute.extproc.routing.scheduling.scheduler import Scheduler
from prefixroute.extproc.routing.sessions import SessionId, SessionTable, session_id
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.types import BlockHash, Decision, EndpointId, EndpointState

DEFAULT_RETRY_AFTER_S = 1
"""Retry-After for 503: health probes run about every second, so a retry after 1 s sees fresh state."""

FEEDBACK_SHRINK_RATIO = 0.85
"""Feedback: a response that found much less cached than predicted shrinks the endpoint's index LRU by this
factor (its oldest entries go: the server evidently evicted sooner than the LRU assumed)."""
FEEDBACK_GROW_RATIO = 0.01
"""Feedback: a response that found what was predicted grows the LRU back by this share of its ceiling (the
scraped KV capacity): additive increase, multiplicative decrease, as TCP finds a link's capacity."""
FEEDBACK_MIN_RATIO = 1 / 32
"""Feedback never shrinks an LRU below this share of its ceiling."""
FEEDBACK_SLACK_BLOCKS = 2
"""A response counts as a miss when it found more than this many blocks (and a quarter of the prediction)
fewer cached tokens than predicted: a block or two of difference is the partial last block and rounding."""


class HitRatioStats:
    """Predicted vs actual cached share of prompt tokens, per endpoint, over responses that reported usage.
    Plain counters (floats), read by the metrics thread as a copy."""

    __slots__ = ("num_responses", "prompt_tokens", "predicted_tokens", "cached_tokens", "num_misses")

    def __init__(self) -> None:
        self.num_responses = 0
        self.prompt_tokens = 0.0
        self.predicted_tokens = 0.0
        self.cached_tokens = 0.0
        self.num_misses = 0


class RouterCore:
    """Applies the model check, schedules, and records each pick in the prefix index.

    Errors raised by `route` (`OpenAIError`):
    - 404 ``The model `X` does not exist.`` (vLLM's wording, X clipped to `request.MAX_ECHO_CHARS`) when every endpoint has a known model list and
      none lists the model (unhealthy ones included: a model served only by down endpoints is 503, not 404);
    - 503 with ``retry_after_s`` when the pool is empty or no endpoint serving the model is healthy.
    """

    def __init__(self, settings: RoutingSettings, *, rng: random.Random | None = None,
                 index: PrefixIndex | None = None, retry_after_s: int = DEFAULT_RETRY_AFTER_S,
                 track_prefill: bool = False, event_index: BlockIndex | None = None,
                 note_routed: Callable[[EndpointId, BlockHash, float | None], None] | None = None) -> None:
        """`track_prefill`: the caller will release every routed request (finished, failed or cancelled:
        ``learner.on_release``, the router service's lifecycle does), so the prefix policy's learner may count the
        prefill tokens outstanding per endpoint. Off by
        default: without releases the counts would only grow. `event_index`: the KV-events index the caller
        feeds (extproc/kv_events); endpoints named by `set_event_endpoints` are matched against it.
        `note_routed(endpoint, first block hash, now_s)`: told of every pick with token blocks (the events
        index's check that the server hashes tokens as the router does: `KVEventIndex.note_routed`)."""
        self.settings = settings
        self.index = index if index is not None else PrefixIndex(settings.default_index_capacity_blocks)
        src = settings.index_source
        own = {"events": "none", "feedback": index_sources.FEEDBACK, "approximate": index_sources.APPROXIMATE,
               "auto": index_sources.FEEDBACK}[src]
        self.sourced = SourcedIndex(self.index, event_index, own_source=own)
        self.event_index = event_index
        self._note_routed = note_routed
        self.hit_stats: dict[EndpointId, HitRatioStats] = {}
        self._ceiling: dict[EndpointId, int] = {}  # feedback: LRU capacity ceiling (from the scrape)
        self._fb_capacity: dict[EndpointId, float] = {}  # feedback: the current learned capacity
        self.scheduler = Scheduler(settings, rng, track_prefill=track_prefill)
        # The prefix policy's time model and the picks it waits on (None for the baselines): the router
        # service's lifecycle listener tells it each pick's first token, usage and release.
        self.learner = self.scheduler.learner
        # Chat sessions: only for a policy that uses them (prefix; `Policy.uses_sessions`).
        self.memory = memory.plan(settings)
        self.sessions: SessionTable | None = SessionTable(self.memory.max_sessions, settings.session_ttl_s) \
            if self.scheduler.policy.uses_sessions and settings.session_key != "off" else None
        self.rng = self.scheduler.rng
        self.retry_after_s = retry_after_s
        self._known: set[EndpointId] = set()
        self._capacity_from: dict[EndpointId, tuple[int | None, int | None, int | None]] = {}
        self._restart_epoch: dict[EndpointId, int] = {}
        self.num_caches_cleared = 0

    def route(self, request: InferenceRequest, endpoints: Sequence[EndpointState],
              in_flight: Mapping[EndpointId, int], now_s: float | None = None, *,
              on_decided: Callable[[Decision], None] | None = None) -> Decision:
        """The decision for `request` given a pool snapshot and the in-flight counts; records the pick.
        `on_decided`: called once with the decision `route` returns, as soon as it is final and before the pick
        is recorded (so a caller can answer Envoy first: recording changes nothing the answer holds, and it is
        done before `route` returns, hence before the event loop runs anything else); never called when `route`
        raises; must not raise.

        Kind "other" (``/v1/models``, ...): the least-loaded healthy endpoints (any model), index untouched.
        The caller owns in-flight accounting (acquire the primary it actually uses). `now_s`: a monotonic clock
        in seconds (the gateway's, or a simulation's virtual time), for the time model's draining queues and the
        sessions' expiry (None: sessions never expire, only their LRU bound applies).

        Sessions: a request with a `session_key` whose session (salted by `tenant`) is live and whose endpoint
        E is eligible is scheduled with E credited with the previous turn's prompt, if this request's block
        hashes extend it (when they do not, the client rewrote its history: no credit; E keeps only what the
        index says). An endpoint whose KV events feed the index is not credited beyond them (its events report
        the evictions a session cannot know of; a turn still prefilling is the time model's pending prefix) but
        still keeps its session on a tie. See `Scheduler.schedule`: the session stays on E while E is predicted
        fastest and moves when another endpoint is. After the decision the session records (primary, this
        prompt). A request without a key routes exactly as it would without sessions.
        """
        if not endpoints:
            raise OpenAIError(503, "no endpoint is configured", retry_after_s=self.retry_after_s)
        k = 1 + self.settings.num_fallbacks
        if request.kind == "other":
            healthy = self.scheduler.eligible_cache.view(endpoints, None).endpoints  # healthy, any model
            if not healthy:
                raise OpenAIError(503, "no healthy endpoint", retry_after_s=self.retry_after_s)
            order = pickers.least_load_order(healthy, in_flight, self.rng, k)
            decision = Decision(endpoints=tuple(order), reason="load", policy=self.scheduler.policy.name)
            if on_decided is not None:
                on_decided(decision)
            return decision
        skey = request.session_key
        sessions = self.sessions if skey is not None else None
        session = None
        if sessions is not None:
            s = sessions.lookup(request.tenant, skey, now_s)  # type: ignore[arg-type]
            if s is not None:
                credit = s.credit(request.block_hashes)
                if credit is not None:
                    if s.endpoint in self.sourced.event_endpoints:
                        credit = 0  # its KV events say what it still holds; the session only breaks ties
                    session = (s.endpoint, credit)
        decision = self.scheduler.schedule(request, endpoints, in_flight, self.sourced, now_s, session)
        if not decision.endpoints:
            if not filters.filter_model(endpoints, request.model):
                raise OpenAIError(404, f"The model `{clip(request.model)}` does not exist.", param="model",
                                  type_="NotFoundError")
            what = f"serving model `{clip(request.model)}`" if request.model else ""
            raise OpenAIError(503, f"no healthy endpoint {what}".strip(), retry_after_s=self.retry_after_s)
        if on_decided is not None:
            on_decided(decision)
        primary = decision.endpoints[0]
        self.apply_pick(primary, request.block_hashes,
                        session_id(request.tenant, skey) if sessions is not None else None, now_s)  # type: ignore[arg-type]
        if self._note_routed is not None and request.block_hashes and request.num_prompt_tokens is not None:
            # Lets the events index check the server hashes tokens as the router does (token_mismatch).
            self._note_routed(primary, request.block_hashes[0], now_s)
        return decision

    # --- one apply path for this replica's picks and other replicas' (extproc/peers) ----------------------------
    def apply_pick(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash], session: SessionId | None,
                   now_s: float | None) -> None:
        """A request with `block_hashes` (a turn of `session`, None: no session) was routed to `endpoint`, by
        this replica (`route`) or another (`apply_peer_pick`): the own index records it where it learns from
        picks (not for an endpoint whose KV events tell the truth), the session records its turn."""
        if block_hashes and self._records(endpoint):
            self.index.record(block_hashes, endpoint)
        if session is not None and self.sessions is not None:
            self.sessions.record_id(session, endpoint, block_hashes, now_s)

    def apply_failover(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash],
                       session: SessionId | None) -> None:
        """A request with `block_hashes` was served by `endpoint`, a fallback, here (`record_failover`) or on
        another replica (`apply_peer_failover`): recorded there too, so the next request of this prefix finds
        the cache where it really is; its session, if this was still its last turn, follows it."""
        if block_hashes and self._records(endpoint):
            self.index.record(block_hashes, endpoint)
        if session is not None and self.sessions is not None:
            self.sessions.moved_id(session, endpoint, block_hashes)

    # --- other replicas' picks (extproc/peers; docs/operating.md: Several replicas) -------------------------------------
    def apply_peer_pick(self, key: tuple, endpoint: EndpointId, block_hashes: Sequence[BlockHash],
                        pending_tokens: float | None, session: bytes | None,
                        now_s: float, expires_s: float) -> bool:
        """Another replica routed a request with `block_hashes` to `endpoint`: the same state changes as a local
        pick at `route` (the index records it where the own index learns from picks, the session records its
        turn, the policy queues `pending_tokens` under `key` until `apply_peer_done` or `expires_s`), so the
        next request of that prefix here scores `endpoint` as that replica would. `session`: the turn's
        `sessions.session_id` (None: no session). False (nothing changed) for an endpoint this router does not
        know (not in its pool)."""
        if endpoint not in self._known:
            return False
        self.apply_pick(endpoint, block_hashes, session, now_s)
        if pending_tokens is not None and self.learner is not None:
            self.learner.apply_peer_pick(key, endpoint, pending_tokens, block_hashes, now_s, expires_s)
        return True

    def knows(self, endpoint: EndpointId) -> bool:
        """Whether `endpoint` is in the pool this router last synced with (`sync_endpoints`)."""
        return endpoint in self._known

    def apply_peer_failover(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash],
                            session: bytes | None) -> None:
        """Another replica's request was served by `endpoint`, a fallback (`record_failover` there)."""
        if endpoint in self._known:
            self.apply_failover(endpoint, block_hashes, session)

    def _records(self, endpoint: EndpointId) -> bool:
        """Whether the own index learns from picks at `endpoint` (not when its events tell the truth)."""
        return endpoint not in self.sourced.event_endpoints and self.sourced.own_source != "none"

    def set_event_endpoints(self, endpoints: Sequence[EndpointId]) -> None:
        """The endpoints whose KV events the caller feeds into `event_index` (ignored without one): their
        matches come from the events from now on, and what the own index held for them goes."""
        if self.event_index is None:
            return
        new = frozenset(endpoints)
        for ep in new - self.sourced.event_endpoints:
            self.index.clear_endpoint(ep)
        self.sourced.event_endpoints = new

    def index_source_of(self, decision: Decision) -> str:
        """Where `decision`'s primary match came from (events / feedback / approximate), "" when nothing
        matched: one set lookup, for telemetry."""
        return self.sourced.source_of(decision.endpoints[0]) if decision.matched_blocks else ""

    def index_sources(self, endpoints: Sequence[EndpointId]) -> dict[EndpointId, str]:
        """The index source of each endpoint (events / feedback / approximate / none)."""
        return self.sourced.sources(endpoints)

    def predicted_cached_tokens(self, request: InferenceRequest, decision: Decision) -> float:
        """Prompt tokens the decision expected cached at its primary: matched blocks x tokens per block, at
        most the prompt; a match of every hashed block of a prompt longer than the hashing cap counts the rest
        as cached too, less one block (as the prefix policy prices it). A pinned Responses follow-up
        (``request.known_prefix_tokens`` set) expects at least that much: its previous prompt, held where it is
        pinned."""
        known = request.known_prefix_tokens
        m = decision.matched_blocks
        if not m:
            return float(known) if known is not None else 0.0
        if known is not None:
            return max(float(known), self._matched_tokens(request, m))
        return self._matched_tokens(request, m)

    def _matched_tokens(self, request: InferenceRequest, m: int) -> float:
        """Prompt tokens of `m` matched leading blocks (`predicted_cached_tokens` without a known prefix)."""
        st = self.settings
        if request.num_prompt_tokens is not None:
            per_block, cap, prompt = float(st.kv_block_tokens), st.max_token_blocks, float(request.num_prompt_tokens)
        else:
            per_block, cap = st.tokens_per_block, st.max_blocks
            prompt = request.num_prompt_chars / st.chars_per_token
        n = len(request.block_hashes)
        if m >= n >= cap:
            return max(0.0, prompt - per_block)
        return min(prompt, m * per_block)

    def _feedback(self, request: InferenceRequest, decision: Decision, prompt_tokens: int | None,
                  cached_tokens: int | None, served_by: EndpointId | None) -> None:
        """Compare what the server reported cached with what the decision predicted; in feedback mode adapt
        the endpoint's LRU capacity (AIMD, see FEEDBACK_*). Only the primary's own responses count (a fallback
        served something the decision did not predict), and only blocks not pending at decision time."""
        if cached_tokens is None or not prompt_tokens or prompt_tokens <= 0 or not decision.endpoints:
            return
        ep = decision.endpoints[0]
        if served_by is not None and served_by != ep:
            return
        predicted = self.predicted_cached_tokens(request, decision)
        st = self.hit_stats.get(ep)
        if st is None:
            st = self.hit_stats[ep] = HitRatioStats()
        st.num_responses += 1
        st.prompt_tokens += prompt_tokens
        st.predicted_tokens += predicted
        st.cached_tokens += min(cached_tokens, prompt_tokens)
        # A pinned follow-up's prediction came from its previous response's usage, not from the index: it says
        # nothing about how long the endpoint keeps blocks (and a client that changed its instructions would
        # make it wrong), so only the statistics take it.
        if decision.pending_blocks or decision.session_blocks or request.known_prefix_tokens is not None or \
                self.sourced.source_of(ep) != index_sources.FEEDBACK:
            return
        per_block = self.settings.kv_block_tokens if request.num_prompt_tokens is not None else \
            self.settings.tokens_per_block
        ceiling = self._ceiling.get(ep, self.index.capacity(ep))
        cap = self._fb_capacity.get(ep, float(ceiling))
        if predicted - cached_tokens > max(FEEDBACK_SLACK_BLOCKS * per_block, 0.25 * predicted):
            st.num_misses += 1
            cap = max(ceiling * FEEDBACK_MIN_RATIO, cap * FEEDBACK_SHRINK_RATIO, 1.0)
        elif predicted > 0 and cap < ceiling:
            cap = min(float(ceiling), cap + ceiling * FEEDBACK_GROW_RATIO)
        else:
            return
        self._fb_capacity[ep] = cap
        self.index.set_capacity(ep, max(1, int(cap)))

    def observe_usage(self, request: InferenceRequest, decision: Decision, prompt_tokens: int | None,
                      cached_tokens: int | None, served_by: EndpointId | None = None) -> None:
        """`request`'s response reported these usage figures (at most once per decision, first token or not):
        they feed the predicted-vs-actual hit statistics and, in feedback mode, the endpoint's index capacity
        (`served_by`: the endpoint that served, when the caller knows it)."""
        self._feedback(request, decision, prompt_tokens, cached_tokens, served_by)

    def record_failover(self, request: InferenceRequest, served_by: EndpointId) -> None:
        """The request was served by a fallback (Envoy's ``x-gateway-destination-endpoint-served``): record it
        there too, so the next request of this prefix can find the cache where it really is; its session, if
        this request is still the session's last turn, follows it there."""
        key = request.session_key
        self.apply_failover(served_by, request.block_hashes,
                            session_id(request.tenant, key) if key is not None and self.sessions is not None else None)

    # --- pool changes -----------------------------------------------------------------------------------
    def capacity_blocks(self, state: EndpointState) -> int:
        """Index capacity for `state` in router blocks: scraped num_gpu_blocks (plus its host tier's
        num_cpu_blocks: a prefix offloaded there is still a hit, so the own index must not forget it; feedback
        shrinks the LRU when the tiers hold less) x block_size tokens / tokens per router block (token blocks:
        the blocks when the block sizes agree), else ``default_index_capacity_blocks``."""
        num_blocks = (state.num_gpu_blocks or 0) + (state.num_cpu_blocks or 0) if state.num_gpu_blocks else 0
        if num_blocks and state.block_size and self.settings.tokenizer:
            return max(1, math.floor(num_blocks * state.block_size / self.settings.kv_block_tokens))
        if num_blocks and state.block_size:
            return max(1, math.floor(num_blocks * state.block_size / self.settings.tokens_per_block))
        return self.settings.default_index_capacity_blocks

    def set_capacity(self, endpoint: EndpointId, num_blocks: int) -> None:
        self._ceiling[endpoint] = num_blocks
        self._fb_capacity.pop(endpoint, None)
        self.index.set_capacity(endpoint, num_blocks)

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        """An endpoint left the pool: its index entries (and outstanding prefill estimate) and its sessions go
        with it."""
        if self.sessions is not None:
            self.sessions.forget_endpoint(endpoint)
        self.index.remove_endpoint(endpoint)
        if self.event_index is not None:
            self.event_index.remove_endpoint(endpoint)
        self.hit_stats.pop(endpoint, None)
        self._ceiling.pop(endpoint, None)
        self._fb_capacity.pop(endpoint, None)
        if self.learner is not None:
            self.learner.on_endpoint_removed(endpoint)
        self._known.discard(endpoint)
        self._capacity_from.pop(endpoint, None)
        self._restart_epoch.pop(endpoint, None)

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        """`endpoint`'s KV cache is known empty: forget its prefix-index entries (its capacity stays), so the next
        request of a prefix it held is not predicted a hit there, nor its sessions credited. Called by
        `sync_endpoints` when the pool's ``restart_epoch`` for it changes; the seam for KV events'
        AllBlocksCleared (a later source of the same fact)."""
        # Not the events index: the endpoint's own events say when its cache emptied (AllBlocksCleared, or the
        # publisher's sequence restarting), and the pool sees a restart only at its next scrape, after the new
        # process may already have published blocks the events index must keep.
        self.index.clear_endpoint(endpoint)
        if self.sessions is not None:  # they were credited with what its cache held
            self.sessions.forget_endpoint(endpoint)
        if self.learner is not None:
            self.learner.on_cache_cleared(endpoint)
        self.num_caches_cleared += 1

    def sync_endpoints(self, snapshot: Sequence[EndpointState]) -> None:
        """Bring the index in line with a pool snapshot: drop endpoints no longer present, size each endpoint's
        LRU from its scraped KV capacity, and clear an endpoint whose ``restart_epoch`` changed since the last
        snapshot (`on_cache_cleared`; the first sight of an endpoint only records its epoch). Cheap when nothing
        changed; fit as the pool's ``on_change`` hook."""
        present = {s.endpoint for s in snapshot}
        for ep in self._known - present:
            self.on_endpoint_removed(ep)
        epochs = self._restart_epoch
        for s in snapshot:
            src = (s.num_gpu_blocks, s.block_size, s.num_cpu_blocks)
            if self._capacity_from.get(s.endpoint) != src:
                self._capacity_from[s.endpoint] = src
                self.set_capacity(s.endpoint, self.capacity_blocks(s))
            seen = epochs.get(s.endpoint)
            if seen != s.restart_epoch:
                epochs[s.endpoint] = s.restart_epoch
                if seen is not None:
                    self.on_cache_cleared(s.endpoint)
        self._known = present

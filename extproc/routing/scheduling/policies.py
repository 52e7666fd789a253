"""The selectable policies, each a `Policy` subclass registered in `POLICY_CLASSES` under the name it declares in
`settings.POLICIES`. Each turns a `PolicyInput` into a `Decision` (pure: no I/O, no clock; state is the
injected rng, the round-robin counter and the prefix policy's recent-share counts and outstanding prefill).
`Policy` states the contract of `decide` and of the lifecycle hooks the router calls.

`prefix` (default): the least predicted time-to-first-token, full prefill included, from a time model of
each endpoint (routing/timemodel.py: its pending prefill queue, its decoding load, its learned prefill rate),
plus a charge for the prefill work a request adds for the requests behind it; ties go to the longest match,
then to rendezvous order on the prefix key. See `PrefixPolicy`.

Why the time model and not request counts (issue 12): the earlier `prefix` policy balanced on in-flight
counts and recent shares of picks and priced load in prompt tokens. Near saturation a prefix holder looked
"over", the request moved and prefilled 8k tokens from scratch elsewhere, which made that endpoint busy in
turn: a feedback loop that lost 7.7x to sglang-router's P50 TTFT on many 8k-token system prompts. Priced in
seconds, moving a request costs its whole prefill, so it moves only when that pays; balance is what the
prices produce, not a rule that overrides them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol

import numpy as np

from prefixroute.extproc.routing.hashing import seed_for
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling import filters, pickers, scorers
from prefixroute.extproc.routing.scheduling.scorers import Scored
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import BlockHash, Decision, DecisionReason, EndpointId, EndpointState


@dataclasses.dataclass(slots=True)
class PolicyInput:
    """One decision's inputs. `eligible` is non-empty, in the pool's order; `matches` (from the index) holds
    eligible endpoints only, and `holders` is their states, in the pool's order. `view`, when given, is the
    memoised view whose ``endpoints`` is `eligible` (the same object): per-snapshot positions and rendezvous
    table; None -> policies build what they need from `eligible`."""

    request: InferenceRequest
    eligible: Sequence[EndpointState]
    in_flight: Mapping[EndpointId, int]
    matches: Mapping[EndpointId, int]
    holders: Sequence[EndpointState] = ()
    view: filters.EligibleView | None = None
    now_s: float | None = None  # the caller's monotonic clock at the decision (live or virtual); None: no clock
    # The endpoint that served the request's session's previous turn, whose prompt this request extends (its
    # credit is already in `matches`): eligible, given only to policies with `uses_sessions`; None without.
    session_endpoint: EndpointId | None = None

    def rendezvous(self) -> pickers.RendezvousTable:
        """The rendezvous table of `eligible` (memoised per snapshot when `view` is given)."""
        if self.view is not None and self.view.endpoints is self.eligible:
            return self.view.rendezvous
        return pickers.RendezvousTable(self.eligible)


class Policy:
    """Base of every policy: `decide` per request, and lifecycle hooks that are no-ops unless a policy keeps
    per-endpoint or per-request state. Built once per router (`make_policy`); not thread-safe (one event loop).

    `track_prefill`: the caller calls `on_release` exactly once for every decision of this policy (as
    `RouterCore(track_prefill=True)` promises), so a policy may keep per-request state that releases undo
    (the prefix policy's outstanding prefill tokens). When False, `on_release` may never come: a policy then
    keeps nothing that only a release would remove.
    """

    name: ClassVar[str]
    """A key of `settings.POLICIES`: what `RoutingSettings.policy` selects and `Decision.policy` reports."""
    uses_sessions: ClassVar[bool] = False
    """Whether the router keeps chat sessions for this policy (`sessions.SessionTable`) and credits a session's
    endpoint with its previous turn's prompt (`Scheduler.schedule`). Only the prefix policy: the baselines are
    compared as they are, and none of them looks at matches anyway."""

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        self._settings = settings
        self._k = 1 + settings.num_fallbacks
        self._rng = rng
        self.track_prefill = track_prefill

    def decide(self, inp: PolicyInput) -> Decision:
        """Contract: `Decision.endpoints` lists distinct endpoints of `inp.eligible`, primary first, at most
        ``1 + num_fallbacks``, and is never empty (`inp.eligible` is not). May update this policy's own state
        (counters, recent shares), nothing else; the caller records the pick in the prefix index."""
        raise NotImplementedError

    def on_release(self, request: InferenceRequest, decision: Decision) -> None:
        """Contract: `request`, routed by `decision` (from this policy's `decide`), ended: finished, failed or
        was cancelled. At most once per decision, exactly once when `track_prefill`; it may come after the
        primary left the pool (`on_endpoint_removed`) and must then be absorbed. No-op by default."""

    def on_first_token(self, request: InferenceRequest, decision: Decision, ttft_s: float,
                       prompt_tokens: int | None = None, cached_tokens: int | None = None) -> None:
        """Contract: `request`, routed by `decision`, got its first token `ttft_s` after its arrival. The usage
        figures of the serving endpoint come with it when the caller already knows them (a simulation) and
        otherwise later through `on_usage` (the live gateway learns them at the end of the response). At most
        once per decision, before or after its `on_release` (the gateway's two streams report in no fixed
        order); it may never come (a caller that cannot see first tokens, a non-streamed response, a failed
        request), so a policy must also undo on `on_release` what this would have undone, and bound what it
        keeps for a late report. No-op by default."""

    def on_usage(self, request: InferenceRequest, decision: Decision, prompt_tokens: int | None,
                 cached_tokens: int | None) -> None:
        """Contract: the response of `request` (which had its `on_first_token` without usage) ended, with the
        serving endpoint's prompt and cached tokens (None: it reported none). At most once, before or after
        its `on_release`; it may never come, so what waits for it must be bounded. No-op by default."""

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        """Contract: `endpoint` left the pool; what this policy keeps for it goes (an endpoint of that name
        joining later starts from nothing), and late releases for it are absorbed. No-op by default."""

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        """Contract: `endpoint` stays in the pool but its KV cache is empty (a restart the pool detected; later
        also KV events' AllBlocksCleared): what this policy believes cached there goes. Requests in flight
        there still get their `on_release`. No-op by default (the prefix index is the router's, cleared by
        `RouterCore.on_cache_cleared`)."""

    # --- other replicas' picks (extproc/peers; docs/operating.md: Several replicas) -------------------------------------
    def pending_tokens_of(self, request: InferenceRequest) -> float | None:
        """The uncached prefill this policy queued for `request` at its pick (None: it keeps no queue, or the
        request is no longer pending): what another replica is told to queue. None by default."""
        return None

    def apply_peer_pick(self, key: tuple, endpoint: EndpointId, pending_tokens: float,
                        block_hashes: Sequence[BlockHash], now_s: float, expires_s: float) -> None:
        """Another replica picked `endpoint` for a request (named `key`, never a local request's key) with
        `pending_tokens` to prefill: queue it as a local pick would be (its blocks a pending prefix there)
        until `apply_peer_done(key)` or `expire_peers` past `expires_s`. No-op by default."""

    def apply_peer_done(self, key: tuple) -> None:
        """Another replica's pick `key` got its first token or ended: it leaves the queue. Unknown keys (expired,
        never seen) are absorbed. No-op by default."""

    def expire_peers(self, now_s: float) -> int:
        """Drop peers' picks whose `expires_s` passed (their replica died or their end was lost); how many."""
        return 0

    def take_observations(self) -> list[tuple[EndpointId, float, float, float, float, int]]:
        """What the policy learned from this replica's responses since the last call (`TimeModel.observe`'s
        arguments), for the other replicas; cleared. Empty for a policy that learns nothing."""
        return []

    def apply_peer_observation(self, endpoint: EndpointId, prompt_tokens: float, cached_tokens: float,
                               ttft_s: float, queued_tokens: float, num_decoding: int) -> None:
        """Another replica's policy learned this from one of its responses: learn it too. No-op by default."""

    def num_peer_picks(self) -> int:
        """Peers' picks pending here (a metric)."""
        return 0


class PredictsTtft(Protocol):
    """Capability of a policy that predicts each request's TTFT with a time model (`PrefixPolicy`): what the
    benchmarks (predicted vs actual) and /metrics (the model's figures) read. Declared by `Scheduler.ttft` (the
    policy when it has it, else None), never probed."""

    predictions: collections.deque[tuple[float, float]]

    def time_model_figures(self) -> dict[EndpointId, tuple[float, float, float, int]]: ...


def _decision(order: Sequence[EndpointId], reason: DecisionReason, policy: str, inp: PolicyInput) -> Decision:
    total = len(inp.request.block_hashes)
    matched = inp.matches.get(order[0], 0) if order else 0
    return Decision(endpoints=tuple(order), reason=reason, policy=policy, matched_blocks=matched,
                    total_blocks=total, predicted_hit_ratio=matched / total if total else 0.0)


def prefix_key(request: InferenceRequest, cold_key_blocks: int) -> BlockHash:
    """The rendezvous key of a request: hash of its first `cold_key_blocks` blocks (fewer if it has fewer);
    without blocks, the (model, tenant) seed."""
    hashes = request.block_hashes
    if hashes:
        return hashes[min(cold_key_blocks, len(hashes)) - 1]
    return seed_for(request.model, request.tenant)


class RandomPolicy(Policy):
    """Uniformly random distinct endpoints: the no-information baseline."""

    name = "random"

    def decide(self, inp: PolicyInput) -> Decision:
        order = [s.endpoint for s in self._rng.sample(list(inp.eligible), min(self._k, len(inp.eligible)))]
        return _decision(order, "policy", self.name, inp)


class RoundRobinPolicy(Policy):
    """Cycles through the eligible endpoints in the pool's order; fallbacks are the next ones."""

    name = "round-robin"

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        super().__init__(settings, rng, track_prefill=track_prefill)
        self._counter = itertools.count()

    def decide(self, inp: PolicyInput) -> Decision:
        n = len(inp.eligible)
        start = next(self._counter) % n
        order = [inp.eligible[(start + i) % n].endpoint for i in range(min(self._k, n))]
        return _decision(order, "policy", self.name, inp)


class LeastLoadPolicy(Policy):
    """Fewest in-flight requests (router's own count), then fewest waiting (scraped), then random."""

    name = "least-load"

    def decide(self, inp: PolicyInput) -> Decision:
        order = pickers.least_load_order(inp.eligible, inp.in_flight, self._rng, self._k)
        return _decision(order, "load", self.name, inp)


class ConsistentHashPolicy(Policy):
    """Rendezvous hashing on the prompt prefix only (no load, no threshold): the pure-affinity baseline."""

    name = "consistent-hash"

    def decide(self, inp: PolicyInput) -> Decision:
        key = prefix_key(inp.request, self._settings.cold_key_blocks)
        ranked = inp.rendezvous().ranked(key)
        return _decision([s.endpoint for s in ranked[:self._k]], "policy", self.name, inp)


class ScoredPolicy(Policy):
    """A policy made of one scorer (GIE's Scorer -> Picker): subclasses define `score`, one number per eligible
    endpoint, lower is better. Contract of `decide`: the eligible endpoints by score, equal scores in rendezvous
    order on the request's prefix key (`prefix_key`: requests of one prefix break ties the same way), the
    first ``1 + num_fallbacks``; reason "policy"; the decision reports the primary's match. Subclasses keep
    `score` pure (no state, no I/O); a new one is one file plus its registration (docs/extending.md)."""

    def score(self, inp: PolicyInput) -> Sequence[float]:
        """One score per endpoint of ``inp.eligible``, in that order; lower is better."""
        raise NotImplementedError

    def decide(self, inp: PolicyInput) -> Decision:
        scores = self.score(inp)
        ranked = inp.rendezvous().ranked(prefix_key(inp.request, self._settings.cold_key_blocks))
        tie = {s.endpoint: i for i, s in enumerate(ranked)}
        order = sorted(range(len(inp.eligible)), key=lambda i: (scores[i], tie[inp.eligible[i].endpoint]))
        return _decision([inp.eligible[i].endpoint for i in order[:self._k]], "policy", self.name, inp)


MAX_AWAITING_USAGE = 4096
"""Picks kept for a report still to come (between first token and usage; or released before the first
token's report arrived, the observing stream lagging the routing stream's end): more than a replica has in
flight at once (Envoy's default of 1,024 connections per cluster), so only reports that never come (a cut
stream, a non-streamed response) are dropped, oldest first."""


MAX_PEER_PICKS = 65536
"""Other replicas' picks kept pending at most (oldest out): far more than a fleet has prefilling at once (a
replica's MAX_AWAITING_USAGE x 16 replicas), so only a flood of messages that never end is cut."""


@dataclasses.dataclass(slots=True)
class _TtftPick:
    num_prompt_chars: int  # of its request: all `_learn` needs (the request itself is not kept: its hashes)
    endpoint: EndpointId
    queued_tokens: float
    num_decoding: int
    predicted_s: float
    own_tokens: float


class PrefixPolicy(Policy):
    """Least predicted time-to-first-token, priced with `timemodel.TimeModel` (module docstring).

    For each candidate endpoint: its uncached prefill for this request (prompt tokens estimated from
    characters / ``chars_per_token``, less the matched prefix: the prefix index or a pending prefix there,
    the larger; a match of every hashed block when the prompt is longer than ``max_blocks`` counts the
    unhashed rest as cached too, less one block), its pending prefill queue, its decoding requests (in flight
    less pending) at ``decode_cost_tokens`` per engine step each. Score = predicted TTFT + ``ttft_work_weight`` x the request's
    own prefill seconds there (the work it adds for later requests). Lowest score wins; scores within
    `pickers.TTFT_TIE_RATIO` + `pickers.TTFT_TIE_S` of it tie, broken by the longest match (the holder), then rendezvous order
    on the prefix key; a prefix seen nowhere first goes to the fewest in flight among the tied (at equal load
    it lands where `ConsistentHashPolicy` would put it); a request without hashed blocks has no prefix to keep
    together: its ties go to the fewest in flight, then at random.
    Fallbacks: the next lowest scores.
    So a request leaves its prefix holder only when another endpoint, full prefill included, is predicted
    faster; a hot prefix replicates when its holder's queue makes that true (the router records the replica
    in the index with the pick), and a burst of a new prefix stays on one endpoint (the siblings match its
    pending prefix; moving them would add a whole prefill for no earlier first token).

    Sessions (`PolicyInput.session_endpoint`, see `Scheduler.schedule`): the session's endpoint is scored as
    holding the previous turn's prompt (in `matches`) and wins a tie before the rules above; nothing else
    changes, so a session moves exactly when another endpoint, whole prefill included, is predicted faster.

    Candidates: every eligible endpoint up to ``max_scored_endpoints``; beyond, the holders, the first
    1 + num_fallbacks in rendezvous order and a window of the pool (`EligibleView.scan_order`, rotating
    per decision) up to ``max_scored_endpoints`` in all.

    State (only with `track_prefill`: pending entries need their release): the time model's per-endpoint
    rates, learned from `on_first_token`, and pending requests (added at the pick, removed at first token or
    release). Without `track_prefill` the model keeps its priors and sees no queue (pure prefix + rendezvous).
    `predictions` keeps the last (predicted, actual) TTFT pairs of the primaries, for benchmarks."""

    name = "prefix"
    uses_sessions = True

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        super().__init__(settings, rng, track_prefill=track_prefill)
        self.model = TimeModel(settings.ttft_prior_tokens_per_s, settings.ttft_prior_base_s,
                               decode_cost_tokens=settings.decode_cost_tokens,
                               step_tokens=settings.ttft_step_tokens, window=settings.ttft_rate_window)
        self.scorer = scorers.TtftScorer(settings, self.model)
        self._tpc = 1.0 / settings.chars_per_token
        # Keyed by `InferenceRequest.key` (unique, never reused): entries are a few small numbers each, so the
        # tables cost ~200 bytes per request whatever the client sent.
        self._picks: dict[int, _TtftPick] = {}  # request key -> its pick, until first token or release
        # request key -> (pick, ttft_s) between a first token without usage and its usage report.
        self._awaiting: collections.OrderedDict[int, tuple[_TtftPick, float]] = collections.OrderedDict()
        # request key -> pick, released before any first-token report (which may still come).
        self._released: collections.OrderedDict[int, _TtftPick] = collections.OrderedDict()
        self.predictions: collections.deque[tuple[float, float]] = collections.deque(maxlen=100_000)
        # What `_learn` learned, for the other replicas (`take_observations`); a router that shares nothing
        # keeps at most MAX_AWAITING_USAGE of them.
        self._observed_out: list[tuple[EndpointId, float, float, float, float, int]] = []
        self._scan_offset = 0  # where the next sampling window of a large pool starts (`decide`)
        # Other replicas' pending picks (key -> expiry, oldest first): in `model` as non-local pendings.
        self._peer_expiry: collections.OrderedDict[tuple, float] = collections.OrderedDict()

    def decide(self, inp: PolicyInput) -> Decision:
        """A composition (GIE's Filter -> Scorer -> Picker): the matches merged with the time model's pending
        prefixes, the candidates (`filters.sample_candidates` in a pool over ``max_scored_endpoints``), their
        scores (`scorers.TtftScorer`: one time-model call), the primary among the tied best
        (`pickers.tied_best`, `pickers.pick_tied`), the fallbacks by score; the pick joins the time model's
        pending queue (with `track_prefill`)."""
        req = inp.request
        hashes = req.block_hashes
        pend = self.model.pending_matches(hashes) if hashes else None
        matches = self._with_pending(inp, pend) if pend else inp.matches
        limit_n = self._settings.max_scored_endpoints
        top, candidates = self._sample(inp, matches) if limit_n and len(inp.eligible) > limit_n else \
            (None, inp.eligible)
        scored, insignificant = self.scorer.score(req, candidates, matches, inp.in_flight, inp.now_s)
        tied = pickers.tied_best(scored, matches, longest=bool(matches) and not insignificant)
        if len(tied) == 1:
            primary = tied[0]
        else:
            # > 0: placed as a cold prefix keyed at this many blocks (past an insignificant match)
            cold_key_at = min(max(matches.values()) + self._settings.cold_key_blocks, len(hashes)) \
                if insignificant else 0
            primary = pickers.pick_tied(
                tied, session=inp.session_endpoint, has_prefix=bool(hashes), cold=not matches or bool(cold_key_at),
                top=top, in_flight=inp.in_flight, rng=self._rng,
                rendezvous=lambda: self._weights(inp, hashes[cold_key_at - 1] if cold_key_at else
                                                 prefix_key(req, self._settings.cold_key_blocks)))
        # One more than the fallbacks when there are none: the best alternative explains the decision.
        others: list[Scored] = []
        need = max(self._k - 1, 1)
        for x in scored:
            if x is not primary:
                others.append(x)
                if len(others) == need:
                    break
        order = [primary[scorers.STATE].endpoint, *(x[scorers.STATE].endpoint for x in others[:self._k - 1])]
        if self.track_prefill:
            key = req.key
            queued = self.model.add_pending(key, order[0], primary[scorers.OWN_TOKENS], hashes, inp.now_s)
            self._picks[key] = _TtftPick(req.num_prompt_chars, order[0], queued, primary[scorers.NUM_DECODING],
                                         primary[scorers.PREDICTED_S], primary[scorers.OWN_TOKENS])
        return self._prefix_decision(req, order, matches, insignificant, primary, others, pend)

    def _with_pending(self, inp: PolicyInput, pend: Mapping[EndpointId, int]) -> dict[EndpointId, int]:
        """`inp.matches` with the eligible endpoints' pending prefixes where longer (usually the same endpoints
        the index names: it records each pick at once)."""
        eligible = inp.eligible
        names = inp.view.position if inp.view is not None and inp.view.endpoints is eligible else {
            s.endpoint for s in eligible}
        merged = dict(inp.matches)
        for ep, m in pend.items():
            if m > merged.get(ep, 0) and ep in names:
                merged[ep] = m
        return merged

    def _sample(self, inp: PolicyInput, matches: Mapping[EndpointId, int],
                ) -> tuple[tuple[EndpointState, ...], Sequence[EndpointState]]:
        """A pool over ``max_scored_endpoints``: (the rendezvous top-k, the endpoints to score)."""
        eligible = inp.eligible
        limit_n = self._settings.max_scored_endpoints
        view = inp.view if inp.view is not None and inp.view.endpoints is eligible else filters.EligibleView(eligible)
        holders = inp.holders if len(matches) == len(inp.holders) else [s for s in eligible if s.endpoint in matches]
        top = view.rendezvous_top(prefix_key(inp.request, self._settings.cold_key_blocks), self._k)
        candidates, self._scan_offset = filters.sample_candidates(view, holders, matches, top, inp.session_endpoint,
                                                                  limit_n, self._scan_offset)
        return top, candidates

    @staticmethod
    def _weights(inp: PolicyInput, key: int) -> tuple[np.ndarray, Mapping[EndpointId, int]]:
        """The rendezvous weights of the eligible endpoints for `key`, and their positions in the table."""
        table = inp.rendezvous()
        pos = inp.view.position if inp.view is not None and inp.view.endpoints is table.endpoints else {
            s.endpoint: i for i, s in enumerate(table.endpoints)}
        return table.weights(key), pos

    def _prefix_decision(self, req: InferenceRequest, order: list[EndpointId], matches: Mapping[EndpointId, int],
                         insignificant: bool, primary: Scored, others: list[Scored],
                         pend: Mapping[EndpointId, int] | None) -> Decision:
        hashes = req.block_hashes
        if not hashes:
            reason: DecisionReason = "load"
        elif not matches or insignificant:
            reason = "cold"
        else:
            best_match = max(matches.values())
            m = matches.get(order[0], 0)
            reason = "affinity" if m >= best_match else ("spill" if m == 0 else "load")
        n_total = len(hashes)
        matched = matches.get(order[0], 0)
        alt = others[0] if others else None
        return Decision(endpoints=tuple(order), reason=reason, policy=self.name, matched_blocks=matched,
                        total_blocks=n_total, predicted_hit_ratio=matched / n_total if n_total else 0.0,
                        predicted_ttft_ms=primary[scorers.PREDICTED_S] * 1000.0,
                        alternative_endpoint=alt[scorers.STATE].endpoint if alt is not None else None,
                        alternative_ttft_ms=alt[scorers.PREDICTED_S] * 1000.0 if alt is not None else None,
                        pending_blocks=pend.get(order[0], 0) if pend else 0)

    def pending_tokens_of(self, request: InferenceRequest) -> float | None:
        p = self._picks.get(request.key)
        return p.own_tokens if p is not None else None

    def apply_peer_pick(self, key: tuple, endpoint: EndpointId, pending_tokens: float,
                        block_hashes: Sequence[BlockHash], now_s: float, expires_s: float) -> None:
        if not self.track_prefill:
            return  # no releases, no queue: the peers' picks would have nothing to empty them either
        self.model.add_pending(key, endpoint, pending_tokens, block_hashes, now_s)
        peers = self._peer_expiry
        peers.pop(key, None)
        peers[key] = expires_s  # insertion order is expiry order: one TTL, a monotonic clock
        if len(peers) > MAX_PEER_PICKS:
            old, _ = peers.popitem(last=False)
            self.model.remove_pending(old)

    def apply_peer_done(self, key: tuple) -> None:
        if self._peer_expiry.pop(key, None) is not None:
            self.model.remove_pending(key)

    def expire_peers(self, now_s: float) -> int:
        peers = self._peer_expiry
        n = 0
        while peers:
            key, expires_s = next(iter(peers.items()))
            if expires_s > now_s:
                break
            del peers[key]
            self.model.remove_pending(key)
            n += 1
        return n

    def num_peer_picks(self) -> int:
        return len(self._peer_expiry)

    def time_model_figures(self) -> dict[EndpointId, tuple[float, float, float, int]]:
        """Per endpoint the model knows (learned or with requests pending): (rate tokens/s, base s, pending
        prefill tokens, responses learned from). Built from copies (``dict(d)`` is one C call under the GIL),
        so the metrics thread may call it while the event loop routes."""
        m = self.model
        fits, tokens = dict(m.fits), dict(m.queued_tokens)
        learned = m.num_observations_by_endpoint()
        prior = m.default_fit
        return {ep: (*fits.get(ep, prior), tokens.get(ep, 0.0), learned.get(ep, 0))
                for ep in {*fits, *tokens, *learned}}

    def outstanding_prefill_tokens(self) -> dict[EndpointId, float]:
        """Estimated uncached prefill tokens picked and not yet past their first token (or released), per
        endpoint (a copy; absent = 0): the time model's queues."""
        m = self.model
        return {ep: float(m.pending_tokens(ep)) for ep in m.pending_queue_endpoints()}

    def predicted_ttft_s(self, request: InferenceRequest) -> float | None:
        """The predicted TTFT of `request`'s primary at its pick (None once it left the pending set)."""
        p = self._picks.get(request.key)
        return p.predicted_s if p is not None else None

    def on_first_token(self, request: InferenceRequest, decision: Decision, ttft_s: float,
                       prompt_tokens: int | None = None, cached_tokens: int | None = None) -> None:
        """The request's prefill leaves its endpoint's queue; the endpoint's rate learns from it now (usage
        given) or at `on_usage` (the pick waits there, at most MAX_AWAITING_USAGE of them)."""
        key = request.key
        p = self._picks.pop(key, None)
        if p is None:
            p = self._released.pop(key, None)  # the routing stream closed first (a short response)
            if p is None:
                return
        self.model.remove_pending(key)
        if prompt_tokens is not None:
            self._learn(p, ttft_s, prompt_tokens, cached_tokens)
            return
        awaiting = self._awaiting
        awaiting[key] = (p, ttft_s)
        if len(awaiting) > MAX_AWAITING_USAGE:
            awaiting.popitem(last=False)  # the oldest lost its usage report (stream cut, telemetry stalled)

    def on_usage(self, request: InferenceRequest, decision: Decision, prompt_tokens: int | None,
                 cached_tokens: int | None) -> None:
        """The rate learns from the TTFT `on_first_token` reported, with these usage figures."""
        got = self._awaiting.pop(request.key, None)
        if got is not None:
            self._learn(got[0], got[1], prompt_tokens, cached_tokens)

    def _learn(self, p: _TtftPick, ttft_s: float, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        # In the router's units: its prompt estimate, with the uncached share the endpoint reported (the
        # router's own estimate of it when the response reported no cached tokens: vLLM reports them only
        # with --enable-prompt-tokens-details, and a stream only with stream_options.include_usage).
        est = p.num_prompt_chars * self._tpc
        if prompt_tokens is not None and prompt_tokens > 0 and cached_tokens is not None:
            share = max(0.0, min(1.0, (prompt_tokens - cached_tokens) / prompt_tokens))
            cached = est * (1.0 - share)
        else:
            cached = est - p.own_tokens
        self.model.observe(p.endpoint, est, cached, ttft_s, p.queued_tokens, p.num_decoding)
        self.predictions.append((p.predicted_s, ttft_s))
        out = self._observed_out
        if len(out) < MAX_AWAITING_USAGE:  # bounded when no one takes them
            out.append((p.endpoint, est, cached, ttft_s, p.queued_tokens, p.num_decoding))

    def take_observations(self) -> list[tuple[EndpointId, float, float, float, float, int]]:
        out = self._observed_out
        if not out:
            return []
        self._observed_out = []
        return out

    def apply_peer_observation(self, endpoint: EndpointId, prompt_tokens: float, cached_tokens: float,
                               ttft_s: float, queued_tokens: float, num_decoding: int) -> None:
        self.model.observe(endpoint, prompt_tokens, cached_tokens, ttft_s, queued_tokens, num_decoding)

    def on_release(self, request: InferenceRequest, decision: Decision) -> None:
        """The request ended: if no first token was reported, it leaves the queue, and its pick waits (at most
        MAX_AWAITING_USAGE of them) for a first token that may still come: the observing stream reports in
        no fixed order with the routing stream's end. A pick awaiting its usage report keeps waiting too."""
        key = request.key
        p = self._picks.pop(key, None)
        if p is not None:
            self.model.remove_pending(key)
            released = self._released
            released[key] = p
            if len(released) > MAX_AWAITING_USAGE:
                released.popitem(last=False)

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        self.model.forget_endpoint(endpoint)
        for key in [key for key, p in self._picks.items() if p.endpoint == endpoint]:
            del self._picks[key]
        for key in [key for key, (p, _) in self._awaiting.items() if p.endpoint == endpoint]:
            del self._awaiting[key]
        for key in [key for key, p in self._released.items() if p.endpoint == endpoint]:
            del self._released[key]

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        self.model.clear_prefixes(endpoint)


_CLASSES_BY_NAME = {p.name: p for p in (PrefixPolicy, ConsistentHashPolicy, LeastLoadPolicy,
                                         RoundRobinPolicy, RandomPolicy)}
POLICY_CLASSES: dict[str, type[Policy]] = {name: _CLASSES_BY_NAME[name] for name in POLICIES}
"""The class of every name in `settings.POLICIES`, in its order (a declared name without a class fails here)."""


def make_policy(settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> Policy:
    """The policy named by ``settings.policy`` (validated by RoutingSettings); `track_prefill`: see `Policy`."""
    return POLICY_CLASSES[settings.policy](settings, rng, track_prefill=track_prefill)

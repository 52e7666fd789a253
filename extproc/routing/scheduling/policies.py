"""The selectable policies, each a `Policy` subclass registered in `POLICY_CLASSES` under the name it declares in
`settings.POLICIES`. Each turns a `PolicyInput` into a `Decision` (pure: no I/O, no clock; state is the
injected rng, the round-robin counter and the prefix policy's recent-share counts and outstanding prefill).
`Policy` states the contract of `decide` and of the lifecycle hooks the router calls.

`prefix` (default): the least predicted time-to-first-token, full prefill included, from a time model of
each endpoint (routing/timemodel.py: its pending prefill queue, its decoding load, its learned prefill rate),
plus a charge for the prefill work a request adds for the requests behind it; ties go to the longest match,
then to rendezvous order on the prefix key. See `PrefixPolicy`.

Why the time model and not request counts: the earlier `prefix` policy balanced on in-flight
counts and recent shares of picks and priced load in prompt tokens. Near saturation a prefix holder looked
"over", the request moved and prefilled 8k tokens from scratch elsewhere, which made that endpoint busy in
turn: a feedback loop that lost 7.7x to sglang-router's P50 TTFT on many 8k-token system prompts. Priced in
seconds, moving a request costs its whole prefill, so it moves only when that pays; balance is what the
prices produce, not a rule that overrides them.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from prefixroute.extproc.routing import memory
from prefixroute.extproc.routing.conversations import NO_OUTLOOK, ConversationTable
from prefixroute.extproc.routing.hashing import seed_for
from prefixroute.extproc.routing.scheduling.conversation_load import ConversationLoad
from prefixroute.extproc.routing.scheduling.placement import EvictionOrder, Placement
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling import filters, pickers, scorers
from prefixroute.extproc.routing.scheduling.scorers import Scored
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.extproc.routing.ttft_learner import TtftLearner
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
    # Each endpoint's blocks in eviction order (the KV-events index), for placement; None: not known.
    order: EvictionOrder | None = None

    def rendezvous(self) -> pickers.RendezvousTable:
        """The rendezvous table of `eligible` (memoised per snapshot when `view` is given)."""
        if self.view is not None and self.view.endpoints is self.eligible:
            return self.view.rendezvous
        return pickers.RendezvousTable(self.eligible)


class Policy:
    """Base of every policy: `decide`, per request, and nothing else (what happens to a request after its
    decision is the router service's lifecycle, extproc/lifecycle.py; the prefix policy's time model learns
    from it through its `ttft_learner.TtftLearner`). Built once per router (`make_policy`); not thread-safe
    (one event loop). `track_prefill`: the caller releases every pick (`RouterCore(track_prefill=True)`), so
    the prefix policy's picks may join its time model's pending queue."""

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

    State (`learner`, a `ttft_learner.TtftLearner`; pending entries only with `track_prefill`, as they need
    their release): the time model's per-endpoint rates, learned from first tokens, and pending requests
    (added at the pick, removed at first token or
    release). Without `track_prefill` the model keeps its priors and sees no queue (pure prefix + rendezvous).
    `predictions` keeps the last (predicted, actual) TTFT pairs of the primaries, for benchmarks."""

    name = "prefix"
    uses_sessions = True

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        super().__init__(settings, rng, track_prefill=track_prefill)
        # The time model and the picks it waits on (their first token, usage, release): the lifecycle's.
        self.learner = TtftLearner(settings, track_prefill=track_prefill)
        self.model = self.learner.model
        self.scorer = scorers.TtftScorer(settings, self.model)
        self._scan_offset = 0  # where the next sampling window of a large pool starts (`decide`)
        # Placement under cache pressure (routing/scheduling/placement.py), when a placement setting is on.
        self.placement = Placement(settings, self.model) if Placement.enabled(settings) else None
        # Conversations placed by the load they will bring (scheduling/conversation_load.py), unless off.
        plan = memory.plan(settings)
        self.conversations = ConversationLoad(self.model, ConversationTable(plan.max_conversations, plan.max_roots),
                                              settings.conversation_horizon_turns) \
            if settings.conversation_horizon_turns > 0 else None

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
        conversations = self.conversations
        outlook = conversations.outlook(req, max(matches.values()) if matches else 0) \
            if conversations is not None else NO_OUTLOOK
        conv = outlook.conversation
        scored, insignificant = self.scorer.score(req, candidates, matches, inp.in_flight, inp.now_s,
                                                  *((conv.endpoint, conv.num_tokens) if conv is not None else ()))
        if conversations is not None:
            scored = conversations.adjust(outlook, scored, inp.now_s)
        placement = self.placement
        if placement is not None:
            scored = placement.adjust(req, scored, {} if insignificant else matches, inp.order)
            placement.observe(req)
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
        if placement is not None:
            placement.on_pick(req, order[0], inp.order)
        if conversations is not None:
            conversations.record(req, outlook, primary, inp.now_s, self.scorer.prompt_tokens(req)[0])
        self.learner.add_pick(req, order[0], primary[scorers.OWN_TOKENS], primary[scorers.NUM_DECODING],
                              primary[scorers.PREDICTED_S], inp.now_s, primary[scorers.OWN_WORK])
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

_CLASSES_BY_NAME = {p.name: p for p in (PrefixPolicy, ConsistentHashPolicy, LeastLoadPolicy,
                                         RoundRobinPolicy, RandomPolicy)}
POLICY_CLASSES: dict[str, type[Policy]] = {name: _CLASSES_BY_NAME[name] for name in POLICIES}
"""The class of every name in `settings.POLICIES`, in its order (a declared name without a class fails here)."""


def make_policy(settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> Policy:
    """The policy named by ``settings.policy`` (validated by RoutingSettings); `track_prefill`: see `Policy`."""
    return POLICY_CLASSES[settings.policy](settings, rng, track_prefill=track_prefill)

"""The selectable policies, each a `Policy` subclass registered in `POLICY_CLASSES` under the name it declares in
`settings.POLICIES`. Each turns a `PolicyInput` into a `Decision` (pure: no I/O, no clock; state is the
injected rng, the round-robin counter and the prefix policy's recent-share counts and outstanding prefill).
`Policy` states the contract of `decide` and of the lifecycle hooks the router calls.

`prefix` (default). First the balance limits split the eligible endpoints into *under* and *over*: over = more
in flight than ``balance_factor`` x the mean in-flight + ``balance_slack`` (or at ``concurrency_threshold``),
or a recent share of picks above ``balance_factor`` x fair. Only when every endpoint is over do the over ones
compete. Then, in order:
1. No block hashed (prompt shorter than one block): least cost on load alone (reason "load").
2. Prefix seen nowhere among eligible endpoints -> rendezvous (HRW) keyed on the chained hash of the first
   ``cold_key_blocks`` blocks, with bounded loads: the first endpoint in HRW order at or under
   ``cold_balance_factor`` x the mean in-flight (reason "cold"), and, when the caller reports releases
   (``track_prefill``, `Policy.on_release`), at or under that factor x the mean outstanding
   prefill tokens. At equal load this is plain rendezvous: requests sharing a system prompt converge and
   each endpoint owns ~1/N of new prefixes.
3. Otherwise -> the least *cost* in prompt tokens (Dynamo-like): prefill the endpoint would have to compute
   (hashed tokens not held there) + ``load_cost_tokens`` x in-flight + ``queue_cost_tokens`` x waiting +
   ``kv_cost_tokens`` x KV usage, computed as weighted [0, 1] scorers whose weights are token amounts
   (scorers.py); in pools larger than ``max_scored_endpoints``, over the holders plus a random sample.
   Ties by load then random. Reason "affinity" when the primary holds the longest match; "spill" when an
   endpoint holding a longer match was over a limit; "load" when load outweighed a partial match.
   Fallbacks: the next cheapest, then endpoints over the limits.

`ttft` (opt-in, issue 12): the least predicted time-to-first-token, full prefill included, from a time model
of each endpoint (routing/timemodel.py: pending prefill queue, decoding load, learned prefill rate) plus a
charge for the prefill work a request adds; see `TtftPolicy`. It needs `on_first_token` to learn rates and
to empty its queues at the first token (the virtual fleet calls it; the live gateway does not yet).

Why `prefix` is as it is (virtual benchmarks, bench/virtual.py): the earlier version scored prefix match as a fraction of the prompt
against load scores scaled to a fixed threshold of 32 in flight, so a short shared instruction or system prompt
pulled every new document or session to one endpoint and nothing spilled before 32. A
cost in tokens lets a 256-token shared prefix lose against a few requests of load while an 8,000-token one
wins; the limits relative to the fleet's mean make a hot prefix spill and then spread (its second endpoint is
recorded in the index); bounded-load cold placement sends new prefixes away from busy endpoints; and bounding
outstanding prefill tokens as well (when releases are reported) tells a long prompt from a short one, as
requests differ 100x in length.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from prefixroute.extproc.routing.hashing import seed_for
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling import filters, pickers
from prefixroute.extproc.routing.scheduling.scorers import (InFlightScorer, KvCacheScorer, PrefixScorer, QueueScorer,
                                                    Scorer, ScoringContext, weighted_scores)
from prefixroute.extproc.routing.settings import POLICIES, RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.extproc.routing.types import BlockHash, Decision, DecisionReason, EndpointId, EndpointState


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

    def on_first_token(self, request: InferenceRequest, decision: Decision, ttft_s: float, prompt_tokens: int,
                       cached_tokens: int) -> None:
        """Contract: `request`, routed by `decision`, got its first token `ttft_s` after its pick; the serving
        endpoint reported `prompt_tokens` and `cached_tokens` (usage). At most once per decision, before its
        `on_release`; it may never come (a caller that cannot see first tokens, a failed request), so a policy
        must also undo on `on_release` what this would have undone. No-op by default."""

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        """Contract: `endpoint` left the pool; what this policy keeps for it goes (an endpoint of that name
        joining later starts from nothing), and late releases for it are absorbed. No-op by default."""

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        """Contract: `endpoint` stays in the pool but its KV cache is empty (a restart the pool detected; later
        also KV events' AllBlocksCleared): what this policy believes cached there goes. Requests in flight
        there still get their `on_release`. No-op by default (the prefix index is the router's, cleared by
        `RouterCore.on_cache_cleared`)."""


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


SHARE_WINDOW_PER_ENDPOINT = 32
"""The recent-share estimate of `PrefixPolicy` decays over about 32 picks per endpoint: long enough that a
share of 1.5 x fair is not noise (a binomial share over 32 picks has a relative spread of ~17%), short enough
to follow a workload that changes within a minute at a few requests per second per endpoint."""


SHARE_WARMUP_PICKS = 4
"""The share limit applies once the window holds this many picks per endpoint on average: before that a
share is a handful of requests (the first pick alone is 100% of one endpoint)."""


class PrefixPolicy(Policy):
    """Prefix affinity priced against load, an adaptive balance limit, rendezvous cold placement (module doc)."""

    name = "prefix"

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        super().__init__(settings, rng, track_prefill=track_prefill)
        self._prefix = PrefixScorer()
        t = settings.concurrency_threshold
        # Load scorers are 1 - x / scale: weight = cost per unit x scale gives "constant - cost x units" in
        # prompt tokens, the currency of the prefix term (`_scorers`).
        self._load_terms: list[tuple[Scorer, float]] = [
            (InFlightScorer(), settings.load_cost_tokens * t),
            (QueueScorer(), settings.queue_cost_tokens * settings.queue_scale),
            (KvCacheScorer(), settings.kv_cost_tokens),
        ]
        self._tokens_per_block = settings.tokens_per_block * settings.prefix_weight
        # Estimated uncached prefill tokens sent to each endpoint and not yet released (`on_release`);
        # kept only when the caller reports releases (`track_prefill`), see `_cold_order`.
        self._prefill: dict[EndpointId, float] = {}
        self._tokens_per_char = 1.0 / settings.chars_per_token
        # Recent picks per endpoint, exponentially decayed per decision (window ~ SHARE_WINDOW_PER_ENDPOINT x
        # endpoints). Stored scaled by a growing unit `_unit` so a pick costs O(1) instead of decaying all.
        self._picks: dict[EndpointId, float] = {}
        self._picks_sum = 0.0
        self._unit = 1.0

    def _scorers(self, total_blocks: int) -> list[tuple[Scorer, float]]:
        """Weights in prompt tokens for one request: the prefix score (matched / total blocks) times the
        tokens hashed is the prefill an endpoint saves; the load scorers turn into token costs."""
        return [(self._prefix, total_blocks * self._tokens_per_block), *self._load_terms]

    def over_share(self, num_eligible: int) -> set[EndpointId]:
        """Endpoints whose recent share of picks is above ``balance_factor`` x the fair share (1 / eligible
        endpoints): in-flight counts cannot see an imbalance at low load (requests finish before the next
        one arrives), while the share of requests each endpoint gets is what hot-spotting is measured by.
        Empty until the window holds SHARE_WARMUP_PICKS picks per endpoint. Picks are counted over every
        decision of this policy, so in a pool serving several models the fair share is approximate; an
        endpoint that leaves decays out of the window. Cost: one max() over the endpoints picked recently
        (C speed); the set is built only when one is over."""
        picks = self._picks
        if not picks:
            return set()
        mean = self._picks_sum / num_eligible
        if mean < SHARE_WARMUP_PICKS * self._unit:
            return set()
        limit = self._settings.balance_factor * mean
        if max(picks.values()) <= limit:
            return set()
        return {ep for ep, w in picks.items() if w > limit}

    def _note_pick(self, endpoint: EndpointId, num_eligible: int) -> None:
        unit = self._unit * (1.0 + 1.0 / (SHARE_WINDOW_PER_ENDPOINT * num_eligible))
        if unit > 1e12:  # rescale before floats lose the small terms
            inv = 1.0 / unit
            self._picks = {ep: w * inv for ep, w in self._picks.items() if w * inv > 1e-6}
            self._picks_sum *= inv
            unit = 1.0
        self._unit = unit
        self._picks[endpoint] = self._picks.get(endpoint, 0.0) + unit
        self._picks_sum += unit

    def _cold_order(self, inp: PolicyInput, candidates: Sequence[EndpointState],
                    rest: Sequence[EndpointState], mean_in_flight: float) -> list[EndpointId]:
        """Rendezvous order on the prefix key with bounded loads (Mirrokni et al.'s consistent hashing with
        bounded loads, on HRW): endpoints at or under ``cold_balance_factor`` x the mean in-flight come first
        (there is always one: the least loaded is at or under the mean), then the other candidates, then
        those over the limits, each group in rendezvous order. At equal load (idle fleet, or a test) this is
        plain rendezvous: adding or removing an endpoint moves only its share of new prefixes.

        With `track_prefill`, "light" also requires outstanding prefill tokens at or under
        ``cold_balance_factor`` x their mean (when that leaves any endpoint): a count of requests cannot
        tell a 30k-token prompt from a 300-token one."""
        k = self._k
        key = prefix_key(inp.request, self._settings.cold_key_blocks)
        # HRW order of every eligible endpoint once (numpy); the rendezvous order of any subset below is that
        # order filtered to the subset, so the groups are walked from the top and the walk stops at k.
        ranked = inp.rendezvous().ranked(key)
        # `_decide` makes candidates the eligible endpoints less `rest` (disjoint, one or the other may be
        # empty): skipping the few in `rest` while walking avoids building the candidates' order (O(N)).
        if not rest and len(candidates) == len(inp.eligible):
            skip: set[EndpointId] | frozenset[EndpointId] = frozenset()
        elif len(candidates) + len(rest) == len(inp.eligible):
            skip = {s.endpoint for s in rest}
        else:  # not that split (a caller of its own): membership by name
            names = {s.endpoint for s in candidates}
            skip = {s.endpoint for s in ranked if s.endpoint not in names}
        in_flight = inp.in_flight
        order: list[EndpointId] = []
        if in_flight:
            get = in_flight.get
            bound = self._settings.cold_balance_factor * mean_in_flight
            prefill = self._prefill
            if prefill:
                ranked_c = [s for s in ranked if s.endpoint not in skip] if skip else ranked
                # Exact earlier form (only with track_prefill): the prefill test needs every light endpoint.
                light = [s for s in candidates if get(s.endpoint, 0) <= bound]
                if len(light) > 1:
                    # Requests differ by 100x in prompt length: among the endpoints light on requests, keep
                    # those also at or under the bound on outstanding prefill tokens (none -> the request
                    # bound alone).
                    pget = prefill.get
                    pbound = self._settings.cold_balance_factor * sum(prefill.values()) / len(inp.eligible)
                    light = [s for s in light if pget(s.endpoint, 0.0) <= pbound] or light
                if light and len(light) < len(candidates):
                    order = pickers.first_in_order(ranked_c, light, k)
                    if len(order) < k:
                        heavy = [s for s in candidates if get(s.endpoint, 0) > bound]
                        order += pickers.first_in_order(ranked_c, heavy, k - len(order))
                else:
                    order = [s.endpoint for s in ranked_c[:k]]
            else:
                # Light (at or under the bound) first, then heavy, each in HRW order. When all or none are
                # light this is plain HRW order, as the earlier two-branch form had it.
                heavy_first: list[EndpointId] = []
                for s in ranked:
                    ep = s.endpoint
                    if ep in skip:
                        continue
                    if get(ep, 0) <= bound:
                        order.append(ep)
                        if len(order) == k:
                            return order
                    elif len(heavy_first) < k:
                        heavy_first.append(ep)
                order += heavy_first[:k - len(order)]
        else:
            order = list(itertools.islice((s.endpoint for s in ranked if s.endpoint not in skip), k))
        if len(order) < k and rest:
            order += pickers.first_in_order(ranked, rest, k - len(order))
        return order

    @staticmethod
    def mean_in_flight(inp: PolicyInput) -> float:
        """Mean in-flight requests per eligible endpoint: the in-flight counts given (the router's, every
        endpoint) over the eligible endpoints. Exact for one-model pools; an overestimate (less spilling)
        when endpoints of other models carry load."""
        return sum(inp.in_flight.values()) / len(inp.eligible) if inp.in_flight else 0.0

    def balance_limit(self, inp: PolicyInput, mean_in_flight: float | None = None) -> int:
        """In-flight count at or above which an endpoint is 'over' for this decision: the lower of the fixed
        ``concurrency_threshold`` and ``balance_factor x mean in-flight + balance_slack`` (strictly above
        that is over; see `mean_in_flight`)."""
        st = self._settings
        if mean_in_flight is None:
            mean_in_flight = self.mean_in_flight(inp)
        adaptive = int(st.balance_factor * mean_in_flight + st.balance_slack) + 1
        return min(st.concurrency_threshold, adaptive)

    def decide(self, inp: PolicyInput) -> Decision:
        d = self._decide(inp)
        if d.endpoints:
            self._note_pick(d.endpoints[0], len(inp.eligible))
            if self.track_prefill:
                tokens = self.prefill_tokens(inp.request, d)
                if tokens > 0:
                    ep = d.endpoints[0]
                    self._prefill[ep] = self._prefill.get(ep, 0.0) + tokens
        return d

    def prefill_tokens(self, request: InferenceRequest, decision: Decision) -> float:
        """Estimated prompt tokens the primary of `decision` has to compute for `request`: its prompt
        (characters / ``chars_per_token``, the whole prompt, hashed or not) less the matched blocks. >= 0;
        the same figure at pick and at release, so an endpoint's sum returns to 0 once all its picks are
        released."""
        return max(0.0, request.num_prompt_chars * self._tokens_per_char
                   - decision.matched_blocks * self._settings.tokens_per_block)

    def on_release(self, request: InferenceRequest, decision: Decision) -> None:
        """The request's estimated prefill leaves the primary's outstanding sum. A no-op unless
        `track_prefill`; the sum never goes negative (a release without its pick is absorbed). A lost release
        leaves the endpoint looking busier for cold placement only, until it leaves the pool."""
        if not self.track_prefill or not decision.endpoints:
            return
        ep = decision.endpoints[0]
        left = self._prefill.get(ep, 0.0) - self.prefill_tokens(request, decision)
        if left > 0.5:  # under half a token is float residue of the additions
            self._prefill[ep] = left
        else:
            self._prefill.pop(ep, None)

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        """Its outstanding prefill goes (its recent share decays out of the window by itself)."""
        self._prefill.pop(endpoint, None)

    def outstanding_prefill_tokens(self) -> dict[EndpointId, float]:
        """Estimated uncached prefill tokens picked and not yet released, per endpoint (copy; absent = 0)."""
        return dict(self._prefill)

    def _decide(self, inp: PolicyInput) -> Decision:
        st = self._settings
        k = self._k
        mean = self.mean_in_flight(inp)
        limit = self.balance_limit(inp, mean)
        under, over = filters.split_threshold(inp.eligible, inp.in_flight, limit)
        hot = self.over_share(len(inp.eligible))
        if hot:
            # An idle endpoint (nothing in flight) cannot make this request wait, so its recent share alone
            # does not move a request away from its cache: sequential traffic sharing one system prompt
            # keeps its affinity; the limit acts once the hot endpoint is busy.
            in_flight = inp.in_flight
            hot = {ep for ep in hot if in_flight.get(ep, 0) > 0}
        if hot and len(hot) < len(inp.eligible):
            view = inp.view
            if not over and under is inp.eligible and view is not None and view.endpoints is under:
                # Nobody at the limit: over = the hot endpoints, under = the others, both in pool order,
                # found by position in O(hot) (the general form below walks every endpoint twice).
                over = view.in_pool_order(hot)
                under = list(under)
                for s in reversed(over):
                    del under[view.position[s.endpoint]]
            else:
                over = [s for s in inp.eligible
                        if s.endpoint in hot or inp.in_flight.get(s.endpoint, 0) >= limit]
                under = [s for s in under if s.endpoint not in hot]
        candidates = under or over
        rest = over if under else []
        hashes = inp.request.block_hashes
        matches = inp.matches

        if hashes and not matches:
            return _decision(self._cold_order(inp, candidates, rest, mean), "cold", self.name, inp)

        limit_n = st.max_scored_endpoints
        if limit_n and len(candidates) > limit_n:
            if rest:  # candidates are the endpoints under the limits: so are the holders to score
                rest_names = {s.endpoint for s in rest}
                holders = [s for s in inp.holders if s.endpoint not in rest_names]
            else:
                holders = list(inp.holders)
            candidates = self._sample(candidates, holders, limit_n)
        ctx = ScoringContext(in_flight=inp.in_flight, matches=matches, total_blocks=len(hashes),
                             concurrency_threshold=st.concurrency_threshold, queue_scale=st.queue_scale)
        scorers = self._scorers(len(hashes))
        scores = weighted_scores(ctx, candidates, scorers)
        order = pickers.max_score_order(candidates, scores, inp.in_flight, self._rng, k)
        if len(order) < k and rest:
            rest_scores = weighted_scores(ctx, rest, scorers)
            order += pickers.max_score_order(rest, rest_scores, inp.in_flight, self._rng, k - len(order))

        reason: DecisionReason
        if not hashes:
            reason = "load"
        else:
            # `matches` holds eligible endpoints only (the scheduler filters it) and is usually tiny.
            primary_match = matches.get(order[0], 0)
            over_names = {s.endpoint for s in rest}
            best_candidate = max((n for ep, n in matches.items() if ep not in over_names), default=0)
            best_over = max((n for ep, n in matches.items() if ep in over_names), default=0)
            if best_over > primary_match and best_over > best_candidate:
                reason = "spill"
            elif primary_match > 0 and primary_match >= best_candidate:
                reason = "affinity"
            else:
                reason = "load"
        return _decision(order, reason, self.name, inp)

    def _sample(self, candidates: Sequence[EndpointState], holders: Sequence[EndpointState],
                limit: int) -> list[EndpointState]:
        """`holders` (the candidates holding part of the prefix, all of them) + other candidates drawn
        uniformly at random, `limit` in all (more when more than `limit` endpoints hold the prefix: none is
        skipped). Independent draws, not a window of the pool: endpoints busy together are often neighbours
        in the configured order (one host, one rack)."""
        out = list(holders)
        taken = {s.endpoint for s in holders}
        n = len(candidates)
        rand = self._rng.random
        for _ in range(2 * limit):  # with replacement, duplicates skipped: O(limit), no O(n) shuffle
            if len(out) >= limit:
                break
            s = candidates[int(rand() * n)]
            if s.endpoint not in taken:
                taken.add(s.endpoint)
                out.append(s)
        return out


TTFT_TIE_S = 0.001
TTFT_TIE_RATIO = 0.05
"""Scores within 5% + 1 ms of the best are a tie (then: the longest match, then rendezvous order). Rates
learned on identical GPUs differ by a few percent (noise of ~64 responses), and without a relative margin the
endpoint that happens to look fastest took every cold prefix of an idle fleet (1.6x its fair share at 20% load
in the shared-prompts sweep); within 5% placement stays rendezvous and affinity stays with the holder."""


@dataclasses.dataclass(slots=True)
class _TtftPick:
    request: InferenceRequest  # held so that its id() (the key) is not reused while it is pending
    endpoint: EndpointId
    queued_tokens: float
    num_decoding: int
    predicted_s: float


class TtftPolicy(Policy):
    """Least predicted time-to-first-token (issue 12, opt-in), priced with `timemodel.TimeModel`.

    For each candidate endpoint: its uncached prefill for this request (prompt tokens estimated from
    characters / ``chars_per_token``, less the matched prefix: the prefix index or a pending prefix there,
    the larger; a match of every hashed block when the prompt is longer than ``max_blocks`` counts the
    unhashed rest as cached too, less one block), its pending prefill queue, its decoding requests (in flight
    less pending) at ``load_cost_tokens`` each. Score = predicted TTFT + ``ttft_work_weight`` x the request's
    own prefill seconds there (the work it adds for later requests). Lowest score wins; scores within
    `TTFT_TIE_RATIO` + `TTFT_TIE_S` of it tie, broken by the longest match (the holder), then rendezvous order
    on the prefix key (cold prefixes land where `ConsistentHashPolicy` would put them at equal load).
    Fallbacks: the next lowest scores.
    So a request leaves its prefix holder only when another endpoint, full prefill included, is predicted
    faster; a hot prefix replicates when its holder's queue makes that true (the router records the replica
    in the index with the pick), and a burst of a new prefix stays on one endpoint (the siblings match its
    pending prefix; moving them would add a whole prefill for no earlier first token).

    Candidates: every eligible endpoint up to ``max_scored_endpoints``; beyond, the holders, the first
    1 + num_fallbacks in rendezvous order and a random sample (`PrefixPolicy._sample`).

    State (only with `track_prefill`: pending entries need their release): the time model's per-endpoint
    rates, learned from `on_first_token`, and pending requests (added at the pick, removed at first token or
    release). Without `track_prefill` the model keeps its priors and sees no queue (pure prefix + rendezvous).
    `predictions` keeps the last (predicted, actual) TTFT pairs of the primaries, for benchmarks."""

    name = "ttft"

    def __init__(self, settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> None:
        super().__init__(settings, rng, track_prefill=track_prefill)
        self.model = TimeModel(settings.ttft_prior_tokens_per_s, settings.ttft_prior_base_s,
                               decode_cost_tokens=settings.load_cost_tokens, window=settings.ttft_rate_window)
        self._tpc = 1.0 / settings.chars_per_token
        self._tpb = settings.tokens_per_block
        self._picks: dict[int, _TtftPick] = {}  # id(request) -> its pick, until first token or release
        self.predictions: collections.deque[tuple[float, float]] = collections.deque(maxlen=100_000)

    def _uncached(self, prompt_tokens: float, matched: int, num_hashed: int) -> float:
        if matched <= 0:
            return prompt_tokens
        if matched >= num_hashed and num_hashed >= self._settings.max_blocks:
            return min(prompt_tokens, self._tpb)
        return max(0.0, prompt_tokens - matched * self._tpb)

    def decide(self, inp: PolicyInput) -> Decision:
        st = self._settings
        k = self._k
        req = inp.request
        hashes = req.block_hashes
        eligible = inp.eligible
        matches = inp.matches
        model = self.model
        # Pending prefixes (usually the same endpoints the index names: it records each pick at once).
        pend = model.pending_matches(hashes) if hashes else None
        if pend:
            names = inp.view.position if inp.view is not None and inp.view.endpoints is eligible else {
                s.endpoint for s in eligible}
            merged = dict(matches)
            for ep, m in pend.items():
                if m > merged.get(ep, 0) and ep in names:
                    merged[ep] = m
            matches = merged
        limit_n = st.max_scored_endpoints
        weights = None  # HRW weights of the eligible endpoints for this prefix, computed when needed (numpy)
        if limit_n and len(eligible) > limit_n:
            table = inp.rendezvous()
            weights = table.weights(prefix_key(req, st.cold_key_blocks))
            holders = inp.holders if len(matches) == len(inp.holders) else [
                s for s in eligible if s.endpoint in matches]
            # The first 1 + num_fallbacks in rendezvous order are always scored: on an idle fleet a cold
            # prefix goes where rendezvous puts it, whichever random sample is drawn.
            top = np.argpartition(weights, -k)[-k:] if k < len(eligible) else range(len(eligible))
            first = [table.endpoints[i] for i in top if table.endpoints[i].endpoint not in matches]
            candidates = PrefixPolicy._sample(self, eligible, [*holders, *first], limit_n)  # type: ignore[arg-type]
        else:
            candidates = eligible
        prompt_tokens = req.num_prompt_chars * self._tpc
        n_hashed = len(hashes)
        in_flight = inp.in_flight
        w = st.ttft_work_weight
        decode_cost = model.decode_cost_tokens
        terms = model.terms
        get_match = matches.get
        get_in_flight = in_flight.get
        scored: list[tuple[float, float, EndpointState, float, int]] = []
        cold_own = prompt_tokens
        for s in candidates:
            ep = s.endpoint
            m = get_match(ep, 0)
            own = self._uncached(prompt_tokens, m, n_hashed) if m else cold_own
            rate, base, queued, n_pending = terms(ep)
            decoding = get_in_flight(ep, 0) - n_pending
            if decoding < 0:
                decoding = 0
            pred = base + (queued + decode_cost * decoding + own) / rate  # = model.predict(ep, own, decoding)
            scored.append((pred + w * own / rate, pred, s, own, decoding))
        best = min(x[0] for x in scored)
        tied = [x for x in scored if x[0] <= best * (1.0 + TTFT_TIE_RATIO) + TTFT_TIE_S]
        if len(tied) > 1:
            top = max(matches.get(x[2].endpoint, 0) for x in tied)
            tied = [x for x in tied if matches.get(x[2].endpoint, 0) == top]
        if len(tied) > 1:
            # The first of the tied in rendezvous order: the highest HRW weight (as `RendezvousTable.ranked`).
            table = inp.rendezvous()
            if weights is None:
                weights = table.weights(prefix_key(req, st.cold_key_blocks))
            pos = inp.view.position if inp.view is not None and inp.view.endpoints is table.endpoints else {
                s.endpoint: i for i, s in enumerate(table.endpoints)}
            primary = max(tied, key=lambda x: (int(weights[pos[x[2].endpoint]]), pos[x[2].endpoint]))
        else:
            primary = tied[0]
        rest = heapq.nsmallest(k - 1, (x for x in scored if x is not primary), key=lambda x: x[0])
        order = [primary[2].endpoint, *(x[2].endpoint for x in rest)]
        if self.track_prefill:
            key = id(req)
            queued = model.add_pending(key, order[0], primary[3], hashes)
            self._picks[key] = _TtftPick(req, order[0], queued, primary[4], primary[1])
        if not hashes:
            reason: DecisionReason = "load"
        elif not matches:
            reason = "cold"
        else:
            best_match = max(matches.values())
            m = matches.get(order[0], 0)
            reason = "affinity" if m >= best_match else ("spill" if m == 0 else "load")
        n_total = len(hashes)
        matched = matches.get(order[0], 0)
        return Decision(endpoints=tuple(order), reason=reason, policy=self.name, matched_blocks=matched,
                        total_blocks=n_total, predicted_hit_ratio=matched / n_total if n_total else 0.0)

    def predicted_ttft_s(self, request: InferenceRequest) -> float | None:
        """The predicted TTFT of `request`'s primary at its pick (None once it left the pending set)."""
        p = self._picks.get(id(request))
        return p.predicted_s if p is not None else None

    def on_first_token(self, request: InferenceRequest, decision: Decision, ttft_s: float, prompt_tokens: int,
                       cached_tokens: int) -> None:
        """The request's prefill leaves its endpoint's queue, and the endpoint's rate learns from it."""
        p = self._picks.pop(id(request), None)
        if p is None:
            return
        self.model.remove_pending(id(request))
        # In the router's units: its prompt estimate, with the uncached share the endpoint reported.
        est = request.num_prompt_chars * self._tpc
        share = (prompt_tokens - cached_tokens) / prompt_tokens if prompt_tokens > 0 else 1.0
        self.model.observe(p.endpoint, est, est * (1.0 - share), ttft_s, p.queued_tokens, p.num_decoding)
        self.predictions.append((p.predicted_s, ttft_s))

    def on_release(self, request: InferenceRequest, decision: Decision) -> None:
        """A request that ended without a reported first token leaves the queue (nothing learned)."""
        if self._picks.pop(id(request), None) is not None:
            self.model.remove_pending(id(request))

    def on_endpoint_removed(self, endpoint: EndpointId) -> None:
        self.model.forget_endpoint(endpoint)
        for key in [key for key, p in self._picks.items() if p.endpoint == endpoint]:
            del self._picks[key]

    def on_cache_cleared(self, endpoint: EndpointId) -> None:
        self.model.clear_prefixes(endpoint)


_CLASSES_BY_NAME = {p.name: p for p in (TtftPolicy, PrefixPolicy, ConsistentHashPolicy, LeastLoadPolicy,
                                         RoundRobinPolicy, RandomPolicy)}
POLICY_CLASSES: dict[str, type[Policy]] = {name: _CLASSES_BY_NAME[name] for name in POLICIES}
"""The class of every name in `settings.POLICIES`, in its order (a declared name without a class fails here)."""


def make_policy(settings: RoutingSettings, rng: random.Random, *, track_prefill: bool = False) -> Policy:
    """The policy named by ``settings.policy`` (validated by RoutingSettings); `track_prefill`: see `Policy`."""
    return POLICY_CLASSES[settings.policy](settings, rng, track_prefill=track_prefill)

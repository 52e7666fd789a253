"""`Scheduler`: eligible endpoints + prefix-index lookup + the configured policy -> `Decision`."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from prefixroute.extproc.kv_events.index import KVEventIndex
from prefixroute.extproc.routing.index_sources import BlockIndex, SourcedIndex
from prefixroute.extproc.routing.scheduling.placement import EvictionOrder
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling import filters
from prefixroute.extproc.routing.scheduling.policies import Policy, PolicyInput, PrefixPolicy, make_policy
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.ttft_learner import TtftLearner
from prefixroute.types import Decision, EndpointId, EndpointState


class Scheduler:
    """Chooses endpoints for one request. Pure apart from the injected rng and the round-robin counter.

    ``schedule`` does not modify the index (the caller records the pick: `RouterCore` does). Not thread-safe;
    one event loop. Cost: O(matched blocks) + the policy's; the eligible endpoints are memoised per pool snapshot
    (`filters.EligibleCache`) and the blocks are bounded by ``max_blocks``. A session credit costs O(1) more.
    """

    def __init__(self, settings: RoutingSettings, rng: random.Random | None = None, *,
                 track_prefill: bool = False) -> None:
        """`track_prefill`: the caller reports every release to ``policy.on_release`` (see `Policy`)."""
        self.settings = settings
        self.rng = rng if rng is not None else random.Random(settings.rng_seed)
        self.policy: Policy = make_policy(settings, self.rng, track_prefill=track_prefill)
        # The prefix policy's time model and the picks it waits on (None: a baseline, which learns nothing).
        self.learner: TtftLearner | None = self.policy.learner if isinstance(self.policy, PrefixPolicy) else None
        self.eligible_cache = filters.EligibleCache()

    @staticmethod
    def _eviction_order(index: BlockIndex) -> EvictionOrder | None:
        """The KV-events index behind `index` when it keeps eviction order (placement reads it), else None."""
        if isinstance(index, SourcedIndex) and isinstance(index.events, KVEventIndex):
            return index.events
        return None

    def schedule(self, request: InferenceRequest, endpoints: Sequence[EndpointState],
                 in_flight: Mapping[EndpointId, int], index: BlockIndex, now_s: float | None = None,
                 session: tuple[EndpointId, int] | None = None) -> Decision:
        """Endpoints for `request`: primary first, then up to ``num_fallbacks`` distinct fallbacks.

        Only healthy endpoints serving ``request.model`` are returned; an empty tuple means none is eligible
        (the caller decides between 404 and 503, see `RouterCore`). ``matched_blocks`` is the primary's
        consecutive leading blocks in the index, reported for every policy. `now_s`: the caller's monotonic
        clock (seconds), for policies that model queues draining over time; None = no clock.

        `session`: (endpoint E that served the request's session's previous turn, blocks of this request that
        turn's prompt covers), given only when this request's hashes extend that prompt (`sessions.Session.
        credit`; a rewritten history gets no credit). For a policy with ``uses_sessions`` (prefix), when E is
        eligible, E's match is the larger of the index's and the credit (never their sum: the index usually
        holds the same blocks, recorded at the previous pick) and the policy is told E (`PolicyInput.
        session_endpoint`: it wins ties). The policy then decides as always: the session stays on E while E is
        predicted fastest and moves when another endpoint is. Other policies ignore sessions (the baselines
        stay what they are compared as). ``Decision.session_blocks`` reports the credit beyond the index.
        """
        view = self.eligible_cache.view(endpoints, request.model)
        eligible = view.endpoints
        if not eligible:
            return Decision(endpoints=(), reason="load", policy=self.policy.name,
                            total_blocks=len(request.block_hashes))
        matches = index.match(request.block_hashes) if request.block_hashes else {}
        holders: list[EndpointState] = []
        if matches:
            holders = view.in_pool_order(matches)
            if len(holders) != len(matches):  # the index remembers endpoints that are now down or gone
                matches = {s.endpoint: matches[s.endpoint] for s in holders}
        session_ep = None
        indexed = credit = 0
        if session is not None and self.policy.uses_sessions and session[0] in view.position:
            session_ep, credit = session
            indexed = matches.get(session_ep, 0)
            if credit > indexed:
                matches = {**matches, session_ep: credit}
                holders = view.in_pool_order(matches)
        decision = self.policy.decide(PolicyInput(request=request, eligible=eligible, in_flight=in_flight,
                                                  matches=matches, holders=holders, view=view, now_s=now_s,
                                                  session_endpoint=session_ep,
                                                  order=self._eviction_order(index)))
        if credit > indexed and decision.endpoints[0] == session_ep:
            extra = min(credit, decision.matched_blocks) - indexed
            if extra > 0:
                decision = dataclasses.replace(decision, session_blocks=extra)
        return decision

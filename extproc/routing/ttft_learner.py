"""`TtftLearner`: what the prefix policy's time model learns from routed requests, and the requests it is
waiting to hear from (the policy only decides; this is the state between a request's pick and its
end). Pure: no I/O, no clock (times come from the caller).

At a pick (`add_pick`, from `PrefixPolicy.decide` with `track_prefill`) the request's uncached prefill joins its
endpoint's pending queue in the `TimeModel` (its blocks become a pending prefix there). At its first token it
leaves the queue; with its usage (`on_usage`, or figures given with the first token) the endpoint's rate learns
from the (work ahead at the pick + own, TTFT) pair; at its release it leaves the queue if still there. The
gateway's two streams report in no fixed order, so a pick released before its first token's report, or
between its first token and its usage, waits (bounded: MAX_AWAITING_USAGE). Other replicas' picks
(extproc/peers) join the queue under their own keys until their done message or expiry; what this replica
learned goes to them (`take_observations`) and theirs is learned here (`apply_peer_observation`).

The router service's lifecycle listener (`extproc/lifecycle_listeners.py`, `TimeModelListener`) calls the
hooks; the baselines have no learner. Single event loop; not thread-safe, except `time_model_figures`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import BlockHash, Decision, EndpointId

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
    own_tokens: float  # its uncached prefill tokens at the endpoint (the router's estimate)
    own_work: float  # their prefill work (`TimeModel.prefill_work`): what it queued there
    decode_context: float  # mean context of the requests decoding on the endpoint at the pick (tokens)
    picked_s: float | None  # the caller's clock at the pick (None: no clock)


class TtftLearner:
    """The prefix policy's time model and the picks it waits on (module docstring). `track_prefill`: the caller
    calls `on_release` exactly once per pick (`RouterCore(track_prefill=True)`), so picks may join the pending
    queue; without it the model keeps its priors and sees no queue (pure prefix + rendezvous)."""

    def __init__(self, settings: RoutingSettings, *, track_prefill: bool = False) -> None:
        self.track_prefill = track_prefill
        self.model = TimeModel(settings.ttft_prior_tokens_per_s, settings.ttft_prior_base_s,
                               decode_cost_tokens=settings.decode_cost_tokens,
                               step_tokens=settings.ttft_step_tokens, window=settings.ttft_rate_window,
                               attention_tokens=settings.attention_tokens)
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
        # Other replicas' pending picks (key -> expiry, oldest first): in `model` as non-local pendings.
        self._peer_expiry: collections.OrderedDict[tuple, float] = collections.OrderedDict()

    def add_pick(self, request: InferenceRequest, endpoint: EndpointId, own_tokens: float, num_decoding: int,
                 predicted_s: float, now_s: float | None, own_work: float | None = None) -> None:
        """`request` was picked for `endpoint` with `own_tokens` of uncached prefill (`own_work` of prefill work:
        `TimeModel.prefill_work`; None: the tokens), `num_decoding` requests decoding there and a predicted TTFT
        of `predicted_s`: it joins the pending queue (with `track_prefill`) and the endpoint's recent load."""
        if not self.track_prefill:
            return
        key = request.key
        model = self.model
        work = own_tokens if own_work is None else own_work
        queued = model.add_pending(key, endpoint, work, request.block_hashes, now_s)
        if now_s is not None:
            model.add_busy(endpoint, work / model.priced(endpoint)[0], now_s)
        self._picks[key] = _TtftPick(request.num_prompt_chars, endpoint, queued, num_decoding, predicted_s,
                                     own_tokens, work, model.mean_decode_context(endpoint), now_s)

    def pending_tokens_of(self, request: InferenceRequest) -> float | None:
        """The prefill work `request` queued on its endpoint (what another replica queues for it), None once it
        left the queue."""
        p = self._picks.get(request.key)
        return p.own_work if p is not None else None

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
        if p is not None:
            # Decoding from now on, until its release: its context joins the endpoint's batch.
            self.model.add_decoding(key, p.endpoint, float(prompt_tokens) if prompt_tokens else
                                    p.num_prompt_chars * self._tpc,
                                    p.picked_s + ttft_s if p.picked_s is not None else None)
        else:
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
        self.model.observe(p.endpoint, est, cached, ttft_s, p.queued_tokens, p.num_decoding, p.decode_context)
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

    def on_release(self, request: InferenceRequest, decision: Decision, now_s: float | None = None) -> None:
        """The request ended (at `now_s`, the clock of the picks, when known: its decode time then counts in its
        endpoint's decode load): if no first token was reported, it leaves the queue, and its pick waits (at most
        MAX_AWAITING_USAGE of them) for a first token that may still come: the observing stream reports in
        no fixed order with the routing stream's end. A pick awaiting its usage report keeps waiting too."""
        key = request.key
        self.model.remove_decoding(key, now_s)
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

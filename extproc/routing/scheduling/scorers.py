"""Scorers: a number per candidate endpoint, lower is better (GIE's scheduling framework: Filter -> Scorer ->
Picker). The prefix policy's scorer prices each candidate in seconds with the time model; the baselines score
nothing (they order by load, by rendezvous weight or at random: pickers.py).

`TtftScorer` contract: given a request, its candidates (eligible, distinct) and their matched leading blocks,
it returns one `Scored` per candidate, sorted by score (stable: equal scores keep the candidates' order), with
the predicted TTFT of the request there (seconds, >= 0, from ONE `TimeModel.predict_many` call over the
candidates; a second call over the matched ones only when the match is insignificant), the uncached prefill it
would add there (tokens) and the decoding requests there. Score = predicted TTFT + ``ttft_work_weight`` x the
request's own prefill seconds there (the work it adds for the requests behind it); a match below
`SIGNIFICANT_MATCH_RATIO` of the hashed blocks and below `SIGNIFICANT_MATCH_TOKENS` scores as no match.
Pure: reads the time model, changes nothing. Not thread-safe (the router's event loop).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import EndpointId, EndpointState

SIGNIFICANT_MATCH_RATIO = 0.3
SIGNIFICANT_MATCH_TOKENS = 1024.0
"""A match under SIGNIFICANT_MATCH_RATIO of a request's hashed blocks *and* under SIGNIFICANT_MATCH_TOKENS
tokens is not a reason to choose its holders (sglang-router's cache_aware threshold is the same 0.3): the
request is scored as if cached nowhere and placed as a new prefix, keyed past the common part (its predicted
TTFT still counts the match). A short shared instruction before distinct documents matches every endpoint that
ever served one, and its few blocks of saved prefill pulled every new document onto the first endpoint
(capacity pressure, 4 x 8B: request shares 4/13/95/188 of 300, hit ratio 0.30; with the rule 0.42)."""


Scored = tuple[float, float, EndpointState, float, int, float]
"""One candidate's figures (`TtftScorer.score`), a plain tuple (a named one costs ~10x to build, per candidate
per decision): score, predicted TTFT s, the endpoint's state, its own uncached prefill tokens, decoding
requests there, and the prefill work of those tokens (`TimeModel.prefill_work`: what the time model queues).
Read with the index names below."""
SCORE, PREDICTED_S, STATE, OWN_TOKENS, NUM_DECODING, OWN_WORK = range(6)


TtftScores = tuple[list[Scored], bool]
"""`TtftScorer.score`'s answer: the candidates by score, and whether the best match was insignificant (then the
request is placed as a new prefix, keyed past that match)."""

_by_score = operator.itemgetter(SCORE)


class TtftScorer:
    """Predicted time-to-first-token per candidate, full prefill included (module docstring: the contract)."""

    def __init__(self, settings: RoutingSettings, model: TimeModel) -> None:
        self._settings = settings
        self.model = model
        self._tpc = 1.0 / settings.chars_per_token
        self._tpb = settings.tokens_per_block
        self._kvb = float(settings.kv_block_tokens)

    def prompt_tokens(self, request: InferenceRequest) -> tuple[float, float, int]:
        """(prompt tokens, tokens per block, block cap) of `request`: exact tokens and KV-block-sized blocks when
        the router tokenizes, else characters / ``chars_per_token`` and text blocks."""
        n_tok = request.num_prompt_tokens
        if n_tok is not None:
            return float(n_tok), self._kvb, self._settings.max_token_blocks
        return request.num_prompt_chars * self._tpc, self._tpb, self._settings.max_blocks

    def score(self, request: InferenceRequest, candidates: Sequence[EndpointState],
              matches: Mapping[EndpointId, int], in_flight: Mapping[EndpointId, int],
              now_s: float | None, holder: EndpointId | None = None, holder_tokens: float = 0.0) -> TtftScores:
        """`holder`: the endpoint that served the conversation this request continues (None: not known), the only
        one credited with the prompt beyond the hashing cap, up to `holder_tokens` (its previous turn's prompt;
        0: all of it but one block)."""
        prompt_tokens, tpb, cap = self.prompt_tokens(request)
        n_hashed = len(request.block_hashes)
        names = [s.endpoint for s in candidates]
        if matches:
            get_match = matches.get
            # Uncached prefill with m leading blocks held: a match of every hashed block of a prompt longer than
            # the hashing cap counts the unhashed rest as cached too, less one block; at the endpoint holding the
            # conversation it continues, what its previous turn left uncached (the new turn); elsewhere, when
            # that conversation is known to be elsewhere (it moved on from there), only its hashed blocks.
            whole = n_hashed >= cap
            beyond = min(prompt_tokens, max(tpb, prompt_tokens - holder_tokens) if holder_tokens > 0.0 else tpb)
            own = [prompt_tokens if (m := get_match(ep, 0)) <= 0 else
                   ((beyond if ep == holder else min(prompt_tokens, tpb))
                    if whole and m >= n_hashed and (holder is None or ep == holder)
                    else max(0.0, prompt_tokens - m * tpb))
                   for ep in names]
        else:
            own = [prompt_tokens] * len(names)
        # Tokens to prefill -> prefill work (`TimeModel.prefill_work`, inlined: one multiply per candidate): o new
        # tokens on the prompt_tokens - o cached attend to prompt_tokens - o / 2 on average.
        model = self.model
        inv, norm = model.inv_attention, model.work_norm
        own_work = [o * (1.0 + (prompt_tokens - 0.5 * o) * inv) * norm if o > 0.0 else 0.0 for o in own] if inv \
            else own
        predicted = model.predict_many(names, own_work, in_flight, now_s)
        sig = min(SIGNIFICANT_MATCH_RATIO * n_hashed, SIGNIFICANT_MATCH_TOKENS / tpb) if matches else 0.0
        insignificant = bool(matches) and max(matches.values()) < sig
        w = self._settings.ttft_work_weight
        scored: list[Scored] = [(pred + w * ow / rate, pred, s, o, dec, ow)
                                for (pred, rate, dec), s, o, ow in zip(predicted, candidates, own, own_work)]
        if insignificant:
            # Chosen as if cached nowhere: the matched candidates are scored at their whole prefill.
            at = [i for i, ep in enumerate(names) if matches.get(ep, 0)]
            whole = model.prefill_work(prompt_tokens, 0.0)
            cold = self.model.predict_many([names[i] for i in at], [whole] * len(at), in_flight, now_s)
            for i, (pred, rate, _) in zip(at, cold):
                scored[i] = (pred + w * whole / rate, *scored[i][1:])
        scored.sort(key=_by_score)
        return scored, insignificant

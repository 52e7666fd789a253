"""`ConversationLoad`: a conversation placed by the load it will bring, not only by where its first request is
cheapest (pure: no I/O; times from the caller).

The time model prices one request: its queue, its prefill, its decode share now. A conversation (a chat, an agent
in a tool loop) brings more: `Outlook.future_turns` more turns, each about `Outlook.turn_work` of prefill, all to
the endpoint that holds its history, since moving it later costs a recompute of everything it has said. A new
agent behind a shared 4k-token tool preamble is cheapest, now, on the preamble's holder; sent there every time,
every agent's 20-30k-token history piles onto that one endpoint while the others idle.

So each candidate's score gets the waiting the conversation's remaining turns add there::

    cost(e) = T x (turn_s(e) x C'(rho(e)) + decode_s x rho(e)),      C(rho) = rho^2 / (1 - rho)

- T = the conversation's expected further turns (the table's learned mean for its root, at most
  ``conversation_horizon_turns``); 0 for one-off requests, which are then scored exactly as before;
- turn_s(e) = a turn's prefill work at e's rate (seconds); decode_s = a request's mean decode time;
- rho(e) = e's recent prefill utilisation (`TimeModel.utilization`) with this request's own prefill there added
  (a move's recompute loads the endpoint it moves to), less the conversation's own share when it is already
  there (its turns are not extra load where they already are), read at most at `RHO_CAP`;
- C(rho) is the mean number of requests waiting in a single-server queue at utilisation rho (M/M/1), so
  C'(rho) x (turn_s / gap) is the extra waiting per second one more conversation of that load brings, its own and
  everyone else's there, and over its T turns (T x gap seconds) the total is T x turn_s x C'(rho): seconds, the
  unit of every other term of the score. 0 on an idle endpoint; 1 at rho 0.29; 10 at 0.7; 99 at 0.9. Its own
  answers decode in steps that others' prefills lengthen: a fraction rho of each turn's decode time.

Not counted: the stall a turn's prefill causes the requests decoding beside it (its seconds x their number).
Priced too (weight 1), it balanced agents a little more evenly (ITL p50 -1%) but moved short chat sessions off
their system prompt's holder under load (virtual tenants at 80% of capacity: hit ratio -0.010, TTFT P99 +30%).

What it gives, as a rule (docs/routing.md, "Balance"): while an endpoint sits idle (rho 0), a conversation joins a
busier one only when the one-off cost of moving there (the time model's own prices: the recompute of its shared
prefix, or of its whole history for a conversation already under way) is more than the waiting its remaining
turns would add where it is; a conversation under way moves only when staying costs more than its context's
recompute. One-off requests, and conversations on an idle fleet, are placed as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prefixroute.extproc.routing.conversations import ConversationTable, NO_OUTLOOK, Outlook
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling.pickers import TTFT_TIE_RATIO, TTFT_TIE_S
from prefixroute.extproc.routing.scheduling.scorers import OWN_WORK, SCORE, STATE, Scored, _by_score
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import EndpointId

RHO_CAP = 0.9
"""Utilisation is read at most at 0.9 (C' = 99): past it the queue model says nothing useful (an overloaded
endpoint's utilisation estimate can pass 1), and a bounded price keeps a conversation's history (a recompute of
tens of thousands of tokens) from being thrown away for a spike."""

MIN_FUTURE_TURNS = 0.05
"""Below this many expected further turns (one conversation in twenty continuing) the term is skipped: the
request is a one-off and scored exactly as without it."""


def marginal_waiting(rho: float) -> float:
    """C'(rho) for C(rho) = rho^2 / (1 - rho) (module docstring), rho clipped to [0, RHO_CAP]."""
    if rho <= 0.0:
        return 0.0
    if rho > RHO_CAP:
        rho = RHO_CAP
    d = 1.0 - rho
    return rho * (2.0 - rho) / (d * d)


class ConversationLoad:
    """The conversation-load term of the prefix policy's score (module docstring), over a `ConversationTable`."""

    def __init__(self, model: TimeModel, table: ConversationTable, horizon_turns: float) -> None:
        self.model = model
        self.table = table
        self.horizon_turns = horizon_turns
        self.num_adjusted = 0  # decisions whose order the term changed (the primary is not the time model's)
        self._unloaded_best: EndpointId | None = None  # the time model's best of the last `adjust` it changed

    def outlook(self, request: InferenceRequest, best_match: int) -> Outlook:
        """The request's conversation and what it will bring (`ConversationTable.outlook`); none for a pinned
        Responses follow-up (its endpoint is fixed, and its hashes are only what precedes its input)."""
        if request.response_ref is not None or not request.block_hashes:
            return NO_OUTLOOK
        return self.table.outlook(request.block_hashes, best_match)

    def costs(self, outlook: Outlook, endpoints: Sequence[EndpointId], now_s: float | None,
              own_work: Sequence[float] | None = None) -> list[float] | None:
        """The term for each endpoint (seconds, >= 0), None when it does not apply (a one-off, no clock).
        `own_work`: this request's prefill work at each endpoint, which raises that endpoint's utilisation
        before its further turns (a move's recompute loads its new endpoint: without it, moves of long
        histories into endpoints that looked idle fed each other)."""
        turns = min(outlook.future_turns, self.horizon_turns)
        if turns < MIN_FUTURE_TURNS or now_s is None or outlook.turn_work <= 0.0:
            return None
        model = self.model
        conv = outlook.conversation
        here = conv.endpoint if conv is not None else None
        gap = conv.gap_s if conv is not None else None
        decode_s = model.mean_decode_s
        window = model.load_window_s
        inv_window = 1.0 / window
        turn_work = outlook.turn_work
        # `TimeModel.priced` and `utilization`, inlined over local lookups: this runs for every candidate of
        # every turn of a conversation.
        get_fit, prior = model.fits.get, model.default_fit
        get_load = model.loads.get
        exp = math.exp
        out = []
        for i, ep in enumerate(endpoints):
            rate = get_fit(ep, prior)[0]
            turn_s = turn_work / rate
            rho = 0.0
            load = get_load(ep)
            if load is not None and load.t is not None:
                dt = now_s - load.t
                rho = load.prefill * (exp(-dt * inv_window) if dt > 0.0 else 1.0) * inv_window
            if own_work is not None:
                rho += own_work[i] / rate * inv_window
            if ep == here and gap:  # its own turns are already part of the load there
                rho -= turn_s / gap
            if rho <= 0.0:
                out.append(0.0)
                continue
            if rho > RHO_CAP:
                rho = RHO_CAP
            d = 1.0 - rho
            out.append(turns * (turn_s * rho * (2.0 - rho) / (d * d) + decode_s * rho))
        return out

    def adjust(self, outlook: Outlook, scored: list[Scored], now_s: float | None) -> list[Scored]:
        """`scored` with each candidate's term added to its score, re-sorted (stable); unchanged when the term
        does not apply."""
        self._unloaded_best = None
        if outlook.future_turns < MIN_FUTURE_TURNS or now_s is None or outlook.turn_work <= 0.0:
            return scored  # a one-off, or no clock: `costs` would say so, after building its lists
        # `scored` is sorted by score and the term is >= 0: a candidate whose score alone is past the best
        # score with its term so far (and the picker's tie margin) can neither win nor tie; it keeps its score
        # (still behind the contenders, as a fallback), and the rest are not priced.
        best = scored[0][SCORE] + self.costs(outlook, [scored[0][STATE].endpoint], now_s, [scored[0][OWN_WORK]])[0]
        n = 1
        while n < len(scored) and scored[n][SCORE] <= best * (1.0 + TTFT_TIE_RATIO) + TTFT_TIE_S:
            n += 1
        contenders = scored[:n]
        costs = self.costs(outlook, [x[STATE].endpoint for x in contenders], now_s, [x[OWN_WORK] for x in contenders])
        if costs is None or not any(costs):
            return scored
        out = [(x[SCORE] + c, *x[1:]) for x, c in zip(contenders, costs)]
        out.extend(scored[n:])
        out.sort(key=_by_score)
        if out[0][STATE] is not scored[0][STATE]:
            self.num_adjusted += 1
            self._unloaded_best = scored[0][STATE].endpoint
        return out

    def record(self, request: InferenceRequest, outlook: Outlook, primary: Scored, now_s: float | None,
               num_tokens: float) -> None:
        """The request (`num_tokens` of prompt) went to `primary`: its conversation moves on (or starts); a pinned
        Responses follow-up counts one more turn for the conversations of its prefix."""
        hashes = request.block_hashes
        if not hashes:
            return
        if request.response_ref is not None:
            self.table.record_followup(hashes[-1])
            return
        ep = primary[STATE].endpoint
        unloaded, self._unloaded_best = self._unloaded_best, None
        self.table.record(hashes, outlook, ep, primary[OWN_WORK], now_s, num_tokens,
                          unloaded is not None and ep != unloaded)

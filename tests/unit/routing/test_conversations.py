"""Conversations placed by the load they will bring: the conversation table (routing/conversations.py), the
conversation-load term of the prefix policy (scheduling/conversation_load.py), and the time model's attention,
decode-context and load terms (routing/timemodel.py) they rest on."""

from __future__ import annotations

import random

import pytest

from prefixroute.extproc.routing.conversations import (END_AFTER_S, TAIL_BACKOFF_BLOCKS, ConversationTable,
                                                      tail_position)
from prefixroute.extproc.routing.request import InferenceRequest
from prefixroute.extproc.routing.scheduling.conversation_load import RHO_CAP, marginal_waiting
from prefixroute.extproc.routing.scheduling.policies import PolicyInput, PrefixPolicy
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.timemodel import TimeModel
from prefixroute.types import BlockHash, EndpointId, EndpointState

A, B, C, D = (EndpointId(f"{x}:1") for x in "abcd")
RATE = 10_000.0


def _chain(*parts: tuple[int, int]) -> list[BlockHash]:
    """Block hashes of a prompt made of (namespace, blocks) parts: a chain, so two prompts share a prefix exactly
    while their parts agree."""
    out: list[BlockHash] = []
    h = 17
    for ns, n in parts:
        for i in range(n):
            h = hash((h, ns, i)) & ((1 << 62) - 1)
            out.append(BlockHash(h))
    return out


def _turns(agent: int, num_turns: int, preamble: int = 64, task: int = 8, step: int = 20) -> list[list[BlockHash]]:
    """The block hashes of an agent's successive turns: a shared preamble, its task, then `step` more blocks a
    turn (its previous prompt is always a prefix of the next)."""
    parts = [(0, preamble), (1000 + agent, task)]
    out = []
    for k in range(num_turns):
        out.append(_chain(*parts, *((10_000 * agent + j, step) for j in range(k))))
    return out


# --- the table -------------------------------------------------------------------------------------------------

def test_a_turn_that_extends_the_previous_prompt_continues_its_conversation():
    t = ConversationTable(100, 100)
    turns = _turns(1, 4)
    o = t.outlook(turns[0], 64)  # matched the shared preamble
    assert o.conversation is None and o.root == turns[0][63]
    t.record(turns[0], o, A, 500.0, 0.0)
    for k in (1, 2, 3):
        o = t.outlook(turns[k], len(turns[k - 1]))
        assert o.conversation is not None and o.conversation.endpoint == (A if k == 1 else B)
        t.record(turns[k], o, B, 500.0, float(k))
    assert (t.num_branches, t.num_continued, len(t)) == (1, 3, 1)
    # A history rewritten (its third turn's blocks changed) continues nothing: a new branch off what it matched.
    rewritten = _chain((0, 64), (1001, 8), (999, 30))
    assert t.outlook(rewritten, 72).conversation is None


def test_the_template_seam_at_the_end_of_a_prompt_does_not_lose_the_conversation():
    # The next turn re-renders the generation prompt at the end of the last one: its last block differs.
    prev = _chain((0, 64), (1001, 30))
    t = ConversationTable(100, 100)
    t.record(prev, t.outlook(prev, 64), A, 1.0, 0.0)
    nxt = prev[:-1] + _chain((0, 64), (1001, 29), (55, 25))[93:]
    assert nxt[:93] == prev[:93] and nxt[93] != prev[93]
    assert t.find(nxt, 93) == tail_position(94, 64) == 93 - TAIL_BACKOFF_BLOCKS


def test_one_off_questions_after_a_shared_prompt_are_never_taken_for_a_conversation():
    t = ConversationTable(100, 100)
    for q in range(50):  # a shared 64-block system prompt, then a 1-block question each
        hashes = _chain((0, 64), (q + 1, 1))
        o = t.outlook(hashes, 64)
        assert o.conversation is None
        t.record(hashes, o, A, 10.0, q * 0.01)
    assert t.num_continued == 0
    assert t.outlook(_chain((0, 64), (999, 1)), 64).future_turns == 0.0


def test_future_turns_are_learned_per_shared_prefix():
    t = ConversationTable(1000, 100)
    now = 0.0
    for agent in range(6):  # agents behind preamble 0: 8 turns each
        turns = _turns(agent, 8)
        for k, hashes in enumerate(turns):
            now += 0.1
            t.record(hashes, t.outlook(hashes, 64 if k == 0 else len(turns[k - 1])), A, 300.0, now)
    one_offs = _chain((7, 64))
    for q in range(6):  # one-off questions behind prompt 7
        hashes = one_offs + _chain((7, 64), (500 + q, 2))[64:]
        t.record(hashes, t.outlook(hashes, 64), B, 10.0, now)
    agents = t.outlook(_turns(99, 1)[0], 64)
    questions = t.outlook(one_offs + _chain((7, 64), (900, 2))[64:], 64)
    # 7 further turns per agent, shrunk a little towards the table's overall 42 / (12 + 1)
    assert agents.future_turns == pytest.approx((6 * 7 + 2 * 42 / 13) / (6 + 2))
    assert agents.turn_work == pytest.approx(300.0)
    assert 0.0 < questions.future_turns < 1.0  # borrowed from the table at first, then its own zero wins
    assert questions.future_turns < agents.future_turns / 4


def test_a_prompt_past_the_hashing_cap_continues_its_conversation():
    # Past the cap, every turn has the same hashes (what follows is not hashed): still the same conversation.
    t = ConversationTable(100, 100)
    capped = _chain((0, 64), (1, 192))
    t.record(capped, t.outlook(capped, 64), A, 1.0, 0.0)
    o = t.outlook(capped, 256)
    assert o.conversation is not None and o.conversation.endpoint == A


def test_conversations_end_when_not_continued_and_the_table_is_bounded():
    t = ConversationTable(3, 100)
    for agent in range(5):
        h = _turns(agent, 1)[0]
        t.record(h, t.outlook(h, 64), A, 1.0, 0.0)
    assert len(t) == 3  # least recently continued out
    h = _turns(9, 1)[0]
    t.record(h, t.outlook(h, 64), A, 1.0, END_AFTER_S + 1.0)  # the others waited past END_AFTER_S
    assert len(t) == 1 and t.num_ended == 5
    t.forget_endpoint(A)
    assert len(t) == 0


# --- the conversation-load term --------------------------------------------------------------------------------

def test_marginal_waiting():
    assert marginal_waiting(0.0) == 0.0 and marginal_waiting(-1.0) == 0.0
    assert marginal_waiting(0.29) == pytest.approx(1.0, abs=0.02)
    assert marginal_waiting(0.7) == pytest.approx(10.1, abs=0.1)
    assert marginal_waiting(5.0) == marginal_waiting(RHO_CAP) == pytest.approx(99.0)


def _req(hashes: list[BlockHash]) -> InferenceRequest:
    return InferenceRequest(kind="chat", path="/v1/chat/completions", block_hashes=hashes,
                            num_prompt_chars=64 * len(hashes))


def _policy(**kw) -> PrefixPolicy:
    s = RoutingSettings(**{"policy": "prefix", "ttft_prior_tokens_per_s": RATE, "ttft_prior_base_s": 0.0,
                           "rng_seed": 0, **kw})
    return PrefixPolicy(s, random.Random(0), track_prefill=True)


def _decide(p: PrefixPolicy, hashes: list[BlockHash], matches: dict, now_s: float, eps=(A, B)) -> EndpointId:
    states = tuple(EndpointState(e, address=e) for e in eps)
    d = p.decide(PolicyInput(request=_req(hashes), eligible=states, in_flight={}, matches=matches, now_s=now_s))
    return d.endpoints[0]


def _teach(p: PrefixPolicy, num_agents: int, num_turns: int, now_s: float) -> None:
    """Agents behind preamble 0, all of whose turns went to A (A's recent load: their prefill)."""
    model = p.model
    for agent in range(num_agents):
        turns = _turns(agent, num_turns)
        for k, hashes in enumerate(turns):
            m = 64 if k == 0 else len(turns[k - 1])
            o = p.conversations.outlook(_req(hashes), m)
            p.conversations.table.record(hashes, o, A, 20 * 16.0, now_s - 5.0 + 0.01 * k)
            model.add_busy(A, 0.3, now_s - 5.0 + 0.01 * k)  # A busy: its utilisation well above zero


def test_balance_rule_a_new_conversation_goes_to_the_idle_endpoint_when_the_waits_it_brings_cost_more():
    """The rule: while an endpoint sits idle, a conversation joins a busier one only when moving is dearer
    than the waiting its remaining turns would add there. A new agent behind a 64-block preamble held by a
    loaded A: the recompute of the preamble on idle B is cheaper than what its ~7 further turns would add on A."""
    p = _policy()
    _teach(p, 6, 8, now_s=10.0)
    new_agent = _turns(50, 1)[0]
    assert p.model.utilization(A, 10.0) > 0.5 and p.model.utilization(B, 10.0) == 0.0
    assert _decide(p, new_agent, {A: 64}, 10.0) == B
    # The same router without the term (or a one-off, which brings no further turn) takes the cached preamble.
    off = _policy(conversation_horizon_turns=0)
    _teach_off = off.model
    for _ in range(40):
        _teach_off.add_busy(A, 0.3, 5.0)
    assert _decide(off, new_agent, {A: 64}, 10.0) == A


def test_a_one_off_request_is_placed_as_without_the_term():
    p = _policy()
    for q in range(30):  # one-off questions behind prompt 0, all on A, A busy
        h = _chain((0, 64), (q + 1, 1))
        p.conversations.table.record(h, p.conversations.outlook(_req(h), 64), A, 16.0, 9.0)
        p.model.add_busy(A, 0.3, 9.0)
    assert _decide(p, _chain((0, 64), (999, 1)), {A: 64}, 10.0) == A


def test_a_conversation_under_way_stays_unless_staying_costs_more_than_its_recompute():
    p = _policy()
    _teach(p, 6, 8, now_s=10.0)
    # Agent 3's ninth turn: its 204-block history is on A; moving recomputes it on B.
    turns = _turns(3, 9)
    assert _decide(p, turns[8], {A: len(turns[7])}, 10.0) == A
    # A short one (its history cheap to recompute) on a far busier A moves.
    p2 = _policy()
    _teach(p2, 6, 8, now_s=10.0)
    for _ in range(200):
        p2.model.add_busy(A, 0.3, 10.0)
    short = _turns(77, 2, preamble=2, task=1, step=1)
    o = p2.conversations.outlook(_req(short[0]), 0)
    p2.conversations.table.record(short[0], o, A, 16.0, 9.0)
    assert _decide(p2, short[1], {A: len(short[0])}, 10.0) == B


# --- the time model's terms ------------------------------------------------------------------------------------

def test_prefill_work_prices_attention_over_the_context():
    m = TimeModel(RATE, attention_tokens=32768.0, step_tokens=8192.0)
    assert m.prefill_work(8192.0, 0.0) == pytest.approx(8192.0)  # the unit: a cold chunk
    long = m.prefill_work(700.0, 25_000.0)
    assert long / m.prefill_work(700.0, 0.0) == pytest.approx((1 + 25_350 / 32768) / (1 + 350 / 32768))
    assert 1.6 < long / 700.0 * (1 + 4096 / 32768) < 1.8  # 700 tokens on a 25k context: ~1.7x 700 cold ones
    assert TimeModel(RATE).prefill_work(700.0, 25_000.0) == 700.0  # attention off: every token alike
    assert m.prefill_work(0.0, 1e6) == 0.0


def test_decoding_requests_cost_each_step_by_their_context():
    m = TimeModel(RATE, decode_cost_tokens=2.0, attention_tokens=32768.0)
    base = m.predict(A, 1000.0, num_decoding=4)
    m.add_decoding("r1", A, 32768.0)
    m.add_decoding("r2", A, 32768.0)
    assert m.mean_decode_context(A) == 32768.0
    assert m.decode_step_tokens(4, 32768.0) == pytest.approx(4 * 3.0)
    assert m.predict(A, 1000.0, num_decoding=4) > base
    assert m.remove_decoding("r1") and not m.remove_decoding("r1")
    m.remove_decoding("r2")
    assert m.mean_decode_context(A) == 0.0 and m.predict(A, 1000.0, num_decoding=4) == base


def test_load_is_the_recent_work_per_second():
    m = TimeModel(RATE, load_window_s=10.0)
    for i in range(100):
        m.add_busy(A, 0.05, i * 0.1)  # 0.5 s of prefill a second for 10 s
    assert 0.25 < m.utilization(A, 10.0) < 0.5 and m.utilization(B, 10.0) == 0.0
    assert m.utilization(A, 40.0) < 0.05 * m.utilization(A, 10.0)  # decays over the window
    m.add_decoding("r", A, 100.0, since_s=40.0)
    m.remove_decoding("r", now_s=42.0)  # 2 s decoding
    assert m.mean_decode_s == pytest.approx(2.0)

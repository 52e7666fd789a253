"""Issue 27: what a client can make the router keep is bounded. Every client value a table keeps is bounded at
parse time; each table's cost per entry is at most the figure routing/memory.py sizes it with (measured here
with tracemalloc, worst case: keys at their length limit); the policy's tables no longer keep requests; the
tokenizer caches stay within their bytes. The end-to-end check (ext_proc RSS under a flood of 7 MiB
prompt_cache_keys): tests/integration/reliability/test_hardening_findings.py."""

from __future__ import annotations

import gc
import tracemalloc

import orjson
import pytest

from helpers.peers import POST, replica
from prefixroute.extproc.response_directory import ResponseDirectory
from prefixroute.extproc.routing.conversations import (CONVERSATION_ENTRY_BYTES, ROOT_ENTRY_BYTES, NO_OUTLOOK,
                                                      ConversationTable)
from prefixroute.extproc.routing import memory
from prefixroute.extproc.routing.request import MAX_KEY_CHARS, bounded_key, parse_request
from prefixroute.extproc.routing.scheduling.policies import PrefixPolicy
from prefixroute.extproc.routing.sessions import SESSION_ENTRY_BYTES, SessionTable
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.text_hash_cache import TextHashCache
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.model_servers.tokenizer import SimTokenizer
from prefixroute.types import EndpointId, EndpointState

S = RoutingSettings()
MIB = 1024 * 1024


def _grown(fill) -> int:  # noqa: ANN001
    """Bytes `fill()` left allocated (tracemalloc), after a collection."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = fill()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del keep
    return after - before


def test_client_values_kept_are_bounded_whatever_their_size():
    big = "k" * (3 * MIB)
    body = orjson.dumps({"model": "m", "prompt_cache_key": big, "user": big,
                         "messages": [{"role": "user", "content": "hi"}]})
    req = parse_request(*POST, {"x-prefixroute-tenant": big, "x-session-id": big, "x-request-id": big}, body, S)
    assert len(req.tenant) <= 2 * MAX_KEY_CHARS + 1
    assert len(req.session_key) == MAX_KEY_CHARS and len(req.request_id) == MAX_KEY_CHARS
    # Still one key per value: two long keys sharing their first 7 MiB less one character differ.
    assert bounded_key(big) != bounded_key(big[:-1] + "x") and bounded_key("short") == "short"


def test_session_entries_cost_at_most_what_the_budget_assumes():
    n = 5000
    table = SessionTable(max_sessions=n, ttl_s=60.0)
    eps = [EndpointId(f"10.0.0.{i}:8000") for i in range(4)]

    def fill():
        for i in range(n):
            table.record("t" * MAX_KEY_CHARS + str(i), "s" * MAX_KEY_CHARS, eps[i % 4], [i, i + 1, 2**63 + i], 1.0)
        return table

    per = _grown(fill) / n
    assert per <= SESSION_ENTRY_BYTES, per
    assert len(table) == n


def test_response_directory_entries_cost_at_most_what_the_budget_assumes():
    n = 5000
    d = ResponseDirectory(max_ids=n, ttl_s=60.0)
    d.sync([EndpointState(EndpointId(f"10.0.0.{i}:8000")) for i in range(4)])

    def fill():
        for i in range(n):
            rid = f"resp_{i:0250d}"
            d.learn(rid, EndpointId(f"10.0.0.{i % 4}:8000"))
            d.set_prompt_tokens(rid, 100_000 + i)
        return d

    per = _grown(fill) / n
    assert per <= memory.RESPONSE_ID_ENTRY_BYTES, per


def test_peer_picks_cost_at_most_what_the_budget_assumes():
    import random

    n, blocks = 300, 1024
    policy = PrefixPolicy(S, random.Random(1), track_prefill=True)
    rng = random.Random(2)

    def fill():
        for i in range(n):
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            policy.learner.apply_peer_pick(("r", 1, i), EndpointId(f"10.0.0.{i % 4}:8000"), 1000.0, hashes, 1.0, 100.0)
        return policy

    per = _grown(fill) / n
    assert per <= memory.peer_pick_bytes(blocks), per


def test_released_requests_are_not_kept_by_the_policy():
    """A request the router has released keeps ~nothing in the policy's tables (its late reports still count):
    300 released requests with 1 MiB tenants and session keys cost ~1 KB each (sessions included), where
    keeping the request kept its tenant: 300 MiB and more (issue 27: 2.19 GB from 300 x 7 MiB)."""
    r = replica()
    key = "k" * MIB

    def fill():
        for i in range(300):
            body = orjson.dumps({"model": "m", "prompt_cache_key": f"{key}{i}", "messages": [
                {"role": "user", "content": f"{i:04d} " + "x" * 120}]})
            pick = r.route(*POST, {"x-session-id": f"{key}{i}"}, body)
            r.release(pick)  # no first-token report: the pick waits for one in the released table
        return r

    grown = _grown(fill)
    policy = r.core.learner
    assert len(policy._released) == 300 and len(r.core.sessions) == 300  # waiting picks and sessions...
    assert grown < 300 * 4096, grown  # ...that cost at most a few KB each, not 1 MiB


def test_tokenizer_caches_stay_within_their_bytes():
    hasher = PromptHasher(SimTokenizer(), block_size=16, max_blocks=1024, cache_entries=100_000, cache_bytes=2 * MIB)

    def fill():
        for i in range(60):
            body = {"messages": [{"role": "system", "content": f"doc {i} " + "word " * 40_000},
                                 *({"role": "user", "content": f"q{i} {j}"} for j in range(200))]}
            hasher.chat_blocks(body)
        return hasher

    grown = _grown(fill)
    assert hasher._pieces.num_bytes + hasher._states.num_bytes <= 2 * MIB
    assert grown < 2.2 * MIB, grown  # what the accounting says is what is held (evicted states are freed)


def test_cached_and_uncached_token_blocks_agree_when_the_cache_is_tiny():
    """Key-linked states whose ancestors were evicted are misses, never wrong hashes."""
    tok = SimTokenizer()
    small = PromptHasher(tok, block_size=16, max_blocks=1024, cache_entries=7, cache_bytes=None)
    body = {"messages": [{"role": "user", "content": f"turn {j} " * 30} for j in range(40)]}
    first = small.chat_blocks(body)
    again = small.chat_blocks(body)
    fresh = PromptHasher(tok, block_size=16, max_blocks=1024).chat_blocks(body)
    assert first == again == fresh


@pytest.mark.parametrize("budget_mb", [64, 512, 4096])
def test_tables_are_sized_from_the_budget(budget_mb):
    p = memory.plan(RoutingSettings(memory_budget_mb=budget_mb, tokenizer="sim"))
    tables = (p.max_sessions * SESSION_ENTRY_BYTES + p.max_response_ids * memory.RESPONSE_ID_ENTRY_BYTES
              + p.tokenizer_cache_bytes + p.text_hash_cache_bytes
              + p.max_peer_picks * memory.peer_pick_bytes(p.max_blocks_per_request)
              + p.max_peer_in_flight * memory.PEER_IN_FLIGHT_ENTRY_BYTES
              + p.max_conversations * CONVERSATION_ENTRY_BYTES + p.max_roots * ROOT_ENTRY_BYTES)
    assert 0.7 * p.budget_bytes <= tables <= p.budget_bytes  # 3/16 is headroom for requests in flight
    explicit = memory.plan(RoutingSettings(memory_budget_mb=budget_mb, max_sessions=10, max_response_ids=20))
    assert (explicit.max_sessions, explicit.max_response_ids) == (10, 20)


def test_conversation_entries_cost_at_most_what_the_budget_assumes():
    n = 5000
    table = ConversationTable(max_conversations=n, max_roots=n)
    eps = [EndpointId(f"10.0.0.{i}:8000") for i in range(4)]

    def fill():
        for i in range(n):  # every request a new branch off its own root: the most roots per conversation
            hashes = [2**62 + i, 2**61 + i, 2**60 + i, 2**59 + i]
            table.record(hashes, table.outlook(hashes, 1), eps[i % 4], 100.0, i * 1e-4)
        return table

    per = _grown(fill) / n
    assert len(table) == n
    assert per <= CONVERSATION_ENTRY_BYTES + ROOT_ENTRY_BYTES, per
    plain = ConversationTable(max_conversations=n, max_roots=4)

    def fill_plain():
        for i in range(n):  # branches off no root: conversations alone
            hashes = [2**62 + i, 2**61 + i, 2**60 + i, 2**59 + i]
            plain.record(hashes, plain.outlook(hashes, 0), eps[i % 4], 100.0, i * 1e-4)
        return plain

    per = _grown(fill_plain) / n
    assert len(plain) == n and per <= CONVERSATION_ENTRY_BYTES, per
    assert NO_OUTLOOK.future_turns == 0.0


def test_text_hash_cache_entries_cost_at_most_what_the_budget_assumes():
    n = 2000
    cache = TextHashCache(64, 1 << 30, n)
    # Distinct texts of n spans, each span's hashes new: the cache ends holding n entries.
    text = "".join(f"{i:08d}" * 128 for i in range(n))
    grown = _grown(lambda: (cache.hash_blocks(text, 7), None)[1])
    assert len(cache) == n
    assert grown / n <= memory.TEXT_SPAN_ENTRY_BYTES, grown / n


def test_text_hash_cache_is_sized_from_the_settings():
    cache = TextHashCache.from_settings(RoutingSettings(tokenizer_cache_entries=100))
    assert cache.max_entries == 100
    small = memory.plan(RoutingSettings(memory_budget_mb=1))
    assert TextHashCache.from_settings(RoutingSettings(memory_budget_mb=1)).max_entries == \
        small.text_hash_cache_bytes // memory.TEXT_SPAN_ENTRY_BYTES
    token_mode = memory.plan(RoutingSettings(tokenizer="sim", memory_budget_mb=8))  # a share below the entries'
    assert token_mode.text_hash_cache_bytes * 7 == token_mode.tokenizer_cache_bytes
    assert memory.plan(S).text_hash_cache_bytes == S.tokenizer_cache_entries * memory.TEXT_SPAN_ENTRY_BYTES

"""The router's memory budget (`RoutingSettings.memory_budget_mb`) and the table sizes it sets (pure).

Everything a router keeps after a request has ended is filled by clients (a session per conversation, a
response id per Responses answer, token ids per prompt piece, other replicas' picks), so each such table has a
fixed cost per entry and a number of entries; `plan` divides the budget between them:

| share | table | worst cost per entry |
| --- | --- | --- |
| 1/8 | chat sessions (`sessions.SessionTable`) | `sessions.SESSION_ENTRY_BYTES` (keys are 16-byte digests) |
| 1/8 | Responses directory (`extproc/response_directory.py`) | `RESPONSE_ID_ENTRY_BYTES` (ids are 16-byte digests) |
| 1/4 | prompt hashing: `tokens.PromptHasher` (7/8; token mode), `text_hash_cache.TextHashCache` (the rest, at most its entries) | token ids, chain states; `TEXT_SPAN_ENTRY_BYTES` a span |
| 1/4 | other replicas' pending picks and requests in flight (extproc/peers) | `peer_pick_bytes(blocks)` / `PEER_IN_FLIGHT_ENTRY_BYTES` |
| 1/16 | conversations recognised by prefix chain (`conversations.ConversationTable`) | `conversations.CONVERSATION_ENTRY_BYTES` |
| 3/16 | headroom: requests in flight (held while they run, ~`IN_FLIGHT_REQUEST_BYTES` each), allocator slack | |

Every client-supplied value a table keeps is bounded before it gets there (request.py `MAX_KEY_CHARS`, digests
for session and response ids), so the per-entry figures are worst cases, measured with tracemalloc
(tests/unit/routing/test_memory_bounds.py), not averages. What is not in the budget: the interpreter and its
modules (~170 MB RSS for one replica), and the prefix index, which is sized from the endpoints' KV capacity
(``default_index_capacity_blocks`` or the scraped ``vllm:cache_config_info``) and the number of endpoints: the
operator's fleet, not the clients. Explicit ``max_sessions`` / ``max_response_ids`` override their share.
"""

from __future__ import annotations

import dataclasses

from prefixroute.extproc.routing.conversations import CONVERSATION_ENTRY_BYTES, ROOT_ENTRY_BYTES
from prefixroute.extproc.routing.sessions import SESSION_ENTRY_BYTES

MIB = 1024 * 1024

RESPONSE_ID_ENTRY_BYTES = 550
"""Most bytes one remembered response id costs the Responses directory (digest key, endpoint and expiry, LRU
and per-endpoint index entries, its prompt-token figure), measured (tests/unit/routing/test_memory_bounds.py)."""

PEER_PICK_BASE_BYTES = 700
PEER_PICK_BLOCK_BYTES = 85
"""Another replica's pending pick costs the time model about PEER_PICK_BASE_BYTES plus PEER_PICK_BLOCK_BYTES per
block hash (the hashes tuple and the pending-prefix counts), measured."""

TEXT_SPAN_ENTRY_BYTES = 900
"""Most bytes one span of the text hash cache costs (its key, a tuple of 16 block hashes, the LRU's links:
extproc/routing/text_hash_cache.py), measured (tests/unit/routing/test_memory_bounds.py)."""

PEER_IN_FLIGHT_ENTRY_BYTES = 400
"""One of another replica's requests counted in flight here (its key and endpoint), measured."""

IN_FLIGHT_REQUEST_BYTES = 64 * 1024
"""What one request costs the router while it runs, at most (its parsed form with up to 1,024 block hashes,
its pick and telemetry record, the gRPC stream): documented, not enforced (Envoy's concurrency limits and
the ext_proc cluster's circuit breaker bound how many run at once)."""

SESSIONS_SHARE = 1 / 8
RESPONSE_IDS_SHARE = 1 / 8
TOKENIZER_SHARE = 1 / 4
PEERS_SHARE = 1 / 4
CONVERSATIONS_SHARE = 1 / 16
ROOTS_PER_CONVERSATION = 1 / 16
"""Roots (shared prefixes conversations branch off) kept per conversation kept: far more conversations than
distinct system prompts or tool preambles."""


def peer_pick_bytes(num_blocks: int) -> int:
    """Worst cost of one pending peer pick with `num_blocks` block hashes."""
    return PEER_PICK_BASE_BYTES + PEER_PICK_BLOCK_BYTES * num_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Table sizes from one budget (module docstring). Counts are >= 1."""

    budget_bytes: int
    max_sessions: int
    max_response_ids: int
    tokenizer_cache_bytes: int
    text_hash_cache_bytes: int
    max_peer_picks: int
    max_peer_in_flight: int
    max_blocks_per_request: int  # hashes one request can carry (text or token blocks): what a peer pick may hold
    max_conversations: int = 1
    max_roots: int = 1

    def describe(self) -> str:
        """One line for the log at start."""
        return (f"memory budget {self.budget_bytes // MIB} MiB: {self.max_sessions} sessions, "
                f"{self.max_response_ids} response ids, tokenizer caches {self.tokenizer_cache_bytes // MIB} MiB, "
                f"text hash cache {self.text_hash_cache_bytes // MIB} MiB, "
                f"{self.max_peer_picks} peer picks, {self.max_peer_in_flight} peer requests in flight, "
                f"{self.max_conversations} conversations")


def plan(settings) -> MemoryPlan:  # noqa: ANN001 - RoutingSettings (import cycle)
    """The table sizes for `settings` (``memory_budget_mb``, ``max_sessions`` and ``max_response_ids`` when set,
    and the hashing caps that bound a pick's size)."""
    budget = settings.memory_budget_mb * MIB
    blocks = max(settings.max_blocks, settings.max_token_blocks if settings.tokenizer else 0)
    peers = budget * PEERS_SHARE
    hashing = int(budget * TOKENIZER_SHARE)
    text_share = hashing // 8 if settings.tokenizer else hashing
    return MemoryPlan(
        budget_bytes=budget,
        max_sessions=settings.max_sessions or max(1, int(budget * SESSIONS_SHARE // SESSION_ENTRY_BYTES)),
        max_response_ids=settings.max_response_ids or max(1, int(budget * RESPONSE_IDS_SHARE
                                                                 // RESPONSE_ID_ENTRY_BYTES)),
        tokenizer_cache_bytes=hashing - text_share,
        # the text spans' share, or less when --tokenizer-cache-entries spans fill less (the rest is headroom)
        text_hash_cache_bytes=min(text_share, settings.tokenizer_cache_entries * TEXT_SPAN_ENTRY_BYTES),
        max_peer_picks=max(1, int(peers * 7 / 8 // peer_pick_bytes(blocks))),
        max_peer_in_flight=max(1, int(peers / 8 // PEER_IN_FLIGHT_ENTRY_BYTES)),
        max_blocks_per_request=blocks,
        max_conversations=(conv := max(1, int(budget * CONVERSATIONS_SHARE
                                              // (CONVERSATION_ENTRY_BYTES + ROOT_ENTRY_BYTES * ROOTS_PER_CONVERSATION)))),
        max_roots=max(1, int(conv * ROOTS_PER_CONVERSATION)),
    )

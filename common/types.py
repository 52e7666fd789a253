"""Shared value types of the routing layer (the contract between router, pool and simulations).

Invariants:
- An `EndpointId` is always ``"host:port"`` as configured in the endpoint pool; the router only ever
  emits ids that came from the pool, never from a request.
- `EndpointState` objects are immutable snapshots: the pool replaces them whole, the scheduler never
  mutates them. A snapshot is a tuple of `EndpointState`, in a stable order (the pool's configured order).
- Ratios are in [0, 1]; counts are >= 0; ``None`` means "not known" (never scraped, or stale).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NewType

BlockHash = NewType("BlockHash", int)
"""A chained xxh3-64 of one fixed-size block of canonical prompt text (see hashing.py)."""

EndpointId = NewType("EndpointId", str)
"""``host:port`` of one model-server endpoint."""

RequestKind = Literal["chat", "completion", "responses", "other"]

DecisionReason = Literal["affinity", "spill", "cold", "load", "failover", "policy"]
"""Why the primary endpoint was chosen:
affinity = it holds the longest cached prefix; spill = the affinity endpoint was over its threshold so a
less-loaded one was chosen; cold = the prefix was seen nowhere (rendezvous placement); load = chosen on
load alone (least-load policy or a request with no prompt); failover = primary was unavailable;
policy = a policy that ignores prefix and load (random, round-robin)."""


@dataclasses.dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint as the scheduler sees it at decision time (replaced whole on every update)."""

    endpoint: EndpointId
    healthy: bool = True
    models: frozenset[str] = frozenset()  # served model names incl. adapters; empty = unknown (serves any)
    num_requests_running: int | None = None  # scraped (vllm:num_requests_running / sglang:num_running_reqs)
    num_requests_waiting: int | None = None  # scraped (vllm:num_requests_waiting / sglang:num_queue_reqs)
    kv_cache_usage_ratio: float | None = None  # scraped (vllm:kv_cache_usage_perc / sglang:token_usage), 0-1
    num_gpu_blocks: int | None = None  # scraped from vllm:cache_config_info, sizes the prefix-index LRU
    block_size: int | None = None  # tokens per KV block, from vllm:cache_config_info
    # blocks of the endpoint's host-memory KV tier (vllm:kv_offload_config_info: cpu_num_chunks x cpu_blocks_per_chunk); None: none known
    num_cpu_blocks: int | None = None
    # (queried, GPU hit, CPU-tier hit) prompt tokens the endpoint counted since it started (vllm:prefix_cache_*,
    # vllm:external_prefix_cache_hits): its hit ratio by tier; None when it does not export them
    prefix_cache_tokens: tuple[float, float, float] | None = None
    scraped_at_s: float | None = None  # time.monotonic() of the scrape these figures came from
    # ``ip:port`` / ``[v6]:port`` the endpoint's host resolved to (what Envoy's ORIGINAL_DST connects to);
    # None while a name has not resolved. A healthy endpoint always has one.
    address: str | None = None
    # Restarts the pool detected (process start time changed, or a cumulative counter went backwards): when it
    # changes, the endpoint's KV cache is empty and the router forgets what its prefix index believed there.
    restart_epoch: int = 0
    # Routed although its health probes fail: the pool is in panic mode (too few endpoints pass their probes,
    # so it routes as if the ones that only timed out were healthy; extproc/endpoints/pool.py). Implies healthy.
    panic: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """The scheduler's answer for one request.

    `endpoints` is ordered: the primary first, then fallbacks to try on connect failure. It is empty
    only when no endpoint is eligible (the caller answers 503).
    """

    endpoints: tuple[EndpointId, ...]
    reason: DecisionReason
    policy: str
    matched_blocks: int = 0  # consecutive leading blocks the primary is believed to hold
    total_blocks: int = 0  # blocks hashed for this request (capped)
    predicted_hit_ratio: float = 0.0  # matched_blocks / total_blocks, 0 when total is 0
    # The time model's predicted TTFT (ms, >= 0) at the primary and at the best other endpoint it scored
    # (`alternative_endpoint`, the first fallback when there is one): None for policies without a time model
    # or when no other endpoint was scored. What explains a decision: "stayed, 40 ms against 610 ms elsewhere".
    predicted_ttft_ms: float | None = None
    alternative_endpoint: EndpointId | None = None
    alternative_ttft_ms: float | None = None
    # Leading blocks of the primary's match that a request still prefilling there shares (the time model's
    # pending prefixes): not cached yet when this request arrives, so cached-token feedback ignores them.
    pending_blocks: int = 0
    # Leading blocks of the primary's match credited only by the request's session (the primary served the
    # session's previous turn, whose prompt this one extends) beyond what the prefix index holds there: a
    # miss on them says nothing of the index's capacity, so cached-token feedback does not resize it for them.
    session_blocks: int = 0

"""Settings of the routing core (request parsing, hashing, prefix index, scheduler)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.settings import Settings, setting

POLICIES: dict[str, str] = {
    "prefix": "prefix affinity + load, default",
    "consistent-hash": "rendezvous hash of the prompt prefix only, no load",
    "least-load": "",
    "round-robin": "",
    "random": "",
    "ttft": "opt-in: least predicted time-to-first-token, see ttft_* settings",
}
"""The scheduling policies, name -> note for the help text (empty: the name says it): the default first, then
the baselines from the most to the least informed. The one declaration of the names: `RoutingSettings.policy`
accepts these, scheduling/policies.py has one class per name, and every list of policies (help texts, the
bench's routers) derives from this."""

DEFAULT_POLICY = next(iter(POLICIES))


def _policy_help() -> str:
    listed = ", ".join(f"{name} ({note})" if note else name for name, note in POLICIES.items())
    return (f"Scheduling policy: {listed}. consistent-hash, least-load, round-robin and random exist for "
            "comparison.")


@dataclasses.dataclass(frozen=True)
class RoutingSettings(Settings):
    """How requests are understood, hashed and assigned to endpoints. Immutable; validated on construction."""

    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_"
    TITLE: ClassVar[str] = "Routing"

    policy: str = setting(DEFAULT_POLICY, _policy_help())
    block_chars: int = setting(
        64,
        "Characters of canonical prompt text per router block. 64 = 16 tokens x ~4 characters per token, the "
        "size of a vLLM KV block, so one router block approximates one cached KV block.")
    max_blocks: int = setting(
        256,
        "Most blocks hashed per request (the prompt beyond max_blocks x block_chars = 16 KiB by default is "
        "ignored). Bounds per-request work: a 1 MB prompt costs about what a 16 KB one does beyond JSON "
        "parsing, while 16 KiB (~4k tokens) still tells long shared system prompts apart.")
    chars_per_token: float = setting(
        4.0,
        "Average characters per token, used to convert an endpoint's scraped KV capacity (tokens) into router "
        "blocks for its prefix-index LRU. ~4 for English text with Llama-style tokenizers.")
    prefix_weight: float = setting(
        1.0,
        "Value of one prompt token an endpoint already holds (prefix index) against the load costs below, which "
        "are in prompt tokens too (cost model like NVIDIA Dynamo's: prefill the endpoint would have to compute + "
        "its load). 1 = a cached token saves exactly one token of prefill.")
    load_cost_tokens: float = setting(
        64.0,
        "Cost, in prompt tokens of prefill, of one in-flight request (router's own count) on an endpoint. A "
        "running request mostly adds one sequence to each decode step, about what 64 prompt tokens add to a "
        "step, so a conversation of a few hundred tokens stays where its cache is at a small load difference "
        "(the balance limits below, not this cost, spread hot prefixes); in the virtual benchmarks larger "
        "values moved sessions away from their cache and lowered the multi-turn hit ratio.")
    queue_cost_tokens: float = setting(
        1024.0,
        "Extra cost, in prompt tokens, of each scraped waiting request (num_requests_waiting): a waiting "
        "request still has its whole prefill ahead of ours, ~1k tokens for a typical chat prompt.")
    kv_cost_tokens: float = setting(
        256.0,
        "Cost, in prompt tokens, of a full KV cache (scaled by the scraped kv_cache_usage_ratio). Small: high KV "
        "usage is normal for a server with a warm prefix cache; it only breaks ties toward emptier caches.")
    queue_scale: int = setting(
        16,
        "Waiting requests at which the queue scorer reaches 0. 16 waiting requests on a vLLM server means "
        "seconds of queueing delay: such an endpoint should look as bad as possible on this signal.")
    concurrency_threshold: int = setting(
        32,
        "In-flight requests (counted by this router) at or above which an endpoint is not chosen for prefix "
        "affinity or cold placement while another eligible endpoint is under it (like SageMaker's "
        "ConcurrencyThreshold), whatever the fleet's mean load (see balance_factor). 32 is about where vLLM batches on one GPU stop gaining throughput for 8B-70B "
        "models; the hot prefix then spills to a second endpoint, which the prefix index then also records.")
    balance_factor: float = setting(
        1.5,
        "Adaptive overflow: an endpoint with more than balance_factor x the mean in-flight requests of the "
        "eligible endpoints (+ balance_slack), or more than balance_factor x its fair share of recent picks "
        "(decayed over ~32 picks per endpoint), is not chosen for prefix affinity or cold placement while "
        "another is under both limits, so a hot prefix spills to a second endpoint (which the prefix index "
        "records) and then spreads. 1.5 is the fair-share bound the benchmarks hold the router to.")
    balance_slack: float = setting(
        4.0,
        "In-flight requests allowed above balance_factor x mean before the balance limit applies. At low load "
        "the mean is below one request and a limit of 1.5 x mean would move every second request of a prefix "
        "away from its cache for no latency gain. 4, not 2: a few extra requests queued behind a cached "
        "8,000-token prefix cost less than prefilling it again elsewhere; in the virtual benchmarks 2 spilled "
        "hot system prompts early and lost hit ratio with no P90 gain, while 4 and 6 behaved alike.")
    cold_balance_factor: float = setting(
        1.0,
        "A prefix seen nowhere goes to the first endpoint in rendezvous order whose in-flight requests are at "
        "most cold_balance_factor x the mean (consistent hashing with bounded loads). Nothing is cached "
        "anywhere for it, so load is all that separates endpoints; 1.0 (at or under the mean: a set that is "
        "never empty) lowered the simulated Mooncake trace's P90 TTFT against plain rendezvous. At equal "
        "load this is plain rendezvous.")
    cold_key_blocks: int = setting(
        4,
        "A prefix seen nowhere is placed by rendezvous hashing on the chained hash of its first "
        "cold_key_blocks blocks (256 characters by default): requests sharing a system prompt of at least "
        "that length converge on one endpoint, while prompts that differ within it spread out.")
    max_scored_endpoints: int = setting(
        32,
        "Most endpoints scored per decision: every endpoint holding part of the prompt's prefix, plus a random "
        "sample of the others up to this many (power-of-d choices). Keeps decision time flat as the pool grows "
        "to hundreds of endpoints while the least-loaded of 32 random endpoints is nearly as good as the "
        "least-loaded of all. 0 = score every endpoint.")
    num_fallbacks: int = setting(
        2,
        "Fallback endpoints listed after the primary (Envoy tries them in order when the primary refuses the "
        "connection). 2 survives one dead endpoint plus one more without a client-visible error.")
    tenant_header: str = setting(
        "x-prefixroute-tenant",
        "Request header (lower case) naming the tenant. Its value salts the block hashes so tenants never "
        "share routing state; the body field prompt_cache_key salts them further. Empty = header ignored.")
    max_body_bytes: int = setting(
        8 * 1024 * 1024,
        "Largest request body accepted; larger ones get 413. 8 MiB holds a 128k-token prompt (~0.5 MB) many "
        "times over plus a few base64 images, while bounding what the router buffers per request.")
    default_index_capacity_blocks: int = setting(
        31250,
        "Prefix-index LRU capacity (router blocks) per endpoint until its KV capacity is scraped from "
        "vllm:cache_config_info: 31,250 blocks x 16 tokens = 500k tokens, the KV cache of an 80 GB-class GPU "
        "serving an 8B model (the figure GIE uses).")
    ttft_prior_tokens_per_s: float = setting(
        12800.0,
        "ttft policy: prefill tokens per second an endpoint is assumed to compute until its own responses teach "
        "the router its rate (learned per endpoint from TTFT, prompt and cached tokens). 12,800 = the simulated "
        "Llama 3.1 70B on TP4 H200s (model_servers/profiles.py, an 8,000-token prefill in 0.62 s); an 8B on "
        "one H200 is ~35,000. A wrong prior only costs the first few dozen decisions per endpoint.")
    ttft_prior_base_s: float = setting(
        0.015,
        "ttft policy: TTFT at zero queued work (one engine step plus scheduling) until learned: ~15 ms is one "
        "small step of the simulated 70B and 8B profiles.")
    ttft_rate_window: float = setting(
        64.0,
        "ttft policy: responses over which an endpoint's learned rate is averaged (exponential weights): 64 "
        "follows a change of speed within about a minute at one request per second per endpoint while one odd "
        "response moves the rate by under 2%.")
    ttft_work_weight: float = setting(
        2.0,
        "ttft policy: the score is predicted TTFT + this x the seconds of prefill the request adds to the "
        "endpoint. Added prefill delays the requests that arrive behind it there (about rho / (1 - rho) of them "
        "at utilisation rho: 1 at 50%, 4 at 80%), which the request's own TTFT does not see; 0 = pure least "
        "predicted TTFT, which leaves a prefix holder whenever it ties and replays the spill loop of issue 12. "
        "2: in the virtual sweeps (4 x 70B; shared-prompts of 300 x 8k-token prompts, and mix) 0.5 spilled hot "
        "prefixes (hit ratio -0.01 to -0.02) and lost 10-60% of P50 at 80-100% load; 2 to 8 were alike on "
        "shared-prompts, and 4 traded P90/P99 for P50 on mix.")
    rng_seed: int | None = setting(
        None,
        "Seed of the random generator used for tie breaks and the random policy; unset = from the OS. Set it "
        "to replay a benchmark exactly.")

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for name in ("block_chars", "max_blocks", "concurrency_threshold", "cold_key_blocks", "queue_scale",
                     "max_body_bytes", "default_index_capacity_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.max_scored_endpoints < 0:
            raise ValueError(f"max_scored_endpoints must be >= 0; got {self.max_scored_endpoints}")
        if self.num_fallbacks < 0:
            raise ValueError(f"num_fallbacks must be >= 0; got {self.num_fallbacks}")
        if self.chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be > 0; got {self.chars_per_token}")
        if self.cold_balance_factor < 1.0:
            raise ValueError(f"cold_balance_factor must be >= 1; got {self.cold_balance_factor}")
        if self.balance_factor < 1.0:
            raise ValueError(f"balance_factor must be >= 1; got {self.balance_factor}")
        if self.ttft_prior_tokens_per_s <= 0 or self.ttft_rate_window < 1:
            raise ValueError("ttft_prior_tokens_per_s must be > 0 and ttft_rate_window >= 1")
        for name in ("ttft_prior_base_s", "ttft_work_weight", "prefix_weight", "load_cost_tokens",
                     "queue_cost_tokens", "kv_cost_tokens", "balance_slack"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")

    @property
    def max_prompt_chars(self) -> int:
        """Characters of canonical text that can contribute to the hashes (max_blocks x block_chars)."""
        return self.max_blocks * self.block_chars

    @property
    def tokens_per_block(self) -> float:
        """Tokens one router block stands for (block_chars / chars_per_token)."""
        return self.block_chars / self.chars_per_token

"""Settings of the routing core (request parsing, hashing, prefix index, scheduler)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.settings import Settings, setting

POLICIES: dict[str, str] = {
    "prefix": "least predicted time-to-first-token, prefix cache and queues priced in seconds; default",
    "consistent-hash": "rendezvous hash of the prompt prefix only, no load",
    "least-load": "",
    "round-robin": "",
    "random": "",
}
"""The scheduling policies, name -> note for the help text (empty: the name says it): the default first, then
the baselines from the most to the least informed. The one declaration of the names: `RoutingSettings.policy`
accepts these, scheduling/policies.py has one class per name, and every list of policies (help texts, the
bench's routers) derives from this."""

DEFAULT_POLICY = next(iter(POLICIES))

INDEX_SOURCES: dict[str, str] = {
    "auto": "KV events for endpoints that publish them, cached-token feedback for the others; default",
    "events": "only the servers' KV events (endpoints without an event address match nothing)",
    "feedback": "the router's own picks, corrected by each response's usage.prompt_tokens_details.cached_tokens",
    "approximate": "the router's own picks and an LRU sized from the servers' KV capacity (the first index, kept for comparison)",
}
"""Where the prefix index learns what each endpoint holds, name -> note for the help text."""


PLACEMENT_VICTIMS = ("off", "all", "oneoff")
"""`RoutingSettings.placement_victims`: which requests pay for what their new blocks evict (routing/scheduling/placement.py)."""


SESSION_KEY_SOURCES = ("header", "user", "prompt_cache_key", "off")
"""Where `RoutingSettings.session_key` takes a chat request's session key from."""


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
    index_source: str = setting(
        "auto", "Prefix-index source: " + "; ".join(f"{k} ({v})" for k, v in INDEX_SOURCES.items()) + ". "
        "events and auto match requests by token blocks and need --tokenizer; without one, auto is feedback.")
    tokenizer: str = setting(
        "",
        "How the router tokenizes prompts to match the servers' KV blocks: 'sim' (the simulated servers' "
        "tokenizer and Llama-3 chat template), or a local Hugging Face tokenizer folder (tokenizer.json, and "
        "tokenizer_config.json for the chat template; nothing is downloaded). Empty: prompts are hashed as "
        "canonical text in block_chars blocks (no KV events possible).")
    kv_block_tokens: int = setting(
        16,
        "Tokens per KV block when hashing token blocks: the servers' block size, a divisor or a multiple of it. "
        "16 divides vLLM's CUDA defaults (16 up to 0.33, 64 from 0.34): a server's larger blocks are split into "
        "16-token sub-blocks as its events arrive, so one router matches both; SGLang's default 1-token pages "
        "are merged into 16-token blocks (~100 bytes of router memory per cached token). Checked against each "
        "endpoint's scraped block or page size and its events: a size that is neither a multiple nor a divisor "
        "is logged and that endpoint's events are not matched. A larger value hashes fewer blocks per request "
        "(less router CPU on long prompts) but only matches servers whose size it divides.")
    kv_cpu_load_us_per_token: float = setting(
        2.38,
        "Host-to-device load time of one token's KV from the servers' CPU tier (vLLM --kv-offloading-size), in "
        "microseconds: KV bytes per token per TP rank / host-link bandwidth. 2.38 = Llama-3.1-8B (128 KiB) over an "
        "H200's PCIe Gen5 x16 link (55 GB/s); a 70B at TP 4 (80 KiB per rank) is 1.49. Blocks the events say are "
        "in the CPU tier are priced at this load time (extproc/routing/tier_pricing.py).")
    max_token_blocks: int = setting(
        1024,
        "Most token blocks hashed per request when the router tokenizes (1024 x 16 = 16k tokens): the prompt "
        "beyond is assumed to follow its prefix (cached where all hashed blocks are). Token blocks come from "
        "cached segments for known prefixes, so the cap bounds only a new prompt's cost.")
    tokenizer_cache_entries: int = setting(
        8192,
        "Text segments (a message, a system prompt) whose token ids and block hashes the router keeps (LRU), so "
        "a prompt whose prefix was seen before costs a few hash lookups instead of a tokenization. 8192 "
        "segments of a few thousand tokens are some tens of MB. Text blocks (text mode, and requests token mode "
        "hashes by text) are cached as 1 KiB spans of prompt text, as many (~900 bytes each: ~7 MB, 8 MiB of "
        "distinct prompt text), so a repeated system prompt costs a lookup per KiB instead of a hash per block.")
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
    decode_cost_tokens: float = setting(
        2.0,
        "Time model: prefill-token equivalents one decoding request (in flight, past its first token) adds to "
        "each engine step on its endpoint, so to every step a new request's prefill waits through. In the H200 "
        "step costs (../shared/calibration, model_servers/cost_model.py) one decode sequence adds ~0.1 ms to a "
        "step: 1.3 tokens' worth of prefill for the 70B on TP4, 2.7 for the 8B. 64 (the round-1 figure, per "
        "request rather than per step) priced a busy holder 20x too dear and scattered documents and sessions.")
    attention_tokens: float = setting(
        32768.0,
        "Time model: the context (tokens) at which attention doubles what a prefill token costs. A prefill of n "
        "new tokens on c cached is priced n x (1 + (c + n/2) / this), and each decoding request adds its context / "
        "this to every engine step (the engines' step cost is linear in new tokens and in new tokens x context: "
        "model_servers/cost_model.py). 32768: Llama 3.1 70B on H200s (the calibration: 28k for small steps, 36k "
        "for full chunks), so 700 new tokens on a 25k-token context cost 1.7x 700 cold ones; the 8B is ~16k. "
        "0 = context not priced (every token the same).")
    conversation_horizon_turns: float = setting(
        32.0,
        "Conversations (chats, agents in tool loops: a request that extends an earlier one's prompt) are placed by "
        "the load they will bring: each candidate's score adds the waiting their expected further turns (learned "
        "per shared prefix: 0 for one-off questions) would add there at its recent utilisation "
        "(scheduling/conversation_load.py). This caps the turns counted: 32 covers an agent's life of a few "
        "dozen turns, while a utilisation estimate of a few seconds says little about minutes ahead. 0 = off "
        "(place each request by its own predicted TTFT only).")
    ttft_step_tokens: float = setting(
        8192.0,
        "Time model: tokens an engine step computes at most (vLLM's max_num_batched_tokens: a prefill longer "
        "than this takes several steps, and every step also carries the decoding requests). 8192: vLLM V1's "
        "default for the OpenAI server, and the simulated servers'.")
    cold_key_blocks: int = setting(
        4,
        "A prefix seen nowhere is placed by rendezvous hashing on the chained hash of its first "
        "cold_key_blocks blocks (256 characters by default): requests sharing a system prompt of at least "
        "that length converge on one endpoint, while prompts that differ within it spread out.")
    max_scored_endpoints: int = setting(
        32,
        "Most endpoints scored per decision: every endpoint holding part of the prompt's prefix, the first "
        "1 + num_fallbacks in rendezvous order, plus a random sample of the others up to this many "
        "(power-of-d choices). Keeps decision time flat as the pool grows to hundreds of endpoints while the "
        "fastest of 32 random endpoints is nearly as good as the fastest of all. 0 = score every endpoint.")
    num_fallbacks: int = setting(
        2,
        "Fallback endpoints listed after the primary (Envoy tries them in order when the primary refuses the "
        "connection). 2 survives one dead endpoint plus one more without a client-visible error.")
    tenant_header: str = setting(
        "x-prefixroute-tenant",
        "Request header (lower case) naming the tenant. Its value salts the text-block hashes so tenants never "
        "share routing state; the body field prompt_cache_key salts them further. Token blocks (--tokenizer) "
        "are salted only by the body's cache_salt, as the servers' KV blocks are: the index then mirrors caches "
        "that tenants share unless they send cache_salt. Empty = header ignored.")
    session_key: str = setting(
        "header",
        "Where a chat conversation's session key comes from: header (the session_header header), user (the "
        "body's user field), prompt_cache_key (the body's field), or off. A request with a key stays on the "
        "endpoint that served its session's previous turn, priced by the time model as holding that turn's "
        "prompt, so it moves only when another endpoint, whole prefill included, is predicted faster. Without "
        "a key nothing changes: prefix matching keeps conversations together on its own.")
    session_header: str = setting(
        "x-session-id",
        "Request header (lower case) carrying the session key when session_key is header.")
    session_ttl_s: float = setting(
        600.0,
        "Seconds a session is remembered after its last turn: 10 minutes outlives a user's pause between "
        "chat turns, while an endpoint's KV cache usually turns over within minutes under load.")
    max_sessions: int = setting(
        0,
        "Most sessions remembered (oldest first out). 0 = from memory_budget_mb (an eighth of it at ~400 bytes a "
        "session, keys being 16-byte digests: 167,772 with the default budget).")
    response_id_ttl_s: float = setting(
        3600.0,
        "Seconds the router remembers which endpoint produced a Responses API response (for "
        "previous_response_id and GET /v1/responses/{id}). An id it no longer remembers is looked up on the "
        "endpoints (response_lookup_*), so the TTL bounds memory, not correctness.")
    max_response_ids: int = setting(
        0,
        "Most response ids remembered (oldest first out). 0 = from memory_budget_mb (an eighth of it at ~550 "
        "bytes an id: 122,016 with the default budget, an hour of 33 Responses answers a second).")
    response_lookup_timeout_s: float = setting(
        0.3,
        "Seconds the router waits for the endpoints' answers to GET /v1/responses/{id} when it does not know "
        "an id (router restarted, id expired): a store lookup is a dict read on the server (well under 10 ms), "
        "so 0.3 s is only reached by a hung endpoint. Keep it below the gateway's ext_proc message timeout "
        "(--extproc-message-timeout-ms, 500 ms), which the lookup runs inside: past that Envoy applies its "
        "failure mode instead of the router's answer.")
    max_response_lookups: int = setting(
        64,
        "Most lookups of unknown response ids in flight at once; beyond, a request with an unknown id gets "
        "503 with Retry-After (each lookup asks every endpoint, so unbounded lookups would let forged ids "
        "multiply load on the fleet).")

    memory_budget_mb: int = setting(
        512,
        "Memory the router's tables filled by clients may take at most, worst case, beyond the process's own "
        "~170 MB: an eighth for chat sessions, an eighth for Responses ids, a quarter for the prompt-hashing "
        "caches (tokenizer, text spans), a quarter for other replicas' picks, a quarter left for requests in "
        "flight (routing/memory.py). Every value a client sends that the router keeps is bounded first "
        "(identifiers at 256 characters, digests for session and response ids), so a flood of unique large keys "
        "costs no more than this. 512 MiB: a small share of a router host, and sizes the tables above what a "
        "replica needs at thousands of requests a second.")
    max_messages: int = setting(
        4096,
        "Most messages (chat), input items (Responses) or prompts (completions) in one request; more gets 400 "
        "naming this limit. Rendering and tokenizing cost per message (~40 us each with a chat template, "
        "measured), so this bounds a request's work to ~0.2 s, under Envoy's wait for the router; 4096 is far "
        "beyond any real conversation or agent trace.")
    max_content_parts: int = setting(
        4096,
        "Most content parts (text, images, ...) and tools in one request, over all its messages; more gets 400 "
        "naming this limit (the same reasoning as max_messages).")
    max_input_chars: int = setting(
        4 * 1024 * 1024,
        "Most characters of prompt content (or token ids of a completion prompt) in one request; more gets 400 "
        "naming this limit. 4 Mi characters are ~1M tokens, beyond every served context length, while bounding "
        "what tokenizing one request can cost.")
    inline_parse_bytes: int = setting(
        1024 * 1024,
        "Request bodies up to this size (with at most inline_parse_objects JSON objects) are parsed on the "
        "event loop when the router hashes text (no --tokenizer); larger ones in a parse worker process "
        "(parse_workers), so no request holds the loop: parsing text costs ~1 ms per MiB (JSON decoding; only "
        "the first max_blocks x block_chars characters are hashed).")
    inline_tokenize_bytes: int = setting(
        64 * 1024,
        "The same limit when the router tokenizes prompts (--tokenizer): the whole prompt is tokenized, ~1 ms "
        "per 10-20 KB cold, so bodies over 64 KiB (an 8k-token prompt is ~32 KB) go to the parse worker.")
    inline_parse_objects: int = setting(
        512,
        "Most '{' in a body parsed on the event loop (an upper bound on its JSON objects: messages, parts, "
        "tools); beyond, the body goes to the parse worker, even when small: 512 messages cost ~10 ms to "
        "render and tokenize.")
    parse_workers: int = setting(
        1,
        "Processes that parse large request bodies off the event loop (inline_parse_bytes); 0 = parse every "
        "body on the loop (a large or many-message body then stalls every request on this replica while it is "
        "parsed). One is enough for bodies that are rare; each costs ~60 MB.")
    max_parse_queue: int = setting(
        32,
        "Large bodies waiting for a parse worker at most; beyond, 503 with Retry-After (a flood of large bodies "
        "must not queue for longer than Envoy waits for the router: --extproc-message-timeout-ms).")
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
        "Time model: prefill tokens per second an endpoint is assumed to compute until its own responses teach "
        "the router its rate (learned per endpoint from TTFT, prompt and cached tokens). 12,800 = the simulated "
        "Llama 3.1 70B on TP4 H200s (model_servers/profiles.py, an 8,000-token prefill in 0.62 s); an 8B on "
        "one H200 is ~35,000. A wrong prior only costs the first few dozen decisions per endpoint.")
    ttft_prior_base_s: float = setting(
        0.015,
        "Time model: TTFT at zero queued work (one engine step plus scheduling) until learned: ~15 ms is one "
        "small step of the simulated 70B and 8B profiles.")
    ttft_rate_window: float = setting(
        64.0,
        "Time model: responses over which an endpoint's learned rate is averaged (exponential weights): 64 "
        "follows a change of speed within about a minute at one request per second per endpoint while one odd "
        "response moves the rate by under 2%.")
    ttft_work_weight: float = setting(
        2.0,
        "Time model: the score is predicted TTFT + this x the seconds of prefill the request adds to the "
        "endpoint. Added prefill delays the requests that arrive behind it there (about rho / (1 - rho) of them "
        "at utilisation rho: 1 at 50%, 4 at 80%), which the request's own TTFT does not see; 0 = pure least "
        "predicted TTFT, which leaves a prefix holder whenever it ties and replays a spill loop (hot prefixes moved off their holder and back). "
        "2: in the virtual sweeps (4 x 70B; shared-prompts of 300 x 8k-token prompts, and mix) 0.5 spilled hot "
        "prefixes (hit ratio -0.01 to -0.02) and lost 10-60% of P50 at 80-100% load; 2 to 8 were alike on "
        "shared-prompts, and 4 traded P90/P99 for P50 on mix.")
    placement_victims: str = setting(
        "off",
        "Placement under cache pressure (routing/scheduling/placement.py): price what a request's new blocks would evict on "
        "each endpoint (its least recently used blocks, from KV events and picks, valued by how often recent "
        "requests used them: a count-min sketch with aging) and add it to the score. all: every request; oneoff: "
        "only a request whose prefix was not seen before; off. Needs KV events (index_source events or auto) and "
        "each endpoint's scraped num_gpu_blocks.")
    placement_victim_weight: float = setting(
        0.3,
        "Placement: the score added per evicted block is its prefill seconds x its reuse value (uses by recent "
        "requests / 4, at most 16) x this. In the virtual capacity-pressure sets 1 lost up to 1.56x P90 at 80% load "
        "for little more hit ratio; 0.3 kept TTFT within a few percent (docs/benchmarks.md, placement).")
    placement_replica_weight: float = setting(
        0.0,
        "Placement: score added per block a candidate would duplicate of the best holder's prefix, in that "
        "block's prefill seconds times this: a second copy of a warm prefix must win this much more in TTFT. "
        "0 = off.")
    placement_window_requests: int = setting(
        2048,
        "Placement: requests after which the frequency sketch halves every count (TinyLFU's aging), so a count "
        "is about the uses in the last one or two windows.")
    rng_seed: int | None = setting(
        None,
        "Seed of the random generator used for tie breaks and the random policy; unset = from the OS. Set it "
        "to replay a benchmark exactly.")

    def __post_init__(self) -> None:
        if self.index_source not in INDEX_SOURCES:
            raise ValueError(f"index_source must be one of {', '.join(INDEX_SOURCES)}; got {self.index_source!r}")
        if self.index_source == "events" and not self.tokenizer:
            raise ValueError("index_source 'events' needs a tokenizer (--tokenizer sim or a tokenizer folder)")
        if self.kv_block_tokens < 1 or self.tokenizer_cache_entries < 1 or self.max_token_blocks < 1:
            raise ValueError("kv_block_tokens, max_token_blocks and tokenizer_cache_entries must be >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        for name in ("block_chars", "max_blocks", "cold_key_blocks", "max_body_bytes",
                     "default_index_capacity_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.session_key not in SESSION_KEY_SOURCES:
            raise ValueError(f"session_key must be one of {', '.join(SESSION_KEY_SOURCES)}; got {self.session_key!r}")
        for name in ("session_ttl_s", "response_id_ttl_s", "response_lookup_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        for name in ("max_response_lookups", "memory_budget_mb", "max_messages", "max_content_parts",
                     "max_input_chars", "max_parse_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("max_sessions", "max_response_ids", "inline_parse_bytes", "inline_tokenize_bytes",
                     "inline_parse_objects", "parse_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.max_scored_endpoints < 0:
            raise ValueError(f"max_scored_endpoints must be >= 0; got {self.max_scored_endpoints}")
        if self.num_fallbacks < 0:
            raise ValueError(f"num_fallbacks must be >= 0; got {self.num_fallbacks}")
        if self.chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be > 0; got {self.chars_per_token}")
        if self.ttft_prior_tokens_per_s <= 0 or self.ttft_rate_window < 1:
            raise ValueError("ttft_prior_tokens_per_s must be > 0 and ttft_rate_window >= 1")
        if self.ttft_step_tokens < 1:
            raise ValueError(f"ttft_step_tokens must be >= 1; got {self.ttft_step_tokens}")
        if self.placement_victims not in PLACEMENT_VICTIMS:
            raise ValueError(f"placement_victims must be one of {', '.join(PLACEMENT_VICTIMS)}; "
                             f"got {self.placement_victims!r}")
        if self.placement_window_requests < 1:
            raise ValueError(f"placement_window_requests must be >= 1; got {self.placement_window_requests}")
        for name in ("ttft_prior_base_s", "ttft_work_weight", "decode_cost_tokens", "placement_victim_weight",
                     "placement_replica_weight", "attention_tokens", "conversation_horizon_turns"):
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

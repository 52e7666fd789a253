"""What a prefix held in an endpoint's host-memory (CPU) KV tier is worth to the time model.

A block the endpoint holds on the GPU costs nothing to reuse; a block it does not hold costs its prefill; a block
in the CPU tier (vLLM's native offloading: ``--kv-offloading-size``) costs its host-to-device load, which is
neither. The router prices a request by prefill tokens (`timemodel.TimeModel`: seconds = tokens / rate), so a
CPU-resident block is credited as a fraction of a GPU hit: its recompute time saved less its load time,

    weight = 1 - load_s_per_token x rate        (clamped to [0, 1])

where ``rate`` is the endpoint's prefill rate (tokens/s) and ``load_s_per_token`` the transfer time of one
token's KV (bytes per token per TP rank / host-link bandwidth). A request then costs
``(prompt - (gpu + weight x cpu) x block_tokens) / rate`` = its GPU misses' prefill plus exactly the CPU blocks'
load time. Llama-3.1-8B on an H200 (128 KiB per token, 55 GB/s, ~35k tokens/s of prefill): weight ~0.92;
llm-d credits a CPU hit 0.8 of a GPU hit, Dynamo 0.75, as constants. Pure functions; thread-safe.
"""

from __future__ import annotations

from prefixroute.hardware import H200_HOST_TO_DEVICE_BYTES_PER_S

DEFAULT_LOAD_US_PER_TOKEN = 128 * 1024 / H200_HOST_TO_DEVICE_BYTES_PER_S * 1e6
"""Llama-3.1-8B (128 KiB of KV per token, bf16) over one H200's host link: ~2.38 us per token."""


def cpu_block_weight(load_s_per_token: float, prefill_tokens_per_s: float) -> float:
    """The share of a GPU hit's saving a CPU-resident block keeps (module docstring), in [0, 1]: 1 when loading
    is free, 0 when loading costs as much as recomputing (or the rate is unknown)."""
    if prefill_tokens_per_s <= 0 or load_s_per_token < 0:
        return 0.0
    w = 1.0 - load_s_per_token * prefill_tokens_per_s
    return 0.0 if w < 0.0 else (1.0 if w > 1.0 else w)


def load_s(num_tokens: float, load_s_per_token: float) -> float:
    """Seconds to load `num_tokens` of KV from the CPU tier."""
    return num_tokens * load_s_per_token

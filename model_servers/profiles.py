"""Server profiles: which model a simulated server serves, on what GPU, with how much KV cache.

KV capacity (blocks) = (GPU memory * gpu_memory_utilization - weights per GPU) / (KV bytes per token per GPU
* block_size), with vLLM's default gpu_memory_utilization 0.9 and H200 memory 141e9 bytes:

- ``llama-3.1-8b-h200``: (126.9e9 - 16.06e9) / (128 KiB * 16) = 52,851 blocks (~846k tokens).
- ``llama-3.1-70b-h200-tp4``: weights 141.1e9 / 4 per GPU, KV 320 KiB / 4 per token per GPU (KV heads are
  split over the TP ranks): (126.9e9 - 35.3e9) / (80 KiB * 16) = 69,895 blocks; step times from the
  single-GPU 70B fit divided over TP 4 (see cost_model.TensorParallel).

Activation/graph memory is ignored (vLLM reserves a few GB; the figures are within ~5%).

`EngineSpec` is what one server runs, derived from its settings in one place: the HTTP server
(`server.ModelServer`) and the virtual-time fleet (`virtual_fleet.VirtualFleet`) both build their engines and parse
their requests from it, so a simulation cannot drift from the server it stands for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from prefixroute.model_servers import protocol
from prefixroute.model_servers.cost_model import CostModel, TensorParallel, fit
from prefixroute.hardware import H200_HOST_TO_DEVICE_BYTES_PER_S
from prefixroute.model_servers.cpu_tier import num_cpu_blocks
from prefixroute.model_servers.engine import EngineConfig, EngineCore

H200_MEMORY_BYTES = 141e9
GPU_MEMORY_UTILIZATION = 0.9


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    served_model_name: str
    calibration_model: str
    weight_bytes: float
    kv_bytes_per_token: int  # whole model (all layers, K and V, bf16)
    tensor_parallel: TensorParallel | None = None
    max_model_len: int = 131072

    @property
    def tp_degree(self) -> int:
        return self.tensor_parallel.degree if self.tensor_parallel else 1

    def num_gpu_blocks(self, block_size: int = 16) -> int:
        free = H200_MEMORY_BYTES * GPU_MEMORY_UTILIZATION - self.weight_bytes / self.tp_degree
        return int(free // (self.kv_bytes_per_token / self.tp_degree * block_size))

    def kv_bytes_per_block_per_rank(self, block_size: int = 16) -> int:
        """Bytes of one KV block on one TP rank (what one rank's host link moves to load it)."""
        return self.kv_bytes_per_token // self.tp_degree * block_size

    def cost_model(self) -> CostModel:
        return fit(self.calibration_model, self.tensor_parallel)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("llama-3.1-8b-h200", "meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b",
                weight_bytes=16.06e9, kv_bytes_per_token=128 * 1024),
        Profile("llama-3.1-70b-h200-tp4", "meta-llama/Llama-3.1-70B-Instruct", "llama-3.1-70b",
                weight_bytes=141.1e9, kv_bytes_per_token=320 * 1024, tensor_parallel=TensorParallel(degree=4)),
    )
}
DEFAULT_PROFILE = "llama-3.1-8b-h200"


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None


class SpecSettings(Protocol):
    """What an `EngineSpec` is built from: the engine's part of a server's settings (server_settings.py
    `ServerSettings` has them; declared here so that this module, which the settings import for their defaults,
    does not import them back)."""

    profile: str
    num_gpu_blocks: int | None
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    time_scale: float
    served_model_name: str
    lora_modules: tuple[str, ...]
    default_max_tokens: int
    kv_offloading_size: float | None


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One simulated server's engine and API surface, from its settings (`from_settings`). Immutable; the cost
    model is fitted once and shared by every engine built from the spec (it is immutable too)."""

    profile: Profile
    config: EngineConfig
    cost_model: CostModel
    served_model_name: str
    lora_modules: tuple[str, ...]
    max_model_len: int  # context window in tokens: the setting or the profile's, capped at the KV capacity
    default_max_tokens: int

    @classmethod
    def from_settings(cls, s: SpecSettings) -> EngineSpec:
        """The spec of a server started with settings `s` (ValueError for an unknown profile)."""
        profile = get_profile(s.profile)
        num_blocks = s.num_gpu_blocks or profile.num_gpu_blocks(s.block_size)
        block_bytes = profile.kv_bytes_per_block_per_rank(s.block_size)
        return cls(profile=profile,
                   config=EngineConfig(num_blocks, s.block_size, s.max_num_seqs, s.max_num_batched_tokens,
                                       s.time_scale,
                                       num_cpu_blocks(s.kv_offloading_size, profile.kv_bytes_per_token,
                                                      s.block_size),
                                       block_bytes / H200_HOST_TO_DEVICE_BYTES_PER_S, block_bytes),
                   cost_model=profile.cost_model(),
                   served_model_name=s.served_model_name or profile.served_model_name,
                   lora_modules=tuple(s.lora_modules),
                   max_model_len=min(s.max_model_len or profile.max_model_len, num_blocks * s.block_size),
                   default_max_tokens=s.default_max_tokens)

    def time_model_prior(self) -> tuple[float, float]:
        """(prefill tokens/s, TTFT s at zero work) of this server by its own cost model and time scale: one full
        chunk of ``max_num_batched_tokens`` cold tokens, and one small cached step (64 new tokens on 4,096).
        What a router's time model should start from in front of it (`prefixroute bench` passes it as
        ``--ttft-prior-tokens-per-s`` / ``--ttft-prior-base-s``, the way an operator configures them for a GPU)."""
        n = self.config.max_num_batched_tokens
        cm, scale = self.cost_model, self.config.time_scale
        chunk_s = cm.step_time_s(n, n * n * 0.5, 0, 1) * scale
        small_s = cm.step_time_s(64, 64 * (4096 + 32), 4096, 1) * scale
        return n / chunk_s, small_s

    @property
    def models(self) -> frozenset[str]:
        """Every model name the server answers to: the served model and its LoRA adapters."""
        return frozenset((self.served_model_name, *self.lora_modules))

    def new_engine(self, on_kv_events: Callable[[list], Any] | None = None) -> EngineCore:
        """A fresh engine (empty KV cache, no requests); `on_kv_events` receives each step's KV events."""
        return EngineCore(self.config, self.cost_model, on_kv_events)

    def parse_generate(self, data: dict, *, chat: bool) -> protocol.GenerateRequest:
        """Validate a generation body as this server does (`protocol.parse_generate`; raises `OpenAIError`)."""
        return protocol.parse_generate(data, chat=chat, served=self.served_model_name, models=self.models,
                                       max_model_len=self.max_model_len,
                                       default_max_tokens=self.default_max_tokens)

"""Server profiles: which model a simulated server serves, on what GPU, with how much KV cache.

KV capacity (blocks) = (GPU memory * gpu_memory_utilization - weights per GPU) / (KV bytes per token per GPU
* block_size), with vLLM's default gpu_memory_utilization 0.9 and H200 memory 141e9 bytes:

- ``llama-3.1-8b-h200``: (126.9e9 - 16.06e9) / (128 KiB * 16) = 52,851 blocks (~846k tokens).
- ``llama-3.1-70b-h200-tp4``: weights 141.1e9 / 4 per GPU, KV 320 KiB / 4 per token per GPU (KV heads are
  split over the TP ranks): (126.9e9 - 35.3e9) / (80 KiB * 16) = 69,895 blocks; step times from the
  single-GPU 70B fit divided over TP 4 (see cost_model.TensorParallel).

Activation/graph memory is ignored (vLLM reserves a few GB; the figures are within ~5%).
"""

from __future__ import annotations

import dataclasses

from prefixroute.model_servers.cost_model import CostModel, TensorParallel, fit

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

"""Hardware figures that both the simulated servers and the router price with: one definition, so the router's
tier pricing (extproc/routing/tier_pricing.py) and the servers' CPU tier (model_servers/cpu_tier.py) cannot
drift apart. extproc must not import model_servers, so the figure lives here, in the shared package."""

from __future__ import annotations

H200_HOST_TO_DEVICE_BYTES_PER_S = 55e9
"""Host-to-device bandwidth of one H200 SXM from pinned host memory. Published figure, not measured here: the
H200's host link is PCIe Gen5 x16 (NVIDIA H200 datasheet: 128 GB/s both ways, 64 GB/s each way), and a pinned
``cudaMemcpyAsync`` reaches ~85% of a Gen5 x16 link's raw rate (~55 GB/s). Each tensor-parallel rank loads its own
shard over its own link, so a TP-N load of one block moves ``kv_bytes_per_token / N x block_size`` bytes per link
in parallel."""

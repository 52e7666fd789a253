"""The report's bounds with a CPU tier: Belady MIN and one pooled LRU at GPU and at GPU + CPU capacity, beside
every router."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from prefixroute.bench import report
from prefixroute.bench import upper_bound as ub
from prefixroute.bench import workloads as w

SCHEMA = json.loads((Path(ub.__file__).parent / "results.schema.json").read_text())
PRESSURE = dict(num_groups=12, min_prefix_tokens=256, max_prefix_tokens=1024, num_requests=60, seed=2)


def test_gpu_cpu_bounds_use_the_tier_capacity_from_the_server_args():
    wl = w.capacity_pressure(**PRESSURE)
    gpu_only = ub.fleet_bounds(wl, 4, "llama-3.1-8b-h200", ("--num-gpu-blocks=60",))
    # 0.5 GiB of 8B blocks (2 MiB each): 256 host blocks per server
    tiered = ub.fleet_bounds(wl, 4, "llama-3.1-8b-h200", ("--num-gpu-blocks=60", "--kv-offloading-size=0.5"))
    assert gpu_only["belady_gpu_cpu_hit_ratio"] is None and gpu_only["num_cpu_blocks"] is None
    assert tiered["num_cpu_blocks"] == 256 and tiered["gpu_cpu_capacity_blocks"] == 4 * (60 + 256)
    assert tiered["belady_hit_ratio"] == gpu_only["belady_hit_ratio"]
    # more room: neither bound can drop, and this sequence does not fit in the GPUs alone
    assert tiered["belady_gpu_cpu_hit_ratio"] > tiered["belady_hit_ratio"]
    assert tiered["lru_pooled_gpu_cpu_hit_ratio"] > tiered["lru_pooled_hit_ratio"]
    assert tiered["lru_pooled_gpu_cpu_hit_ratio"] <= tiered["belady_gpu_cpu_hit_ratio"]
    assert tiered["belady_gpu_cpu_hit_ratio"] <= tiered["infinite_cache_hit_ratio"]
    jsonschema.validate(tiered, SCHEMA["properties"]["bounds"] | {"$defs": SCHEMA["$defs"]})
    text = "\n".join(report.render_bounds(tiered))
    assert "GPU + CPU" in text


def test_every_router_stands_beside_the_bounds():
    bounds = {"belady_hit_ratio": 0.6, "lru_pooled_hit_ratio": 0.4, "belady_gpu_cpu_hit_ratio": 0.9,
              "lru_pooled_gpu_cpu_hit_ratio": 0.8}
    runs = [{"router": "a", "hit_ratio": 0.5}, {"router": "b", "hit_ratio": None}]
    lines = report.render_bounds_by_router(runs, bounds)
    row_a = next(x for x in lines if x.startswith("| a |"))
    assert "+50% of gap" in row_a and "1.25x" in row_a  # (0.5-0.4)/(0.6-0.4); 0.5/0.4
    assert "-300% of gap" in row_a  # below the pooled LRU of GPU + CPU: (0.5 - 0.8) / (0.9 - 0.8)
    assert len([x for x in lines if x.startswith("| b |")][0].split("|")) == len(row_a.split("|"))

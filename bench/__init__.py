"""Benchmarks: workloads, trace replay, a streaming client, routers side by side, virtual-time fleets.

Modules (pure logic separate from I/O):

- `workloads`: seeded request sequences (shared-prompts, multi-turn, documents, mix), Mooncake-format trace
  replay (slicing, time scaling) and arrival processes (trace, poisson, closed). Pure, except reading a trace.
- `upper_bound`: the hit ratio one infinite cache would reach on the same request sequence. Pure.
- `client`: asynchronous streaming OpenAI client measuring TTFT, ITL, end-to-end latency, tokens,
  cached tokens and the serving endpoint.
- `results`: metrics arithmetic and the results.json document. Pure.
- `report`: report.md and the PNG plots.
- `runner`: fresh model servers + one router per run (our gateway per policy, sglang-router,
  vllm-router), same request sequence for every router.
- `virtual`, `sim_pool`: the live router service (`PoolRouter` over a `SimulatedPool`) against the model
  servers' virtual-time fleet (`--virtual`).
- `cli`: ``prefixroute bench``.
- `overhead` (+ `http_load`, `fast_upstream`): ``prefixroute overhead-bench``, Envoy with vs without ext_proc.
- `decision`: ``python -m prefixroute.bench.decision``, parse + hash + schedule time per request.
- `recorder`: ``python -m prefixroute.bench.recorder``, the telemetry recorder's cost on the event loop.
- `model_server`: ``prefixroute model-server-bench``, the simulated server's own CPU cost.

Reproduce the README tables (real processes; ~1 min per router for the first, ~4 min per router for the
second)::

    prefixroute bench --workload shared-prompts --out bench-results/shared-prompts
    prefixroute bench --trace mooncake_synthetic_trace.jsonl --trace-end-s 120 --max-output-tokens 64 \\
        --profile llama-3.1-8b-h200 --out bench-results/trace
    prefixroute bench --virtual --trace mooncake_synthetic_trace.jsonl --servers 8 \\
        --profile llama-3.1-8b-h200 --routers prefixroute:random,prefixroute:round-robin,\\
    prefixroute:least-load,prefixroute:consistent-hash,prefixroute:prefix --out bench-results/trace-virtual
"""

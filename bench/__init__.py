"""Benchmarks: workloads, trace replay, a streaming client, routers side by side, virtual-time fleets.

Modules (pure logic separate from I/O):

- `workload_spec`: what a workload is (`RequestSpec`, `Workload`). Pure.
- `workloads`: seeded synthetic request sequences (shared-prompts, multi-turn, documents, mix,
  capacity-pressure) built by name, and arrival processes (trace, poisson, closed); `agents_workload`: the
  tool-calling agents workload; `traces`: Mooncake-format trace replay (parsing, slicing, time scaling);
  `synthetic_text`: their deterministic prompt text. Pure, except reading a trace.
- `upper_bound`: the hit ratio one infinite cache would reach on the same request sequence. Pure.
- `client`: asynchronous streaming OpenAI client measuring TTFT, ITL, end-to-end latency, tokens,
  cached tokens and the serving endpoint.
- `results`: metrics arithmetic and the results.json document. Pure.
- `report`: report.md and the PNG plots.
- `routers`: the routers a bench compares, by name (`parse_router`: `RouterSpec`). Pure.
- `fleet`: the real bench's fresh model servers per run, with their KV-event ports.
- `runner`: fresh model servers + one router per run (our gateway per policy, sglang-router,
  vllm-router), same request sequence for every router.
- `virtual_run`, `sim_pool`: the live router service (`PoolRouter` over a `SimulatedPool`) against the model
  servers' virtual-time fleet (`--virtual`).
- `capacity`, `sweep`, `sweep_report`: load sweeps (``--sweep-load-percents``): the fleet's capacity (the
  sweep's 100%), the sweep's runs, its report and plots.
- `cli`: ``prefixroute bench``.
- `overhead` (+ `http_load`, `fast_upstream`): ``prefixroute overhead-bench``, Envoy with vs without ext_proc.
- `decision`: ``python -m prefixroute.bench.decision``, parse + hash + schedule time per request.
- `decision_replay`: ``python -m prefixroute.bench.decision_replay record|check FILE``, every pick of ~20,000
  seeded decisions (every policy and index source, the service and the virtual fleet) recorded, then replayed
  on changed code: "N identical, M differ".
- `recorder`: ``python -m prefixroute.bench.recorder``, the telemetry recorder's cost on the event loop.
- `model_server`: ``prefixroute model-server-bench``, the simulated server's own CPU cost.

Imports between them go one way (no cycle): both benches take router names from `routers`; `runner` imports
`virtual_run` (the fleet's own speed as the gateway's time-model prior), never the reverse.

Reproduce the tables of docs/benchmarks.md (real processes; ~1 min per router for the first, ~4 min per router for the
second)::

    prefixroute bench --workload shared-prompts --out bench-results/shared-prompts
    prefixroute bench --trace mooncake_synthetic_trace.jsonl --trace-end-s 120 --max-output-tokens 64 \\
        --profile llama-3.1-8b-h200 --out bench-results/trace
    prefixroute bench --virtual --trace mooncake_synthetic_trace.jsonl --servers 8 \\
        --profile llama-3.1-8b-h200 --routers prefixroute:random,prefixroute:round-robin,\\
    prefixroute:least-load,prefixroute:consistent-hash,prefixroute:prefix --out bench-results/trace-virtual
"""

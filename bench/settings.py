"""Settings of `prefixroute bench` (flag > env PREFIXROUTE_BENCH_* > default)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from prefixroute.extproc.routing.settings import INDEX_SOURCES, POLICIES
from prefixroute.settings import Settings, setting

# Our policies from the least to the most informed (the report's rows in that order), then the peers.
DEFAULT_ROUTERS = (*(f"prefixroute:{p}" for p in reversed(POLICIES)), "sglang-router", "vllm-router")


@dataclasses.dataclass(frozen=True)
class BenchSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_BENCH_"
    TITLE: ClassVar[str] = "Benchmark (workload, routers, fleet, output)"

    # --- what to send
    workload: str = setting("shared-prompts", "Synthetic workload: shared-prompts, multi-turn, documents, mix, "
                            "capacity-pressure, agents, tenants or an agent-loops one (ignored with --trace). "
                            "shared-prompts: many long system prompts (the headline figures); capacity-pressure: a "
                            "working set about twice the fleet's KV cache; agents: tool-calling agents over the "
                            "Responses API (the chat equivalent for routers that speak chat); tenants: Zipf-popular "
                            "tenants' system prompts + multi-turn sessions, mostly short cache hits; agent-loops "
                            "(and its shapes -short-preamble, -long-preamble, -few, -many, -apps, -fanout): agents "
                            "re-sending a growing context behind a shared tool preamble, with think times "
                            "(--agent-loop-args).")
    trace: str = setting("", "Mooncake-format JSONL trace to replay instead of a synthetic workload "
                         "(timestamp ms, input_length, output_length, hash_ids per 512-token block).")
    trace_block_tokens: int = setting(512, "Tokens per hash id in the trace (Mooncake: 512; other traces of "
                                      "the same shape may use another block size).")
    trace_start: int = setting(0, "First trace record to replay (index, inclusive).")
    trace_stop: int = setting(0, "Stop before this trace record index; 0 = to the end.")
    trace_start_s: float = setting(0.0, "Keep trace records at or after this time (s from trace start).")
    trace_end_s: float = setting(0.0, "Keep trace records before this time (s); 0 = no limit.")
    trace_time_scale: float = setting(1.0, "Multiply trace inter-arrival times by this (0.5 = twice the rate). "
                                      "Not the model servers' --time-scale (GPU speed): pass that in --server-args.")
    max_output_tokens: int = setting(0, "Cap each trace request's output tokens (0 = trace's own). Real-fleet "
                                     "trace slices on 2 CPU cores often want ~64 to finish in minutes.")
    num_requests: int = setting(0, "Requests of a synthetic workload (a trace is cut with --trace-start/"
                                "--trace-stop/--trace-*-s instead); 0 = 300 (at 8 req/s ~40 s per router, stable "
                                "p50/p90), or 1,500 per point for a virtual sweep (a P99 over 15 requests, not one). "
                                "A real sweep runs it at every point: see --sweep-load-percents for its sizing.")
    seed: int = setting(0, "Seed of every random choice (workload text, groups, arrivals, random policy).")
    num_groups: int = setting(32, "shared-prompts: number of distinct system prompts. 32 groups on 4 servers: "
                              "random routing computes each prefix on every server (~40% of prompt tokens "
                              "missed), prefix routing once.")
    prefix_tokens: int = setting(8000, "shared-prompts: tokens per shared system prompt (mix too): 8,000 as in "
                                 "the published anchor (SageMaker, Llama 3.1 70B); a miss then costs ~0.6 s of "
                                 "prefill on the 70B profile.")
    question_tokens: int = setting(64, "Tokens of each unique question (multi-turn: of each user turn).")
    output_tokens: int = setting(32, "Generated tokens per synthetic request: short, so TTFT (what routing "
                                 "changes) dominates the run time.")
    num_sessions: int = setting(16, "multi-turn: number of chat sessions (requests = sessions x turns; "
                                "--num-requests does not apply). 16 x 6 = 96 requests, 8 sessions interleaved.")
    num_turns: int = setting(6, "multi-turn: turns per session; agents: turns per agent (the first and middle "
                             "ones end in a function call, the last in a text answer).")
    num_agents: int = setting(32, "agents: number of agents (requests = agents x turns; --num-requests does not "
                              "apply). 32 x 6 = 192 requests; with 4 apps, 8 agents share each app's instructions.")
    agent_max_active: int = setting(0, "agents: agents in progress at a time (round-robin over them in the "
                                    "request order, as multi-turn); 0 = all of them. Each follow-up is sent at "
                                    "its Poisson arrival or when its previous turn ends, whichever is later, so "
                                    "with few active agents the offered rate is capped by their latency.")
    agent_tool_output_tokens: tuple[str, ...] = setting(("150", "400"), "agents: MIN,MAX tokens of each tool "
                                                       "output (uniform, seeded): what a follow-up adds to the "
                                                       "conversation, and what a router that loses the "
                                                       "conversation's endpoint recomputes, turn after turn.")
    agent_num_apps: int = setting(4, "agents: distinct apps (instructions + function tools), each shared by "
                                  "~num_agents / num_apps agents.")
    agent_instructions_tokens: int = setting(3000, "agents: tokens of each app's instructions. ~3,000 as coding "
                                             "agents' system prompts; a miss then costs ~0.2 s of prefill on the "
                                             "70B profile.")
    agent_loop_args: tuple[str, ...] = setting((), "agent-loops workloads (agent-loops, agent-loops-short-preamble, "
                                               "-long-preamble, -few, -many, -apps, -fanout: bench/agent_loops.py): "
                                               "KEY=VALUE changes of the named shape, comma-separated, e.g. "
                                               "'num_agents=48,max_think_s=5' (keys: the fields of AgentLoopShape). "
                                               "Requests = --num-requests turns; arrivals as --arrival, each "
                                               "follow-up at least its think time after its previous turn ends.")
    num_documents: int = setting(32, "documents: number of documents (Zipf popularity, s=1.1).")
    document_tokens: int = setting(4096, "documents: tokens per document.")
    pressure_num_groups: int = setting(128, "capacity-pressure: distinct long shared prefixes (documents, system "
                                       "prompts), Zipf popularity. 128 x ~4,900 tokens on 300 requests: a shared "
                                       "working set of ~20,000 blocks, infinite-cache bound ~0.66.")
    pressure_min_prefix_tokens: int = setting(2048, "capacity-pressure: shortest shared prefix in tokens (lengths "
                                              "uniform between min and max).")
    pressure_max_prefix_tokens: int = setting(8192, "capacity-pressure: longest shared prefix in tokens.")
    pressure_zipf_s: float = setting(0.8, "capacity-pressure: Zipf exponent of prefix popularity. 0.8: a hot head "
                                     "and a long tail of prefixes that return after being evicted; higher "
                                     "concentrates the load on fewer prefixes (less pressure).")
    pressure_kv_ratio: float = setting(0.5, "capacity-pressure without --num-gpu-blocks in --server-args: size each "
                                       "server's KV cache so the fleet holds this fraction of the shared working "
                                       "set (blocks two requests or more reference), i.e. --num-gpu-blocks = "
                                       "ratio x shared / --servers, added to --server-args and printed. 0.5: half, "
                                       "as the index-source benchmark in docs/benchmarks.md; 0 = leave the profile's capacity.")
    arrival: str = setting("auto", "Arrival process: trace (trace timestamps), poisson (at --rate-rps), closed "
                           "(--concurrency requests in flight) or auto (trace for --trace, else poisson).")
    rate_rps: float = setting(8.0, "Poisson rate in requests/s. 8 req/s of the default shared-prompts on 4 "
                              "servers of the 70B profile: random routing queues (simulated p50 TTFT ~0.6 s) "
                              "while prefix routing does not, and 2 CPU cores keep up.")
    concurrency: int = setting(16, "Closed-loop concurrency (requests in flight).")

    # --- who serves it
    routers: tuple[str, ...] = setting(DEFAULT_ROUTERS, "Routers to compare, comma-separated: "
                                       "prefixroute:POLICY[@SOURCE] "
                                       f"({', '.join(reversed(POLICIES))}; SOURCE = the prefix index's source, "
                                       f"{', '.join(INDEX_SOURCES)}: --index-source of the gateway, none = its "
                                       "default, auto), sglang-router[:POLICY] (0.3.2), vllm-router[:POLICY] "
                                       "(0.1.17; kv_aware: fed the servers' KV events), smg[:POLICY] (1.13.0, the "
                                       "SGLang Model Gateway, in a venv of its own made on first use under "
                                       "~/.cache/prefixroute/peers, or $PREFIXROUTE_SMG) (peer "
                                       "default: cache_aware). When the simulated servers can publish KV events "
                                       "(--kv-events-config), every run's servers publish them and our gateway "
                                       "subscribes; @events runs are skipped when they cannot. A /chat or "
                                       "/responses suffix forces the API a router is sent the agents workload "
                                       "in (default: Responses for prefixroute, the chat equivalent for peers; "
                                       "both forward /v1/responses, so sglang-router:random/responses is "
                                       "random routing of Responses without affinity).")
    servers: int = setting(4, "Simulated model servers in the fleet. 4 keeps a real run on 2 CPU cores; "
                          "--virtual takes 8-256.")
    profile: str = setting("llama-3.1-70b-h200-tp4", "Model-server profile (--profile of `prefixroute "
                           "model-server`; empty = its default): Llama 3.1 70B on TP4 H200s, the anchor's model.")
    server_args: tuple[str, ...] = setting((), "Extra flags for every model server, comma-separated, "
                                           "e.g. '--time-scale=0.1'.")
    gateway_args: tuple[str, ...] = setting((), "Extra flags for `prefixroute gateway`, comma-separated.")
    startup_timeout_s: float = setting(60.0, "Max wait for a server or router to become ready.")

    # --- bounds and output
    max_duration_s: float = setting(600.0, "Per-router wall-time bound: no request starts after it.")
    request_timeout_s: float = setting(300.0, "Per-request timeout.")
    max_connections: int = setting(1024, "Client connection limit (keep-alive pool); above any sane concurrency "
                                   "so open-loop arrivals are not throttled by the client.")
    out: str = setting("", "Output folder: results.json, report.md, *.png, logs/. Empty: a new folder "
                           "<state folder>/bench/<time>-<workload> (never the current folder; printed at the "
                           "start; the dashboard's Benchmarks page reads it).")
    progress: bool = setting(True, "Progress bar on stderr.")
    overhead: bool = setting(False, "Afterwards, also measure the router's own overhead (`prefixroute "
                             "overhead-bench`: Envoy with vs without ext_proc) into DIR/overhead.txt.")

    # --- fleet simulation
    virtual: bool = setting(False, "Simulate the fleet in virtual time (routing core + model-server engines) "
                            "instead of real processes: 8-256 servers and whole traces in seconds.")
    sweep_load_percents: tuple[str, ...] = setting(
        (), "Sweep Poisson arrivals over these percents of the fleet's capacity (e.g. 20,40,60,80,100,120 with "
        "--virtual; 40,80,110 on real processes) instead of one run at --rate-rps, one request sequence per point "
        "shared by every router. Capacity = the highest rate at which sim:oracle keeps the median queueing (TTFT "
        "minus the request's own prefill on an idle endpoint) under one cold prefill of the workload's median "
        "prompt, found on the virtual fleet of the same workload, --profile, --servers and --server-args (so "
        "--server-args=--time-scale=N lowers it N-fold) in ~10 oracle runs, printed per workload. Writes "
        "DIR/results.json, DIR/report.md, DIR/ttft_vs_load.png and DIR/hit_ratio_vs_load.png. Default --routers: "
        "virtual, every prefixroute policy, sim:sglang-cache-aware and sim:oracle (each router's gap is to it); "
        "real, prefixroute:random, the default policy and sglang-router. On 2 cores keep a real sweep's top rate "
        "near 10 req/s of 8k-token prompts (slow the simulated GPUs with --time-scale), or the client, Envoy and "
        "the servers, not the routing, set the TTFT.")

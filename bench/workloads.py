"""Benchmark workloads: seeded, reproducible sequences of requests, built by name (`make_workload`).

A workload (bench/workload_spec.py) is a tuple of `RequestSpec` in send order plus the parameters that made
it. The same parameters and seed always give byte-identical requests, so every router in a bench run sees
the same sequence. Nothing here does I/O. The synthetic workloads are here (shared-prompts, multi-turn,
documents, mix, capacity-pressure, tenants); agents in bench/agents_workload.py; the agent-loops family in
bench/agent_loops.py; trace replays in bench/traces.py.
Their text is bench/synthetic_text.py's: requests share a text prefix exactly when they share leading
blocks.

Multi-turn sessions resend the growing conversation with a *synthetic*, deterministic assistant answer
per turn (not the text the server returned): that keeps the request sequence identical across routers
and runs, at the cost that a server's cached generated tokens do not match the next turn (vLLM would hit
them with the real answer). The prompt part of every earlier turn is still a shared prefix.

Arrival processes (`apply_arrivals`): ``trace`` (trace timestamps x time_scale), ``poisson`` (exponential
gaps at rate_rps, seeded) and ``closed`` (no arrival times; the client keeps `concurrency` requests in
flight). A request with `after_index` set (the next turn of a session) is never sent before that
request has finished, whatever the arrival process.
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Literal

from prefixroute.bench.agent_loops import SHAPES as AGENT_LOOP_SHAPES, agent_loops
from prefixroute.bench.agents_workload import agents
from prefixroute.bench.synthetic_text import block_text
from prefixroute.bench.workload_spec import RequestSpec, Workload, check_positive

ArrivalKind = Literal["trace", "poisson", "closed"]

WORKLOAD_NAMES = ("shared-prompts", "multi-turn", "documents", "mix", "capacity-pressure", "agents", "tenants",
                  *AGENT_LOOP_SHAPES)


def shared_prompts(*, num_groups: int = 8, prefix_tokens: int = 2048, question_tokens: int = 64,
                   num_requests: int = 200, output_tokens: int = 32, seed: int = 0) -> Workload:
    """G groups x an L-token system prompt, each request = its group's prompt + a unique question.

    The group of each request is drawn uniformly (seeded). Upper bound on hits: every request after the
    first of its group finds the group's prefix cached.
    """
    check_positive(num_groups=num_groups, num_requests=num_requests, prefix_tokens=prefix_tokens,
                    question_tokens=question_tokens, output_tokens=output_tokens)
    rng = random.Random(f"{seed}:shared-prompts")
    reqs = []
    for i in range(num_requests):
        g = rng.randrange(num_groups)
        msgs = ({"role": "system", "content": block_text(seed, "sys", g, prefix_tokens)},
                {"role": "user", "content": block_text(seed, "q", i, question_tokens)})
        reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=msgs, group_id=f"group-{g}"))
    return Workload("shared-prompts", {"num_groups": num_groups, "prefix_tokens": prefix_tokens,
                                       "question_tokens": question_tokens, "output_tokens": output_tokens,
                                       "seed": seed}, tuple(reqs))


def _session_turn(seed: int, system: str, user_kind: str, assistant_kind: str, k: int, user_tokens: int,
                  output_tokens: int) -> list[dict[str, str]]:
    """Turn `k` (from 0) of a chat session: `system`, the k earlier (question, synthetic answer) pairs, then the
    next question; question j is ``block_text(seed, user_kind, j, user_tokens)``, answer j the same of
    `assistant_kind` (module docstring: synthetic answers keep the sequence identical across routers)."""
    msgs = [{"role": "system", "content": system}]
    for j in range(k + 1):
        msgs.append({"role": "user", "content": block_text(seed, user_kind, j, user_tokens)})
        if j < k:
            msgs.append({"role": "assistant", "content": block_text(seed, assistant_kind, j, output_tokens)})
    return msgs


def multi_turn(*, num_sessions: int = 16, num_turns: int = 6, system_tokens: int = 256, user_tokens: int = 128,
               output_tokens: int = 64, max_active_sessions: int = 8, seed: int = 0) -> Workload:
    """Chat sessions; turn k resends system + all earlier (user, assistant) pairs + the k-th question.

    At most `max_active_sessions` sessions are interleaved at a time (round-robin over the active
    ones), so a session's turns are separated by other sessions' requests, as on a real service. The
    assistant text of turn k is synthetic (see module doc). Turn k+1 has after_index = turn k.
    """
    check_positive(num_sessions=num_sessions, num_turns=num_turns, system_tokens=system_tokens,
                    user_tokens=user_tokens, output_tokens=output_tokens, num_active=max_active_sessions)
    rng = random.Random(f"{seed}:multi-turn")
    # Each session picks one of a few system prompts: sessions of the same app share it.
    num_systems = max(1, num_sessions // 4)
    systems = [rng.randrange(num_systems) for _ in range(num_sessions)]
    pending = list(range(num_sessions))
    active: list[int] = []
    turn_of = [0] * num_sessions
    last_index: dict[int, int] = {}
    reqs: list[RequestSpec] = []
    while pending or active:
        while pending and len(active) < max_active_sessions:
            active.append(pending.pop(0))
        for s in list(active):
            k = turn_of[s]
            msgs = _session_turn(seed, block_text(seed, "sys", systems[s], system_tokens), f"u{s}.", f"a{s}.", k,
                                 user_tokens, output_tokens)
            i = len(reqs)
            reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=tuple(msgs),
                                    group_id=f"session-{s}", session_id=f"session-{s}", turn=k,
                                    after_index=last_index.get(s)))
            last_index[s] = i
            turn_of[s] += 1
            if turn_of[s] == num_turns:
                active.remove(s)
    return Workload("multi-turn", {"num_sessions": num_sessions, "num_turns": num_turns,
                                   "system_tokens": system_tokens, "user_tokens": user_tokens,
                                   "output_tokens": output_tokens, "max_active_sessions": max_active_sessions,
                                   "assistant_text": "synthetic", "seed": seed}, tuple(reqs))


def documents(*, num_documents: int = 32, document_tokens: int = 4096, question_tokens: int = 64,
              num_requests: int = 200, output_tokens: int = 32, zipf_s: float = 1.1,
              instruction_tokens: int = 128, seed: int = 0) -> Workload:
    """RAG / few-shot: shared instructions + one document drawn by Zipf popularity + a unique question.

    Document d has weight 1/(d+1)^zipf_s, so a few documents are hot and a long tail is cold, which is
    what separates cache-aware routers from hash-only ones.
    """
    check_positive(num_documents=num_documents, num_requests=num_requests, document_tokens=document_tokens,
                    question_tokens=question_tokens, output_tokens=output_tokens, zipf_s=zipf_s,
                    instruction_tokens=instruction_tokens)
    rng = random.Random(f"{seed}:documents")
    weights = [1.0 / (d + 1) ** zipf_s for d in range(num_documents)]
    instructions = block_text(seed, "inst", 0, instruction_tokens)
    reqs = []
    for i in range(num_requests):
        d = rng.choices(range(num_documents), weights=weights)[0]
        content = block_text(seed, "doc", d, document_tokens)
        msgs = ({"role": "system", "content": instructions},
                {"role": "user", "content": content + block_text(seed, "dq", i, question_tokens)})
        reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=msgs, group_id=f"doc-{d}"))
    return Workload("documents", {"num_documents": num_documents, "document_tokens": document_tokens,
                                  "question_tokens": question_tokens, "instruction_tokens": instruction_tokens,
                                  "output_tokens": output_tokens, "zipf_s": zipf_s, "seed": seed}, tuple(reqs))


def mix(*, num_requests: int = 300, seed: int = 0, **sizes: int) -> Workload:
    """One third each of shared-prompts, multi-turn and documents, interleaved by a seeded shuffle.

    The shuffle keeps each session's turns in order (and after_index is remapped), so the
    dependencies stay valid. `sizes` may override prefix_tokens / document_tokens / output_tokens.
    """
    check_positive(num_requests=num_requests)
    third = max(1, num_requests // 3)
    out_tokens = sizes.get("output_tokens", 32)
    num_sessions = max(1, third // 4)
    parts = [
        shared_prompts(num_requests=third, seed=seed, output_tokens=out_tokens,
                       prefix_tokens=sizes.get("prefix_tokens", 2048)),
        multi_turn(num_sessions=num_sessions, num_turns=4, seed=seed, output_tokens=out_tokens),
        documents(num_requests=max(1, num_requests - third - num_sessions * 4), seed=seed,
                  output_tokens=out_tokens, document_tokens=sizes.get("document_tokens", 4096)),
    ]
    rng = random.Random(f"{seed}:mix")
    # Random merge of three ordered streams: keeps the order inside each stream.
    queues = [list(p.requests) for p in parts]
    order = [k for k, q in enumerate(queues) for _ in q]
    rng.shuffle(order)
    remap: dict[tuple[int, int], int] = {}
    reqs: list[RequestSpec] = []
    heads = [0, 0, 0]
    for k in order:
        r = queues[k][heads[k]]
        heads[k] += 1
        new_index = len(reqs)
        remap[(k, r.index)] = new_index
        after = remap[(k, r.after_index)] if r.after_index is not None else None
        prefix = parts[k].name
        reqs.append(dataclasses.replace(r, index=new_index, after_index=after, group_id=f"{prefix}/{r.group_id}",
                                        session_id=f"{prefix}/{r.session_id}" if r.session_id else None))
    return Workload("mix", {"parts": [p.name for p in parts], "num_per_part": [len(p.requests) for p in parts],
                            "output_tokens": out_tokens, "seed": seed}, tuple(reqs))


def _zipf_prefixes(rng: random.Random, n: int, min_tokens: int, max_tokens: int,
                   zipf_s: float) -> tuple[list[int], list[float]]:
    """n prefix lengths (uniform in min..max_tokens) and popularity weights 1/(rank + 1)^zipf_s, drawn from `rng`
    in that order. The ranks are shuffled against the lengths, so hot prefixes are not all long (or short)."""
    lengths = [rng.randint(min_tokens, max_tokens) for _ in range(n)]
    ranks = list(range(n))
    rng.shuffle(ranks)
    return lengths, [1.0 / (ranks[i] + 1) ** zipf_s for i in range(n)]


def capacity_pressure(*, num_groups: int = 128, min_prefix_tokens: int = 2048, max_prefix_tokens: int = 8192,
                      question_tokens: int = 64, num_requests: int = 300, output_tokens: int = 32,
                      zipf_s: float = 0.8, instruction_tokens: int = 64, seed: int = 0) -> Workload:
    """A working set larger than the fleet's KV cache: G long shared prefixes (documents or system prompts of
    min..max_prefix_tokens, uniform, seeded) under Zipf popularity, each request = a short shared instruction +
    one prefix + a unique follow-up question. Prefix g has weight 1/(rank_g + 1)^zipf_s (ranks shuffled against
    the lengths): a few prefixes are hot, many are cold and come back after the cache has long forgotten them,
    so what a router believes each server holds drifts from what it holds.

    Sizing the fleet against it: the *shared working set* is the distinct KV blocks that two requests or more
    reference (the part worth caching: one-off blocks such as the unique questions and the prefixes drawn once
    only pass through); `prefixroute bench` prints it, with all distinct blocks, in the report's bounds. A fleet
    of S servers holds half of it with ``--server-args=--num-gpu-blocks=N``, N = shared / (2 S)
    (`prefixroute.bench.upper_bound.gpu_blocks_for`; `prefixroute bench` sets it itself when --server-args
    gives no --num-gpu-blocks). At the defaults (seed 0): 128 prefixes of ~4,900 tokens on average, 300
    requests, ~31,000 distinct blocks of 16 tokens of which ~20,000 shared; 4 servers -> N ~ 2,500 blocks each.
    Hit-ratio figures there: infinite cache ~0.66, Belady MIN on the pooled capacity ~0.62, one LRU cache of
    the pooled capacity ~0.42, prefix affinity (each prefix on one server, LRU) ~0.39, random ~0.14. A real run
    of 300 requests at 4 req/s takes about 75 s per router on 2 CPU cores.
    """
    check_positive(num_groups=num_groups, num_requests=num_requests, min_prefix_tokens=min_prefix_tokens,
                    max_prefix_tokens=max_prefix_tokens, question_tokens=question_tokens,
                    output_tokens=output_tokens, zipf_s=zipf_s, instruction_tokens=instruction_tokens)
    if max_prefix_tokens < min_prefix_tokens:
        raise ValueError(f"max_prefix_tokens ({max_prefix_tokens}) < min_prefix_tokens ({min_prefix_tokens})")
    rng = random.Random(f"{seed}:capacity-pressure")
    lengths, weights = _zipf_prefixes(rng, num_groups, min_prefix_tokens, max_prefix_tokens, zipf_s)
    instructions = block_text(seed, "cpi", 0, instruction_tokens)
    picks = rng.choices(range(num_groups), weights=weights, k=num_requests)
    reqs = []
    for i, g in enumerate(picks):
        msgs = ({"role": "system", "content": instructions + block_text(seed, "cpd", g, lengths[g])},
                {"role": "user", "content": block_text(seed, "cpq", i, question_tokens)})
        reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=msgs, group_id=f"prefix-{g}"))
    return Workload("capacity-pressure", {"num_groups": num_groups, "min_prefix_tokens": min_prefix_tokens,
                                          "max_prefix_tokens": max_prefix_tokens,
                                          "question_tokens": question_tokens,
                                          "instruction_tokens": instruction_tokens, "output_tokens": output_tokens,
                                          "zipf_s": zipf_s, "seed": seed}, tuple(reqs))


def tenants(*, num_tenants: int = 24, min_system_tokens: int = 1024, max_system_tokens: int = 4096,
            zipf_s: float = 1.1, mean_turns: float = 3.0, max_turns: int = 8, question_tokens: int = 96,
            output_tokens: int = 32, num_requests: int = 300, max_active_sessions: int = 16,
            seed: int = 0) -> Workload:
    """A multi-tenant chat service (the "tenants" request set, rebuilt: its exact sequence is not
    ours): T tenants, each with its own system prompt of min..max_system_tokens (uniform, seeded) and a
    popularity of 1/(rank + 1)^zipf_s (ranks shuffled against the lengths: a few tenants carry most traffic);
    users open sessions of a tenant drawn by popularity, each of 1..max_turns turns (geometric, mean
    mean_turns), and turn k resends the tenant's system prompt + the k earlier (question, synthetic answer)
    pairs + the next question. At most `max_active_sessions` sessions are interleaved (round-robin), so a
    session's next turn comes after other users' requests, as on a real service; turn k+1 has after_index =
    turn k. What it tests: a hot tenant's system prompt is wanted on several endpoints at once (load), a cold
    tenant's should go where it is cached, and a session's history only where the session was served: most
    requests are cache hits of a few hundred milliseconds at most, so the router's own per-request overhead
    shows in the median. At the defaults (seed 0): 300 requests in ~100 sessions over 24 tenants, ~3,000
    prompt tokens on average.
    """
    check_positive(num_tenants=num_tenants, min_system_tokens=min_system_tokens,
                    max_system_tokens=max_system_tokens, zipf_s=zipf_s, mean_turns=mean_turns, max_turns=max_turns,
                    question_tokens=question_tokens, output_tokens=output_tokens, num_requests=num_requests,
                    num_active=max_active_sessions)
    if max_system_tokens < min_system_tokens:
        raise ValueError(f"max_system_tokens ({max_system_tokens}) < min_system_tokens ({min_system_tokens})")
    if mean_turns < 1:
        raise ValueError(f"mean_turns ({mean_turns}) must be >= 1")
    rng = random.Random(f"{seed}:tenants")
    lengths, weights = _zipf_prefixes(rng, num_tenants, min_system_tokens, max_system_tokens, zipf_s)
    p_end = 1.0 / mean_turns  # geometric number of turns: P(end after each turn)
    reqs: list[RequestSpec] = []
    active: list[list[int]] = []  # [session, tenant, turn, turns]
    last_index: dict[int, int] = {}
    num_sessions = 0
    while len(reqs) < num_requests:
        while len(active) < max_active_sessions:
            tenant = rng.choices(range(num_tenants), weights=weights)[0]
            turns = 1
            while turns < max_turns and rng.random() >= p_end:
                turns += 1
            active.append([num_sessions, tenant, 0, turns])
            num_sessions += 1
        for entry in list(active):
            if len(reqs) >= num_requests:
                break
            sess, tenant, k, turns = entry
            msgs = _session_turn(seed, block_text(seed, "tsys", tenant, lengths[tenant]), f"tq{sess}.", f"ta{sess}.",
                                 k, question_tokens, output_tokens)
            i = len(reqs)
            reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=tuple(msgs),
                                    group_id=f"tenant-{tenant}", session_id=f"session-{sess}", turn=k,
                                    after_index=last_index.get(sess)))
            last_index[sess] = i
            entry[2] += 1
            if entry[2] == turns:
                active.remove(entry)
    return Workload("tenants", {"num_tenants": num_tenants, "min_system_tokens": min_system_tokens,
                                "max_system_tokens": max_system_tokens, "zipf_s": zipf_s, "mean_turns": mean_turns,
                                "max_turns": max_turns, "question_tokens": question_tokens,
                                "output_tokens": output_tokens, "max_active_sessions": max_active_sessions,
                                "assistant_text": "synthetic", "seed": seed}, tuple(reqs))


# -------------------------------------------------------------------------------------------- arrivals


def apply_arrivals(workload: Workload, kind: ArrivalKind, *, rate_rps: float = 0.0, seed: int = 0) -> Workload:
    """Set arrival times: ``trace`` keeps the trace's, ``poisson`` draws exponential gaps at rate_rps,
    ``closed`` clears them (the client then runs at a fixed concurrency)."""
    if kind == "trace":
        if any(r.arrival_s is None for r in workload.requests):
            raise ValueError("trace arrivals need a trace workload (use poisson or closed)")
        return workload
    if kind == "closed":
        reqs = tuple(dataclasses.replace(r, arrival_s=None) for r in workload.requests)
        return dataclasses.replace(workload, requests=reqs, params={**workload.params, "arrival": "closed"})
    if kind == "poisson":
        if not rate_rps > 0 or math.isinf(rate_rps):
            raise ValueError(f"poisson arrivals need a finite rate_rps > 0, got {rate_rps}")
        rng = random.Random(f"{seed}:poisson")
        t = 0.0
        reqs_l = []
        for r in workload.requests:
            reqs_l.append(dataclasses.replace(r, arrival_s=t))
            t += rng.expovariate(rate_rps)
        return dataclasses.replace(workload, requests=tuple(reqs_l),
                                   params={**workload.params, "arrival": "poisson", "rate_rps": rate_rps})
    raise ValueError(f"unknown arrival process {kind!r}")


def make_workload(name: str, *, num_requests: int, seed: int, output_tokens: int, prefix_tokens: int,
                  num_groups: int, question_tokens: int, num_sessions: int, num_turns: int,
                  document_tokens: int, num_documents: int, pressure_num_groups: int = 128,
                  pressure_min_prefix_tokens: int = 2048, pressure_max_prefix_tokens: int = 8192,
                  pressure_zipf_s: float = 0.8, num_agents: int = 32, agent_instructions_tokens: int = 3000,
                  agent_num_apps: int = 4, agent_max_active: int = 0,
                  agent_tool_output_tokens: tuple[int, int] = (150, 400),
                  agent_loop_args: str | tuple[str, ...] = ()) -> Workload:
    """Build a synthetic workload by name (one of WORKLOAD_NAMES) from the CLI's knobs (the pressure_* ones,
    with capacity_pressure's defaults, apply to capacity-pressure only; num_agents and agent_* to agents, which
    also takes num_turns and output_tokens; agent_loop_args, ``key=value`` changes of the shape, to the
    agent-loops workloads, which take num_requests and their own output lengths)."""
    if name in AGENT_LOOP_SHAPES:
        return agent_loops(AGENT_LOOP_SHAPES[name].with_args(agent_loop_args), num_requests=num_requests, seed=seed,
                           name=name)
    if name == "shared-prompts":
        return shared_prompts(num_groups=num_groups, prefix_tokens=prefix_tokens, question_tokens=question_tokens,
                              num_requests=num_requests, output_tokens=output_tokens, seed=seed)
    if name == "multi-turn":
        return multi_turn(num_sessions=num_sessions, num_turns=num_turns, output_tokens=output_tokens, seed=seed,
                          user_tokens=question_tokens)
    if name == "documents":
        return documents(num_documents=num_documents, document_tokens=document_tokens, num_requests=num_requests,
                         question_tokens=question_tokens, output_tokens=output_tokens, seed=seed)
    if name == "mix":
        return mix(num_requests=num_requests, seed=seed, output_tokens=output_tokens, prefix_tokens=prefix_tokens,
                   document_tokens=document_tokens)
    if name == "capacity-pressure":
        return capacity_pressure(num_groups=pressure_num_groups, min_prefix_tokens=pressure_min_prefix_tokens,
                                 max_prefix_tokens=pressure_max_prefix_tokens, question_tokens=question_tokens,
                                 num_requests=num_requests, output_tokens=output_tokens, zipf_s=pressure_zipf_s,
                                 seed=seed)
    if name == "agents":
        return agents(num_agents=num_agents, num_turns=num_turns, num_apps=agent_num_apps,
                      instructions_tokens=agent_instructions_tokens, output_tokens=output_tokens, seed=seed,
                      max_active_agents=agent_max_active or num_agents,
                      min_tool_output_tokens=agent_tool_output_tokens[0],
                      max_tool_output_tokens=agent_tool_output_tokens[1])
    if name == "tenants":
        return tenants(num_requests=num_requests, output_tokens=output_tokens, seed=seed)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")



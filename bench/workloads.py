"""Benchmark workloads: seeded, reproducible sequences of requests.

A workload is a tuple of `RequestSpec` in send order plus the parameters that made it. The same
parameters and seed always give byte-identical requests, so every router in a bench run sees the same
sequence. Nothing here does network I/O; loading a trace file is the only file I/O.

Text model: the simulated model servers count about 4 characters per token, so a block of N tokens is
synthesised as exactly ``N * CHARS_PER_TOKEN`` characters of pseudo-words drawn from a RNG seeded by
(workload seed, namespace, block id). Blocks are cached per key (generation is the expensive part of a
trace replay: the Mooncake sample has ~44k distinct 512-token blocks). Two requests share a text prefix
exactly when they share leading block ids; distinct ids never share a leading 16-token (64-char) block
because each block starts with a unique tag.

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
import functools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

CHARS_PER_TOKEN = 4
"""The simulated servers' tokenizer averages ~4 characters per token (see model_servers tokenizer)."""

TRACE_BLOCK_TOKENS = 512
"""Mooncake-format traces give one hash id per 512-token block of prompt."""

ArrivalKind = Literal["trace", "poisson", "closed"]

WORKLOAD_NAMES = ("shared-prompts", "multi-turn", "documents", "mix", "capacity-pressure", "agents")

# A fixed vocabulary of short lowercase words: text looks like prose to a tokenizer and stays ~4
# chars/token. Built once from a fixed seed so it never depends on the caller's RNG.
def _make_vocab(size: int = 512) -> tuple[str, ...]:
    rng = random.Random("prefixroute-bench-vocab")
    return tuple("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7)))
                 for _ in range(size))


_VOCAB: tuple[str, ...] = _make_vocab()


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, in send order.

    Exactly one of `messages` (chat, sent to /v1/chat/completions) and `prompt` (sent to
    /v1/completions) is set. `arrival_s` is seconds from the start of the run, None under closed-loop
    arrivals. `group_id` names the shared prefix the request belongs to (prompt group, document,
    session or first trace block) for analysis; `after_index` is the index of a request that must
    finish before this one is sent (previous turn of a session).

    Tool-calling requests (the ``agents`` workload) also carry `tools` (chat form: ``{"type": "function",
    "function": {...}}``) and `tool_choice`, sent with `messages` on /v1/chat/completions, and `responses`: the
    same turn in Responses API form (``instructions``, this turn's ``input`` items, flat ``tools``,
    ``tool_choice``), sent by `responses_body` on /v1/responses. `messages` is then exactly the chat prompt the
    server builds for the Responses form (`prefixroute.responses_prompt.input_messages` over the stored chain), so
    the chat and Responses forms of a conversation are the same prompts and one upper bound covers both.
    """

    index: int
    max_tokens: int
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    arrival_s: float | None = None
    group_id: str = ""
    session_id: str | None = None
    turn: int = 0
    after_index: int | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | None = None
    responses: dict[str, Any] | None = None

    def num_chars(self) -> int:
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or () if isinstance(m.get("content"), str))

    def approx_prompt_tokens(self) -> int:
        """Prompt tokens without template overhead (chars / 4); the server's count is authoritative."""
        return self.num_chars() // CHARS_PER_TOKEN

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body: streaming with a final usage chunk, exactly max_tokens generated."""
        b: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "stream": True,
                             "stream_options": {"include_usage": True}, "ignore_eos": True,
                             "temperature": 0.0}
        if self.messages is not None:
            b["messages"] = [dict(m) for m in self.messages]
            if self.tools:
                b["tools"] = [dict(t) for t in self.tools]
            if self.tool_choice is not None:
                b["tool_choice"] = self.tool_choice
        else:
            b["prompt"] = self.prompt
        return b

    def responses_body(self, model: str, previous_response_id: str | None = None,
                       call_id: str | None = None) -> dict[str, Any]:
        """The ``POST /v1/responses`` body of this turn (streaming, stored, exactly max_tokens generated).

        A follow-up names `previous_response_id` (the response of its `after_index` request, known only at
        send time) and answers that response's function call: `call_id` replaces the placeholder call id of
        its ``function_call_output`` items. ValueError when the request has no Responses form."""
        if self.responses is None:
            raise ValueError(f"request {self.index} has no Responses API form")
        form = self.responses
        inp = [dict(item) for item in form["input"]]
        if call_id is not None:
            for item in inp:
                if item.get("type") == "function_call_output":
                    item["call_id"] = call_id
        b: dict[str, Any] = {"model": model, "input": inp, "stream": True, "store": True,
                             "max_output_tokens": self.max_tokens, "temperature": 0.0}
        if form.get("instructions"):
            b["instructions"] = form["instructions"]
        if form.get("tools"):
            b["tools"] = [dict(t) for t in form["tools"]]
        if form.get("tool_choice") is not None:
            b["tool_choice"] = form["tool_choice"]
        if previous_response_id is not None:
            b["previous_response_id"] = previous_response_id
        return b

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named, parameterised request sequence. `params` is JSON-able and goes into results.json."""

    name: str
    params: dict[str, Any]
    requests: tuple[RequestSpec, ...]

    def describe(self) -> dict[str, Any]:
        reqs = self.requests
        timed = [r.arrival_s for r in reqs if r.arrival_s is not None]
        return {
            "name": self.name,
            **self.params,
            "num_requests": len(reqs),
            "mean_prompt_tokens_approx": round(sum(r.approx_prompt_tokens() for r in reqs) / max(1, len(reqs)), 1),
            "total_output_tokens": sum(r.max_tokens for r in reqs),
            "duration_s": round(max(timed) - min(timed), 3) if timed else None,
        }


# ---------------------------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=65536)
def block_text(seed: int, namespace: str, block_id: int | str, num_tokens: int) -> str:
    """Deterministic text of exactly ``num_tokens * CHARS_PER_TOKEN`` characters for one block.

    Same (seed, namespace, block_id, num_tokens) -> same text, in any process. Starts with a tag unique
    to (namespace, block_id), so two different blocks never share their first 64 characters.
    A partial block of n tokens is the first n*4 characters of the full block with the same id (so a
    prefix of a block stays a prefix), see `partial_block_text`.
    """
    n = num_tokens * CHARS_PER_TOKEN
    if n <= 0:
        return ""
    rng = random.Random(f"{seed}:{namespace}:{block_id}")
    parts = [f"{namespace}{block_id}"]
    size = len(parts[0])
    # ~5.5 chars per word incl. the space: draw a little more than needed in one call.
    while size < n:
        words = rng.choices(_VOCAB, k=n // 4 + 8)
        parts.extend(words)
        size += sum(len(w) + 1 for w in words)
    return " ".join(parts)[:n - 1] + "\n" if n > 1 else "\n"


def partial_block_text(seed: int, namespace: str, block_id: int | str, num_tokens: int, full_tokens: int) -> str:
    """The first `num_tokens` tokens of the `full_tokens`-token block (a prefix of the full block)."""
    if num_tokens >= full_tokens:
        return block_text(seed, namespace, block_id, full_tokens)
    return block_text(seed, namespace, block_id, full_tokens)[: num_tokens * CHARS_PER_TOKEN]


# ----------------------------------------------------------------------------------- synthetic workloads


def _check_positive(**values: float) -> None:
    for k, v in values.items():
        if v is None or v < 0 or (k.startswith("num_") and v == 0):
            raise ValueError(f"{k} must be {'> 0' if k.startswith('num_') else '>= 0'}, got {v}")


def shared_prompts(*, num_groups: int = 8, prefix_tokens: int = 2048, question_tokens: int = 64,
                   num_requests: int = 200, output_tokens: int = 32, seed: int = 0) -> Workload:
    """G groups x an L-token system prompt, each request = its group's prompt + a unique question.

    The group of each request is drawn uniformly (seeded). Upper bound on hits: every request after the
    first of its group finds the group's prefix cached.
    """
    _check_positive(num_groups=num_groups, num_requests=num_requests, prefix_tokens=prefix_tokens,
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


def multi_turn(*, num_sessions: int = 16, num_turns: int = 6, system_tokens: int = 256, user_tokens: int = 128,
               output_tokens: int = 64, max_active_sessions: int = 8, seed: int = 0) -> Workload:
    """Chat sessions; turn k resends system + all earlier (user, assistant) pairs + the k-th question.

    At most `max_active_sessions` sessions are interleaved at a time (round-robin over the active
    ones), so a session's turns are separated by other sessions' requests, as on a real service. The
    assistant text of turn k is synthetic (see module doc). Turn k+1 has after_index = turn k.
    """
    _check_positive(num_sessions=num_sessions, num_turns=num_turns, system_tokens=system_tokens,
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
            msgs: list[dict[str, str]] = [{"role": "system", "content": block_text(seed, "sys", systems[s],
                                                                                  system_tokens)}]
            for j in range(k + 1):
                msgs.append({"role": "user", "content": block_text(seed, f"u{s}.", j, user_tokens)})
                if j < k:
                    msgs.append({"role": "assistant", "content": block_text(seed, f"a{s}.", j, output_tokens)})
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
    _check_positive(num_documents=num_documents, num_requests=num_requests, document_tokens=document_tokens,
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
    _check_positive(num_requests=num_requests)
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
    _check_positive(num_groups=num_groups, num_requests=num_requests, min_prefix_tokens=min_prefix_tokens,
                    max_prefix_tokens=max_prefix_tokens, question_tokens=question_tokens,
                    output_tokens=output_tokens, zipf_s=zipf_s, instruction_tokens=instruction_tokens)
    if max_prefix_tokens < min_prefix_tokens:
        raise ValueError(f"max_prefix_tokens ({max_prefix_tokens}) < min_prefix_tokens ({min_prefix_tokens})")
    rng = random.Random(f"{seed}:capacity-pressure")
    lengths = [rng.randint(min_prefix_tokens, max_prefix_tokens) for _ in range(num_groups)]
    # Popularity ranks are shuffled against the lengths, so hot prefixes are not all long (or short).
    ranks = list(range(num_groups))
    rng.shuffle(ranks)
    weights = [1.0 / (ranks[g] + 1) ** zipf_s for g in range(num_groups)]
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


AGENT_TOOL_NAMES = ("search", "read_file", "run_tests")


def _agent_tools(seed: int, app: int, num_tools: int, description_tokens: int) -> tuple[dict[str, Any], ...]:
    """An app's function tools in the Responses (flat) form: fixed names, a per-app description, a small
    JSON-schema of one string argument."""
    return tuple({"type": "function", "name": f"{AGENT_TOOL_NAMES[j % len(AGENT_TOOL_NAMES)]}_{app}",
                  "description": block_text(seed, f"tool{app}.", j, description_tokens).strip(),
                  "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                 "required": ["query"]}}
                 for j in range(num_tools))


def agents(*, num_agents: int = 32, num_turns: int = 6, num_apps: int = 4, instructions_tokens: int = 3000,
           num_tools: int = 3, task_tokens: int = 150, min_tool_output_tokens: int = 150,
           max_tool_output_tokens: int = 400, output_tokens: int = 32, max_active_agents: int = 8,
           seed: int = 0) -> Workload:
    """Tool-calling agents over the Responses API, each request also in its exact chat equivalent.

    `num_apps` apps, each with long instructions (`instructions_tokens`) and `num_tools` function tools; every
    agent belongs to one app (seeded), so several agents share its instructions. Agent a runs `num_turns` turns:

    - turn 0: ``instructions`` + the agent's task (one user message, `task_tokens`), ``tool_choice: "required"``:
      the server answers with one function call;
    - turns 1 .. T-2: ``previous_response_id`` of the previous turn + one ``function_call_output`` item (the
      tool's output, min..max_tool_output_tokens, seeded) answering its call, ``tool_choice: "required"``;
    - turn T-1: the last tool output, ``tool_choice: "auto"``: a text answer.

    The server skips the previous response's function call when it builds a follow-up's prompt (vLLM,
    `prefixroute.responses_prompt.input_messages`), so every turn's full prompt is known in advance and does not
    depend on the generated text: `messages` holds it (computed by that same function over the chain), and
    each turn's prompt extends the previous turn's. The function call's id is only known at send time: the
    Responses form carries a placeholder the client replaces (`RequestSpec.responses_body`); the chat form's
    ``tool_call_id`` is a fixed ``call_a{agent}_{turn}`` (the server's template does not render it).

    Interleaving as `multi_turn`: at most `max_active_agents` agents are active, round-robin, so an agent's
    turns are separated by other agents' requests; turn k+1 has after_index = turn k. group_id names the app
    (the shared instructions), session_id the agent.
    """
    from prefixroute.responses_prompt import chat_tools, input_messages, parse_body

    _check_positive(num_agents=num_agents, num_turns=num_turns, num_apps=num_apps,
                    instructions_tokens=instructions_tokens, task_tokens=task_tokens,
                    min_tool_output_tokens=min_tool_output_tokens, output_tokens=output_tokens,
                    num_active=max_active_agents, num_tools=num_tools)
    if max_tool_output_tokens < min_tool_output_tokens:
        raise ValueError(f"max_tool_output_tokens ({max_tool_output_tokens}) < min_tool_output_tokens "
                         f"({min_tool_output_tokens})")
    rng = random.Random(f"{seed}:agents")
    apps = [rng.randrange(num_apps) for _ in range(num_agents)]
    instructions = [block_text(seed, "ainst", g, instructions_tokens) for g in range(num_apps)]
    tools = [_agent_tools(seed, g, num_tools, 24) for g in range(num_apps)]
    out_lens = [[rng.randint(min_tool_output_tokens, max_tool_output_tokens) for _ in range(num_turns)]
                for _ in range(num_agents)]
    pending = list(range(num_agents))
    active: list[int] = []
    turn_of = [0] * num_agents
    chain: dict[int, list[dict[str, Any]]] = {}
    last_index: dict[int, int] = {}
    reqs: list[RequestSpec] = []
    while pending or active:
        while pending and len(active) < max_active_agents:
            active.append(pending.pop(0))
        for a in list(active):
            k, g = turn_of[a], apps[a]
            if k == 0:
                items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                                "content": block_text(seed, f"task{a}.", 0, task_tokens)}]
            else:
                # Placeholder call id: the client puts the previous response's call_id here at send time.
                items = [{"type": "function_call_output", "call_id": f"call_a{a}_{k - 1}",
                          "output": block_text(seed, f"tout{a}.", k, out_lens[a][k])}]
            choice = "auto" if k == num_turns - 1 else "required"
            form = {"instructions": instructions[g], "input": items, "tools": list(tools[g]), "tool_choice": choice}
            body = parse_body(form)
            # The previous response's output is one function call: skipped from the prompt (as vLLM).
            prev_output = [{"type": "function_call", "call_id": f"call_a{a}_{k - 1}", "name": tools[g][0]["name"],
                            "arguments": "{}"}] if k else None
            msgs = input_messages(body, chain.get(a), prev_output)
            chain[a] = msgs
            i = len(reqs)
            reqs.append(RequestSpec(index=i, max_tokens=output_tokens, messages=tuple(msgs), group_id=f"app-{g}",
                                    session_id=f"agent-{a}", turn=k, after_index=last_index.get(a),
                                    tools=tuple(chat_tools(tools[g])), tool_choice=choice, responses=form))
            last_index[a] = i
            turn_of[a] += 1
            if turn_of[a] == num_turns:
                active.remove(a)
    return Workload("agents", {"num_agents": num_agents, "num_turns": num_turns, "num_apps": num_apps,
                               "instructions_tokens": instructions_tokens, "num_tools": num_tools,
                               "task_tokens": task_tokens, "min_tool_output_tokens": min_tool_output_tokens,
                               "max_tool_output_tokens": max_tool_output_tokens, "output_tokens": output_tokens,
                               "max_active_agents": max_active_agents, "seed": seed}, tuple(reqs))


# ------------------------------------------------------------------------------------------ traces


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRecord:
    """One line of a Mooncake-format trace (lengths in tokens, timestamp in ms from trace start)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceFormatError(ValueError):
    """A trace line is not of the Mooncake shape; the message names the line."""


def parse_trace_line(line: str, line_no: int = 0, block_tokens: int = TRACE_BLOCK_TOKENS) -> TraceRecord:
    """Parse and validate one JSON line. Raises TraceFormatError (with the line number) on bad input.

    Contract: ``block_tokens * (len(hash_ids) - 1) < input_length <= block_tokens * len(hash_ids)``
    (the last block is partial) -- a longer input would have no text for its tail.
    """
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise TraceFormatError(f"trace line {line_no}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"trace line {line_no}: expected a JSON object")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise TraceFormatError(f"trace line {line_no}: missing {key!r}")
    ts, ids = obj["timestamp"], obj["hash_ids"]
    ints = (obj["input_length"], obj["output_length"], *(ids if isinstance(ids, list) else ()))
    # bool is an int subclass in Python; a JSON true is not a length.
    if (not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(ids, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in ints)):
        raise TraceFormatError(f"trace line {line_no}: timestamp must be a number, input_length/output_length "
                               f"integers and hash_ids a list of integers")
    rec = TraceRecord(float(ts), obj["input_length"], obj["output_length"], tuple(ids))
    if (not rec.hash_ids or rec.input_length <= 0 or rec.output_length < 0 or not math.isfinite(rec.timestamp_ms)
            or rec.timestamp_ms < 0):
        raise TraceFormatError(f"trace line {line_no}: empty hash_ids, negative length or bad timestamp")
    n = len(rec.hash_ids)
    if not block_tokens * (n - 1) < rec.input_length <= block_tokens * n:
        raise TraceFormatError(f"trace line {line_no}: input_length {rec.input_length} does not fit "
                               f"{n} blocks of {block_tokens} tokens")
    return rec


def load_trace(path: str | Path, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Read a Mooncake-format JSONL trace (blank lines skipped), in file order."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for no, line in enumerate(fh, 1):
            if line.strip():
                records.append(parse_trace_line(line, no, block_tokens))
    return records


def slice_trace(records: Sequence[TraceRecord], *, start: int = 0, stop: int | None = None,
                start_s: float | None = None, end_s: float | None = None) -> list[TraceRecord]:
    """Take records[start:stop], then keep those with start_s <= timestamp < end_s (seconds)."""
    out = list(records[start:stop])
    if start_s is not None:
        out = [r for r in out if r.timestamp_ms >= start_s * 1000.0]
    if end_s is not None:
        out = [r for r in out if r.timestamp_ms < end_s * 1000.0]
    return out


def trace_prompt(rec: TraceRecord, seed: int = 0, block_tokens: int = TRACE_BLOCK_TOKENS) -> str:
    """The prompt text of a record: one deterministic block per hash id, the last block partial."""
    last_tokens = rec.input_length - block_tokens * (len(rec.hash_ids) - 1)
    parts = [block_text(seed, "h", h, block_tokens) for h in rec.hash_ids[:-1]]
    parts.append(partial_block_text(seed, "h", rec.hash_ids[-1], last_tokens, block_tokens))
    return "".join(parts)


def trace_workload(records: Sequence[TraceRecord], *, seed: int = 0, time_scale: float = 1.0,
                   max_output_tokens: int | None = None, api: Literal["chat", "completions"] = "chat",
                   block_tokens: int = TRACE_BLOCK_TOKENS, source: str = "",
                   slice_params: dict[str, Any] | None = None) -> Workload:
    """Requests from trace records; arrival_s = (timestamp - first timestamp) / 1000 x time_scale.

    time_scale < 1 compresses time (0.5 = twice the rate). The prompt is a single user message (chat)
    or a raw prompt (completions); output lengths can be capped by max_output_tokens.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    t0 = min((r.timestamp_ms for r in records), default=0.0)
    reqs = []
    for i, rec in enumerate(records):
        text = trace_prompt(rec, seed, block_tokens)
        out = max(1, rec.output_length if max_output_tokens is None else min(rec.output_length, max_output_tokens))
        arrival = (rec.timestamp_ms - t0) / 1000.0 * time_scale
        common = dict(index=i, max_tokens=out, arrival_s=arrival, group_id=f"block-{rec.hash_ids[0]}")
        if api == "chat":
            reqs.append(RequestSpec(messages=({"role": "user", "content": text},), **common))
        else:
            reqs.append(RequestSpec(prompt=text, **common))
    return Workload("trace", {"source": source, "time_scale": time_scale, "max_output_tokens": max_output_tokens,
                              "api": api, "seed": seed, **(slice_params or {})}, tuple(reqs))


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
                  agent_tool_output_tokens: tuple[int, int] = (150, 400)) -> Workload:
    """Build a synthetic workload by name (one of WORKLOAD_NAMES) from the CLI's knobs (the pressure_* ones,
    with capacity_pressure's defaults, apply to capacity-pressure only; num_agents and agent_* to agents, which
    also takes num_turns and output_tokens)."""
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
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")


def iter_prompt_texts(workload: Workload) -> Iterator[str]:
    """Concatenated message contents per request (for hashing/analysis without a chat template)."""
    for r in workload.requests:
        yield r.prompt if r.prompt is not None else "".join(m["content"] for m in r.messages or ()
                                                             if isinstance(m.get("content"), str))


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    """Write records in the Mooncake JSONL shape (used by tests and to ship small samples)."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            ts = int(r.timestamp_ms) if float(r.timestamp_ms).is_integer() else r.timestamp_ms
            fh.write(json.dumps({"timestamp": ts, "input_length": r.input_length,
                                 "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")

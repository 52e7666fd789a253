"""The ``agents`` workload: tool-calling agents over the Responses API, each request also in its
exact chat equivalent (`agents`)."""

from __future__ import annotations

import random
from typing import Any

from prefixroute.bench.synthetic_text import block_text
from prefixroute.bench.workload_spec import RequestSpec, Workload, check_positive


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

    check_positive(num_agents=num_agents, num_turns=num_turns, num_apps=num_apps,
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

"""The ``agent-loops`` workloads: agents in tool loops, each turn re-sending a context that keeps growing.

An agent's prompt is a tool preamble (a long system prompt describing the tools, shared by every agent of the
same preamble), its task, then one (assistant, tool output) pair per earlier turn: every turn re-sends the
whole context plus ``min_turn_tokens .. max_turn_tokens`` new tokens (the previous answer and the tool's
output), up to its task's size (drawn between half and all of ``max_context_tokens``, so agents that start
together do not end together); an agent whose next turn would pass it is done and a new agent takes its place
(a fresh task after the same preamble). Between two turns of an agent the client waits for the previous
answer, then `think_s` more (the tool running: ``min_think_s .. max_think_s``); `RequestSpec.think_s` carries it.
Optionally, every ``fanout_every``-th turn of a top-level agent spawns ``fanout_width`` sub-agents, each starting
from the parent's whole context plus a sub-task of its own and running ``subagent_turns`` turns beside its parent.

What this shape exposes: the shared preamble is cheap to recompute (4k tokens: ~0.3 s of prefill on one 70B TP4
server) while an agent's own history, after a few turns, is not (20-30k tokens: 2-3 s). A router that sends
every new agent to the preamble's holder cannot move them later, and that one server then prefills and decodes
every agent's long context while the others idle.

The sequence is fixed before any router runs (so every router gets the same requests): agents take turns in the
order of a nominal schedule (each agent's next turn one think time + `NOMINAL_SERVICE_S` after its last), and
the arrival process (`workloads.apply_arrivals`: Poisson at ``--rate-rps`` by default) stamps the times in that
order; a follow-up is sent at its arrival time or `think_s` after its previous turn ends, whichever is later.
The assistant turns are synthetic text, the same for every router (as multi-turn's).

Named shapes (`SHAPES`) cover the structures a fleet meets: the preamble short and long, few and many agents,
longer think times, several preambles, fan-out to sub-agents; ``--agent-loop-args key=value,...`` changes any
field of a shape (`AgentLoopShape`).
"""

from __future__ import annotations

import dataclasses
import heapq
import random

from prefixroute.bench.synthetic_text import block_text
from prefixroute.bench.workload_spec import RequestSpec, Workload, check_positive

NOMINAL_SERVICE_S = 0.3
"""The turn time the nominal schedule assumes when it orders the agents' turns (only the order depends on it: the
arrival process sets the times)."""


@dataclasses.dataclass(frozen=True)
class AgentLoopShape:
    """The shape of an agent-loops workload (module docstring). Token counts are the simulated tokenizer's
    (~4 characters per token); times in seconds."""

    num_agents: int = 24  # agents in progress at a time (a finished agent is replaced at once)
    num_preambles: int = 1  # distinct tool preambles; each agent draws one (seeded)
    preamble_tokens: int = 4096
    task_tokens: int = 200
    min_turn_tokens: int = 300  # new tokens a turn adds to the context (the answer and the tool's output)
    max_turn_tokens: int = 1000
    max_context_tokens: int = 32768
    min_think_s: float = 0.5  # after the previous answer, before the next turn (the tool running)
    max_think_s: float = 3.0
    min_output_tokens: int = 16
    max_output_tokens: int = 96
    fanout_every: int = 0  # every this many turns of a top-level agent, it spawns sub-agents (0: never)
    fanout_width: int = 3
    subagent_turns: int = 3
    subtask_tokens: int = 200

    def check(self) -> None:
        """ValueError naming the first field out of range."""
        check_positive(num_agents=self.num_agents, num_preambles=self.num_preambles,
                       preamble_tokens=self.preamble_tokens, task_tokens=self.task_tokens,
                       min_turn_tokens=self.min_turn_tokens, max_context_tokens=self.max_context_tokens,
                       min_think_s=self.min_think_s, fanout_every=self.fanout_every,
                       subtask_tokens=self.subtask_tokens)
        for key in ("min_output_tokens", "fanout_width", "subagent_turns"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for lo, hi in (("min_turn_tokens", "max_turn_tokens"), ("min_think_s", "max_think_s"),
                       ("min_output_tokens", "max_output_tokens")):
            if getattr(self, hi) < getattr(self, lo):
                raise ValueError(f"{hi} ({getattr(self, hi)}) < {lo} ({getattr(self, lo)})")
        if self.max_context_tokens < self.preamble_tokens + self.task_tokens + self.max_turn_tokens:
            raise ValueError(f"max_context_tokens ({self.max_context_tokens}) leaves no turn after the preamble "
                             f"and the task ({self.preamble_tokens} + {self.task_tokens} + {self.max_turn_tokens})")

    def with_args(self, args: str | tuple[str, ...]) -> AgentLoopShape:
        """This shape with ``key=value`` changes (a comma-separated string or its items); ValueError for an unknown
        key or a bad value."""
        items = [a for a in (args.split(",") if isinstance(args, str) else args) if a.strip()]
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, int | float] = {}
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in fields:
                raise ValueError(f"--agent-loop-args: {item!r} is not KEY=VALUE with KEY one of {', '.join(fields)}")
            kind = int if fields[key].type in (int, "int") else float
            try:
                changes[key] = kind(value)
            except ValueError:
                raise ValueError(f"--agent-loop-args: {key} takes {kind.__name__}, got {value!r}") from None
        shape = dataclasses.replace(self, **changes)
        shape.check()
        return shape


SHAPES: dict[str, AgentLoopShape] = {
    # 24 agents behind one 4k tool preamble, contexts to 32k, 0.5-3 s of tool time: the set that piled every
    # agent onto the preamble's first holder.
    "agent-loops": AgentLoopShape(),
    # A short preamble (a few tools): nothing shared is worth keeping together; only each agent's history is.
    "agent-loops-short-preamble": AgentLoopShape(preamble_tokens=512),
    # A long preamble (a code base summary, 12k tokens): a miss costs ~1 s on one 70B TP4 server.
    "agent-loops-long-preamble": AgentLoopShape(preamble_tokens=12288, max_context_tokens=40960),
    # Few agents that think fast: each one's turns come back to back.
    "agent-loops-few": AgentLoopShape(num_agents=6, min_think_s=0.2, max_think_s=1.0),
    # Many agents that think slowly (long tool runs), shorter contexts.
    "agent-loops-many": AgentLoopShape(num_agents=64, min_think_s=2.0, max_think_s=8.0, max_context_tokens=16384),
    # Four apps, each with its own preamble.
    "agent-loops-apps": AgentLoopShape(num_agents=32, num_preambles=4),
    # Orchestrators that fan out: every 4th turn spawns 3 sub-agents that start from the parent's whole context.
    "agent-loops-fanout": AgentLoopShape(num_agents=8, fanout_every=4, fanout_width=3, subagent_turns=3),
}
"""The named agent-loops workloads (`prefixroute bench --workload NAME`)."""


@dataclasses.dataclass(slots=True)
class _Agent:
    agent_id: str
    preamble: int
    messages: list[dict[str, str]]
    context_tokens: int
    turns_left: int | None  # a sub-agent's remaining turns; None: a top-level agent (until its context_limit)
    context_limit: int = 0  # a top-level agent is done past this context (its task's size)
    last_index: int | None = None
    last_output_tokens: int = 0
    turn: int = 0


def agent_loops(shape: AgentLoopShape, *, num_requests: int, seed: int = 0, name: str = "agent-loops") -> Workload:
    """`num_requests` turns of agents of `shape` (module docstring), in the nominal schedule's order; arrival times
    are left to the arrival process. group_id names the agent's preamble, session_id the agent."""
    shape.check()
    check_positive(num_requests=num_requests)
    rng = random.Random(f"{seed}:agent-loops")
    preambles = [block_text(seed, "tools", p, shape.preamble_tokens) for p in range(shape.num_preambles)]
    agents_made = 0
    queue: list[tuple[float, int, _Agent]] = []  # (nominal time of the agent's next turn, tie, agent)
    tie = 0

    def push(t: float, agent: _Agent) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(queue, (t, tie, agent))

    def new_agent(t: float) -> None:
        nonlocal agents_made
        a = agents_made
        agents_made += 1
        p = rng.randrange(shape.num_preambles)
        msgs = [{"role": "system", "content": preambles[p]},
                {"role": "user", "content": block_text(seed, f"task{a}.", 0, shape.task_tokens)}]
        # Tasks differ in size: an agent is done somewhere between half and all of the largest context, so
        # agents that start together do not all end together.
        first = shape.preamble_tokens + shape.task_tokens
        limit = int(rng.uniform(first + (shape.max_context_tokens - first) / 2, shape.max_context_tokens))
        push(t, _Agent(f"agent-{a}", p, msgs, first, None, limit))

    # Agents join over one mean think time, as if the fleet had been serving them for a while.
    mean_think = (shape.min_think_s + shape.max_think_s) / 2.0
    for _ in range(shape.num_agents):
        new_agent(rng.uniform(0.0, mean_think))
    reqs: list[RequestSpec] = []
    while len(reqs) < num_requests:
        t, _, agent = heapq.heappop(queue)
        if agent.turn:  # the previous answer and the tool's output join the context
            out_text = block_text(seed, f"{agent.agent_id}.a", agent.turn, agent.last_output_tokens)
            tool_tokens = max(1, rng.randint(shape.min_turn_tokens, shape.max_turn_tokens) - agent.last_output_tokens)
            agent.messages += [{"role": "assistant", "content": out_text},
                               {"role": "user", "content": block_text(seed, f"{agent.agent_id}.t", agent.turn,
                                                                      tool_tokens)}]
            agent.context_tokens += agent.last_output_tokens + tool_tokens
        out_tokens = rng.randint(shape.min_output_tokens, shape.max_output_tokens)
        think = rng.uniform(shape.min_think_s, shape.max_think_s) if agent.last_index is not None else 0.0
        i = len(reqs)
        reqs.append(RequestSpec(index=i, max_tokens=out_tokens, messages=tuple(dict(m) for m in agent.messages),
                                group_id=f"preamble-{agent.preamble}", session_id=agent.agent_id, turn=agent.turn,
                                after_index=agent.last_index, think_s=think))
        agent.last_index, agent.last_output_tokens = i, out_tokens
        agent.turn += 1
        next_t = t + NOMINAL_SERVICE_S + rng.uniform(shape.min_think_s, shape.max_think_s)
        if (shape.fanout_every and agent.turns_left is None and agent.turn % shape.fanout_every == 0):
            for w in range(shape.fanout_width):
                sub_msgs = [*agent.messages,
                            {"role": "assistant", "content": block_text(seed, f"{agent.agent_id}.d", agent.turn, 32)},
                            {"role": "user", "content": block_text(seed, f"{agent.agent_id}.s{agent.turn}.", w,
                                                                   shape.subtask_tokens)}]
                sub = _Agent(f"{agent.agent_id}.sub{agent.turn}.{w}", agent.preamble, sub_msgs,
                             agent.context_tokens + 32 + shape.subtask_tokens, shape.subagent_turns,
                             last_index=i, last_output_tokens=0)
                # Its first turn follows its parent's turn (after a think time) and has no answer to add yet.
                push(t + NOMINAL_SERVICE_S, sub)
        if agent.turns_left is not None:
            agent.turns_left -= 1
            if agent.turns_left <= 0:
                continue
        if agent.context_tokens + shape.max_output_tokens + shape.max_turn_tokens > \
                (agent.context_limit or shape.max_context_tokens):
            if agent.turns_left is None:
                new_agent(next_t)  # done: a new agent takes its place
            continue
        push(next_t, agent)
    return Workload(name, {**dataclasses.asdict(shape), "num_requests": num_requests, "seed": seed,
                           "assistant_text": "synthetic"}, tuple(reqs))

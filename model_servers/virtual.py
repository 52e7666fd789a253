"""Virtual-time runner: a fleet of simulated engines in one discrete-event loop (no HTTP, no sleeping).

The same `EngineCore` as the HTTP server (scheduler, KV cache, cost model); only the clock differs.
API for benchmarks and routing simulations::

    from prefixroute.model_servers.virtual import VirtualFleet, SimRequest

    fleet = VirtualFleet("llama-3.1-8b-h200", num_servers=64)          # ids "sim-0:8000" ... "sim-63:8000"
    reqs = [SimRequest.from_messages(f"r{i}", arrival_s=i * 0.01, messages=[...], max_tokens=64), ...]

    def route(req: SimRequest, fleet: VirtualFleet) -> int:         # called at req.arrival_s
        states = fleet.endpoint_states()                            # tuple[EndpointState], fleet order
        return min(range(len(states)), key=lambda i: states[i].num_requests_running)

    results = fleet.run(reqs, route)      # list[SimResult], in arrival order
    # closed loop / multi-turn: fleet.run(first_turns, route, on_finish=lambda res, fleet: [next_request])
    results[0].ttft_s, .e2e_s, .prompt_tokens, .cached_tokens, .completion_tokens, .server, .endpoint

`route` may also return an `EndpointId` string. `SimRequest.text` / `.messages` keep what a router hashes;
`prompt_ids` is what the engine sees (rendered with the same chat template and tokenizer as the HTTP
server). `fleet.cached_prefix_tokens(req)` gives each server's true prefix-cache hit for an oracle router.
`run` can be called again to continue (the clock and caches persist); requests must arrive in order.

Semantics: arrivals join the engine's waiting queue at their arrival time; an idle engine starts a step at
once; a busy one picks them up at its next step boundary (as vLLM does). Ties: a step ending at the same
instant as an arrival is processed first. Not thread-safe.

Speed: while an engine only decodes an unchanged batch (nothing waiting), consecutive steps are simulated
as one `DecodeRun` (closed-form step times) that an arrival to that engine cuts at the step in progress;
results equal step-by-step simulation (``coalesce_decode=False``, tested). During a run,
`endpoint_states` shows the KV usage of the run's start (decode blocks are allocated when it ends).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from prefixroute.model_servers import tokenizer
from prefixroute.model_servers.engine import DecodeRun, EngineConfig, EngineCore, EngineRequest, StepPlan
from prefixroute.model_servers.kv_cache import root_hash
from prefixroute.model_servers.profiles import DEFAULT_PROFILE, get_profile
from prefixroute.extproc.routing.types import EndpointId, EndpointState


@dataclasses.dataclass(slots=True)
class SimRequest:
    """One request of a simulated workload. `prompt_ids` is what the engine computes on."""

    request_id: str
    arrival_s: float
    prompt_ids: np.ndarray
    max_tokens: int = 16
    model: str | None = None  # None = the fleet's served model; an adapter name changes the block hashes
    cache_salt: str | None = None
    text: str | None = None  # completion prompt (for routers that hash text)
    messages: list | None = None  # chat messages (for routers that hash messages)
    session_id: str | None = None
    meta: Any = None

    @classmethod
    def from_text(cls, request_id: str, arrival_s: float, text: str, max_tokens: int = 16, **kw: Any) -> SimRequest:
        return cls(request_id, arrival_s, tokenizer.encode(text), max_tokens, text=text, **kw)

    @classmethod
    def from_messages(cls, request_id: str, arrival_s: float, messages: list, max_tokens: int = 16,
                      tools: list | None = None, **kw: Any) -> SimRequest:
        prompt = tokenizer.render_chat(messages, tools=tools)
        return cls(request_id, arrival_s, tokenizer.encode(prompt), max_tokens, messages=messages, **kw)


@dataclasses.dataclass(slots=True)
class SimResult:
    request_id: str
    server: int
    endpoint: EndpointId
    arrival_s: float
    first_token_s: float
    finished_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    num_preemptions: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s


class VirtualFleet:
    """N engines of one profile on a shared virtual clock (see module docstring)."""

    def __init__(self, profile: str = DEFAULT_PROFILE, num_servers: int = 8, *, num_gpu_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 time_scale: float = 1.0, served_model_name: str | None = None,
                 lora_modules: Sequence[str] = (), endpoint_ids: Sequence[str] | None = None,
                 coalesce_decode: bool = True) -> None:
        self.profile = get_profile(profile)
        cost = self.profile.cost_model()
        blocks = num_gpu_blocks or self.profile.num_gpu_blocks(block_size)
        cfg = EngineConfig(blocks, block_size, max_num_seqs, max_num_batched_tokens, time_scale)
        self.engines = [EngineCore(cfg, cost) for _ in range(num_servers)]
        self.served = served_model_name or self.profile.served_model_name
        self.models = frozenset((self.served, *lora_modules))
        self.max_model_len = min(self.profile.max_model_len, blocks * block_size)
        ids = endpoint_ids or [f"sim-{i}:8000" for i in range(num_servers)]
        if len(ids) != num_servers:
            raise ValueError("endpoint_ids must name every server")
        self.endpoint_ids: tuple[EndpointId, ...] = tuple(EndpointId(e) for e in ids)
        self._index = {e: i for i, e in enumerate(self.endpoint_ids)}
        self.now_s = 0.0
        self._plans: list[StepPlan | DecodeRun | None] = [None] * num_servers
        self._event: list[int] = [0] * num_servers  # seq of each engine's live heap event (others are stale)
        self.coalesce_decode = coalesce_decode
        self._heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._roots: dict[tuple[str, str | None], int] = {}
        self.block_size = block_size
        self._results: dict[int, SimResult] = {}
        self._order: list[str] = []

    @property
    def num_servers(self) -> int:
        return len(self.engines)

    def endpoint_states(self) -> tuple[EndpointState, ...]:
        """A fresh snapshot of every server, as a perfect scraper would see it now."""
        now = self.now_s
        return tuple(EndpointState(endpoint=eid, healthy=True, models=self.models,
                                   num_requests_running=len(e.running), num_requests_waiting=len(e.waiting),
                                   kv_cache_usage_ratio=e.cache.usage_ratio, num_gpu_blocks=e.config.num_gpu_blocks,
                                   block_size=e.config.block_size, scraped_at_s=now)
                     for eid, e in zip(self.endpoint_ids, self.engines))

    def _root(self, req: SimRequest) -> int:
        key = (req.model or self.served, req.cache_salt)
        r = self._roots.get(key)
        if r is None:
            r = self._roots[key] = root_hash(key)
        return r

    def cached_prefix_tokens(self, req: SimRequest) -> list[int]:
        """Per server, how many prompt tokens its prefix cache would serve for `req` right now."""
        hashes = self._hashes(req)
        max_hit = (len(req.prompt_ids) - 1) // self.block_size
        return [e.cache.num_cached_prefix_blocks(hashes[:max_hit]) * self.block_size for e in self.engines]

    def _hashes(self, req: SimRequest) -> list[int]:
        from prefixroute.model_servers.kv_cache import hash_blocks

        return hash_blocks(req.prompt_ids, self.block_size, self._root(req))

    def _push(self, i: int, t: float) -> None:
        self._seq += 1
        self._event[i] = self._seq
        heapq.heappush(self._heap, (t, self._seq, i))

    def _start_step(self, i: int, t: float) -> None:
        core = self.engines[i]
        if self.coalesce_decode and not core.waiting:
            run = core.plan_decode_run()
            if run is not None:
                run.start_s = t
                self._plans[i] = run
                self._push(i, run.end_s(run.num_steps))
                return
        plan = core.plan_step()
        self._plans[i] = plan
        if plan is not None:
            self._push(i, t + plan.duration_s)

    def _interrupt_run(self, i: int, t: float) -> None:
        """A request arrived at engine i during a decode run: end the run at the step in progress."""
        run = self._plans[i]
        if isinstance(run, DecodeRun):
            j = run.steps_started_by(t)
            if j < run.num_steps:
                run.num_steps = j
                self._push(i, run.end_s(j))

    def run(self, requests: Iterable[SimRequest], route: Callable[[SimRequest, VirtualFleet], int | str],
            *, drain: bool = True,
            on_finish: Callable[[SimResult, VirtualFleet], Iterable[SimRequest] | None] | None = None,
            ) -> list[SimResult]:
        """Simulate `requests` (sorted by arrival_s) routed by `route`; returns results in arrival order.

        `on_finish(result, fleet)` is called when a request finishes (at ``fleet.now_s``) and may return
        follow-up requests (closed-loop clients, next conversation turns); one arriving before now arrives
        now. With drain=False, stops at the last arrival (unfinished requests get no result).
        Raises ValueError for a request that can never fit (prompt + max_tokens > max_model_len) or one
        that arrives before the fleet's clock.
        """
        results = self._results
        order = self._order
        start = len(order)
        heap = self._heap
        plans = self._plans
        engines = self.engines
        ids = self.endpoint_ids
        bs = self.block_size
        injected: list[tuple[float, int, SimRequest]] = []
        inj_seq = 0

        def step_end() -> None:
            nonlocal inj_seq
            t, seq, i = heapq.heappop(heap)
            if seq != self._event[i]:
                return  # superseded (a decode run was cut short)
            self.now_s = t
            plan = plans[i]
            plans[i] = None
            core = engines[i]
            if isinstance(plan, DecodeRun):
                finished = core.finish_decode_run(plan, plan.num_steps, t)
            else:
                finished = [r for r in core.finish_step(plan, t) if r.status == 2]  # type: ignore[arg-type]
            self._start_step(i, t)
            for r in finished:
                k = r.sink
                res = results[k] = SimResult(order[k], i, ids[i], r.arrival_s, r.first_token_s, t,
                                             r.num_prompt_tokens, r.num_cached_tokens, r.num_output,
                                             r.num_preemptions)
                if on_finish is not None:
                    for follow in on_finish(res, self) or ():
                        if follow.arrival_s < t:
                            follow.arrival_s = t
                        inj_seq += 1
                        heapq.heappush(injected, (follow.arrival_s, inj_seq, follow))

        def admit(req: SimRequest) -> None:
            if req.arrival_s < self.now_s - 1e-12:
                raise ValueError(f"request {req.request_id} arrives at {req.arrival_s} before now {self.now_s}")
            self.now_s = req.arrival_s
            if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
                raise ValueError(f"request {req.request_id}: prompt + max_tokens exceeds {self.max_model_len}")
            target = route(req, self)
            i = self._index[target] if isinstance(target, str) else int(target)
            er = EngineRequest(req.request_id, req.prompt_ids, req.max_tokens, block_size=bs,
                               root=self._root(req), arrival_s=req.arrival_s, sink=len(order))
            order.append(req.request_id)
            engines[i].add_request(er)
            if plans[i] is None:
                self._start_step(i, req.arrival_s)
            elif isinstance(plans[i], DecodeRun):
                self._interrupt_run(i, req.arrival_s)

        inf = float("inf")
        it = iter(requests)
        nxt = next(it, None)
        while True:
            t_next = nxt.arrival_s if nxt is not None else inf
            from_injected = bool(injected) and injected[0][0] < t_next
            if from_injected:
                t_next = injected[0][0]
            if heap and heap[0][0] <= t_next:
                if t_next == inf and not drain:
                    break
                step_end()
                continue
            if t_next == inf:
                break
            if from_injected:
                admit(heapq.heappop(injected)[2])
            else:
                admit(nxt)  # type: ignore[arg-type]
                nxt = next(it, None)
        return [results[k] for k in range(start, len(order)) if k in results]

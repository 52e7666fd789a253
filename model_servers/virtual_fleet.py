"""Virtual-time runner: a fleet of simulated engines in one discrete-event loop (no HTTP, no sleeping).

The same `EngineCore` as the HTTP server (scheduler, KV cache, cost model), built from the same `EngineSpec`
(`profiles.py`: what `prefixroute model-server` runs with given settings); only the clock differs. Requests are
the bytes a client sends: `SimRequest.from_body` parses them with the HTTP server's own parser
(`EngineSpec.parse_generate`: tokenizer, chat template, model/LoRA, ``cache_salt``, ``max_tokens`` default and
the 400/404 refusals), so the engine sees what a server would. API for benchmarks and routing simulations::

    from prefixroute.model_servers.profiles import EngineSpec
    from prefixroute.model_servers.server_settings import ServerSettings
    from prefixroute.model_servers.virtual_fleet import VirtualFleet, SimRequest

    spec = EngineSpec.from_settings(ServerSettings(profile="llama-3.1-8b-h200"))
    fleet = VirtualFleet(spec, num_servers=64)                      # ids "sim-0:8000" ... "sim-63:8000"
    reqs = [SimRequest.from_body(f"r{i}", i * 0.01, "/v1/chat/completions", body, spec), ...]

    def route(req: SimRequest, fleet: VirtualFleet) -> int:         # called at req.arrival_s
        return min(range(fleet.num_servers), key=lambda i: fleet.engines[i].num_running)

    results = fleet.run(reqs, route)      # list[SimResult], in arrival order
    # closed loop / multi-turn: fleet.run(first_turns, route, on_finish=lambda res, fleet: [next_request])
    results[0].ttft_s, .e2e_s, .prompt_tokens, .cached_tokens, .completion_tokens, .server, .endpoint, .status

`route` may also return an `EndpointId` string, or raise `OpenAIError` to refuse the request (a router's
4xx/5xx: no server sees it), or return None to hold it (a gateway queue): the router later calls
`fleet.dispatch(request_id, target)` or `fleet.refuse(request_id, error)` from a timer, ``on_step`` or
``on_finish``; its TTFT then counts the wait from its arrival. `run(..., on_step=fn)` calls ``fn(fleet, i)``
after each step (or decode run) of engine i ends: where a router learns that capacity freed. A request the server refuses (`SimRequest.error`) is routed, then answered with
that error at once, as the HTTP server does. `fleet.call_at(t, fn)` runs a callback at a virtual time (a
simulated router's periodic scrapes, bench/sim_pool.py). `fleet.cached_prefix_tokens(req)` gives each
server's true prefix-cache hit for an oracle router. `run` can be called again to continue (the clock, caches
and timers persist); requests must arrive in order.

Semantics: arrivals join the engine's waiting queue at their arrival time; an idle engine starts a step at
once; a busy one picks them up at its next step boundary (as vLLM does). Ties at one instant: timers first,
then a step ending, then an arrival. Not thread-safe.

Speed: while an engine only decodes an unchanged batch (nothing waiting), consecutive steps are simulated
as one `DecodeRun` (closed-form step times) that an arrival to that engine cuts at the step in progress;
results equal step-by-step simulation (``coalesce_decode=False``, tested). During a run, the engine's KV
usage is that of the run's start (decode blocks are allocated when it ends).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from prefixroute.types import EndpointId
from prefixroute.model_servers import protocol
from prefixroute.model_servers.engine import DecodeRun, EngineRequest, StepPlan
from prefixroute.model_servers.kv_cache import root_hash
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.openai_errors import OpenAIError

GENERATE_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
"""The generation paths a simulated server serves (value: chat)."""

_NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass(slots=True)
class SimRequest:
    """One request: as the client sends it (`path`, `headers`, `body`: what a router parses) and as the server
    parsed it (`prompt_ids`, `max_tokens`, `model`, `cache_salt`; or `error`, the server's refusal). Build it
    with `from_body`."""

    request_id: str
    arrival_s: float
    path: str
    body: bytes
    headers: Mapping[str, str]
    prompt_ids: np.ndarray
    max_tokens: int
    model: str
    cache_salt: str | None = None
    error: OpenAIError | None = None

    @classmethod
    def from_body(cls, request_id: str, arrival_s: float, path: str, body: bytes, spec: EngineSpec,
                  headers: Mapping[str, str] | None = None) -> SimRequest:
        """Parse `body` as a server built from `spec` does. `path` must be a generation path (ValueError
        otherwise: the fleet simulates generation only); a body the server refuses gives a request with
        `error` set (its status and message are the server's)."""
        chat = GENERATE_PATHS.get(path.split("?", 1)[0])
        if chat is None:
            raise ValueError(f"request {request_id}: {path!r} is not a generation path "
                             f"({', '.join(GENERATE_PATHS)})")
        hdrs = headers if headers is not None else {}
        try:
            g = spec.parse_generate(protocol.load_json_object(body), chat=chat)
        except OpenAIError as exc:
            return cls(request_id, arrival_s, path, body, hdrs, _NO_TOKENS, 0, spec.served_model_name, error=exc)
        return cls(request_id, arrival_s, path, body, hdrs, g.prompt_ids, g.max_tokens, g.model, g.cache_salt)


@dataclasses.dataclass(slots=True)
class SimResult:
    """One finished request. A refused one (``status`` != 200) has no first token, zero tokens, ``finished_s``
    = ``arrival_s`` and ``error`` = the response body; ``server`` is -1 (``endpoint`` None) when the router
    refused it, else the server that answered the error."""

    request_id: str
    server: int
    endpoint: EndpointId | None
    arrival_s: float
    first_token_s: float | None
    finished_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    num_preemptions: int
    status: int = 200
    error: str | None = None
    cpu_cached_tokens: int = 0  # of cached_tokens, those loaded from the CPU tier

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s


class VirtualFleet:
    """N engines built from one `EngineSpec` on a shared virtual clock (see module docstring)."""

    def __init__(self, spec: EngineSpec | None = None, num_servers: int = 8, *,
                 endpoint_ids: Sequence[str] | None = None, coalesce_decode: bool = True) -> None:
        """`spec` defaults to a server with default settings (`ServerSettings()`)."""
        if spec is None:
            from prefixroute.model_servers.server_settings import ServerSettings

            spec = EngineSpec.from_settings(ServerSettings())
        self.spec = spec
        self.engines = [spec.new_engine() for _ in range(num_servers)]
        self.served = spec.served_model_name
        self.models = spec.models
        self.max_model_len = spec.max_model_len
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
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._roots: dict[tuple[str, str | None], int] = {}
        self.block_size = spec.config.block_size
        self._results: dict[int, SimResult] = {}
        self._order: list[str] = []
        # The current run's follow-up arrivals and on_finish (set by `run`).
        self._injected: list[tuple[float, int, SimRequest]] = []
        self._inj_seq = 0
        self._on_finish: Callable[[SimResult, VirtualFleet], Iterable[SimRequest] | None] | None = None
        self._on_step: Callable[[VirtualFleet, int], None] | None = None
        self._held: dict[str, tuple[SimRequest, int]] = {}  # request id -> (request, order slot): route said None

    @property
    def num_held(self) -> int:
        """Requests the router holds (its route returned None; not dispatched or refused yet)."""
        return len(self._held)

    @property
    def num_servers(self) -> int:
        return len(self.engines)

    def publish_kv_events(self, on_events: Callable[[EndpointId, list], Any]) -> None:
        """Every engine hands the KV events of each step, in order, to ``on_events(endpoint, events)`` at that
        step's virtual time: what a router subscribed to each server's ZMQ publisher would apply, without the
        transport (call before the run: blocks stored earlier are never announced)."""
        for ep, engine in zip(self.endpoint_ids, self.engines):
            engine.set_kv_events_sink(lambda events, ep=ep: on_events(ep, events))

    def call_at(self, t: float, callback: Callable[[], None]) -> None:
        """Run ``callback()`` at virtual time `t` (at ``now_s`` if earlier) during `run`, before a step end or an
        arrival at the same instant. Timers do not keep a run going: `run` returns once only timers are left
        (they stay scheduled for the next `run`). A callback may schedule timers, not requests."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (max(t, self.now_s), self._timer_seq, callback))

    def _root(self, req: SimRequest) -> int:
        key = (req.model, req.cache_salt)
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
            on_step: Callable[[VirtualFleet, int], None] | None = None,
            ) -> list[SimResult]:
        """Simulate `requests` (sorted by arrival_s) routed by `route`; returns results in arrival order.

        `route(req, fleet)` is called at the arrival (``fleet.now_s``); it returns a server index or endpoint
        id, or raises `OpenAIError` to refuse. `on_finish(result, fleet)` is called when a request finishes,
        refused ones included (at ``fleet.now_s``), and may return follow-up requests (closed-loop clients,
        next conversation turns); one arriving before now arrives now. With drain=False, stops at the last
        arrival (unfinished requests get no result). Raises ValueError for a request that arrives before the
        fleet's clock or that the engine cannot hold (prompt + max_tokens > max_model_len: `from_body` makes
        such a request a 400 instead).
        """
        order = self._order
        start = len(order)
        heap = self._heap
        timers = self._timers
        injected = self._injected = []  # follow-ups from on_finish: (arrival_s, seq, request)
        self._on_finish = on_finish
        self._on_step = on_step
        inf = float("inf")
        it = iter(requests)
        nxt = next(it, None)
        while True:
            t_next = nxt.arrival_s if nxt is not None else inf
            from_injected = bool(injected) and injected[0][0] < t_next
            if from_injected:
                t_next = injected[0][0]
            step_next = heap[0][0] if heap else inf
            if step_next <= t_next and t_next == inf and not drain:
                break
            t_event = min(step_next, t_next)
            if t_event == inf:
                break
            while timers and timers[0][0] <= t_event:
                t, _, callback = heapq.heappop(timers)
                self.now_s = t
                callback()
            if step_next <= t_next:
                self._step_end()
            elif from_injected:
                self._admit(heapq.heappop(injected)[2], route)
            else:
                self._admit(nxt, route)  # type: ignore[arg-type]
                nxt = next(it, None)
        results = self._results
        return [results[k] for k in range(start, len(order)) if k in results]

    def _finished(self, res: SimResult, k: int, t: float) -> None:
        """Record request k's result; its follow-ups (the run's on_finish) join the injected arrivals."""
        self._results[k] = res
        on_finish = self._on_finish
        if on_finish is not None:
            for follow in on_finish(res, self) or ():
                if follow.arrival_s < t:
                    follow.arrival_s = t
                self._inj_seq += 1
                heapq.heappush(self._injected, (follow.arrival_s, self._inj_seq, follow))

    def _step_end(self) -> None:
        """The earliest step end: finish that engine's step (or decode run), start its next, record the
        requests it finished."""
        t, seq, i = heapq.heappop(self._heap)
        if seq != self._event[i]:
            return  # superseded (a decode run was cut short)
        self.now_s = t
        plans = self._plans
        plan = plans[i]
        plans[i] = None
        core = self.engines[i]
        if isinstance(plan, DecodeRun):
            done = core.finish_decode_run(plan, plan.num_steps, t)
        else:
            done = [r for r in core.finish_step(plan, t) if r.status == 2]  # type: ignore[arg-type]
        self._start_step(i, t)
        order, ep = self._order, self.endpoint_ids[i]
        for r in done:
            k = r.sink
            self._finished(SimResult(order[k], i, ep, r.arrival_s, r.first_token_s, t, r.num_prompt_tokens,
                                     r.num_cached_tokens, r.num_output, r.num_preemptions,
                                     cpu_cached_tokens=r.num_cpu_cached_tokens), k, t)
        if self._on_step is not None:
            self._on_step(self, i)

    def _refuse(self, req: SimRequest, k: int, i: int, exc: OpenAIError, t: float | None = None) -> None:
        """Answer `req` with `exc` at `t` (default its arrival: a held request answered later waited until t)."""
        t = req.arrival_s if t is None else t
        self._finished(SimResult(req.request_id, i, self.endpoint_ids[i] if i >= 0 else None, req.arrival_s, None,
                                 t, 0, 0, 0, 0, status=exc.status, error=exc.body().decode()), k, t)

    def _admit(self, req: SimRequest, route: Callable[[SimRequest, VirtualFleet], int | str]) -> None:
        """`req` arrives now: route it (a refusal is its result), then add it to the engine picked."""
        if req.arrival_s < self.now_s - 1e-12:
            raise ValueError(f"request {req.request_id} arrives at {req.arrival_s} before now {self.now_s}")
        self.now_s = req.arrival_s
        order = self._order
        k = len(order)
        order.append(req.request_id)
        try:
            target = route(req, self)
        except OpenAIError as exc:
            self._refuse(req, k, -1, exc)
            return
        if target is None:
            self._held[req.request_id] = (req, k)
            return
        self._place(req, k, target)

    def dispatch(self, request_id: str, target: int | str) -> None:
        """A held request (its route returned None) goes to server `target` now (``now_s``)."""
        req, k = self._held.pop(request_id)
        self._place(req, k, target, self.now_s)

    def refuse(self, request_id: str, error: OpenAIError) -> None:
        """A held request is answered with `error` now (the router shed it, or its client left)."""
        req, k = self._held.pop(request_id)
        self._refuse(req, k, -1, error, self.now_s)

    def _place(self, req: SimRequest, k: int, target: int | str, now_s: float | None = None) -> None:
        """Add `req` (order slot k) to the engine `target` names, at `now_s` (default its arrival)."""
        t = req.arrival_s if now_s is None else now_s
        i = self._index[target] if isinstance(target, str) else int(target)
        if req.error is not None:
            self._refuse(req, k, i, req.error, t)
            return
        if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
            raise ValueError(f"request {req.request_id}: prompt + max_tokens exceeds {self.max_model_len}")
        er = EngineRequest(req.request_id, req.prompt_ids, req.max_tokens, block_size=self.block_size,
                           root=self._root(req), arrival_s=req.arrival_s, sink=k)
        self.engines[i].add_request(er)
        plan = self._plans[i]
        if plan is None:
            self._start_step(i, t)
        elif isinstance(plan, DecodeRun):
            self._interrupt_run(i, t)

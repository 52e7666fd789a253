"""Real-time runner: drives one `EngineCore` from an asyncio task (the HTTP server's engine).

Loop: plan a step, sleep until its modelled end, finish it, hand each request that sampled a token to its
sink (``sink.on_token(req)``; the HTTP layer writes an SSE chunk). Step ends are scheduled on a deadline
chain (a step starts at the previous step's planned end when the loop is late), so timer granularity
(uvloop: 1 ms) and scheduling jitter do not accumulate: the average step rate is the modelled one.
`lag` records how late each step ended versus its plan (the bench reports it to show the process keeps up).

Single-threaded: call `submit`/`abort` from the event loop thread only.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefixroute.model_servers.engine import EngineCore, EngineRequest


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_late_steps = 0
        self.lag_sum_s = 0.0
        self.lag_max_s = 0.0
        self.num_steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def submit(self, req: EngineRequest) -> None:
        req.arrival_s = self.now()
        self.core.add_request(req)
        self._wake.set()

    def abort(self, req: EngineRequest) -> None:
        self.core.abort_request(req)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        deadline = loop.time()
        while True:
            plan = core.plan_step()
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            now = loop.time()
            if deadline < now - 0.05:
                deadline = now  # idle gap or a long stall: restart the chain rather than burst
            deadline += plan.duration_s
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let I/O run between back-to-back steps
            end = loop.time()
            lag = end - deadline
            self.num_steps += 1
            if lag > 0:
                self.lag_sum_s += lag
                if lag > self.lag_max_s:
                    self.lag_max_s = lag
                if lag > 0.005:
                    self.num_late_steps += 1
            emitted = core.finish_step(plan, end)
            for req in emitted:
                sink: Any = req.sink
                if sink is not None:
                    try:
                        sink.on_token(req)
                    except Exception:  # a broken client must not stop the engine
                        core.abort_request(req)

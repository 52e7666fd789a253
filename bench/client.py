"""Asynchronous streaming OpenAI client that replays a workload and measures every request.

Per request: TTFT (send -> first non-empty content chunk), inter-token latencies (gaps between content
chunks: a chunk carrying several tokens counts as one gap, as vLLM's benchmark does), end-to-end
latency, prompt/completion/cached tokens from the final ``usage`` chunk (``stream_options.include_usage``),
the serving endpoint (``x-gateway-destination-endpoint-served`` if the gateway set it, else the
server's ``x-prefixroute-server-id``) and the HTTP status / error.

Sending: one aiohttp session with keep-alive and a connection limit. Open loop (requests with
``arrival_s``): each request is sent at its arrival time, never earlier than the end of its
``after_index`` request plus its ``think_s``. Closed loop (no arrival times): `concurrency` workers take requests in order.
Bounds: `max_requests` (first N of the sequence) and `max_duration_s` (no request starts after it;
requests still in flight then are cancelled and recorded as errors ``deadline``).

Latencies are measured with ``time.perf_counter`` in the event loop, so they include the client's own
scheduling delay; keep the client on an otherwise idle loop (the runner does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

import orjson

from prefixroute.bench.workload_spec import RequestSpec
from prefixroute.responses_prompt import RESPONSES_PATH

if TYPE_CHECKING:  # aiohttp is imported when a run starts: results/virtual mode work without it
    import aiohttp

SERVED_HEADER = "x-gateway-destination-endpoint-served"
SERVER_ID_HEADER = "x-prefixroute-server-id"


@dataclasses.dataclass(slots=True)
class RequestResult:
    """What one request measured. Times in ms; `start_s` is seconds from the run start."""

    index: int
    group_id: str = ""
    start_s: float = 0.0
    status: int = 0  # HTTP status; 0 = no response (connect error, timeout, deadline)
    error: str | None = None
    ttft_ms: float | None = None
    itl_ms: list[float] = dataclasses.field(default_factory=list)
    e2e_ms: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None = the server did not report prompt_tokens_details
    cpu_cached_tokens: int | None = None  # of cached_tokens, loaded from a CPU tier (virtual fleet only; None: unknown)
    predicted_tier_blocks: tuple[int, int] | None = None  # the router's (GPU, CPU) blocks at its pick (virtual)
    endpoint: str | None = None
    send_lag_ms: float | None = None  # open loop, no dependency: actual send - scheduled arrival (client lag)
    turn: int = 0
    follow_up: bool = False  # the request continues a conversation (after_index set)
    api: str = "chat"  # "chat" (or completions) / "responses": the form it was sent in
    response_id: str | None = None  # Responses: the id of response.created
    call_id: str | None = None  # Responses: the call_id of the response's function_call output item
    not_found: bool = False  # Responses: the server answered 404 for previous_response_id
    sent: bool = True  # False: a Responses follow-up whose previous turn produced no response id

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


class Progress:
    """A plain-text progress bar on a stream (stderr): redrawn in place on a TTY, a line every 5 s else."""

    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.done = 0
        self.errors = 0
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._tty = self.stream.isatty()

    def update(self, ok: bool) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        now = time.perf_counter()
        if self.enabled and (now - self._last >= (0.2 if self._tty else 5.0) or self.done == self.total):
            self._last = now
            self.draw()

    def line(self) -> str:
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"err {self.errors} {rate:.1f} req/s {elapsed:.0f}s")

    def draw(self) -> None:
        self.stream.write(("\r" if self._tty else "") + self.line() + ("" if self._tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            if self.done != self.total:  # update() already drew the final state otherwise
                self.draw()
            if self._tty:
                self.stream.write("\n")
            self.stream.flush()


async def send_one(session: "aiohttp.ClientSession", base_url: str, spec: RequestSpec, model: str,
                   t_run0: float, timeout_s: float) -> RequestResult:
    """Send one streaming request and measure it. Never raises (except CancelledError)."""
    import aiohttp

    res = RequestResult(index=spec.index, group_id=spec.group_id, turn=spec.turn,
                        follow_up=spec.after_index is not None)
    body = orjson.dumps(spec.body(model))
    t0 = time.perf_counter()
    res.start_s = t0 - t_run0
    last = None
    try:
        async with session.post(base_url + spec.path, data=body, headers={"content-type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            res.endpoint = resp.headers.get(SERVED_HEADER) or resp.headers.get(SERVER_ID_HEADER)
            if resp.status != 200:
                text = await resp.text()
                res.error = f"http {resp.status}: {text[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                    break
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_ms = (now - t0) * 1000.0
                        else:
                            res.itl_ms.append((now - last) * 1000.0)
                        last = now
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
            res.e2e_ms = (time.perf_counter() - t0) * 1000.0
            if res.error is None and res.ttft_ms is None:
                res.error = "no content in stream"
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s:g}s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = f"{exc.__class__.__name__}: {exc}"[:300]
    return res


CHAIN_BROKEN = "previous turn failed"
"""Error of a Responses follow-up that was never sent: its previous turn gave no response id to continue."""

RESPONSES_DELTA_EVENTS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta",
                                    "response.reasoning_text.delta", "response.refusal.delta"})
"""Named SSE events that carry generated tokens: the first one with a non-empty delta is the first token."""


def parse_sse_events(lines: "list[bytes] | tuple[bytes, ...]") -> list[tuple[str, dict]]:
    """A Responses stream's lines -> (event name, data object) per event, in order (for tests and replay).

    Each event is ``event: NAME`` then ``data: {json}``; the data's own ``type`` names the event when the
    ``event:`` line is absent (both are what OpenAI and vLLM send). Blank lines and comments are skipped."""
    out: list[tuple[str, dict]] = []
    state = _SSEState()
    for raw in lines:
        ev = state.feed(raw)
        if ev is not None:
            out.append(ev)
    return out


class _SSEState:
    """Line-at-a-time parser of named SSE events (``event:`` then ``data:``)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = ""

    def feed(self, raw: bytes) -> tuple[str, dict] | None:
        line = raw.strip()
        if line.startswith(b"event:"):
            self.event = line[6:].strip().decode(errors="replace")
            return None
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        name, self.event = self.event, ""
        if data == b"[DONE]":
            return None
        obj = orjson.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("SSE data is not a JSON object")
        return (name or str(obj.get("type") or ""), obj)


def apply_responses_event(res: RequestResult, name: str, data: dict, t0: float, last: float | None) -> float | None:
    """Fold one Responses stream event into `res`; returns the time of the latest token (for the next ITL).

    ``response.created`` gives the response id, a delta event (`RESPONSES_DELTA_EVENTS`, non-empty) a token
    (the first one is TTFT), ``response.output_item.added`` / ``.done`` with a ``function_call`` item its
    call_id, ``response.completed`` the usage (``input_tokens``, ``input_tokens_details.cached_tokens``,
    ``output_tokens``), the response id and call id again; ``error`` / ``response.failed`` an error."""
    if name in RESPONSES_DELTA_EVENTS:
        if data.get("delta"):
            now = time.perf_counter()
            if last is None:
                res.ttft_ms = (now - t0) * 1000.0
            else:
                res.itl_ms.append((now - last) * 1000.0)
            return now
        return last
    if name == "response.created":
        rid = (data.get("response") or {}).get("id")
        if isinstance(rid, str):
            res.response_id = rid
    elif name in ("response.output_item.added", "response.output_item.done"):
        item = data.get("item") or {}
        if item.get("type") == "function_call" and isinstance(item.get("call_id"), str):
            res.call_id = item["call_id"]
    elif name == "response.completed":
        resp = data.get("response") or {}
        if isinstance(resp.get("id"), str):
            res.response_id = resp["id"]
        for item in resp.get("output") or ():
            if isinstance(item, dict) and item.get("type") == "function_call" and isinstance(item.get("call_id"), str):
                res.call_id = item["call_id"]
        usage = resp.get("usage") or {}
        res.prompt_tokens = int(usage.get("input_tokens") or 0)
        res.completion_tokens = int(usage.get("output_tokens") or 0)
        details = usage.get("input_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
    elif name in ("error", "response.failed", "response.incomplete"):
        detail = data.get("error") or (data.get("response") or {}).get("error") or data.get("message") or name
        res.error = f"stream error: {str(detail)[:200]}"
    return last


async def send_responses(session: "aiohttp.ClientSession", base_url: str, spec: RequestSpec, model: str,
                         t_run0: float, timeout_s: float, prev: RequestResult | None) -> RequestResult:
    """Send one turn in Responses form (streaming) and measure it. A follow-up continues `prev` (its
    ``previous_response_id`` and function call id); without a response id there it is not sent (`sent` False,
    error `CHAIN_BROKEN`). A 404 is recorded as ``not_found``. Never raises (except CancelledError)."""
    import aiohttp

    res = RequestResult(index=spec.index, group_id=spec.group_id, turn=spec.turn,
                        follow_up=spec.after_index is not None, api="responses")
    prev_id = prev.response_id if prev is not None else None
    if spec.after_index is not None and (prev is None or not prev.ok or prev_id is None):
        res.sent, res.error = False, CHAIN_BROKEN
        res.start_s = time.perf_counter() - t_run0
        return res
    body = orjson.dumps(spec.responses_body(model, prev_id, prev.call_id if prev is not None else None))
    t0 = time.perf_counter()
    res.start_s = t0 - t_run0
    last = None
    state = _SSEState()
    try:
        async with session.post(base_url + RESPONSES_PATH, data=body, headers={"content-type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            res.status = resp.status
            res.endpoint = resp.headers.get(SERVED_HEADER) or resp.headers.get(SERVER_ID_HEADER)
            if resp.status != 200:
                text = await resp.text()
                res.not_found = resp.status == 404 and "not found" in text.lower()
                res.error = f"{'not found' if res.not_found else f'http {resp.status}'}: {text[:200]}"
                return res
            async for raw in resp.content:
                ev = state.feed(raw)
                if ev is None:
                    continue
                last = apply_responses_event(res, ev[0], ev[1], t0, last)
                if res.error is not None or ev[0] == "response.completed":
                    break
            res.e2e_ms = (time.perf_counter() - t0) * 1000.0
            if res.error is None and res.ttft_ms is None:
                res.error = "no content in stream"
            elif res.error is None and res.response_id is None:
                res.error = "no response id in stream"
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s:g}s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = f"{exc.__class__.__name__}: {exc}"[:300]
    return res


async def run_workload(base_url: str, requests: Sequence[RequestSpec], *, model: str, concurrency: int = 16,
                       max_connections: int = 1024, timeout_s: float = 600.0, max_duration_s: float = 3600.0,
                       progress: Progress | None = None, api: str = "chat") -> list[RequestResult]:
    """Replay `requests` against `base_url` (``http://host:port``); results in request order.

    `api` "responses": requests that have a Responses form (`RequestSpec.responses`) are sent in it
    (`send_responses`, follow-ups continuing their `after_index` request's response); "chat" (default): every
    request in its chat / completions form.

    Requests that never started (duration bound hit) are absent from the result; those cancelled in
    flight at the deadline are present with error ``deadline``. Dependencies (`after_index`) outside
    `requests` are ignored.
    """
    import aiohttp

    if concurrency < 1 or max_connections < 1:
        raise ValueError("concurrency and max_connections must be >= 1")
    if api not in ("chat", "responses"):
        raise ValueError(f"api must be chat or responses, got {api!r}")
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections, keepalive_timeout=60)
    t_run0 = time.perf_counter()
    timed = any(r.arrival_s is not None for r in requests)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        replay = _Replay(session, base_url, model, api, timeout_s, t_run0, t_run0 + max_duration_s, progress,
                         {r.index: asyncio.Event() for r in requests})
        main = asyncio.create_task(replay.open_loop(requests) if timed else replay.closed_loop(requests, concurrency))
        try:
            await asyncio.wait_for(asyncio.shield(main), timeout=max(0.0, replay.deadline - time.perf_counter()))
        except asyncio.TimeoutError:
            main.cancel()
            try:
                await main
            except asyncio.CancelledError:
                pass
    if progress:
        progress.close()
    return [replay.results[i] for i in sorted(replay.results)]


@dataclasses.dataclass
class _Replay:
    """One `run_workload` under way: its session, its clock (`t_run0`, `deadline`), the results so far by request
    index, and each request's done event (what its follow-up waits for). Event-loop only."""

    session: aiohttp.ClientSession
    base_url: str
    model: str
    api: str
    timeout_s: float
    t_run0: float
    deadline: float
    progress: Progress | None
    done_events: dict[int, asyncio.Event]
    results: dict[int, RequestResult] = dataclasses.field(default_factory=dict)
    ended_at: dict[int, float] = dataclasses.field(default_factory=dict)  # request index -> perf_counter at its end

    async def one(self, spec: RequestSpec) -> None:
        """Send `spec` once its `after_index` request is done (unless the deadline passed meanwhile) and record it;
        cancelled at the deadline, it is recorded with error ``deadline``."""
        dep = spec.after_index
        if dep is not None and dep in self.done_events:
            await self.done_events[dep].wait()
            if spec.think_s > 0:  # the agent's tool runs after its previous answer
                ready = self.ended_at.get(dep, time.perf_counter()) + spec.think_s
                if ready > self.deadline:
                    self.done_events[spec.index].set()
                    return
                delay = ready - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
        if time.perf_counter() >= self.deadline:
            self.done_events[spec.index].set()
            return
        start_s = time.perf_counter() - self.t_run0
        try:
            if self.api == "responses" and spec.responses is not None:
                res = await send_responses(self.session, self.base_url, spec, self.model, self.t_run0, self.timeout_s,
                                           self.results.get(dep) if dep is not None else None)
            else:
                res = await send_one(self.session, self.base_url, spec, self.model, self.t_run0, self.timeout_s)
        except asyncio.CancelledError:
            self.results[spec.index] = RequestResult(index=spec.index, group_id=spec.group_id, start_s=start_s,
                                                     turn=spec.turn, follow_up=spec.after_index is not None,
                                                     error="deadline")
            raise
        if spec.arrival_s is not None and spec.after_index is None:
            res.send_lag_ms = (res.start_s - spec.arrival_s) * 1000.0
        self.results[spec.index] = res
        self.ended_at[spec.index] = time.perf_counter()
        self.done_events[spec.index].set()
        if self.progress:
            self.progress.update(res.ok)

    async def open_loop(self, requests: Sequence[RequestSpec]) -> None:
        """Each request at its arrival time (none after the deadline), all in flight at once as they come."""
        tasks = []
        for spec in sorted(requests, key=lambda r: (r.arrival_s or 0.0, r.index)):
            delay = self.t_run0 + (spec.arrival_s or 0.0) - time.perf_counter()
            if self.t_run0 + (spec.arrival_s or 0.0) >= self.deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(spec)))
        if tasks:
            await asyncio.gather(*tasks)

    async def closed_loop(self, requests: Sequence[RequestSpec], concurrency: int) -> None:
        """`concurrency` workers, each taking the next request in index order when its last one is done."""
        it = iter(sorted(requests, key=lambda r: r.index))

        async def worker() -> None:
            for spec in it:  # shared iterator: each request is taken by exactly one worker
                if time.perf_counter() >= self.deadline:
                    return
                await self.one(spec)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)) or 1)))

"""`ParseOffload`: parsing of large request bodies in worker processes, off the router's event loop.

A replica is one event loop: a request body that takes long to parse (JSON of 200,000 one-character messages,
a multi-megabyte prompt rendered through a chat template and tokenized) would hold every other request on the
replica meanwhile (measured before this: 6.5 s for a 6 MB body, every other request failing open). So:

- `heavy(path, body)`: a completion/Responses body over ``inline_parse_bytes`` (``inline_tokenize_bytes`` when
  the router tokenizes: the whole prompt is tokenized), one with more than ``inline_parse_objects`` ``{``
  characters (an upper bound on its JSON objects, counted with numpy past 64 KiB: ~20 us for 200 KB, where
  ``bytes.count`` took ~105 us), or one over
  `VALUE_SCAN_BYTES` with more than `MAX_INLINE_VALUES` commas (an upper bound on its JSON values: a list of
  token-id lists holds no ``{``, yet 0.75 MB of them took 25-38 ms to parse), is parsed in a worker; every other
  body, the common case, stays on the loop (no IPC). What costs is the number of JSON values (objects, token
  ids) and, in token mode, the prompt's length; a long text hashed as text costs ~1 ms per MiB.
- `parse`: runs `request.parse_request` in a worker process (``spawn``: a fork of a process with gRPC threads is
  unsafe) with the same settings and its own tokenizer (and caches), and returns the `InferenceRequest`, or
  raises its `OpenAIError` (the 400s naming a budget: ``max_messages`` and the others). The event loop only
  hands the body over (one pickle of bytes in the executor's thread) and waits.
- Shared fairly: each body is queued under its client's flow (extproc/tenants.py: its tenant, else its address,
  never a name the client picks), and a free worker takes the next body of the flow given the fewest bytes of
  parsing so far (start-time fair queuing, as the gateway queue orders tenants), so one client flooding the
  workers with large bodies delays another's body by at most the parses already running, not by its backlog.
- Bounded: at most ``max_parse_queue`` (32) bodies wait or run; a body arriving at a full queue takes the place of
  the newest waiting body of the flow holding the most (503 for that one) when that flow holds more than its own
  would, else it gets the 503 at once (Retry-After). A body that waited past `MAX_WAIT_S` is answered 503
  without parsing it. A worker that dies (killed, out of memory) is replaced; its requests get 503.

The parse budgets themselves (request.py) bound what a worker spends on one body. Async: call from the event
loop only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Container, Mapping

import msgspec
import numpy as np

from prefixroute.extproc.routing.request_prompt import CanonicalText
from prefixroute.extproc.routing.request import (CHAT_PATH, COMPLETION_PATH, InferenceRequest, next_request_key,
                                                 parse_request)
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.text_hash_cache import TextHashCache
from prefixroute.extproc.routing.tokens import PromptHasher
from prefixroute.openai_errors import OpenAIError
from prefixroute.procs import die_with_parent, return_large_blocks
from prefixroute.responses_prompt import RESPONSES_PATH

log = logging.getLogger("prefixroute.extproc")

WORKER_NICE = 10
"""Workers run this much nicer than the router: under CPU contention its event loop and Envoy go first."""
MAX_WAIT_S = 2.0
"""A body that waited this long for a worker is not parsed (503). Envoy waits servicer.PARSE_EXTENSION_S (5 s) for
the answer to a body parsed off the loop (the router asks it to, on the ext_proc routing stream that large bodies
are handed to): 2 s of waiting leaves 3 s for the parse itself (~0.5 s for the largest bodies the budgets allow,
on a loaded host) and the route. With the fair order a client's body waits at most for the parses already running
(one per worker) and its own flow's earlier bodies, so only a flood of its own reaches this."""
MAX_INLINE_VALUES = 32_768
"""Most commas (an upper bound on JSON values) in a body over `VALUE_SCAN_BYTES` parsed on the event loop: 32k
token ids parse in ~5 ms here (~150-200 ns each, measured on a loaded 2-core host; 1 MiB of them took 88 ms), while
prose has about one comma per 80 characters (a 1 MiB text prompt, hashed as text in 0.2 ms, stays on the loop)."""
VALUE_SCAN_BYTES = 64 * 1024
"""Bodies up to this size are not scanned for commas: whatever their shape, parsing one costs at most a few
milliseconds (64 KiB of token ids: ~5 ms; of one-id lists: ~9 ms, bounded by inline_parse_objects' '{' count
otherwise)."""

_PARSED_PATHS = frozenset({CHAT_PATH, COMPLETION_PATH, RESPONSES_PATH})
_HEADERS_USED = ("x-request-id", "content-encoding")  # plus the tenant and session headers (settings)

_worker_settings: RoutingSettings | None = None
_worker_hasher: PromptHasher | None = None
_worker_text_cache: TextHashCache | None = None


def _init_worker(settings: RoutingSettings, parent: int) -> None:
    global _worker_settings, _worker_hasher, _worker_text_cache
    # Dies with the router (a SIGKILLed router must leave no process behind; multiprocessing's resource tracker
    # then sees its last writer go and exits too), and yields the CPU to the router's event loop and Envoy:
    # parsing a large body is the work that may wait.
    die_with_parent(parent)
    return_large_blocks()
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICE)
    _worker_settings = settings
    _worker_hasher = PromptHasher.from_settings(settings)
    _worker_text_cache = TextHashCache.from_settings(settings)


class _ChatLists(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None


class _CompletionLists(msgspec.Struct):
    prompt: list[msgspec.Raw] | None = None


class _CompletionPrompt(msgspec.Struct):
    prompt: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))


class _ResponsesLists(msgspec.Struct):
    input: list[msgspec.Raw] | None = None


_LIST_DECODERS = {CHAT_PATH: (msgspec.json.Decoder(_ChatLists), "messages"),
                  COMPLETION_PATH: (msgspec.json.Decoder(_CompletionLists), "prompt"),
                  RESPONSES_PATH: (msgspec.json.Decoder(_ResponsesLists), "input")}


def precheck_lists(path: str, headers: Mapping[str, str], body: bytes, settings: RoutingSettings) -> None:
    """Raise the 400 naming ``max_messages`` for a body whose top-level list (``messages``, ``prompt`` of strings
    or of token-id lists, ``input``) has more items, and the 400 naming ``max_input_chars`` for a completion prompt
    of more token ids, without building its items: msgspec skims the list as raw bytes, 4-5x faster than the full
    parse (a 6.4 MB body of 200,000 messages: ~30 ms against ~135 ms), and token ids are counted by their commas
    (a list of integers has one fewer than its items: 1.9M ids in ~35 ms, where skimming each as an item took
    ~285 ms), so a hostile body holds a worker that much less. Any other body (valid, or invalid in another way,
    or compressed) passes unchanged: `parse_request` then decides, with the same message for these limits."""
    route = path.split("?", 1)[0]
    entry = _LIST_DECODERS.get(route)
    if entry is None or headers.get("content-encoding", "identity") != "identity":
        return
    if route == COMPLETION_PATH and _precheck_token_ids(body, settings):
        return
    decoder, name = entry
    try:
        items = getattr(decoder.decode(body), name)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if items is None or len(items) <= settings.max_messages:
        return
    if name == "prompt" and bytes(items[0])[:1] not in (b'"', b"["):  # token ids: counted above
        return
    CanonicalText(0, settings).count_messages(len(items), name)


_DIGITS = frozenset(b"-0123456789")
_BRACE, _COMMA = ord("{"), ord(",")


def _precheck_token_ids(body: bytes, settings: RoutingSettings) -> bool:
    """A completion body whose prompt is token ids (a list of them, or a list of lists): its lists and ids counted
    against ``max_messages`` and ``max_input_chars`` (400s as the parse words them); True when the prompt was of
    that shape (nothing more to skim), False for any other (strings: their commas are not items)."""
    try:
        raw = bytes(_PROMPT_DECODER.decode(body).prompt)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
    if raw[:1] != b"[":
        return False
    rest = raw[1:].lstrip()
    first = rest[:1]
    canon = CanonicalText(0, settings)
    if first and first[0] in _DIGITS:  # [id, id, ...]: a list of integers has one comma fewer than its items
        canon.check_ids(raw.count(b",") + 1)
        return True
    if first == b"[":  # [[id, ...], [id, ...]]: every comma separates two ids of a list or two lists
        canon.count_messages(raw.count(b"[") - 1, "prompt")
        canon.check_ids(raw.count(b",") + 1)  # (ids - lists) + (lists - 1) commas
        return True
    return False


_PROMPT_DECODER = msgspec.json.Decoder(_CompletionPrompt)


def _parse_in_worker(method: str, path: str, headers: dict[str, str], body: bytes,
                     adapters: frozenset[str] | None, submitted_s: float) -> tuple:
    """("ok", InferenceRequest) or ("error", status, message, param, type, retry_after_s): an exception object
    with keyword-only fields does not survive pickling, its fields do."""
    if time.monotonic() - submitted_s > MAX_WAIT_S:
        return ("error", 503, "the router is busy parsing other large requests; retry", None, None, 1)
    assert _worker_settings is not None
    try:
        precheck_lists(path, headers, body, _worker_settings)
        return ("ok", parse_request(method, path, headers, body, _worker_settings, _worker_hasher, adapters,
                                     _worker_text_cache))
    except OpenAIError as err:
        return ("error", err.status, err.message, err.param, err.type, err.retry_after_s)


def _noop() -> int:
    return 0


@dataclasses.dataclass(eq=False, slots=True)
class _Job:
    """One body waiting for (or at) a worker: its parse's arguments, its flow and the future its caller awaits."""

    args: tuple
    flow: str
    num_bytes: int
    arrived_s: float
    future: asyncio.Future
    started: bool = False


class _Flow:
    __slots__ = ("waiting", "running", "vtime")

    def __init__(self, vtime: float) -> None:
        self.waiting: deque[_Job] = deque()
        self.running = 0
        self.vtime = vtime  # bytes of parsing given to this flow (its start tag), for the fair order

    @property
    def num_held(self) -> int:
        return len(self.waiting) + self.running


MIN_JOB_BYTES = 4096
"""A flow is charged at least this per body, so small bodies too take turns (their parse has a fixed cost)."""


class ParseOffload:
    """Worker processes parsing large bodies (module docstring). `start` launches them (in the background);
    `close` stops them. Invariants: at most ``num_workers`` bodies are at the executor at once (the rest wait
    here, in their flows, in the fair order); ``in_queue`` is the number waiting or running, at most
    ``max_parse_queue``; every body's future is answered exactly once (its result, its parse's 400, or a 503)."""

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings
        self.num_workers = settings.parse_workers
        self.max_queue = settings.max_parse_queue
        self.inline_bytes = settings.inline_tokenize_bytes if settings.tokenizer else settings.inline_parse_bytes
        self.inline_objects = settings.inline_parse_objects
        self._headers = tuple(h for h in (*_HEADERS_USED, settings.tenant_header, settings.session_header) if h)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warm: list[concurrent.futures.Future] = []
        self._flows: dict[str, _Flow] = {}
        self._vclock = 0.0  # the start tag of the last body sent to a worker
        self._running = 0
        self.in_queue = 0
        self.num_parsed = 0  # bodies parsed in a worker
        self.num_refused = 0  # 503: queue full, waited too long, given up for another flow's, or a worker died
        self.num_worker_deaths = 0

    @property
    def enabled(self) -> bool:
        return self.num_workers > 0

    def heavy(self, path: str, body: bytes) -> bool:
        """Whether `body` (of a request to `path`) is parsed in a worker: module docstring. O(len(body)) at
        memory speed for a body at most ``inline_parse_bytes`` long, O(1) beyond."""
        if not self.enabled or not body or path.split("?", 1)[0] not in _PARSED_PATHS:
            return False
        if len(body) > self.inline_bytes:
            return True
        if len(body) <= VALUE_SCAN_BYTES:
            return body.count(b"{") > self.inline_objects
        # numpy compares ~6x faster than bytes.count (which walks byte by byte: ~130 us for 200 KB, measured)
        data = np.frombuffer(body, np.uint8)
        return int(np.count_nonzero(data == _BRACE)) > self.inline_objects or \
            int(np.count_nonzero(data == _COMMA)) > MAX_INLINE_VALUES

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self.settings, os.getpid()))
        return self._pool

    def start(self) -> None:
        """Launch the workers now (a spawned worker imports the routing modules: ~1 s), so the first large
        body does not wait for that (a body that waits past MAX_WAIT_S for a worker still starting is 503)."""
        if self.enabled:
            self._warm = [self._executor().submit(_noop) for _ in range(self.num_workers)]

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until the workers `start` launched have started (for tests and benchmarks)."""
        if self._warm:
            await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in self._warm)), timeout_s)

    async def parse(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
                    adapters: Container[str] | None, *, client: str = "") -> InferenceRequest:
        """`parse_request` in a worker, in `client`'s turn (its flow: module docstring). Raises `OpenAIError` (the
        parse's own, or 503 when the queue is full, the body waited too long, another flow's body took its place
        or the worker died)."""
        if self.in_queue >= self.max_queue and not self._make_room(client):
            self.num_refused += 1
            raise _busy(f"too many large requests are being parsed ({self.max_queue}); retry")
        sent_headers = {h: headers[h] for h in self._headers if h in headers}
        names = frozenset(adapters) if adapters is not None else None
        loop = asyncio.get_running_loop()
        job = _Job((method, path, sent_headers, body, names), client, len(body), time.monotonic(),
                   loop.create_future())
        flow = self._flows.get(client)
        if flow is None:  # a flow that becomes active starts at the clock: idle time is not banked
            flow = self._flows[client] = _Flow(self._vclock)
        flow.waiting.append(job)
        self.in_queue += 1
        self._dispatch()
        try:
            result = await asyncio.shield(job.future)
        except asyncio.CancelledError:
            if not job.started and not job.future.done():  # its client left while it waited: it goes
                self._unqueue(job)
                job.future.cancel()
            raise
        if result[0] == "error":
            _, status, message, param, type_, retry_after_s = result
            if status == 503:
                self.num_refused += 1
            raise OpenAIError(status, message, param=param, type_=type_, retry_after_s=retry_after_s)
        self.num_parsed += 1
        request = result[1]
        request.key = next_request_key()  # the worker's counter is not this process's
        return request

    def _make_room(self, client: str) -> bool:
        """The queue is full: give up the newest waiting body of the flow holding the most, when it holds more
        than `client`'s flow would with one more (then True). Its caller gets a 503."""
        mine = self._flows.get(client)
        held = (mine.num_held if mine is not None else 0) + 1
        largest = max((f for f in self._flows.values() if f.waiting), key=lambda f: f.num_held, default=None)
        if largest is None or largest is mine or largest.num_held <= held:
            return False
        victim = largest.waiting.pop()
        self.in_queue -= 1
        self._forget_if_idle(victim.flow)
        victim.future.set_result(_REPLACED)
        return True

    def _unqueue(self, job: _Job) -> None:
        flow = self._flows.get(job.flow)
        if flow is not None:
            with contextlib.suppress(ValueError):
                flow.waiting.remove(job)
                self.in_queue -= 1
            self._forget_if_idle(job.flow)

    def _forget_if_idle(self, name: str) -> None:
        flow = self._flows.get(name)
        if flow is not None and not flow.num_held:
            del self._flows[name]

    def _dispatch(self) -> None:
        """Send waiting bodies to free workers, the flow given the fewest bytes first (ties: its name)."""
        while self._running < self.num_workers:
            ready = [(f.vtime, name, f) for name, f in self._flows.items() if f.waiting]
            if not ready:
                return
            vtime, name, flow = min(ready, key=lambda r: (r[0], r[1]))
            job = flow.waiting.popleft()
            if time.monotonic() - job.arrived_s > MAX_WAIT_S:  # waited too long: answered without a parse
                self.in_queue -= 1
                self._forget_if_idle(name)
                if not job.future.done():
                    job.future.set_result(_WAITED)
                continue
            self._vclock = max(self._vclock, vtime)
            flow.vtime = vtime + max(job.num_bytes, MIN_JOB_BYTES)
            flow.running += 1
            self._running += 1
            job.started = True
            asyncio.ensure_future(self._run(job, flow))

    async def _run(self, job: _Job, flow: _Flow) -> None:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor(), _parse_in_worker, *job.args, time.monotonic())
        except concurrent.futures.process.BrokenProcessPool:
            self.num_worker_deaths += 1
            log.error("a parse worker died; starting new ones")
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            result = ("error", 503, "the router's parse worker failed; retry", None, None, 1)
        except Exception as exc:  # noqa: BLE001 - answered as a failure of the worker, never left unanswered
            log.exception("a parse worker call failed")
            result = ("error", 503, f"the router's parse worker failed ({type(exc).__name__}); retry", None, None, 1)
        finally:
            flow.running -= 1
            self._running -= 1
            self.in_queue -= 1
            self._forget_if_idle(job.flow)
        if not job.future.done():
            job.future.set_result(result)
        self._dispatch()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _busy(message: str) -> OpenAIError:
    return OpenAIError(503, message, retry_after_s=1)


_WAITED = ("error", 503, "the router is busy parsing other large requests; retry", None, None, 1)
_REPLACED = ("error", 503, "this client's other large requests fill the router's parse queue; retry", None, None, 1)

"""`ParseOffload`: parsing of large request bodies in worker processes, off the router's event loop (issue 27).

A replica is one event loop: a request body that takes long to parse (JSON of 200,000 one-character messages,
a multi-megabyte prompt rendered through a chat template and tokenized) would hold every other request on the
replica meanwhile (measured before this: 6.5 s for a 6 MB body, every other request failing open). So:

- `heavy(path, body)`: a completion/Responses body over ``inline_parse_bytes`` (``inline_tokenize_bytes`` when
  the router tokenizes: the whole prompt is tokenized), or one with more than ``inline_parse_objects`` ``{``
  characters (an upper bound on its JSON objects: ``bytes.count`` runs at memory speed), is parsed in a worker;
  every other body, the common case, stays on the loop (no IPC). What costs is the number of objects (messages,
  parts) and, in token mode, the prompt's length; a long text hashed as text costs ~1 ms per MiB.
- `parse`: runs `request.parse_request` in a worker process (``spawn``: a fork of a process with gRPC threads is
  unsafe) with the same settings and its own tokenizer (and caches), and returns the `InferenceRequest`, or
  raises its `OpenAIError` (the 400s naming a budget: ``max_messages`` and the others). The event loop only
  hands the body over (one pickle of bytes in the executor's thread) and waits.
- Bounded: at most ``max_parse_queue`` (32) bodies wait or run; beyond, 503 with Retry-After at once. A body that
  waited past `MAX_WAIT_S` is answered 503 by the worker without parsing it (Envoy has failed the request
  open by then: --extproc-message-timeout-ms). A worker that dies (killed, out of memory) is replaced; its
  requests get 503.

The parse budgets themselves (request.py) bound what a worker spends on one body. Async: call from the event
loop only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Container, Mapping

import msgspec

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
MAX_WAIT_S = 0.4
"""A body that waited this long for a worker is not parsed (503): Envoy waits 0.5 s for the router's answer
(--extproc-message-timeout-ms) and has applied its failure mode by then."""

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


class _ResponsesLists(msgspec.Struct):
    input: list[msgspec.Raw] | None = None


_LIST_DECODERS = {CHAT_PATH: (msgspec.json.Decoder(_ChatLists), "messages"),
                  COMPLETION_PATH: (msgspec.json.Decoder(_CompletionLists), "prompt"),
                  RESPONSES_PATH: (msgspec.json.Decoder(_ResponsesLists), "input")}


def precheck_lists(path: str, headers: Mapping[str, str], body: bytes, settings: RoutingSettings) -> None:
    """Raise the 400 naming ``max_messages`` for a body whose top-level list (``messages``, ``prompt`` of strings
    or of token-id lists, ``input``) has more items, without building its items: msgspec skims them as raw
    bytes, 4-5x faster than the full parse (a 6.4 MB body of 200,000 messages: ~30 ms against ~135 ms), so a
    hostile body holds a worker that much less. Any other body (valid, or invalid in another way, or
    compressed) passes unchanged: `parse_request` then decides, with the same message for this limit."""
    entry = _LIST_DECODERS.get(path.split("?", 1)[0])
    if entry is None or headers.get("content-encoding", "identity") != "identity":
        return
    decoder, name = entry
    try:
        items = getattr(decoder.decode(body), name)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    if items is None or len(items) <= settings.max_messages:
        return
    if name == "prompt" and bytes(items[0])[:1] not in (b'"', b"["):  # token ids: bounded by max_input_tokens instead
        return
    CanonicalText(0, settings).count_messages(len(items), name)


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


class ParseOffload:
    """Worker processes parsing large bodies (module docstring). `start` launches them (in the background);
    `close` stops them."""

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings
        self.num_workers = settings.parse_workers
        self.max_queue = settings.max_parse_queue
        self.inline_bytes = settings.inline_tokenize_bytes if settings.tokenizer else settings.inline_parse_bytes
        self.inline_objects = settings.inline_parse_objects
        self._headers = tuple(h for h in (*_HEADERS_USED, settings.tenant_header, settings.session_header) if h)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warm: list[concurrent.futures.Future] = []
        self.in_queue = 0
        self.num_parsed = 0  # bodies parsed in a worker
        self.num_refused = 0  # 503: queue full, waited too long, or a worker died
        self.num_worker_deaths = 0

    @property
    def enabled(self) -> bool:
        return self.num_workers > 0

    def heavy(self, path: str, body: bytes) -> bool:
        """Whether `body` (of a request to `path`) is parsed in a worker: module docstring. O(len(body)) at
        memory speed for a body at most ``inline_parse_bytes`` long, O(1) beyond."""
        if not self.enabled or not body or path.split("?", 1)[0] not in _PARSED_PATHS:
            return False
        return len(body) > self.inline_bytes or body.count(b"{") > self.inline_objects

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
                    adapters: Container[str] | None) -> InferenceRequest:
        """`parse_request` in a worker. Raises `OpenAIError` (the parse's own, or 503 when the queue is full,
        the body waited too long or the worker died)."""
        if self.in_queue >= self.max_queue:
            self.num_refused += 1
            raise OpenAIError(503, f"too many large requests are being parsed ({self.max_queue}); retry",
                              retry_after_s=1)
        sent_headers = {h: headers[h] for h in self._headers if h in headers}
        names = frozenset(adapters) if adapters is not None else None
        loop = asyncio.get_running_loop()
        self.in_queue += 1
        try:
            result = await loop.run_in_executor(self._executor(), _parse_in_worker, method, path, sent_headers,
                                                body, names, time.monotonic())
        except concurrent.futures.process.BrokenProcessPool:
            self.num_worker_deaths += 1
            self.num_refused += 1
            log.error("a parse worker died; starting new ones")
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            raise OpenAIError(503, "the router's parse worker failed; retry", retry_after_s=1) from None
        finally:
            self.in_queue -= 1
        if result[0] == "error":
            _, status, message, param, type_, retry_after_s = result
            if status == 503:
                self.num_refused += 1
            raise OpenAIError(status, message, param=param, type_=type_, retry_after_s=retry_after_s)
        self.num_parsed += 1
        request = result[1]
        request.key = next_request_key()  # the worker's counter is not this process's
        return request

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

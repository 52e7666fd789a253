#!/usr/bin/env python3
"""The walk of one streamed chat request through the router, per transport: which of the router's modules it
enters, how often, and whether it comes back into a transport from below. A call tracer, not a profiler.

What runs: the router as ``prefixroute extproc`` builds it (its settings parsed by the command's own parser,
`extproc.cli.serve`: pool, router, telemetry, tracker, facts receiver, the gRPC port and the ext_authz HTTP port),
in this process, in front of one simulated model server (``prefixroute model-server``, a child process). No Envoy:
a small client sends the router the messages Envoy sends, on the router's own ports, and stands in for Envoy's
upstream request (the chat is sent to the endpoint the router picked and its SSE answer read), so the response
side gets the server's real chunks. Per transport, one streamed chat (``stream: true``, usage included):

- ``ext_proc``: Envoy's ext_proc routing filter as our configuration runs it on the facts path (the default routing
  filter, on the default response path): a
  stream with the facts metadata; the request headers (answered CONTINUE), the whole body (BUFFERED: the decision);
  the response headers are not sent (SKIP on the facts path); the stream ends when the response has ended (the
  pick's release).
- ``authz_http``: Envoy's ext_authz filter over HTTP/1.1 (extproc/authz_http.py; an option), one check on a
  kept-alive connection, as Envoy sends it (facts and handoff headers, the body cap).
- ``gie``: the Gateway API Inference Extension's protocol (extproc/gie.py) on one stream, request and response
  bodies FULL_DUPLEX_STREAMED: request headers, the body, then the response headers and every response chunk as the
  server sent them, the last with end of stream.
- ``facts``: the facts path's two calls that close a request routed by ``ext_proc`` (envoy_facts.py): the early
  first token report, sent when the first chunk arrives, and Envoy's facts record (an OTLP log record with the
  status, timing and the usage the Lua filter takes from the stream's tail), sent after the stream's end.

The requests routed by ``ext_proc`` and ``authz_http`` are closed by their facts too, untraced in their own rows. Before each traced
request, one untraced request of the same transport warms the router (imports, caches, pre-built answers); each
request has its own user question after a shared system prompt, so the traced one is a typical next chat, not a
repeat of a cached prompt.

What is traced (`ModuleTracer`: ``sys.setprofile`` on the event loop's thread, where every transport handler
runs): calls into the repository's own modules (``prefixroute.*``; the standard library, grpc, protobuf, uvloop and
every other package are invisible), from the moment the first message is sent until the answer has come back (for
a stream: until the stream has ended). A call belongs to the request's *walk* when the nearest repository frame
below it on the stack belongs to the walk; a call with no repository frame below it (gRPC or the event loop called
it) starts the walk when its module is a transport module or the wire classes (``extproc/wire.py``: the answer's
serializer, which gRPC calls), or when it runs a task the walk created. Everything else in the window (the pool's
probes and scrapes, the client's own work) is background: counted apart and shown, never in the figures. Other
threads (the span exporter) are off the request path and not traced.

The figures of a walk:

- modules: distinct modules entered;
- entries: calls whose caller (the nearest repository frame below) is in another module, or outside the repository
  (gRPC or the event loop calling a handler, a callback, the answer's serializer);
- re-entries: entries into a module the walk had already entered (entries - modules);
- from below: entries into a transport module (`TRANSPORT_MODULES`) whose caller is a repository module that is
  not one (a transport called back from the router beneath it);
- resumptions, apart: a coroutine or generator of the walk resumed by another module or the event loop (after an
  await that suspended: how many suspend depends on timing, so they are not entries and not in the figures above).

Usage::

    .venv/bin/python scripts/walk_modules.py                       # every transport, tables and sequences
    .venv/bin/python scripts/walk_modules.py --transport gie --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

from prefixroute import settings
from prefixroute.extproc import cli as extproc_cli
from prefixroute.extproc import wire
from prefixroute.extproc.authz_http import CHECK_PATH_PREFIX
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.envoy_facts import EXPORT_PATH
from prefixroute.extproc.facts_fields import (A_CONTENT_TYPE, A_DURATION_US, A_FIRST_TOKEN_US, A_RESPONSE_ID,
                                              A_ROUTING_US, A_START, A_STATUS, A_TRACEPARENT, A_TTFT_US, A_UPSTREAM,
                                              A_USAGE, FACTS_MARK, FIRST_TOKEN_METHOD, MAX_USAGE_CHARS,
                                              OBSERVED_FACTS, TAIL_BYTES)
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.extproc.headers import (AUTHZ_BODY_BYTES_HEADER, DESTINATION_HEADER, FAIRNESS_HEADER,
                                         HANDOFF_HEADER, HANDOFF_VALUE, OBSERVED_METADATA, TRACEPARENT_HEADER)
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.server import ExtprocSettings, new_event_loop
from prefixroute.extproc.tenants import TenantSettings
from prefixroute.procs import ManagedProcess, free_port, http_ok, prefixroute_argv
from prefixroute.telemetry.router import RouterTelemetrySettings

PACKAGE = "prefixroute"
TRANSPORTS = ("ext_proc", "authz_http", "gie", "facts")
"""What `walk` can drive, in the order it runs them (module docstring)."""
DEFAULT_PATH = ("ext_proc", "facts")
"""The transports one request meets on the default path (`prefixroute gateway`: the ext_proc routing stream, then
the facts path); their walks together are the ``default path`` row."""
TRANSPORT_MODULES = frozenset(f"{PACKAGE}.{m}" for m in (
    "extproc.servicer", "extproc.authz", "extproc.authz_http", "extproc.gie", "extproc.envoy_facts",
    "extproc.health", "extproc.server",
    # The bearer-token wrapper gRPC calls every unary handler through (the facts calls): the
    # transport's own layer, above the handler.
    "grpc_auth"))
"""The transport modules: a call into one of these from a repository module outside them is a call from below."""
ROOT_MODULES = TRANSPORT_MODULES | {f"{PACKAGE}.extproc.wire"}
"""Modules whose calls from outside the repository (gRPC, the event loop) start a walk."""
SYSTEM_PROMPT = ("You are a careful assistant for a team that runs inference fleets. Answer briefly, name the "
                 "component you mean, and say which figure you measured and how. ") * 8
"""The shared system prompt of every request (~1.3 KB): what a chat application sends before each question."""
MAX_TOKENS = 16


def short(module: str | None) -> str:
    """A module's name without the package prefix (``extproc.servicer``); ``outside`` for none."""
    if module is None:
        return "outside"
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else module


@dataclass(frozen=True, slots=True)
class Entry:
    """One module entry: a call into `module`'s `function` from `caller` (None: from outside the repository)."""

    module: str
    function: str
    caller: str | None
    reentry: bool
    from_below: bool


@dataclass(frozen=True, slots=True)
class Resumption:
    """A coroutine or generator of `module` resumed from `caller` (another module, or None: the event loop)."""

    module: str
    function: str
    caller: str | None


@dataclass
class Walk:
    """One transport's walk (module docstring). Invariants: ``num_entries == len(entries)``,
    ``num_reentries == num_entries - num_modules``, every entry's module is in `modules`; resumptions are not
    entries (how often an await suspends depends on timing, what is called does not)."""

    transport: str
    entries: list[Entry] = field(default_factory=list)
    resumptions: list[Resumption] = field(default_factory=list)
    num_calls: int = 0
    """Calls of the walk into repository functions, entries or not (resumptions not counted)."""
    background: Counter = field(default_factory=Counter)
    """Repository calls in the traced windows that are not the walk's, per module."""
    num_windows: int = 0
    """Traced windows (one per handler call the client made: a stream, a check, a report)."""
    num_response_chunks: int = 0
    """Response body messages the walk carried (GIE: one per SSE event of the answer; 0 elsewhere)."""
    task: Any = field(default=None, repr=False, compare=False)
    """The task of the stream's handler (`ModuleTracer.window` with one_task), once entered."""

    @property
    def modules(self) -> list[str]:
        """Distinct modules entered, in the order first entered."""
        return list(dict.fromkeys(e.module for e in self.entries))

    @property
    def num_modules(self) -> int:
        return len(self.modules)

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    @property
    def num_reentries(self) -> int:
        return sum(e.reentry for e in self.entries)

    @property
    def num_from_below(self) -> int:
        return sum(e.from_below for e in self.entries)

    def joined(self, other: Walk, transport: str) -> Walk:
        """This walk followed by `other`, as one request's walk (re-entries counted across both)."""
        out = Walk(transport, resumptions=[*self.resumptions, *other.resumptions],
                   num_calls=self.num_calls + other.num_calls,
                   num_response_chunks=self.num_response_chunks + other.num_response_chunks,
                   background=self.background + other.background, num_windows=self.num_windows + other.num_windows)
        seen: set[str] = set()
        for e in [*self.entries, *other.entries]:
            out.entries.append(Entry(e.module, e.function, e.caller, e.module in seen, e.from_below))
            seen.add(e.module)
        return out

    def figures(self) -> dict[str, int]:
        return {"num_modules": self.num_modules, "num_entries": self.num_entries,
                "num_reentries": self.num_reentries, "num_from_below": self.num_from_below,
                "num_resumptions": len(self.resumptions), "num_calls": self.num_calls,
                "num_response_chunks": self.num_response_chunks,
                "num_background_calls": sum(self.background.values())}

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, **self.figures(), "modules": [short(m) for m in self.modules],
                "sequence": [{"module": short(e.module), "function": e.function, "caller": short(e.caller),
                              "reentry": e.reentry, "from_below": e.from_below} for e in self.entries],
                "resumptions": [{"module": short(r.module), "function": r.function, "caller": short(r.caller)}
                                for r in self.resumptions],
                "background": {short(m): n for m, n in self.background.most_common()}}


class ModuleTracer:
    """Records the walk of the calls made while `window` is open (module docstring), on the thread that opens it.

    Not re-entrant (one window at a time). Frames met are kept alive until `reset`, so an id is never reused
    for another frame within a request."""

    def __init__(self, package: str = PACKAGE, transports: frozenset[str] = TRANSPORT_MODULES,
                 roots: frozenset[str] = ROOT_MODULES) -> None:
        self.package = package
        self.prefix = package + "."
        self.transports = transports
        self.roots = roots
        self.walk: Walk | None = None
        self._frames: dict[int, tuple[Any, bool]] = {}  # id(frame) -> (frame, in the walk)
        self._adopted: dict[int, Any] = {}  # frames of coroutines that tasks created by the walk will run
        self._entered: set[str] = set()
        self._one_task = False

    def reset(self) -> None:
        self._frames.clear()
        self._adopted.clear()
        self._entered.clear()

    def _ours(self, frame: Any) -> str | None:
        name = frame.f_globals.get("__name__")
        if isinstance(name, str) and (name == self.package or name.startswith(self.prefix)):
            return name
        return None

    def _caller(self, frame: Any) -> Any:
        """The nearest repository frame below `frame` (None: gRPC or the event loop called it)."""
        back = frame.f_back
        while back is not None:
            if self._ours(back) is not None:
                return back
            back = back.f_back
        return None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = self._ours(frame)
        if module is None:
            return
        walk = self.walk
        assert walk is not None
        known = self._frames.get(id(frame))
        resumed = known is not None and known[0] is frame
        caller = self._caller(frame)
        if caller is not None:
            ours = self._frames.get(id(caller))
            in_walk = ours is not None and ours[0] is caller and ours[1]
            caller_module = self._ours(caller)
        else:
            caller_module = None
            if resumed:
                in_walk = known[1]
            elif self._adopted.get(id(frame)) is frame:
                in_walk = True
            elif module not in self.roots:
                in_walk = False
            elif self._one_task:  # only the first transport handler's task (and the tasks it creates)
                task = asyncio.current_task()
                if walk.task is None and module in self.transports:
                    walk.task = task
                in_walk = task is not None and task is walk.task
            else:
                in_walk = True
        self._frames[id(frame)] = (frame, in_walk)
        if not in_walk:
            if not resumed:
                walk.background[module] += 1
            return
        if resumed:
            if caller_module != module:
                walk.resumptions.append(Resumption(module, frame.f_code.co_name, caller_module))
            return
        walk.num_calls += 1
        if caller_module == module:
            return
        walk.entries.append(Entry(module, frame.f_code.co_name, caller_module, module in self._entered,
                                  module in self.transports and caller_module is not None
                                  and caller_module not in self.transports))
        self._entered.add(module)

    def _task_factory(self, previous: Any) -> Callable[..., Any]:
        """A task factory that marks the coroutines of tasks created by the walk (their first call has no
        repository frame below it), then creates the task as `previous` would."""

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> Any:
            frame = sys._getframe(1)
            while frame is not None and self._ours(frame) is None:
                frame = frame.f_back
            if frame is not None:
                ours = self._frames.get(id(frame))
                cr_frame = getattr(coro, "cr_frame", None)
                if ours is not None and ours[0] is frame and ours[1] and cr_frame is not None:
                    self._adopted[id(cr_frame)] = cr_frame
            if previous is not None:
                return previous(loop, coro, **kw)
            return asyncio.Task(coro, loop=loop, **kw)

        return factory

    @contextlib.contextmanager
    def window(self, walk: Walk, *, one_task: bool = False) -> Iterator[None]:
        """Trace into `walk` on this thread (the event loop's) until the block ends. `one_task`: the walk is one
        gRPC stream's: calls from outside the repository start it only in the task of the first transport handler
        entered (gRPC runs each call's handler in a task of its own), so other calls the window sees (Envoy's
        early report on the same port, while the stream waits) are background."""
        loop = asyncio.get_running_loop()
        previous = loop.get_task_factory()
        self.walk = walk
        self._one_task = one_task
        walk.num_windows += 1
        loop.set_task_factory(self._task_factory(previous))
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            loop.set_task_factory(previous)
            self.walk = None


# ---- what Envoy sends -------------------------------------------------------------------------------------------

def chat_body(model: str, question: int) -> bytes:
    """One streamed chat request (a shared system prompt, a question of its own), as a client sends it."""
    return json.dumps({"model": model, "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": MAX_TOKENS, "messages": [
                           {"role": "system", "content": SYSTEM_PROMPT},
                           {"role": "user", "content": f"Question {question}: which endpoint served request "
                                                       f"{question}, and how long did its first token take?"}]},
                      separators=(",", ":")).encode()


def request_headers(body: bytes) -> dict[str, str]:
    """The request's headers as Envoy's filters see them (pseudo-headers, Envoy's own, the fairness id it sets)."""
    return {":authority": "gateway", ":path": "/v1/chat/completions", ":method": "POST", ":scheme": "http",
            "content-type": "application/json", "content-length": str(len(body)), "accept": "text/event-stream",
            "user-agent": "OpenAI/Python 1.99.0", "x-forwarded-proto": "http", "x-request-id": str(uuid.uuid4()),
            FAIRNESS_HEADER: "address:127.0.0.1"}


def _header_map(headers: dict[str, str]) -> Any:
    return wire.HeaderMap(headers=[wire.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def _body_mode(name: str) -> int:
    return wire.POOL.FindEnumTypeByName(
        "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode").values_by_name[name].number


def _set_headers(mutation: Any) -> dict[str, str]:
    return {o.header.key: (o.header.raw_value.decode() if o.header.raw_value else o.header.value)
            for o in mutation.set_headers}


@dataclass
class Answer:
    """What the router answered: the endpoint to send the request to and the traceparent its facts carry."""

    endpoint: str
    traceparent: str | None


@dataclass
class Upstream:
    """The server's streamed answer as Envoy passes it on: status, headers, chunks, timing."""

    status: int
    headers: dict[str, str]
    chunks: list[bytes]
    start_s: float
    ttft_us: int
    duration_us: int

    def usage_text(self) -> str | None:
        """What the facts Lua filter keeps: the last ``"usage": {`` object of the last TAIL_BYTES, cut at
        MAX_USAGE_CHARS (envoy_config/facts.py)."""
        tail = b"".join(self.chunks)[-TAIL_BYTES:].decode("utf-8", "replace")
        found = list(re.finditer(r'"usage"\s*:\s*\{', tail))
        return tail[found[-1].start():found[-1].start() + MAX_USAGE_CHARS] if found else None


class Gateway:
    """Stands in for Envoy: talks to the router's ports and to the model server, as Envoy would."""

    def __init__(self, channel: grpc.aio.Channel, authz_http_port: int, http: aiohttp.ClientSession) -> None:
        self.channel = channel
        self.process = wire.process_call(channel)
        self.first_token = channel.unary_unary(FIRST_TOKEN_METHOD, request_serializer=None, response_deserializer=None)
        self.export = channel.unary_unary(EXPORT_PATH, request_serializer=ExportLogsServiceRequest.SerializeToString,
                                          response_deserializer=ExportLogsServiceResponse.FromString)
        self.authz_http_port = authz_http_port
        self.http = http
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.body_cap = min(EnvoySettings().authz_body_bytes, EnvoySettings().max_request_body_bytes)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()

    async def upstream(self, answer: Answer, body: bytes, headers: dict[str, str],
                       on_first_chunk: Callable[[], Awaitable[None]] | None = None,
                       on_chunk: Callable[[bytes], Awaitable[None]] | None = None) -> Upstream:
        """Send the request to the picked endpoint and read its SSE answer, chunk by chunk as it arrives."""
        sent = {k: v for k, v in headers.items() if not k.startswith(":") and k != "content-length"}
        sent[DESTINATION_HEADER] = answer.endpoint
        if answer.traceparent:
            sent[TRACEPARENT_HEADER] = answer.traceparent
        start_s, t0 = time.time(), time.perf_counter()
        chunks: list[bytes] = []
        ttft_us = 0
        async with self.http.post(f"http://{answer.endpoint}/v1/chat/completions", data=body, headers=sent) as r:
            async for chunk in r.content.iter_any():
                if not chunks:
                    ttft_us = int((time.perf_counter() - t0) * 1e6)
                    if on_first_chunk is not None:
                        await on_first_chunk()
                chunks.append(chunk)
                if on_chunk is not None:
                    await on_chunk(chunk)
            status, rheaders = r.status, {k.lower(): v for k, v in r.headers.items()}
        return Upstream(status, rheaders, chunks, start_s, ttft_us, int((time.perf_counter() - t0) * 1e6))

    def facts_record(self, traceparent: str, endpoint: str, up: Upstream) -> ExportLogsServiceRequest:
        """Envoy's facts record of the response (facts_fields.FACTS_ATTRIBUTES, as Envoy formats them)."""
        values = {FACTS_MARK: "1", A_TRACEPARENT: traceparent, A_STATUS: str(up.status), A_UPSTREAM: endpoint,
                  A_CONTENT_TYPE: up.headers.get("content-type", "-"), A_TTFT_US: str(up.ttft_us),
                  A_DURATION_US: str(up.duration_us), A_ROUTING_US: "400", A_START: f"{up.start_s:.6f}",
                  A_FIRST_TOKEN_US: "-", A_USAGE: up.usage_text() or "-", A_RESPONSE_ID: "-", "flags": "-"}
        record = LogRecord(attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in values.items()])
        return ExportLogsServiceRequest(resource_logs=[ResourceLogs(scope_logs=[ScopeLogs(log_records=[record])])])

    async def facts(self, answer: Answer, body: bytes, headers: dict[str, str], tracer: ModuleTracer | None,
                    walk: Walk | None) -> Upstream:
        """The upstream request of a request routed on the facts path, with its early first token report (at the
        first chunk) and its facts record (after the end); each call traced into `walk` when given."""
        assert answer.traceparent is not None, "the router gave no traceparent: the facts path is off"
        early = answer.traceparent.encode()

        async def first_token() -> None:
            with _traced(tracer, walk):
                await self.first_token(early, timeout=5)

        up = await self.upstream(answer, body, headers, on_first_chunk=first_token)
        record = self.facts_record(answer.traceparent, answer.endpoint, up)
        with _traced(tracer, walk):
            await self.export(record, timeout=5)
        return up

    # -- the transports' requests: each returns the router's answer; `walk` given: traced into it

    async def ext_proc(self, body: bytes, tracer: ModuleTracer | None, walk: Walk | None,
                       facts_walk: Walk | None = None) -> Answer:
        """Our ext_proc routing filter on the facts path (module docstring), traced from the stream's first message
        to its end; Envoy's early first token report (while the stream waits) and the facts record (after it)
        are not the stream's walk: traced into `facts_walk` when given."""
        headers = request_headers(body)
        first = wire.ProcessingRequest(request_headers=wire.HttpHeaders(headers=_header_map(headers)))
        first.protocol_config.CopyFrom(wire.ProtocolConfiguration(request_body_mode=_body_mode("BUFFERED"),
                                                                  response_body_mode=_body_mode("NONE")))
        whole = wire.ProcessingRequest(request_body=wire.HttpBody(body=body, end_of_stream=True))
        with _traced(tracer, walk, one_task=True):
            call = self.process(metadata=((OBSERVED_METADATA, OBSERVED_FACTS),))
            await call.write(first)
            at_headers = await call.read()
            assert at_headers.WhichOneof("response") == "request_headers", at_headers
            await call.write(whole)
            at_body = await call.read()
            assert at_body.WhichOneof("response") == "request_body", at_body
            set_headers = _set_headers(at_body.request_body.response.header_mutation)
            answer = Answer(set_headers[DESTINATION_HEADER], set_headers.get(TRACEPARENT_HEADER))
            assert answer.traceparent is not None, "the router gave no traceparent: the facts path is off"
            early = answer.traceparent.encode()
            # Envoy's upstream request, and its Lua filter's early report at the first chunk.
            async def first_token() -> None:
                with _traced(tracer, facts_walk):
                    await self.first_token(early, timeout=5)

            up = await self.upstream(answer, body, headers, on_first_chunk=first_token)
            # The HTTP stream ended: Envoy closes the routing stream (the pick's release).
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        with _traced(tracer, facts_walk):
            await self.export(self.facts_record(answer.traceparent, answer.endpoint, up), timeout=5)
        return answer

    async def authz_http(self, body: bytes, tracer: ModuleTracer | None, walk: Walk | None,
                         facts_walk: Walk | None = None) -> Answer:
        """One check over HTTP/1.1 on a kept-alive connection, then the facts (traced into `facts_walk`)."""
        if self._conn is None:
            self._conn = await asyncio.open_connection("127.0.0.1", self.authz_http_port)
        reader, writer = self._conn
        headers = request_headers(body)
        sent = {k: v for k, v in headers.items() if not k.startswith(":")}
        sent.update({"host": headers[":authority"], OBSERVED_METADATA: OBSERVED_FACTS, HANDOFF_HEADER: HANDOFF_VALUE,
                     AUTHZ_BODY_BYTES_HEADER: str(self.body_cap)})
        raw = (f"POST {CHECK_PATH_PREFIX}{headers[':path']} HTTP/1.1\r\n"
               + "".join(f"{k}: {v}\r\n" for k, v in sent.items()) + "\r\n").encode() + body
        with _traced(tracer, walk):
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        answered = dict(line.split(": ", 1) for line in lines if line)
        extra = int(answered.get("content-length", "0"))
        if extra:
            await reader.readexactly(extra)
        assert status_line.split()[1] == "200", head
        answer = Answer(answered[DESTINATION_HEADER], answered.get(TRACEPARENT_HEADER))
        await self.facts(answer, body, headers, tracer if facts_walk is not None else None, facts_walk)
        return answer

    async def gie(self, body: bytes, tracer: ModuleTracer | None, walk: Walk | None) -> Answer:
        """One GIE stream (FULL_DUPLEX_STREAMED both ways), traced from its first message to its end: the request,
        then the response through it. Each answer is read before the next message is sent (Envoy need not wait,
        but the walk is the same and the window then holds all of it)."""
        headers = request_headers(body)
        first = wire.ProcessingRequest(request_headers=wire.HttpHeaders(headers=_header_map(headers)))
        duplex = _body_mode("FULL_DUPLEX_STREAMED")
        first.protocol_config.CopyFrom(wire.ProtocolConfiguration(request_body_mode=duplex, response_body_mode=duplex))
        whole = wire.ProcessingRequest(request_body=wire.HttpBody(body=body, end_of_stream=True))
        status = {":status": "200", "content-type": "text/event-stream", "server": "envoy"}
        response_headers = wire.ProcessingRequest(response_headers=wire.HttpHeaders(headers=_header_map(status)))
        buffered = bytearray()
        held: list[bytes] = []
        answers: list[Any] = []
        call = self.process()

        async def send(msg: Any) -> None:
            await call.write(msg)
            answers.append(await call.read())

        async def chunk_message(chunk: bytes, end: bool) -> None:
            await send(wire.ProcessingRequest(response_body=wire.HttpBody(body=chunk, end_of_stream=end)))

        async def on_chunk(chunk: bytes) -> None:
            # One response body message per SSE event, as Envoy forwards a server that writes each event when it
            # is made (at real token rates one read each; the fast simulated server's may coalesce, so they are
            # split here: the walk's figures then do not depend on socket timing). An event goes on when the next
            # one is complete, so the last carries the end of stream.
            buffered.extend(chunk)
            while (end := buffered.find(b"\n\n")) >= 0:
                event = bytes(buffered[:end + 2])
                del buffered[:end + 2]
                if held:
                    await chunk_message(held.pop(), False)
                held.append(event)

        with _traced(tracer, walk, one_task=True):
            await call.write(first)
            await call.write(whole)
            answers.append(await call.read())  # the request headers' answer: the destination
            answers.append(await call.read())  # the body, echoed (one chunk)
            routed = answers[0]
            assert routed.WhichOneof("response") == "request_headers", routed
            set_headers = _set_headers(routed.request_headers.response.header_mutation)
            answer = Answer(set_headers[DESTINATION_HEADER], set_headers.get(TRACEPARENT_HEADER))
            # Envoy's upstream request: the response headers precede the first chunk.
            await self.upstream(answer, body, headers, on_first_chunk=lambda: send(response_headers),
                                on_chunk=on_chunk)
            await chunk_message((held.pop() if held else b"") + bytes(buffered), True)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        if walk is not None:
            walk.num_response_chunks = sum(1 for a in answers if a.WhichOneof("response") == "response_body")
        return answer


def _traced(tracer: ModuleTracer | None, walk: Walk | None, *, one_task: bool = False
            ) -> contextlib.AbstractContextManager[None]:
    return (tracer.window(walk, one_task=one_task) if tracer is not None and walk is not None
            else contextlib.nullcontext())


# ---- the router and the server ----------------------------------------------------------------------------------

def extproc_argv(port: int, authz_http_port: int, endpoint: str) -> list[str]:
    """The ``prefixroute extproc`` arguments the gateway launcher gives one replica (extproc/gateway.py) on
    loopback ports of its own; everything else at its default. `authz_http_port` -1: no HTTP check (the gateway's
    default, Envoy's ext_proc filter), as the launcher runs it unless the HTTP check is chosen."""
    return ["--port", str(port), "--listen-address", "127.0.0.1", "--metrics-port", "-1",
            "--authz-http-port", str(authz_http_port), "--endpoints", endpoint]


def parse_extproc(argv: list[str]) -> tuple[Any, ...]:
    """The settings `prefixroute extproc ARGV` runs with, parsed by its own parser (extproc/cli.py)."""
    parser = argparse.ArgumentParser(prog="prefixroute extproc")
    extproc_cli.configure_parser(parser)
    args = parser.parse_args(argv)
    ext = settings.from_namespace(ExtprocSettings, args)
    routing = settings.from_namespace(RoutingSettings, args)
    flow = settings.from_namespace(FlowSettings, args)
    return (ext, routing, settings.from_namespace(PoolSettings, args),
            settings.from_namespace(RouterTelemetrySettings, args), settings.from_namespace(PeerSettings, args), flow,
            extproc_cli.tenants_from_settings(settings.from_namespace(TenantSettings, args), routing, flow))


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not come within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def walk(transports: tuple[str, ...] = TRANSPORTS, *, endpoint: str | None = None) -> dict[str, Any]:
    """Run the router in this process in front of the model server at `endpoint` (``host:port``; None: start a
    simulated one for the run) and trace one streamed chat per transport in `transports` (after one untraced
    request of the same transport). Must run on the event loop the router should use. Returns
    ``{"walks": {transport: Walk}, "ready_line": str, "endpoint": str}``, with ``"default path"`` among the walks
    when both of `DEFAULT_PATH` ran."""
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transport(s) {', '.join(sorted(unknown))}; choose from {', '.join(TRANSPORTS)}")
    server = None
    if endpoint is not None and not http_ok(f"http://{endpoint}/health", timeout_s=2.0):
        raise OSError(f"no model server answers at http://{endpoint}/health")
    logs = tempfile.TemporaryDirectory(prefix="walk-modules-")
    if endpoint is None:
        port = free_port()
        endpoint = f"127.0.0.1:{port}"
        server = ManagedProcess("model-server", prefixroute_argv(
            "model-server", "--port", str(port), "--id", "walk", "--time-scale", "0.05", "--log-level", "WARNING"),
            log_path=Path(logs.name) / "model-server.log",
            ready=lambda: http_ok(f"http://{endpoint}/health", timeout_s=1.0), ports=(port,))
        server.spawn()
    # The HTTP check's port only when it is walked: without it the router runs as the default gateway runs it.
    grpc_port, http_port = free_port(), (free_port() if "authz_http" in transports else -1)
    ext, routing, pool, tele, peers, flow, tenants = parse_extproc(extproc_argv(grpc_port, http_port, endpoint))
    stop = asyncio.Event()
    printed = io.StringIO()
    walks: dict[str, Walk] = {}
    gc_threshold = gc.get_threshold()  # `serve` tunes the collector for the process: undone after
    router: asyncio.Task[None] | None = None
    try:
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.wait_ready, 60.0)
        with contextlib.redirect_stdout(printed):  # the ready line, kept for the report
            router = asyncio.create_task(extproc_cli.serve(ext, routing, pool, stop, tele, peers, flow, tenants))
            await _until(lambda: router.done() or extproc_cli.READY_PREFIX in printed.getvalue(), 60.0,
                         "the router's ready line")
            if router.done():
                router.result()  # its error
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{endpoint}/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
                async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    gateway = Gateway(channel, http_port, http)
                    tracer = ModuleTracer()
                    question = 0
                    try:
                        for transport in [t for t in TRANSPORTS if t in transports]:
                            drive = gateway.ext_proc if transport == "facts" else getattr(gateway, transport)
                            for traced in (False, True):
                                question += 1
                                body = chat_body(model, question)
                                tracer.reset()
                                if transport == "facts":
                                    walks["facts"] = Walk("facts")
                                    await drive(body, tracer, None, walks["facts"] if traced else None)
                                else:
                                    walks[transport] = Walk(transport)
                                    await drive(body, tracer, walks[transport] if traced else None)
                            await asyncio.sleep(0.1)  # the pool's and the tracker's own work settles between
                    finally:
                        await gateway.close()
                        tracer.reset()
            stop.set()
            await router
    finally:
        stop.set()
        if router is not None and not router.done():  # stopped by an error above: let it close its ports
            with contextlib.suppress(Exception):
                await asyncio.wait_for(router, 10.0)
        if server is not None:
            server.stop(grace_s=2.0)
        logs.cleanup()
        gc.unfreeze()
        gc.set_threshold(*gc_threshold)
    if all(t in walks for t in DEFAULT_PATH):
        walks["default path"] = walks["ext_proc"].joined(walks["facts"], "default path")
    ready = next((line for line in printed.getvalue().splitlines() if line.startswith(extproc_cli.READY_PREFIX)), "")
    return {"walks": walks, "ready_line": ready, "endpoint": endpoint}


# ---- output -----------------------------------------------------------------------------------------------------

WHAT_RUNS = ("No Envoy: a client on loopback sends the router's ports the messages Envoy sends, and sends the "
             "chat to the picked endpoint itself (one simulated model server). Traced: calls into prefixroute.* "
             "modules on the event loop's thread, from the first message sent until the answer (a stream: its "
             "end) came back.")
COLUMNS = (("transport", None), ("modules", "num_modules"), ("entries", "num_entries"),
           ("re-entries", "num_reentries"), ("from below", "num_from_below"), ("resumptions", "num_resumptions"))
WHAT_WALKS = {
    "ext_proc": "routing stream: request headers, whole body, stream end",
    "authz_http": "one ext_authz check over HTTP/1.1",
    "gie": "one stream: request, response headers, every response chunk",
    "facts": "early first token report + facts record (closing the ext_proc request)",
    "default path": "ext_proc + facts: one request's whole walk",
}


def table(walks: dict[str, Walk]) -> str:
    """The figures as a Markdown table, one row per walk."""
    head = [name for name, _ in COLUMNS] + ["what was traced"]
    rows = [head, ["---"] * len(head)]
    for name, w in walks.items():
        figures = w.figures()
        what = WHAT_WALKS.get(name, "")
        if w.num_response_chunks:
            what += f" ({w.num_response_chunks} response chunks)"
        rows.append([name, *(str(figures[key]) for _, key in COLUMNS[1:]), what])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def sequence(w: Walk) -> str:
    """The walk's module entries in order: ``module.function`` per entry, ``*`` a re-entry, ``!`` from below."""
    return " -> ".join(f"{short(e.module)}.{e.function}{'!' if e.from_below else ''}{'*' if e.reentry else ''}"
                       for e in w.entries)


def report(result: dict[str, Any]) -> str:
    walks: dict[str, Walk] = result["walks"]
    out = [WHAT_RUNS, f"Router: {result['ready_line']}", "", table(walks), ""]
    for name, w in walks.items():
        if name == "default path":
            continue
        out.append(f"{name} (traced windows: {w.num_windows})")
        out.append(f"  entries ({w.num_entries}): {sequence(w)}")
        out.append(f"  modules ({w.num_modules}): {', '.join(short(m) for m in w.modules)}")
        if w.resumptions:
            out.append("  resumptions (not entries): " + ", ".join(
                f"{short(m)} x{n}" for m, n in Counter(r.module for r in w.resumptions).most_common()))
        if w.background:
            out.append("  background in the windows (not counted): "
                       f"{', '.join(f'{short(m)} x{n}' for m, n in w.background.most_common())}")
        out.append("")
    out.append("Marks: * re-entry (module entered before in this walk), ! a transport entered from below.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", action="append", choices=TRANSPORTS,
                        help="trace only this transport (repeatable; default: all of them)")
    parser.add_argument("--endpoint", default=None,
                        help="a running model server's host:port (default: start a simulated one for the run)")
    parser.add_argument("--json", action="store_true", help="print the walks as JSON")
    args = parser.parse_args(argv)
    ext = parse_extproc(extproc_argv(0, 0, "127.0.0.1:1"))[0]
    loop = new_event_loop(ext.uvloop)  # the router's own loop (uvloop by default)
    asyncio.set_event_loop(loop)
    try:
        result = loop.run_until_complete(walk(tuple(args.transport or TRANSPORTS), endpoint=args.endpoint))
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        print(f"walk_modules: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    if args.json:
        print(json.dumps({"what_runs": WHAT_RUNS, "ready_line": result["ready_line"],
                          "walks": {k: w.to_dict() for k, w in result["walks"].items()}}, indent=1))
    else:
        print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

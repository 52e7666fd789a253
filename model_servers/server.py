"""OpenAI-compatible HTTP server around one real-time engine (raw asyncio Protocol + httptools).

Why not a framework: the per-request overhead budget is 0.5 ms of CPU for a 4k-token streamed request
with 64 tokens, so the request path is a hand-written HTTP/1.1 keep-alive protocol: httptools parses,
orjson decodes, each streamed token is one pre-encoded SSE chunk (`protocol.StreamEncoder`) written in
one `transport.write` (chunked transfer encoding).

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream and not), the Responses API (POST
/v1/responses, stream and not; GET /v1/responses/{id}; POST /v1/responses/{id}/cancel: vLLM's answers, the
bounded in-process store of response_store.py), GET /v1/models, GET /health,
POST /tokenize, GET /metrics, GET /version, POST /reset_prefix_cache (vLLM's: 200 when the prefix cache was
emptied, 409 while requests hold blocks unless ``?reset_running_requests=true`` preempts them first; its
`AllBlocksCleared` event goes out with the next engine step, as vLLM's; the gateway's path allowlist keeps it off
the public API), SGLang-style probes (GET /server_info, /get_server_info,
/model_info, /get_model_info, /readiness). GET|POST /admin/faults (runtime fault injection) is served only on
the separate admin listener (`admin_port`, off by default, loopback): the serving port answers every
/admin/* path with a 404, so nothing a gateway forwards can change the server's faults.
With ``--kv-events-config`` the engine publishes vLLM's KV events over ZMQ (kv_events_publisher.py); the bound addresses
are printed as ``KV_EVENTS <addr>`` (and ``KV_EVENTS_REPLAY <addr>``) before ``READY``.
Every response carries ``x-prefixroute-server-id``; no request header is echoed (a request's W3C ``traceparent``
is the router's, and its span id keys the gateway's facts records): the latest 256 received are listed by
GET /admin/traceparents on the admin listener.

Failure behaviours (chosen, tested):
- malformed HTTP: 400 and close; body over `max_body_bytes`: 413 and close; unknown path 404; wrong
  method 405 (OpenAI error bodies);
- a body with a Content-Encoding other than identity: 415;
- bad JSON / fields: 400 (see protocol.py); unknown model: 404; prompt + max_tokens over max_model_len: 400;
- any other exception in a handler: a 500 in OpenAI format (logged), never a parser error or a dropped
  connection;
- `fail_ratio`: that fraction of generation requests gets a 500 ``InternalServerError`` before the engine;
- `extra_latency_ms`: added before the request enters the engine (shows in TTFT);
- refusing connections (flag, SIGUSR1 toggle, or POST /admin/faults on the admin listener): the serving
  socket is closed (connects get ECONNREFUSED) and idle keep-alive connections are closed; in-flight
  requests finish; the admin listener stays up (so `{"refuse_connections": false}` reopens it);
- client disconnect: the request is aborted in the engine (KV blocks released);
- a client that does not read (backpressure): the transport's write buffer pauses the connection at
  `WRITE_HIGH_WATER_BYTES`; while paused its response keeps at most `max_stream_buffer_bytes` in this
  process; past that, or paused for `stall_timeout_s`, the request is aborted in the engine (KV blocks
  released, like a disconnect), the connection is reset, and
  ``prefixroute:slow_client_aborts_total{reason="buffer_full"|"stalled"}`` counts it. A paused connection
  also stops reading, so pipelined requests cannot pile up responses behind it;
- SIGTERM: stop listening, let in-flight requests finish for up to `shutdown_grace_s`, then close the rest
  and exit 0.

Modules: server_settings.py (`ServerSettings`), http_connection.py (HTTP parsing, responses, flow control),
sinks.py (how tokens reach the client); this one the server (`ModelServer`: lifecycle, routes, handlers) and
`serve`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import random
import signal
import socket
import time
from urllib.parse import unquote

import orjson

from prefixroute import identity, responses_prompt
from prefixroute.model_servers import kv_events_publisher, metrics, protocol, response_store, tokenizer
from prefixroute.model_servers.engine import EngineRequest
from prefixroute.model_servers.http_connection import SLOW_CLIENT_REASONS, HttpConnection
from prefixroute.model_servers.kv_cache import root_hash
from prefixroute.model_servers.profiles import EngineSpec
from prefixroute.model_servers.runtime import AsyncEngine
from prefixroute.model_servers.server_settings import ServerSettings
from prefixroute.model_servers.sinks import FullSink, ResponsesFullSink, ResponsesStreamSink, StreamSink
from prefixroute.openai_errors import OpenAIError, error_body

__all__ = ["HttpConnection", "ModelServer", "ServerSettings", "serve"]

log = logging.getLogger("prefixroute.model_server")


class ModelServer:
    """One simulated vLLM server: engine + HTTP listener. Lives on one event loop."""

    def __init__(self, s: ServerSettings) -> None:
        self.settings = s
        # One spec builds the engine and validates requests, here and in the virtual fleet.
        self.spec = spec = EngineSpec.from_settings(s)
        self.profile = spec.profile
        ev_cfg = kv_events_publisher.parse_config(s.kv_events_config)
        self.kv_publisher = (kv_events_publisher.ZmqEventPublisher(ev_cfg) if ev_cfg is not None and ev_cfg.enabled
                             else None)
        self.core = spec.new_engine(self.kv_publisher.publish if self.kv_publisher is not None else None)
        self.engine = AsyncEngine(self.core)
        self.served = spec.served_model_name
        self.loras = spec.lora_modules
        self.models = spec.models
        # vLLM numbers --lora-modules adapters from 1 (its lora_int_id, BlockStored.lora_id)
        self.lora_ids = {name: i for i, name in enumerate(self.loras, start=1)}
        self.max_model_len = spec.max_model_len
        self.server_id = s.id or f"{s.host}:{s.port}"
        self.fail_ratio = s.fail_ratio
        self.extra_latency_s = s.extra_latency_ms / 1000.0
        self.refusing = s.refuse_connections
        self.rng = random.Random(s.seed)
        self.num_failed = 0
        self.slow_client_aborts = dict.fromkeys(SLOW_CLIENT_REASONS, 0)
        self.connections: set[HttpConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._admin_server: asyncio.AbstractServer | None = None
        self.admin_port: int | None = None
        self._roots: dict[tuple[str, str | None], int] = {}
        self._ids = itertools.count(1)
        self.responses = (response_store.ResponseStore(s.responses_store_max_entries, s.responses_store_max_bytes)
                          if s.responses_store else None)
        self._created = int(time.time())
        self.port = s.port
        self.closing = False
        sid = self.server_id.encode()
        self.common_headers = b"x-prefixroute-server-id: " + sid + b"\r\n"
        self.received_traceparents: collections.deque[bytes] = collections.deque(maxlen=RECEIVED_TRACEPARENTS)
        # The launcher's per-run identity key (prefixroute.identity), by environment only: "" = no proof given.
        self.identity_key = identity.resolve_key()

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.engine.start()
        if self.settings.admin_port >= 0:
            loop = asyncio.get_running_loop()
            self._admin_server = await loop.create_server(lambda: HttpConnection(self, admin=True),
                                                          self.settings.admin_host, self.settings.admin_port,
                                                          reuse_address=True)
            self.admin_port = self._admin_server.sockets[0].getsockname()[1]
        if not self.refusing:
            await self._listen()

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        if self.settings.listen_fd >= 0:
            # The launcher's listening socket (it holds the port while this process restarts): a duplicate, so
            # closing this server (refusing, shutdown) leaves the launcher's open.
            sock = socket.socket(fileno=os.dup(self.settings.listen_fd))
            sock.setblocking(False)
            self._server = await loop.create_server(lambda: HttpConnection(self), sock=sock)
        else:
            self._server = await loop.create_server(lambda: HttpConnection(self), self.settings.host, self.port,
                                                    reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        if not self.settings.id:
            self.server_id = f"{self.settings.host}:{self.port}"
            self.common_headers = b"x-prefixroute-server-id: " + self.server_id.encode() + b"\r\n"

    async def set_refusing(self, refusing: bool) -> None:
        if refusing == self.refusing:
            return
        self.refusing = refusing
        if refusing:
            if self._server is not None:
                self._server.close()
                self._server = None
            for c in list(self.connections):
                if c.active is None and not c.admin:
                    c.transport.close()
        else:
            await self._listen()

    async def shutdown(self) -> None:
        """Stop listening, let in-flight requests finish within the grace period, close everything."""
        self.closing = True
        for srv in (self._server, self._admin_server):
            if srv is not None:
                srv.close()
        self._server = self._admin_server = None
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while any(c.active is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            c.transport.close()
        await self.engine.stop()
        if self.kv_publisher is not None:
            self.kv_publisher.shutdown()

    def root_for(self, model: str, cache_salt: str | None) -> int:
        key = (model, cache_salt)
        r = self._roots.get(key)
        if r is None:
            r = self._roots[key] = root_hash((model, cache_salt))
        return r

    # -- request handling ---------------------------------------------------------------------------
    def dispatch(self, conn: HttpConnection, method: bytes, path: bytes, body: bytes) -> None:
        """Answer one request. Never raises: an `OpenAIError` becomes its status, anything else a logged 500
        (an exception escaping here would surface as an httptools callback error, i.e. a bogus 400)."""
        path, _, conn.query = path.partition(b"?")
        try:
            if path in _GENERATE and not conn.admin:
                if method != b"POST":
                    raise OpenAIError(405, "Method Not Allowed")
                self.generate(conn, path == b"/v1/chat/completions", body)
                return
            if path.startswith(b"/v1/responses") and not conn.admin:
                self.dispatch_responses(conn, method, path, body)
                return
            route = (_ADMIN_ROUTES if conn.admin else _ROUTES).get(path)
            if route is None:  # named as decoded, like vLLM's HTTP server sees it (%2F is a slash to it)
                raise OpenAIError(404, f"Not Found: {protocol.clip(unquote(path.decode(errors='replace')))}")
            allowed, handler = route
            if method not in allowed:
                raise OpenAIError(405, "Method Not Allowed")
            handler(self, conn, body)
        except OpenAIError as exc:
            self.num_failed += exc.status >= 500
            self._error_reply(conn, exc.status, exc.body())
        except Exception as exc:
            log.exception("request %s %s failed", method.decode(errors="replace"), protocol.clip(path.decode(
                errors="replace")))
            self.num_failed += 1
            self._error_reply(conn, 500, error_body(500, f"Internal server error ({type(exc).__name__})."))

    def _error_reply(self, conn: HttpConnection, status: int, body: bytes) -> None:
        if conn.active is not None:  # failed after the request was built: it must not stay in the engine
            self.engine.abort(conn.active)
        conn.respond(status, body)

    def generate(self, conn: HttpConnection, chat: bool, body: bytes) -> None:
        data = protocol.load_json_object(body)
        g = self.spec.parse_generate(data, chat=chat)
        if self.fail_ratio and self.rng.random() < self.fail_ratio:
            raise OpenAIError(500, "Simulated failure (fault injection: --fail-ratio).")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids):x}"
        lora = g.model if g.model != self.served else None
        req = EngineRequest(rid, g.prompt_ids, g.max_tokens, block_size=self.core.block_size,
                            root=self.root_for(g.model, g.cache_salt), lora_name=lora,
                            lora_id=self.lora_ids.get(lora) if lora is not None else None, cache_salt=g.cache_salt)
        req.sink = (StreamSink if g.stream else FullSink)(conn, g, rid, req)
        conn.active = req
        if self.extra_latency_s > 0:
            asyncio.get_running_loop().call_later(self.extra_latency_s, self._submit_if_open, conn, req)
        else:
            self._submit(req)

    def _submit_if_open(self, conn: HttpConnection, req: EngineRequest) -> None:
        if conn.active is req:
            self._submit(req)

    def _submit(self, req: EngineRequest) -> None:
        sink = req.sink
        if type(sink) is ResponsesStreamSink:
            sink.open()  # response.created + response.in_progress at admission, before any token (as vLLM)
        self.engine.submit(req)

    # -- Responses API ------------------------------------------------------------------------------
    def dispatch_responses(self, conn: HttpConnection, method: bytes, path: bytes, body: bytes) -> None:
        """POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel (else 404 / 405)."""
        if path == b"/v1/responses":
            if method != b"POST":
                raise OpenAIError(405, "Method Not Allowed")
            self.create_response(conn, body)
            return
        text = path.decode(errors="replace")
        rid = responses_prompt.path_response_id(text)
        rest = text[len(responses_prompt.RESPONSES_PREFIX) + len(rid or ""):]
        if rid is None or rest not in ("", "/cancel"):
            raise OpenAIError(404, f"Not Found: {protocol.clip(text)}")
        if method != (b"GET" if rest == "" else b"POST"):
            raise OpenAIError(405, "Method Not Allowed")
        if not rid.startswith(responses_prompt.RESPONSE_ID_PREFIX):
            raise responses_prompt.invalid_id(rid)
        stored = self.responses.peek(rid) if self.responses is not None else None
        if stored is None:
            raise responses_prompt.not_found(rid)
        if rest == "":
            conn.respond(200, stored.body)
            return
        # vLLM cancels only background responses (queued / in progress); a stored one here has finished
        raise OpenAIError(400, "Cannot cancel a synchronous response.", param="response_id",
                          type_="invalid_request_error")

    def create_response(self, conn: HttpConnection, body: bytes) -> None:
        """POST /v1/responses: validate, build the prompt as vLLM does (`responses_api`), run it like chat."""
        data = protocol.load_json_object(body)
        model = protocol.resolve_model(data, self.served, self.models)
        rb = responses_prompt.parse_body(data)
        max_output, cache_salt = protocol.check_responses_fields(data)
        if isinstance(rb.input, list):
            for i, item in enumerate(rb.input):
                itype = item.get("type")
                if itype is not None and itype not in responses_prompt.KNOWN_ITEM_TYPES:
                    raise OpenAIError(400, f"Input item type '{protocol.clip(itype)}' (input[{i}]) is not "
                                           "supported by this server.", param=f"input[{i}].type")
        function = response_store.forced_function(rb.tools, data.get("tool_choice"))
        prev = None
        if rb.previous_response_id is not None:
            prev = self.responses.get(rb.previous_response_id) if self.responses is not None else None
            if prev is None:
                raise responses_prompt.not_found(rb.previous_response_id)
        messages = responses_prompt.input_messages(rb, prev.messages if prev is not None else None,
                                                prev.response["output"] if prev is not None else None)
        try:
            text = tokenizer.render_chat(messages, tools=responses_prompt.chat_tools(rb.tools))
        except tokenizer.ChatTemplateError as exc:
            raise OpenAIError(400, f"{exc} (in the messages built from 'input')", param="input") from None
        ids = tokenizer.encode(text)
        num_prompt = len(ids)
        if max_output is None:
            max_output = max(1, min(self.spec.default_max_tokens, self.max_model_len - num_prompt))
        if num_prompt + max_output > self.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                   f"you requested {num_prompt + max_output} tokens ({num_prompt} in the input, "
                                   f"{max_output} in max_output_tokens). Please reduce the length of the input "
                                   "or max_output_tokens.", param="input")
        if self.fail_ratio and self.rng.random() < self.fail_ratio:
            raise OpenAIError(500, "Simulated failure (fault injection: --fail-ratio).")
        rid = response_store.new_id("resp")
        meta = response_store.ResponseMeta(
            response_id=rid, created_at=int(time.time()), model=model, max_output_tokens=max_output,
            store=rb.store and self.responses is not None, data=data, tools=list(rb.tools),
            instructions=rb.instructions, previous_response_id=rb.previous_response_id, function=function,
            item_id=response_store.new_id("fc" if function is not None else "msg"),
            call_id=response_store.new_id("call", 24))
        lora = model if model != self.served else None
        req = EngineRequest(rid, ids, max_output, block_size=self.core.block_size,
                            root=self.root_for(model, cache_salt), lora_name=lora,
                            lora_id=self.lora_ids.get(lora) if lora is not None else None, cache_salt=cache_salt)
        sink = ResponsesStreamSink if rb.stream else ResponsesFullSink
        req.sink = sink(self.finish_response, conn, meta, messages, req)
        conn.active = req
        if self.extra_latency_s > 0:
            asyncio.get_running_loop().call_later(self.extra_latency_s, self._submit_if_open, conn, req)
        else:
            self._submit(req)

    def finish_response(self, meta: response_store.ResponseMeta, messages: list, req: EngineRequest,
                        text: str) -> tuple[dict, bytes]:
        """The completed response object of `req` and its JSON, stored when the request asked to be."""
        obj = response_store.response_object(meta, status="completed", output=response_store.output_items(meta, text),
                                        usage_=response_store.usage(req.num_prompt_tokens, req.num_output,
                                                               req.num_cached_tokens, self.core.block_size))
        body = orjson.dumps(obj)
        if meta.store and self.responses is not None:
            self.responses.put(meta.response_id, messages, obj, body)
        return obj, body

    # simple endpoints
    def h_health(self, conn: HttpConnection, body: bytes) -> None:
        # Identity (prefixroute.identity): the router's challenge answered with the per-run key, so a process
        # that took this port after a crash cannot pass for this server.
        challenge = conn.cur_challenge
        if challenge is not None and self.identity_key:
            answer = identity.proof(self.identity_key, challenge.decode("latin-1")).encode()
            conn.respond(200, b"", extra_headers=b"x-prefixroute-proof: " + answer + b"\r\n")
            return
        conn.respond(200, b"")

    def h_models(self, conn: HttpConnection, body: bytes) -> None:
        data = [{"id": self.served, "object": "model", "created": self._created, "owned_by": "vllm",
                 "root": self.served, "parent": None, "max_model_len": self.max_model_len, "permission": []}]
        data += [{"id": name, "object": "model", "created": self._created, "owned_by": "vllm", "root": name,
                  "parent": self.served, "max_model_len": self.max_model_len, "permission": []}
                 for name in self.loras]
        conn.respond(200, orjson.dumps({"object": "list", "data": data}))

    def h_metrics(self, conn: HttpConnection, body: bytes) -> None:
        text = metrics.render(self.core, model_name=self.served, server_id=self.server_id,
                              num_http_requests_failed=self.num_failed, runner=self.engine,
                              slow_client_aborts=self.slow_client_aborts, kv_publisher=self.kv_publisher,
                              responses_store=self.responses, max_model_len=self.max_model_len,
                              tp_degree=self.profile.tp_degree)
        conn.respond(200, text.encode(), content_type=b"text/plain; version=0.0.4; charset=utf-8")

    def h_tokenize(self, conn: HttpConnection, body: bytes) -> None:
        data = protocol.load_json_object(body)
        protocol.resolve_model(data, self.served, self.models)
        ids = protocol.prompt_ids_of(data, "messages" in data)
        conn.respond(200, orjson.dumps({"count": len(ids), "max_model_len": self.max_model_len,
                                        "tokens": ids.tolist(), "token_strs": None}))

    def h_reset_prefix_cache(self, conn: HttpConnection, body: bytes) -> None:
        """vLLM's POST /reset_prefix_cache[?reset_running_requests=true] (see the module docstring)."""
        reset_running = False
        for part in conn.query.split(b"&"):
            key, _, value = part.partition(b"=")
            if key == b"reset_running_requests":
                if value.lower() not in (b"true", b"false", b"1", b"0"):
                    raise OpenAIError(400, "'reset_running_requests' must be true or false",
                                      param="reset_running_requests")
                reset_running = value.lower() in (b"true", b"1")
        if not self.core.reset_prefix_cache(reset_running_requests=reset_running):
            raise OpenAIError(409, f"Prefix cache reset failed: {self.core.cache.num_held} KV blocks are held by "
                                   "running requests (retry when idle, or pass reset_running_requests=true).",
                              type_="ConflictError")
        log.info("prefix cache reset")
        conn.respond(200, b"")

    def h_version(self, conn: HttpConnection, body: bytes) -> None:
        conn.respond(200, b'{"version":"0.0.0+prefixroute.sim"}')

    def h_server_info(self, conn: HttpConnection, body: bytes) -> None:
        c = self.core.config
        conn.respond(200, orjson.dumps({
            "model_path": self.served, "served_model_name": self.served, "server_id": self.server_id,
            "profile": self.profile.name, "tp_size": self.profile.tp_degree, "page_size": c.block_size,
            "max_total_num_tokens": c.num_gpu_blocks * c.block_size, "max_running_requests": c.max_num_seqs,
            "chunked_prefill_size": c.max_num_batched_tokens, "context_length": self.max_model_len}))

    def h_model_info(self, conn: HttpConnection, body: bytes) -> None:
        conn.respond(200, orjson.dumps({"model_path": self.served, "tokenizer_path": self.served,
                                        "is_generation": True, "max_model_len": self.max_model_len}))

    def h_faults(self, conn: HttpConnection, body: bytes) -> None:
        if body:
            data = protocol.load_json_object(body)
            fr = data.get("fail_ratio")
            if fr is not None:
                if isinstance(fr, bool) or not isinstance(fr, (int, float)) or not 0 <= fr <= 1:
                    raise OpenAIError(400, "'fail_ratio' must be a number in [0, 1]", param="fail_ratio")
                self.fail_ratio = float(fr)
            lat = data.get("extra_latency_ms")
            if lat is not None:
                if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
                    raise OpenAIError(400, "'extra_latency_ms' must be a number >= 0", param="extra_latency_ms")
                self.extra_latency_s = lat / 1000.0
            refuse = data.get("refuse_connections")
            if refuse is not None and not isinstance(refuse, bool):
                raise OpenAIError(400, "'refuse_connections' must be a boolean", param="refuse_connections")
            if refuse is not None and refuse != self.refusing:
                # answer first, then stop/start the serving listener (the admin listener stays up)
                conn.respond(200, self._faults_json(refusing=refuse))
                asyncio.get_running_loop().create_task(self.set_refusing(refuse))
                return
        conn.respond(200, self._faults_json(refusing=self.refusing))

    def h_traceparents(self, conn: HttpConnection, body: bytes) -> None:
        conn.respond(200, orjson.dumps([tp.decode("latin-1") for tp in self.received_traceparents]))

    def _faults_json(self, *, refusing: bool) -> bytes:
        return orjson.dumps({"fail_ratio": self.fail_ratio, "extra_latency_ms": self.extra_latency_s * 1000,
                             "refuse_connections": refusing})


_GENERATE = {b"/v1/chat/completions", b"/v1/completions"}
RECEIVED_TRACEPARENTS = 256
"""How many received traceparents the admin listener lists (the latest)."""
_GET, _POST, _BOTH = (b"GET",), (b"POST",), (b"GET", b"POST")
_ROUTES = {
    b"/health": (_GET, ModelServer.h_health),
    b"/ping": (_BOTH, ModelServer.h_health),
    b"/readiness": (_GET, ModelServer.h_health),
    b"/v1/models": (_GET, ModelServer.h_models),
    b"/metrics": (_GET, ModelServer.h_metrics),
    b"/tokenize": (_POST, ModelServer.h_tokenize),
    b"/version": (_GET, ModelServer.h_version),
    b"/reset_prefix_cache": (_POST, ModelServer.h_reset_prefix_cache),
    b"/server_info": (_GET, ModelServer.h_server_info),
    b"/get_server_info": (_GET, ModelServer.h_server_info),
    b"/model_info": (_GET, ModelServer.h_model_info),
    b"/get_model_info": (_GET, ModelServer.h_model_info),
}
_ADMIN_ROUTES = {
    b"/admin/faults": (_BOTH, ModelServer.h_faults),
    b"/admin/traceparents": (_GET, ModelServer.h_traceparents),
    b"/health": (_GET, ModelServer.h_health),
}


async def serve(s: ServerSettings, ready: asyncio.Future | None = None) -> int:
    """Run a server until SIGTERM/SIGINT; returns the exit code (0 on a clean shutdown)."""
    app = ModelServer(s)
    await app.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(app.set_refusing(not app.refusing)))
    # Start-up lines are INFO: they report a normal event (WARNING is for what needs attention).
    log.info("model server %s listening on %s:%d profile=%s blocks=%d", app.server_id, s.host, app.port,
             app.profile.name, app.core.config.num_gpu_blocks)
    if app.admin_port is not None:
        log.info("admin listener (POST /admin/faults) on %s:%d", s.admin_host, app.admin_port)
        print(f"ADMIN {s.admin_host}:{app.admin_port}", flush=True)
    if app.kv_publisher is not None:
        pub = app.kv_publisher
        log.info("KV events: PUB %s%s topic %r", pub.endpoint,
                 f", replay {pub.replay_endpoint}" if pub.replay_endpoint else "", pub.config.topic)
        print(f"KV_EVENTS {pub.endpoint}", flush=True)
        if pub.replay_endpoint:
            print(f"KV_EVENTS_REPLAY {pub.replay_endpoint}", flush=True)
    print(f"READY {s.host}:{app.port}", flush=True)
    if ready is not None:
        ready.set_result(app)
    await stop.wait()
    await app.shutdown()
    return 0

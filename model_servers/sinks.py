"""Response sinks: how one request's tokens reach its client, called by the engine runner per sampled token
(``sink.on_token(req)``). Streamed chat/completions write one pre-encoded SSE chunk per token (`StreamSink`),
non-streamed ones one body at the end (`FullSink`); the Responses API has its named events (`ResponsesStreamSink`)
and its stored response object (`ResponsesFullSink`). The generated text is deterministic (tokenizer.py
`OUTPUT_WORDS`, seeded by the prompt's length). A streamed write checks the client first (`_writable`): gone,
the request is aborted; paused with a full buffer, it is given up (http_connection.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from prefixroute.model_servers import protocol, response_store, tokenizer
from prefixroute.model_servers.engine import EngineRequest
from prefixroute.model_servers.http_connection import HttpConnection

FinishResponse = Callable[[response_store.ResponseMeta, list, EngineRequest, str], tuple[dict, bytes]]
"""Completes a Responses API response: (meta, messages, request, output text) -> (object, its JSON), stored when
the request asked to be (server.py `ModelServer.finish_response`)."""

_WORDS = tuple(w.encode() for w in tokenizer.OUTPUT_WORDS)
_NUM_WORDS = len(_WORDS)


def _writable(conn: HttpConnection) -> bool:
    """Whether a streamed response may write its next token to `conn`: raises ConnectionError when the client
    is gone (the engine aborts the request); False when a paused client's buffer is full (the request is given
    up: aborted in the engine, so no more tokens come for it)."""
    if conn.closed:
        raise ConnectionError("client gone")
    if conn.paused and conn.transport.get_write_buffer_size() > conn.app.settings.max_stream_buffer_bytes:
        conn.give_up("buffer_full")
        return False
    return True


def _word(seed: int, index: int) -> bytes:
    return _WORDS[(seed * 31 + index * 7) % _NUM_WORDS]


class StreamSink:
    """Writes one streamed response: SSE chunks as the engine samples tokens."""

    __slots__ = ("conn", "enc", "include_usage", "started", "seed")

    def __init__(self, conn: HttpConnection, g: protocol.GenerateRequest, rid: str, req: EngineRequest) -> None:
        self.conn = conn
        self.enc = protocol.StreamEncoder(chat=g.chat, request_id=rid, created=int(time.time()), model=g.model)
        self.include_usage = g.include_usage
        self.started = False
        self.seed = req.num_prompt_tokens * 31

    def on_token(self, req: EngineRequest) -> None:
        conn = self.conn
        if not _writable(conn):
            return
        enc = self.enc
        finished = req.status == 2  # FINISHED; attribute compare is cheaper than the property
        chunk = enc.head + _WORDS[(self.seed + (req.num_output - 1) * 7) % _NUM_WORDS] + (
            enc.last if finished else enc.mid)
        if not self.started:
            self.started = True
            conn.start_stream()
            if enc.first:
                chunk = enc.first + chunk
        if finished:
            if self.include_usage:
                chunk += enc.usage_chunk(req.num_prompt_tokens, req.num_output, req.num_cached_tokens)
            chunk += protocol.DONE
            conn.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk))
            conn.finish_response()
        else:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))


class FullSink:
    """Collects a non-streamed response and writes it when the request finishes."""

    __slots__ = ("conn", "g", "rid")

    def __init__(self, conn: HttpConnection, g: protocol.GenerateRequest, rid: str, req: EngineRequest) -> None:
        self.conn, self.g, self.rid = conn, g, rid

    def on_token(self, req: EngineRequest) -> None:
        if not req.finished:
            return
        text = b"".join(_word(req.num_prompt_tokens, i) for i in range(req.num_output)).decode()
        self.conn.respond(200, protocol.full_response(
            chat=self.g.chat, request_id=self.rid, created=int(time.time()), model=self.g.model, text=text,
            prompt_tokens=req.num_prompt_tokens, completion_tokens=req.num_output,
            cached_tokens=req.num_cached_tokens))


def _output_text(req: EngineRequest) -> str:
    return b"".join(_word(req.num_prompt_tokens, i) for i in range(req.num_output)).decode()


class ResponsesStreamSink:
    """Writes one streamed Responses API response: named SSE events (`response_store.StreamEncoder`), one write per
    token; the opening events at admission (`open`). Backpressure and disconnects as `StreamSink`."""

    __slots__ = ("conn", "finish", "enc", "meta", "messages", "seed", "opened")

    def __init__(self, finish: FinishResponse, conn: HttpConnection, meta: response_store.ResponseMeta,
                 messages: list, req: EngineRequest) -> None:
        self.finish, self.conn, self.meta, self.messages = finish, conn, meta, messages
        self.enc = response_store.StreamEncoder(meta)
        self.seed = req.num_prompt_tokens * 31
        self.opened = False

    def open(self) -> None:
        if not self.opened and not self.conn.closed:
            self.opened = True
            self.conn.start_stream()
            opening = self.enc.opening()
            self.conn.transport.write(b"%x\r\n%b\r\n" % (len(opening), opening))

    def on_token(self, req: EngineRequest) -> None:
        conn = self.conn
        if not _writable(conn):
            return
        if not self.opened:
            self.open()
        index = req.num_output - 1
        finished = req.status == 2  # FINISHED
        enc = self.enc
        chunk = enc.token(_WORDS[(self.seed + index * 7) % _NUM_WORDS], index, finished)
        if index == 0:
            chunk = enc.first() + chunk
        if finished:
            text = _output_text(req)
            final, _ = self.finish(self.meta, self.messages, req, text)
            chunk += enc.closing(text, req.num_output, final)
            conn.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(chunk), chunk))
            conn.finish_response()
        else:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))


class ResponsesFullSink:
    """Collects a non-streamed Responses API response; writes (and stores) it when the request finishes."""

    __slots__ = ("finish", "conn", "meta", "messages")

    def __init__(self, finish: FinishResponse, conn: HttpConnection, meta: response_store.ResponseMeta,
                 messages: list, req: EngineRequest) -> None:
        self.finish, self.conn, self.meta, self.messages = finish, conn, meta, messages

    def on_token(self, req: EngineRequest) -> None:
        if not req.finished:
            return
        _, body = self.finish(self.meta, self.messages, req, _output_text(req))
        self.conn.respond(200, body)

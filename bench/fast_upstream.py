"""A minimal, fast HTTP/1.1 upstream for the overhead benchmark (`python -m prefixroute.bench.fast_upstream PORT`).

It answers every request with a small fixed JSON body at once (no model simulation), so that what the
benchmark measures is Envoy and the ext_proc service, not the upstream. It also answers ``/health``,
``/v1/models`` and ``/metrics`` (empty exposition) so the endpoint pool accepts it as a healthy endpoint.
Keep-alive; Content-Length request bodies only (Envoy sends those for buffered requests).

Streamed mode (a request body containing ``"stream": true``, for the inter-token-latency benchmark): an
SSE response, chunked, of ``max_tokens`` content events (default 32) one every ITL_MS milliseconds (second
command-line argument, default 5), then a usage event and ``[DONE]``: a steady token stream whose spacing
the gateway must preserve.
"""

from __future__ import annotations

import asyncio
import re
import sys

_OK = b'{"id":"bench","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'
_MODELS = b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"prefixroute"}]}'


def _response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


_RESP_OK = _response(_OK)
_RESP_MODELS = _response(_MODELS)
_RESP_METRICS = _response(b"", b"text/plain; version=0.0.4")
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_TOKEN_EVENT = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def _stream(writer: asyncio.StreamWriter, body: bytes, itl_s: float) -> None:
    m = _MAX_TOKENS.search(body)
    n = int(m.group(1)) if m else 32
    writer.write(_SSE_HEAD)
    loop = asyncio.get_running_loop()
    due = loop.time()
    for k in range(n):
        # Each token at least itl_s after the previous one, as a decode loop steps: scheduled against the start
        # time while on time (the upstream's own jitter does not accumulate), but a stall (a busy host) is not
        # caught up with a burst of short gaps, which would read as the gateway bunching tokens.
        if k:
            due = max(due + itl_s, loop.time())
        await asyncio.sleep(max(0.0, due - loop.time()))
        writer.write(_chunk(_TOKEN_EVENT))
    usage = b'data: {"object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":' \
        + str(n).encode() + b',"prompt_tokens_details":{"cached_tokens":0}}}\n\ndata: [DONE]\n\n'
    writer.write(_chunk(usage) + b"0\r\n\r\n")


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, itl_s: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            i = lower.find(b"content-length:")
            body = b""
            if i >= 0:
                n = int(lower[i + 15:lower.index(b"\r\n", i)])
                if n:
                    body = await reader.readexactly(n)
            line = head[:head.index(b"\r\n")]
            if body and _STREAM.search(body):
                await _stream(writer, body, itl_s)
            elif b" /v1/models" in line:
                writer.write(_RESP_MODELS)
            elif b" /metrics" in line:
                writer.write(_RESP_METRICS)
            else:
                writer.write(_RESP_OK)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve(port: int, host: str = "127.0.0.1", itl_ms: float = 5.0) -> None:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, itl_ms / 1000.0), host, port, limit=1 << 20)
    print(f"fast upstream listening on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        asyncio.run(serve(int(argv[0]), itl_ms=float(argv[1]) if len(argv) > 1 else 5.0))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

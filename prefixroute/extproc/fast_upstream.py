"""A minimal, fast HTTP/1.1 upstream for the overhead benchmark (`python -m prefixroute.extproc.fast_upstream PORT`).

It answers every request with a small fixed JSON body at once (no model simulation), so that what the
benchmark measures is Envoy and the ext_proc service, not the upstream. It also answers ``/health``,
``/v1/models`` and ``/metrics`` (empty exposition) so the endpoint pool accepts it as a healthy endpoint.
Keep-alive; Content-Length bodies only (Envoy sends those for buffered requests).
"""

from __future__ import annotations

import asyncio
import sys

_OK = b'{"id":"bench","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'
_MODELS = b'{"object":"list","data":[{"id":"bench-model","object":"model","owned_by":"prefixroute"}]}'


def _response(body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


_RESP_OK = _response(_OK)
_RESP_MODELS = _response(_MODELS)
_RESP_METRICS = _response(b"", b"text/plain; version=0.0.4")


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            i = lower.find(b"content-length:")
            if i >= 0:
                n = int(lower[i + 15:lower.index(b"\r\n", i)])
                if n:
                    await reader.readexactly(n)
            line = head[:head.index(b"\r\n")]
            if b" /v1/models" in line:
                writer.write(_RESP_MODELS)
            elif b" /metrics" in line:
                writer.write(_RESP_METRICS)
            else:
                writer.write(_RESP_OK)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def serve(port: int, host: str = "127.0.0.1") -> None:
    server = await asyncio.start_server(_handle, host, port, limit=1 << 20)
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
        asyncio.run(serve(int(argv[0])))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A canary endpoint for gateway tests: a tiny HTTP/1.1 server (asyncio, in a thread of the test process) that
looks enough like a model server for the ext_proc pool to route to it (``/health`` 200, ``/v1/models`` listing
`MODEL`, empty ``/metrics``) and records every request that came through Envoy (Envoy adds
``x-forwarded-proto``; the pool's own probes do not), so a test can assert which paths the gateway forwarded.

Every other request gets 200 with a small JSON body naming the path and the body size it received. Request
headers change that: ``x-canary-delay-s: S`` answers after S seconds; ``x-canary-garbage`` answers bytes that are
not HTTP; ``x-canary-stream-bytes: N`` answers an SSE-like chunked response of N bytes, written as fast as the
client side lets it (for backpressure tests; `stream_bytes_sent` counts what left); ``x-canary-echo`` answers with
every header it received echoed back and `PLANTED` (a server that leaks whatever it is sent, and worse).
Contract: `Canary()` serves on return; `close()` stops it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

from helpers.fleet import MODEL


PLANTED = {"x-gateway-destination-endpoint": "10.9.9.9:8000", "x-gateway-destination-endpoint-served": "10.9.9.9:8000",
           "x-prefixroute-fallback-endpoint-1": "10.9.9.8:8000", "x-prefixroute-replica": "0",
           "x-prefixroute-traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
           "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
           "x-prefixroute-handoff": "ext_proc", "x-prefixroute-router-token": "Bearer planted",
           "x-envoy-original-dst-host": "10.9.9.9:8000"}
"""Router-internal headers an echoing canary adds to its answer (``x-canary-echo``), as a careless server might."""


@dataclass(frozen=True)
class Seen:
    method: str
    target: str  # the request target as received (path and query)
    headers: dict[str, str]
    body_bytes: int


class Canary:
    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.stream_bytes_sent = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("canary did not start")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [s.target for s in list(self.seen)]

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=1 << 20)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    h = await reader.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = b""
                if "content-length" in headers:
                    body = await reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await reader.readline()).split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        body += chunk[:-2]
                        if size == 0:
                            break
                if "x-forwarded-proto" in headers:
                    self.seen.append(Seen(method, target, headers, len(body)))
                if "x-canary-delay-s" in headers:
                    await asyncio.sleep(float(headers["x-canary-delay-s"]))
                if "x-canary-garbage" in headers:
                    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
                    await writer.drain()
                    return
                if "x-canary-stream-bytes" in headers:
                    await self._stream(writer, int(headers["x-canary-stream-bytes"]))
                    return
                extra = b""
                if "x-canary-echo" in headers:
                    echoed = {k: v for k, v in headers.items()
                              if k not in ("content-length", "transfer-encoding", "connection", "host")}
                    extra = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in {**PLANTED, **echoed}.items())
                path = target.split("?")[0]
                if path == "/v1/models":
                    out = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 131072}]}
                elif path == "/metrics":
                    out = None
                else:
                    out = {"path": target, "body_bytes": len(body)}
                data = b"" if out is None else json.dumps(out).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
                    b"application/json" if out is not None else b"text/plain", len(data), extra, data))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, num_bytes: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b"data: " + b"x" * 16378 + b"\n\n"  # 16 KiB events
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        sent = 0
        while sent < num_bytes:
            writer.write(chunk)
            await writer.drain()  # returns only once the peer (Envoy) took it: backpressure reaches here
            sent += len(event)
            self.stream_bytes_sent += len(event)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

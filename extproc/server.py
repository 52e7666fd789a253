"""The grpc.aio server hosting the ext_proc servicer, and its settings."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import ClassVar

import grpc

from prefixroute.extproc import wire
from prefixroute.extproc.servicer import ExtProcServicer, RouterService
from prefixroute.extproc.tracking import NULL_TRACKER, Tracker
from prefixroute.settings import Settings, setting


@dataclasses.dataclass(frozen=True)
class ExtprocSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_EXTPROC_"
    TITLE: ClassVar[str] = "ext_proc service"

    port: int = setting(9002, "gRPC port Envoy's ext_proc filter connects to (9002: the endpoint-picker "
                        "reference port).")
    listen_address: str = setting("0.0.0.0", "Address to listen on (all interfaces so Envoy in another "
                                  "container reaches it; 127.0.0.1 when Envoy runs on the same host).")
    ready_timeout_s: float = setting(10.0, "At start, wait up to this long for every endpoint to pass its first "
                                     "health probe before serving (requests before that would get 503); "
                                     "serving starts anyway when it expires.")
    uvloop: bool = setting(True, "Run on uvloop instead of asyncio's default loop (measured faster with "
                           "grpc.aio; see overhead-bench).")


async def start_server(router: RouterService, s: ExtprocSettings, tracker: Tracker = NULL_TRACKER
                       ) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the started server (call `stop(grace)` on it) and its port (port 0 = any).
    Telemetry: a `RequestTracker`, or the default `NULL_TRACKER` for none."""
    server = grpc.aio.server(options=[
        # Many concurrent HTTP requests = many concurrent streams on Envoy's one HTTP/2 connection.
        ("grpc.max_concurrent_streams", 100000),
        # Bodies arrive whole (BUFFERED): gRPC's default 4 MiB cap would fail bodies Envoy already accepted
        # (its own limit, max_request_body_bytes, is the one that answers 413).
        ("grpc.max_receive_message_length", -1),
        ("grpc.so_reuseport", 0),
        # Request bodies arrive as one message: a stream window above the largest body avoids flow-control
        # round trips (the 64 KiB default stalls every 64 KB prompt), and makes BDP probing pointless.
        ("grpc.http2.lookahead_bytes", 16 * 1024 * 1024),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.optimization_target", "latency"),
    ])
    wire.add_to_server(server, ExtProcServicer(router, tracker).Process)
    bound = server.add_insecure_port(f"{s.listen_address}:{s.port}")
    if bound == 0:
        raise OSError(f"cannot listen on {s.listen_address}:{s.port}")
    await server.start()
    return server, bound


def new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop

            return uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            pass
    return asyncio.new_event_loop()

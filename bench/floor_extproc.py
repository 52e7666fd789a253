"""The floor of a Python ext_proc: the least a grpc.aio (uvloop) server can do per routed request, for
`prefixroute overhead-bench --extproc-variants floor` (how much of the ext_proc's CPU per request is
the router's own work, and how much any Python gRPC server on this stack pays).

Per routing stream it does what Envoy needs and nothing else: the request headers message answered CONTINUE,
the body message answered with the router's own pre-built routing answer to one fixed endpoint
(servicer.ResponseCache: the same bytes as the router's, less the per-request traceparent), then the stream's
end. No parsing, hashing, scheduling, telemetry or endpoint pool. It also answers what the gateway's Envoy
sends besides: gRPC health checks (SERVING) and the facts path's OTLP ``LogsService.Export`` (an empty answer, the
records dropped), so Envoy treats it as it treats the router.

    python -m prefixroute.bench.floor_extproc PORT ENDPOINT

Not a router: it serves one address whatever the request, for measuring only."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc

from prefixroute.extproc import wire
from prefixroute.extproc.servicer import ResponseCache

_CONTINUE = wire.ProcessingResponse(request_headers=wire.HeadersResponse()).SerializeToString()
_SERVING = wire.HealthCheckResponse(status=wire.HealthCheckResponse.SERVING)


class _DropLogs(logs_service_pb2_grpc.LogsServiceServicer):
    async def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's method name)
        return logs_service_pb2.ExportLogsServiceResponse()


async def serve(port: int, endpoint: str) -> None:
    """Serve until cancelled on 127.0.0.1:`port`, routing every request to `endpoint` (``ip:port``)."""
    routed = ResponseCache().routing_response((endpoint,), False).SerializeToString()

    async def process(requests: Any, context: Any) -> Any:
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield _CONTINUE
            elif kind == "request_body":
                yield routed

    async def check(request: Any, context: Any) -> Any:
        return _SERVING

    server = grpc.aio.server()
    wire.add_to_server(server, process)
    wire.add_health_to_server(server, check)
    logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_DropLogs(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m prefixroute.bench.floor_extproc PORT ENDPOINT", file=sys.stderr)
        return 2
    try:
        import uvloop
        uvloop.run(serve(int(argv[0]), argv[1]))
    except ImportError:  # the router runs on uvloop where installed; so does its floor
        asyncio.run(serve(int(argv[0]), argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

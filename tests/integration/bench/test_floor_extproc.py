"""bench/floor_extproc.py, the Python ext_proc's floor for overhead-bench: over real gRPC it answers a routing
stream the way Envoy needs (CONTINUE at the headers, the router's own routing answer at the body), answers
health checks SERVING, and accepts the facts path's OTLP records, so the gateway treats it as the router."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc

from prefixroute.bench.floor_extproc import serve
from prefixroute.extproc import wire
from prefixroute.extproc.headers import DESTINATION_HEADER
from prefixroute.procs import free_port, tcp_open

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


async def test_floor_answers_a_routing_stream_health_and_records():
    port = free_port()
    task = asyncio.create_task(serve(port, "10.1.2.3:8000"))
    try:
        for _ in range(200):
            if tcp_open(port):
                break
            await asyncio.sleep(0.02)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = wire.process_call(channel)()
            await call.write(wire.ProcessingRequest(request_headers=wire.HttpHeaders()))
            at_headers = await call.read()
            await call.write(wire.ProcessingRequest(request_body=wire.HttpBody(body=b"{}", end_of_stream=True)))
            at_body = await call.read()
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            health = await wire.health_check_call(channel)(wire.HealthCheckRequest())
            records = await logs_service_pb2_grpc.LogsServiceStub(channel).Export(
                logs_service_pb2.ExportLogsServiceRequest())
        assert at_headers.WhichOneof("response") == "request_headers"
        assert not at_headers.request_headers.response.header_mutation.set_headers  # CONTINUE, nothing set
        body = at_body.request_body.response
        assert body.clear_route_cache
        assert wire.header_value([h.header for h in body.header_mutation.set_headers],
                                 DESTINATION_HEADER) == "10.1.2.3:8000"
        assert health.status == wire.HealthCheckResponse.SERVING
        assert records == logs_service_pb2.ExportLogsServiceResponse()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

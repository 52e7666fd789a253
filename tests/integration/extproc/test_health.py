"""The picker's gRPC health service (extproc/health.py) over real gRPC, asked with gRPC's own health client
(grpcio-health-checking's ``HealthStub``, the gRPC project's release): the services GIE's protocol names, real
readiness, the bearer token exemption, and the plaintext health port."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixroute.extproc import wire
from prefixroute.extproc.server import ExtprocSettings, start_health_server, start_server

pytestmark = pytest.mark.integration


class _Router:
    def route(self, *a: object, **kw: object) -> None:
        raise AssertionError("not routed in these tests")


async def _check(port: int, service: str) -> tuple[int | None, grpc.StatusCode]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=5)
            return resp.status, grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return None, exc.code()


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def test_liveness_always_and_readiness_as_the_picker_can_route() -> None:
    ready = [False]
    server, port = await start_server(_Router(), ExtprocSettings(port=0, listen_address="127.0.0.1"),
                                      ready=lambda: ready[0])
    try:
        names = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "", "inference-extension")
        assert await _check(port, "liveness") == (SERVING, grpc.StatusCode.OK)
        for name in names:
            assert await _check(port, name) == (NOT_SERVING, grpc.StatusCode.OK), name
        ready[0] = True
        for name in names:
            assert await _check(port, name) == (SERVING, grpc.StatusCode.OK), name
        assert await _check(port, "no-such-service") == (None, grpc.StatusCode.NOT_FOUND)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                         timeout=5):
                    pass
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


async def test_the_health_check_needs_no_token_while_ext_proc_does() -> None:
    s = ExtprocSettings(port=0, listen_address="127.0.0.1", auth_token="t" * 32)
    server, port = await start_server(_Router(), s)
    try:
        assert await _check(port, "envoy.service.ext_proc.v3.ExternalProcessor") == (SERVING, grpc.StatusCode.OK)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = wire.process_call(channel)()
            # The server refuses the stream before reading it: the write itself may fail (the stream is already
            # closed: gRPC's "execute_batch" error, seen once in CI), so the stream's status is what is checked.
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                await call.write(wire.ProcessingRequest(request_headers=wire.HttpHeaders()))
                await call.done_writing()  # without the check the stream would end OK here
            assert await asyncio.wait_for(call.code(), 5.0) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(None)


async def test_the_plaintext_health_port_answers_the_same() -> None:
    ready = [True]
    s = ExtprocSettings(port=0, listen_address="127.0.0.1", health_port=0)
    health = await start_health_server(s, lambda: ready[0])
    assert health is not None
    try:
        port = health.bound_port
        assert await _check(port, "readiness") == (SERVING, grpc.StatusCode.OK)
        ready[0] = False
        assert await _check(port, "readiness") == (NOT_SERVING, grpc.StatusCode.OK)
        assert await _check(port, "liveness") == (SERVING, grpc.StatusCode.OK)
    finally:
        await health.stop(None)
    assert await start_health_server(ExtprocSettings(), lambda: True) is None  # -1 (the default): none

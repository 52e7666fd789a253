"""The facts receiver's reports served as gRPC unary calls on a loopback server (the rest of its tests, in process:
tests/unit/extproc/test_envoy_facts.py)."""

from __future__ import annotations

import pytest
import grpc
from hypothesis import strategies as st
from helpers.facts_records import CHAT_USAGE, export, record
from prefixroute.extproc.envoy_facts import (MAX_EARLY_REPORT_BYTES, EarlyReport, FactsCollector, FactsReceiver,
                                             add_to_server, decode_early_report, decode_first_token, facts_of)
from prefixroute.extproc.facts_fields import (FACTS_ATTRIBUTES, FIRST_TOKEN_METHOD, OBSERVED_FACTS, RESPONSE_ID_METHOD,
                                             TRACEPARENT_KEY)
from unit.extproc.test_envoy_facts import begin_early, begin_responses, early_rig, frame

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


async def call_served(rx: FactsReceiver, method: str, *messages: bytes) -> list[bytes]:
    """Each of `messages` as a gRPC unary call of `method` to a server `add_to_server` set up for `rx`; the answers."""
    server = grpc.aio.server()
    add_to_server(server, rx)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            return [await call(m, timeout=5) for m in messages]
    finally:
        await server.stop(None)


async def test_the_report_is_served_as_a_grpc_unary_call_beside_otlp() -> None:
    t, rx, router, _ = early_rig()
    st, tp = begin_early(t)
    # Each answered at once, the second (no traceparent) counted unmatched.
    assert await call_served(rx, FIRST_TOKEN_METHOD, tp.encode(), b"not a traceparent") == [b"", b""]
    assert [c[0] for c in router.calls] == ["first_token"] and rx.first_token_counts["unmatched"] == 1
    assert facts_of(record(tp)) is not None and frame(tp.encode())[4] == len(tp)


async def test_the_id_report_is_served_beside_the_first_token_report() -> None:
    t, rx, router, _ = early_rig()
    st_, tp = begin_responses(t, stream=False)
    answers = await call_served(rx, RESPONSE_ID_METHOD, f"{tp}\nresp_rpc\n10.0.0.1:80".encode(), b"not a report")
    assert answers == [b"", b""]
    assert router.calls == [("learn_response", "resp_rpc", "10.0.0.1:80")]
    assert rx.early_id_counts == {"learned": 1, "unmatched": 1}

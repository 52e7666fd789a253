"""Routing answers built at the byte level (answers.with_traceparent) parse to the same message as the one built
with protobuf objects, at both phases, with and without a replica header."""

from __future__ import annotations

import pytest

from prefixroute.extproc import wire
from prefixroute.extproc.answers import header_option, serialized, with_traceparent
from prefixroute.extproc.headers import TRACEPARENT_HEADER
from prefixroute.extproc.servicer import ResponseCache

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _built_with_objects(cached, at_headers: bool, traceparent: str):
    resp = wire.ProcessingResponse()
    resp.CopyFrom(cached)
    common = resp.request_headers.response if at_headers else resp.request_body.response
    common.header_mutation.set_headers.append(header_option(TRACEPARENT_HEADER, traceparent))
    return resp


@pytest.mark.parametrize("at_headers", [True, False])
@pytest.mark.parametrize("replica", [None, 3])
@pytest.mark.parametrize("traceparent", [TRACEPARENT, "x" * 200])  # 200: a two-byte length varint
def test_byte_level_answer_equals_object_answer(at_headers, replica, traceparent):
    cached = ResponseCache(replica).routing_response(("10.0.0.1:8000", "10.0.0.2:8000"), at_headers)
    data = with_traceparent(cached, at_headers, traceparent)
    assert isinstance(data, bytes)
    got = wire.ProcessingResponse.FromString(data)
    assert got == _built_with_objects(cached, at_headers, traceparent)
    headers = (got.request_headers if at_headers else got.request_body).response.header_mutation.set_headers
    assert headers[-1].header.key == TRACEPARENT_HEADER
    assert headers[-1].header.raw_value == traceparent.encode()
    assert headers[-1].append_action == wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert got.dynamic_metadata == cached.dynamic_metadata


def test_serialized_once_and_never_confused_by_a_reused_id():
    cache = ResponseCache()
    a = cache.routing_response(("10.0.0.1:8000",), True)
    assert serialized(a) is serialized(a)
    b = cache.routing_response(("10.0.0.9:8000",), True)
    assert wire.ProcessingResponse.FromString(serialized(b)) == b


def test_serializer_passes_bytes_through():
    msg = wire.ProcessingResponse(request_headers=wire.HeadersResponse())
    assert wire.serialize(msg) == msg.SerializeToString()
    assert wire.serialize(b"\x0a\x00") == b"\x0a\x00"

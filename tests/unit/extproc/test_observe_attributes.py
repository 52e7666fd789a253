"""The observing stream's correlation key arrives as attributes with its first message (issue 15: no request
headers message): `servicer.attribute_headers` turns them back into the request headers tracking.py reads."""

from __future__ import annotations

import pytest

from prefixroute.extproc import wire
from prefixroute.extproc.headers import EXT_PROC_ATTRIBUTES_KEY, TRACEPARENT_HEADER
from prefixroute.extproc.servicer import attribute_headers

TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def _request(attrs: dict[str, str] | None, key: str = EXT_PROC_ATTRIBUTES_KEY) -> wire.ProcessingRequest:
    req = wire.ProcessingRequest(observability_mode=True)
    req.response_headers.SetInParent()
    if attrs is not None:
        fields = req.attributes[key]
        for name, value in attrs.items():
            fields.fields[name].string_value = value
    return req


@pytest.mark.parametrize(("attrs", "key", "expected"), [
    (None, EXT_PROC_ATTRIBUTES_KEY, []),  # an Envoy config without response_attributes
    ({}, EXT_PROC_ATTRIBUTES_KEY, []),
    ({"request.headers['traceparent']": TRACEPARENT}, EXT_PROC_ATTRIBUTES_KEY, [(TRACEPARENT_HEADER, TRACEPARENT)]),
    ({"request.headers['traceparent']": TRACEPARENT, "request.id": "r-1", "request.url_path": "/v1/responses"},
     EXT_PROC_ATTRIBUTES_KEY, [(TRACEPARENT_HEADER, TRACEPARENT), ("x-request-id", "r-1"), (":path", "/v1/responses")]),
    ({"request.headers['traceparent']": "", "request.id": "r-2"}, EXT_PROC_ATTRIBUTES_KEY,
     [("x-request-id", "r-2")]),  # an absent header comes as an empty value: no header, not an empty one
    ({"request.headers['authorization']": "Bearer x"}, EXT_PROC_ATTRIBUTES_KEY, []),  # only the known attributes
    ({"request.headers['traceparent']": TRACEPARENT}, "some.other.filter", []),  # another filter's namespace
])
def test_attribute_headers(attrs, key, expected):
    got = [(h.key, h.value) for h in attribute_headers(_request(attrs, key))]
    assert got == expected


def test_reading_attributes_does_not_insert_the_namespace():
    req = _request(None)
    assert attribute_headers(req) == []
    assert EXT_PROC_ATTRIBUTES_KEY not in req.attributes


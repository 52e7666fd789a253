"""W3C traceparent parsing and child-span creation."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.telemetry.tracecontext import (
    TraceParent,
    child_context,
    format_traceparent,
    parse_traceparent,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"

hex_id = lambda n: st.text(alphabet="0123456789abcdef", min_size=n, max_size=n)  # noqa: E731


@pytest.mark.parametrize(("value", "expected"), [
    (f"00-{TRACE}-{SPAN}-01", TraceParent(TRACE, SPAN, 1)),
    (f"00-{TRACE}-{SPAN}-00", TraceParent(TRACE, SPAN, 0)),
    (f"  00-{TRACE}-{SPAN}-01\t", TraceParent(TRACE, SPAN, 1)),  # OWS around the value
    (f"00-{TRACE}-{SPAN}-01".encode(), TraceParent(TRACE, SPAN, 1)),
    (f"cc-{TRACE}-{SPAN}-09-what-the-future-adds", TraceParent(TRACE, SPAN, 9)),  # future version: extra fields
    (f"cc-{TRACE}-{SPAN}-01", TraceParent(TRACE, SPAN, 1)),
    (None, None),
    ("", None),
    (f"00-{TRACE}-{SPAN}-01-extra", None),  # version 00 is exactly 55 chars
    (f"ff-{TRACE}-{SPAN}-01", None),  # forbidden version
    (f"00-{TRACE.upper()}-{SPAN}-01", None),  # upper case is invalid
    (f"00-{'0' * 32}-{SPAN}-01", None),  # all-zero trace id
    (f"00-{TRACE}-{'0' * 16}-01", None),  # all-zero span id
    (f"00-{TRACE[:-1]}-{SPAN}-01", None),  # short trace id
    (f"00_{TRACE}-{SPAN}-01", None),  # wrong separator
    (f"cc-{TRACE}-{SPAN}-01x", None),  # longer than 55 without a '-'
    (f"00-{TRACE}-{SPAN}-0g", None),
    (b"\xff\xfe", None),  # not ASCII
])
def test_parse_traceparent_table(value, expected):
    assert parse_traceparent(value) == expected


@given(hex_id(32), hex_id(16), st.integers(0, 255))
def test_format_then_parse_round_trips(trace_id, span_id, flags):
    parsed = parse_traceparent(format_traceparent(trace_id, span_id, flags))
    if trace_id == "0" * 32 or span_id == "0" * 16:
        assert parsed is None
    else:
        assert parsed == TraceParent(trace_id, span_id, flags)


@given(st.one_of(st.text(max_size=80), st.binary(max_size=80),
                 st.text(alphabet=string.hexdigits + "-", min_size=50, max_size=60)))
def test_parse_never_raises_and_only_accepts_well_formed(value):
    parsed = parse_traceparent(value)
    if parsed is not None:
        text = value.decode() if isinstance(value, bytes) else value
        assert text.strip(" \t")[3:35] == parsed.trace_id
        assert len(parsed.span_id) == 16 and 0 <= parsed.flags <= 255


def test_child_context_joins_incoming_trace_with_a_new_span():
    ctx = child_context(f"00-{TRACE}-{SPAN}-00")
    assert ctx.trace_id == TRACE
    assert ctx.parent_span_id == SPAN
    assert ctx.span_id != SPAN and len(ctx.span_id) == 16
    # The model server must see the router's span as its parent, with the caller's flags.
    assert parse_traceparent(ctx.traceparent) == TraceParent(TRACE, ctx.span_id, 0)


@pytest.mark.parametrize("incoming", [None, "garbage", f"00-{'0' * 32}-{SPAN}-01"])
def test_child_context_starts_a_sampled_trace_without_a_valid_parent(incoming):
    ctx = child_context(incoming)
    assert ctx.parent_span_id is None
    assert parse_traceparent(ctx.traceparent) == TraceParent(ctx.trace_id, ctx.span_id, 1)


def test_ids_are_unique():
    ids = {child_context(None).trace_id for _ in range(2000)}
    assert len(ids) == 2000


@pytest.mark.parametrize(("a", "b", "same"), [("sk-abc", "sk-abc", True), ("sk-abc", b"sk-abc", True),
                                              ("sk-abc", "sk-abd", False), ("", "x", False)])
def test_tenant_hash(a, b, same):
    from prefixroute.telemetry.records import tenant_hash

    assert (tenant_hash(a) == tenant_hash(b)) is same
    assert len(tenant_hash(a)) == 16
    assert a == "" or a not in tenant_hash(a)

"""W3C Trace Context (``traceparent``) for the router: join an incoming trace, start a child span.

The router is a span of its own: it keeps the incoming trace id (or starts a trace when the client
sent none or an invalid header), takes a fresh span id, and passes
``traceparent: 00-<trace_id>-<router span id>-<flags>`` on to the model server, so the model
server's spans are children of the router's span. ``tracestate`` is passed on unchanged by Envoy.

Parsing follows https://www.w3.org/TR/trace-context/#traceparent-header: lower-case hex only;
version ``ff`` is invalid; all-zero trace or span ids are invalid; version ``00`` must be exactly
55 characters; a higher version may carry more fields after a ``-`` (ignored). An invalid header is
treated as absent (the spec's "restart the trace"), never an error for the request.
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

SAMPLED_FLAG = 0x01
# SystemRandom would cost a syscall per id; ids need uniqueness, not secrecy.
_rand = random.Random()


class TraceParent(NamedTuple):
    """A parsed ``traceparent``: ids are lower-case hex (32 and 16 chars), flags an int 0-255."""

    trace_id: str
    span_id: str
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED_FLAG)


# version-traceid-parentid-flags, then (versions above 00 only) "-" and fields we ignore.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """Parse a ``traceparent`` header value; None when absent or invalid (never raises)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    m = _TRACEPARENT.fullmatch(value.strip(" \t"))  # OWS around a header value is not part of it
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def new_trace_id() -> str:
    """A random non-zero 128-bit trace id, 32 lower-case hex chars."""
    return f"{_rand.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    """A random non-zero 64-bit span id, 16 lower-case hex chars."""
    return f"{_rand.getrandbits(64) or 1:016x}"


def format_traceparent(trace_id: str, span_id: str, flags: int = SAMPLED_FLAG) -> str:
    """The version-00 header value for (trace_id, span_id, flags)."""
    return f"00-{trace_id}-{span_id}-{flags & 0xFF:02x}"


class RouterSpanContext(NamedTuple):
    """The router's span: ids for the `RequestRecord`, and the header value to send to the model server."""

    trace_id: str
    span_id: str
    parent_span_id: str | None  # None: the router started this trace
    flags: int
    traceparent: str  # value of the traceparent header the model server must receive


def child_context(incoming: str | bytes | None) -> RouterSpanContext:
    """Join the incoming trace (if its ``traceparent`` is valid) with a fresh router span; else start one.

    The sampled flag is inherited from the caller (the router records every request regardless,
    since the receiver needs all of them; the flag only tells the model server what the caller asked).
    A new trace is sampled.
    """
    parent = parse_traceparent(incoming)
    span_id = new_span_id()
    if parent is None:
        trace_id = new_trace_id()
        return RouterSpanContext(trace_id, span_id, None, SAMPLED_FLAG, format_traceparent(trace_id, span_id))
    return RouterSpanContext(parent.trace_id, span_id, parent.span_id, parent.flags,
                             format_traceparent(parent.trace_id, span_id, parent.flags))

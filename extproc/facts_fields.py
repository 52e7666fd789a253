"""The response facts' names, shared by the Envoy side (envoy_config/facts.py: the Lua filter and the facts
logger) and the router side (envoy_facts.py: the receiver). A leaf module: the ext_proc process imports it
without the typed Envoy configuration classes.

The facts path (docs/architecture.md, "Response facts"): a Lua filter in Envoy takes a response's facts while
its chunks pass (never buffering a body) and writes them as dynamic metadata in `FACTS_NAMESPACE`; at the
request's end Envoy's ``envoy.access_loggers.open_telemetry`` logger puts them, with Envoy's own stream timing, in
one OTLP log record (`FACTS_ATTRIBUTES`) and sends it to the ext_proc replica that routed the request, whose gRPC
port also serves OTLP ``LogsService.Export``. Nothing per body chunk crosses gRPC.
"""

from __future__ import annotations

FACTS_NAMESPACE = "prefixroute.facts"
"""Dynamic metadata namespace the facts Lua filter writes."""
TIMING_NAMESPACE = "prefixroute.timing"
FIRST_TOKEN_KEY = "first_token_us"
"""A Responses API stream's first token event (unix microseconds, Envoy's clock), in `TIMING_NAMESPACE`: the
telemetry records read it too (envoy_config/timing.py)."""
USAGE_KEY = "usage"
"""The response's last ``"usage": {...}`` object as text (at most `MAX_USAGE_CHARS`), from its last bytes."""
COMPLETE_KEY = "complete"
"""``"1"`` once the response's own end passed the filter (a chat or completions stream's ``data: [DONE]``, a
Responses stream's terminal event, which carries its usage): a client that closes then has its whole answer, even
if Envoy had not yet seen the upstream's end of stream (Envoy then flags DC, `CLIENT_CUT_FLAG`)."""
RESPONSE_ID_KEY = "response_id"
"""The first ``"id": "resp..."`` of a response (Responses API), from its first `MAX_ID_SCAN_BYTES`."""
MAX_USAGE_CHARS = 1024
MAX_ID_SCAN_BYTES = 64 * 1024
TAIL_BYTES = 4096
"""Last bytes of a response the Lua filter keeps to find its usage: the final usage event of a stream
(+ ``[DONE]``), or the end of a JSON body (usage comes near its end: OpenAI's field order, vLLM)."""

FACTS_MARK = "prefixroute.facts"
"""Attribute that marks a facts record (value "1"), so a facts receiver ignores any other log record."""
A_TRACEPARENT = "tp"
A_STATUS = "status"
A_UPSTREAM = "upstream"
A_CONTENT_TYPE = "ctype"
A_TTFT_US = "ttft_us"
A_DURATION_US = "duration_us"
A_ROUTING_US = "routing_us"
A_START = "start"
A_FIRST_TOKEN_US = "first_token_us"
A_USAGE = "usage"
A_RESPONSE_ID = "response_id"
A_FLAGS = "flags"
A_COMPLETE = "complete"
CLIENT_CUT_FLAG = "DC"
"""Envoy's response flag "downstream connection termination": the client closed its connection before the
response ended (the status is still the one its headers carried, e.g. 200). Not a cut when the record says the
response was complete (`COMPLETE_KEY`): the OpenAI SDK closes its connection at a stream's ``[DONE]``, which may
reach the client before Envoy reads the upstream's end of stream."""

FACTS_ATTRIBUTES: dict[str, str] = {
    FACTS_MARK: "1",
    # The routing filter's traceparent: its span id is the key of the router's pick (tracking.py).
    A_TRACEPARENT: "%REQ(TRACEPARENT)%",
    A_STATUS: "%RESPONSE_CODE%",
    A_UPSTREAM: "%UPSTREAM_HOST%",
    A_CONTENT_TYPE: "%RESP(CONTENT-TYPE)%",
    # Envoy's clock: from the first request byte to the first upstream response body byte, and to the last byte
    # sent to the client (microseconds; "-" when a time point is missing).
    A_TTFT_US: "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    A_DURATION_US: "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
    # The routing delay: from the request's last byte received to its first byte sent upstream (the routing
    # filter's round trip, a handoff's and the gateway queue's wait included); "-" when the upstream request
    # began before the request ended (Envoy routed without waiting: no routing filter on the route).
    A_ROUTING_US: "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%",
    A_START: "%START_TIME(%s.%6f)%",
    A_FIRST_TOKEN_US: f"%DYNAMIC_METADATA({TIMING_NAMESPACE}:{FIRST_TOKEN_KEY})%",
    A_USAGE: f"%DYNAMIC_METADATA({FACTS_NAMESPACE}:{USAGE_KEY})%",
    A_RESPONSE_ID: f"%DYNAMIC_METADATA({FACTS_NAMESPACE}:{RESPONSE_ID_KEY})%",
    # Envoy's response flags ("-" for none): DC, the client cut the response short (unless it was complete).
    A_FLAGS: "%RESPONSE_FLAGS%",
    A_COMPLETE: f"%DYNAMIC_METADATA({FACTS_NAMESPACE}:{COMPLETE_KEY})%",
}
"""The facts record's attributes: short keys (they travel once per request), Envoy format strings as values."""

FACTS_LOG_NAME = "prefixroute.facts"
OBSERVED_FACTS = "facts"
"""Value of the routing stream's OBSERVED_METADATA (headers.py) when the request's facts come as a record
(the facts path) instead of an observing stream ("1")."""
DEFAULT_FLUSH_INTERVAL_MS = 50

# The early first token report (`facts_first_token_early`): at a streamed response's first token the facts Lua
# filter makes one asynchronous gRPC unary call to the replica that routed the request (Envoy does not wait for
# its answer), so the router learns the first token when it happens, not at the stream's end.
FIRST_TOKEN_METHOD = "/prefixroute.facts.v1.Facts/FirstToken"
"""The call's gRPC method. Request: the routing filter's ``traceparent`` as ASCII text (the pick's key), then, for
a Responses stream answered 200, ``\n`` + its response id + ``\n`` + the served address (Envoy's served header,
empty when absent); answer: empty. The router times the first token at the call's arrival (its own clock, as the
observing stream does) and learns the id then."""
RESPONSE_ID_METHOD = "/prefixroute.facts.v1.Facts/ResponseId"
"""The early response id report of a JSON (not streamed) Responses answer: the same message, sent when the facts
Lua filter sees the id in the body's first bytes, so a follow-up sent at once finds its pin."""
TRACEPARENT_KEY = "tp"
"""The request's traceparent (after the routing filter set it), kept by the Lua filter in `FACTS_NAMESPACE` for its
response side, which has no request headers."""
FIRST_TOKEN_TIMEOUT_MS = 1000
"""The call's timeout: nothing waits on it; a call that fails leaves the first token to the facts record."""

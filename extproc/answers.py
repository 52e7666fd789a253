"""ext_proc answers both protocols give (prefixroute's own, servicer.py; GIE's, gie.py): a header option, a
refusal as an ImmediateResponse, a routing answer with ``traceparent`` added, and the refusal of a Responses
follow-up whose holder changed during its lookup. Pure functions over the wire classes; no state."""

from __future__ import annotations

from typing import Any

from prefixroute.extproc import wire
from prefixroute.extproc.headers import REFUSED_HEADER, TRACEPARENT_HEADER
from prefixroute.openai_errors import OpenAIError


def header_option(key: str, value: str) -> Any:
    """A header to set, overwriting any value the request already has."""
    return wire.HeaderValueOption(header=wire.HeaderValue(key=key, raw_value=value.encode()),
                                  append_action=wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


_MAX_SERIALIZED = 4096
_serialized: dict[int, tuple[Any, bytes]] = {}
"""Cached routing responses' wire bytes, keyed by the response object's id. The entry holds the object itself,
so its id cannot be reused by another object while the entry lives (checked with `is` all the same)."""


def serialized(cached: Any) -> bytes:
    """The wire bytes of a cached (never mutated) response, serialized once."""
    entry = _serialized.get(id(cached))
    if entry is None or entry[0] is not cached:
        if len(_serialized) >= _MAX_SERIALIZED:
            _serialized.clear()
        entry = _serialized[id(cached)] = (cached, cached.SerializeToString())
    return entry[1]


def _varint(n: int) -> bytes:
    # Kept here rather than imported from telemetry.otlp_encode: that module imports the OTLP exporter, which
    # a broken opentelemetry install (xds-protos over opentelemetry-proto) cannot import, and the router must
    # still start then (tests/integration/telemetry/test_telemetry_exporter_broken.py).
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_TRACEPARENT_KEY = _field(1, TRACEPARENT_HEADER.encode())  # HeaderValue.key
_OVERWRITE = _varint(3 << 3) + _varint(2)  # HeaderValueOption.append_action = OVERWRITE_IF_EXISTS_OR_ADD


def _suffix_around(at_headers: bool, value_len: int) -> tuple[bytes, bytes]:
    """The bytes before and after a traceparent value of `value_len` bytes in `traceparent_suffix`."""
    marker = b"\0" * value_len
    option = _field(1, _TRACEPARENT_KEY + _field(3, marker)) + _OVERWRITE
    common = _field(2, _field(1, option))  # CommonResponse.header_mutation.set_headers[0]
    whole = _field(1 if at_headers else 3, _field(1, common))  # request_headers / request_body .response
    at = whole.index(_field(3, marker)) + len(_field(3, marker)) - value_len
    return whole[:at], whole[at + value_len:]


_SUFFIX_TEMPLATES: dict[tuple[bool, int], tuple[bytes, bytes]] = {}


def traceparent_suffix(at_headers: bool, traceparent: str) -> bytes:
    """A ProcessingResponse holding only `traceparent` as a header to set, at the request headers
    (`at_headers`) or the request body, as wire bytes. Appended to a serialized response it adds that header to
    its set_headers: protobuf parses concatenated messages as one merged message (embedded messages merge,
    repeated fields append), which Envoy's parser and ours both do (tests/unit/extproc/test_answers_wire.py).
    The bytes around the value depend only on its length (always 55 for W3C version 00): built once per length."""
    value = traceparent.encode("latin-1")
    key = (at_headers, len(value))
    around = _SUFFIX_TEMPLATES.get(key)
    if around is None:
        if len(_SUFFIX_TEMPLATES) >= 64:
            _SUFFIX_TEMPLATES.clear()
        around = _SUFFIX_TEMPLATES[key] = _suffix_around(at_headers, len(value))
    return around[0] + value + around[1]


def with_traceparent(cached: Any, at_headers: bool, traceparent: str) -> bytes:
    """A cached routing response that also sets ``traceparent`` (the router span) upstream, as wire bytes (the
    gRPC serializer, wire.serialize, passes bytes through): the cached response's bytes, serialized once, and
    the header appended at the byte level, so no message is copied or built per request."""
    return serialized(cached) + traceparent_suffix(at_headers, traceparent)


def immediate_response(err: OpenAIError) -> Any:
    """An OpenAIError as an ext_proc ImmediateResponse (status, JSON body, content-type, retry-after)."""
    headers = [header_option("content-type", "application/json"), header_option(REFUSED_HEADER, str(err.status))]
    if err.retry_after_s is not None:
        headers.append(header_option("retry-after", str(err.retry_after_s)))
    return wire.ProcessingResponse(immediate_response=wire.ImmediateResponse(
        status=wire.HttpStatus(code=err.status),
        headers=wire.HeaderMutation(set_headers=headers), body=err.body(), details=f"prefixroute_{err.status}"))


def lookup_changed(response_id: str) -> OpenAIError:
    """The 503 of a follow-up whose response id was found, then forgotten at once (its endpoint left meanwhile):
    no second lookup round."""
    return OpenAIError(503, "the endpoint holding this response changed during its lookup; retry",
                       retry_after_s=1, param="previous_response_id")


MAX_CACHED_ANSWERS = 4096
"""Distinct endpoint lists each transport keeps its answers pre-built for; beyond it the cache is reset (a rebuild
is cheap). A fleet of N endpoints with F fallbacks has at most N x (N-1)^F lists in use; 4096 covers 16 endpoints
with two fallbacks."""

"""Span attribute keys of the router span: the one mapping shared by the recorder (record -> span)
and the receiver (span -> store row), so the two cannot drift.

OpenTelemetry GenAI / HTTP semantic conventions are used where a convention exists; the rest lives
in the ``prefixroute.*`` namespace. A few values are written under both (e.g. cached tokens as
``gen_ai.usage.cache_read.input_tokens`` and ``prefixroute.cached_tokens``) so that generic GenAI
tooling and prefixroute queries both find them.
"""

from __future__ import annotations

SPAN_NAME = "prefixroute.route"
INSTRUMENTATION_SCOPE = "prefixroute.router"

# RequestRecord field -> attribute key the receiver reads it back from.
FIELD_ATTRIBUTES: dict[str, str] = {
    "request_id": "prefixroute.request_id",
    "model": "gen_ai.request.model",
    "tenant_hash": "prefixroute.tenant_hash",
    "policy": "prefixroute.policy",
    "reason": "prefixroute.reason",
    "endpoint": "prefixroute.endpoint",
    "endpoints": "prefixroute.extproc.endpoints",
    "matched_blocks": "prefixroute.matched_blocks",
    "total_blocks": "prefixroute.total_blocks",
    "predicted_hit_ratio": "prefixroute.predicted_hit_ratio",
    # The time model's predictions (ms), omitted for policies without one (see records.py).
    "predicted_ttft_ms": "prefixroute.predicted_ttft_ms",
    "alternative_endpoint": "prefixroute.alternative_endpoint",
    "alternative_ttft_ms": "prefixroute.alternative_ttft_ms",
    "index_source": "prefixroute.index_source",
    "decision_us": "prefixroute.decision_us",
    "ttft_ms": "prefixroute.ttft_ms",
    "latency_ms": "prefixroute.latency_ms",
    "prompt_tokens": "gen_ai.usage.input_tokens",
    "completion_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "prefixroute.cached_tokens",
    "stream": "prefixroute.stream",
    "status": "http.response.status_code",
    "error": "error.type",
    "path": "url.path",
    # Flow control: the gateway queue's wait and outcome (records.py).
    "gateway_wait_ms": "prefixroute.gateway_wait_ms",
    "gateway_outcome": "prefixroute.gateway_outcome",
    # Envoy's routing delay (records.py).
    "routing_ms": "prefixroute.routing_ms",
}

# Extra keys written for generic tooling (derived from the fields above).
OPERATION_NAME = "gen_ai.operation.name"
CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
FALLBACK_ENDPOINTS = "prefixroute.fallback_endpoints"
STATUS = "prefixroute.status"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
REQUEST_ID = FIELD_ATTRIBUTES["request_id"]


def operation_name(path: str) -> str | None:
    """GenAI operation for an OpenAI-style path (None when the path is not a GenAI operation)."""
    if path.endswith("/chat/completions") or path.endswith("/v1/responses"):
        return "chat"  # the Responses API is a chat turn: GenAI semconv has no operation of its own for it
    if path.endswith("/completions"):
        return "text_completion"
    if path.endswith("/embeddings"):
        return "embeddings"
    return None


# --- Attribute limits -------------------------------------------------------------------------------
# Applied by the recorder to every attribute it exports and again by the receiver to whatever any sender
# sent, so one oversized value (a 1 MB model name from a client's body) costs at most this much in a
# span, an export request and a store row.
MAX_ATTRIBUTE_BYTES = 512
"""Longest string attribute value, in UTF-8 bytes (cut at a character boundary, as OpenTelemetry's
attribute value length limit truncates). 512 holds every legitimate value with room: a Hugging Face model
id is at most 96 characters (an adapter name a few more), an endpoint a DNS name (<= 253) plus ``:port``,
a path ``/v1/chat/completions``, a request id a UUID, an error a one-line description."""
MAX_ATTRIBUTE_LIST = 16
"""Longest list attribute (items beyond it are dropped): the decision's endpoints are the primary plus at
most 4 fallbacks (extproc/headers.py MAX_FALLBACKS), so 16 never cuts a real decision."""
MAX_ATTRIBUTES = 128
"""Most attributes kept per span and per resource by the receiver (OpenTelemetry's default
OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT); the router writes about 30."""


def cap_str(s: str, max_bytes: int = MAX_ATTRIBUTE_BYTES) -> str:
    """`s` cut to at most `max_bytes` UTF-8 bytes (whole characters only)."""
    if len(s) * 4 <= max_bytes:  # cannot be over: no encoding needed (the common case)
        return s
    b = s.encode("utf-8", "replace")  # "replace": a lone surrogate becomes "?" instead of raising
    if len(b) <= max_bytes:
        return s
    return b[:max_bytes].decode("utf-8", "ignore")


def cap_value(v):  # noqa: ANN001, ANN201 - any attribute value
    """An attribute value within the limits: strings capped, lists shortened (and their items capped);
    numbers and booleans as they are; anything else (bytes, dicts from other senders) capped by type."""
    t = type(v)
    if t is str:
        return cap_str(v)
    if t is tuple or t is list:
        return tuple(cap_value(x) for x in v[:MAX_ATTRIBUTE_LIST])
    if t is bytes:
        return v[:MAX_ATTRIBUTE_BYTES]
    if t is dict:
        return {cap_str(str(k)): cap_value(x) for k, x in list(v.items())[:MAX_ATTRIBUTE_LIST]}
    return v

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
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "text_completion"
    if path.endswith("/embeddings"):
        return "embeddings"
    return None

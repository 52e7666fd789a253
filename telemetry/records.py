"""`RequestRecord`: everything the router knows about one routed request, built at response end.

Contract with the ext_proc servicer (the only producer):
- One record per routed request, created when the request headers arrive (`start_time`, ids) and
  filled as the decision and the response arrive; it is handed to `TelemetryRecorder.record` once,
  at response end, and never touched by the servicer afterwards (the recorder keeps a reference).
- Ids are lower-case hex: `trace_id` 32 chars, `span_id`/`parent_span_id` 16 chars (W3C form, see
  tracecontext.py). `span_id` is the router's own span, i.e. the parent the model server sees.
- Times: `start_time` is unix seconds (time.time()) at request-header arrival; durations are in the
  unit their name says and measured on a monotonic clock. ``None`` means "not observed" (e.g. no
  first body byte because the request failed, or usage missing from the response).
- `status` is the HTTP status sent to the client (0 when the stream was reset before headers).
- `predicted_ttft_ms` / `alternative_ttft_ms` are the decision's predictions (routing.types.Decision),
  None for policies without a time model; a prediction is *comparable* with `ttft_ms` when the request
  succeeded (`is_comparable_prediction`) on the primary it was made for.
"""

from __future__ import annotations

import dataclasses
import operator

import xxhash

# The dump/store columns, in output order (the store's `requests` table has these plus end_time, attrs).
RECORD_FIELDS: tuple[str, ...] = (
    "trace_id", "span_id", "parent_span_id", "request_id", "start_time", "model", "tenant_hash", "policy",
    "reason", "endpoint", "endpoints", "matched_blocks", "total_blocks", "predicted_hit_ratio", "predicted_ttft_ms",
    "alternative_endpoint", "alternative_ttft_ms", "decision_us", "ttft_ms", "latency_ms", "prompt_tokens", "completion_tokens", "cached_tokens", "stream", "status", "error",
    "path", "index_source", "gateway_wait_ms", "gateway_outcome", "routing_ms",
)


_FIELD_VALUES = operator.attrgetter(*RECORD_FIELDS)


def tenant_hash(tenant: str | bytes) -> str:
    """The value for `RequestRecord.tenant_hash`: 16 hex chars of xxh3-64 of the tenant key (an API key,
    a user id...), so telemetry can group by tenant without storing the key. Not a secret-grade hash:
    enough to keep keys out of traces and dashboards, not to resist guessing a low-entropy id."""
    return xxhash.xxh3_64_hexdigest(tenant.encode() if isinstance(tenant, str) else tenant)


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One routed request as the router saw it (see the module docstring for the contract)."""

    trace_id: str
    span_id: str
    start_time: float
    parent_span_id: str | None = None  # the incoming traceparent's span, None when the router started the trace
    request_id: str = ""  # x-request-id (Envoy sets one when the client did not)
    model: str | None = None  # "model" of the request body
    tenant_hash: str | None = None  # hashed tenant key (never the raw key)
    policy: str = ""
    reason: str = ""  # routing.types.DecisionReason
    endpoint: str | None = None  # endpoint that served the request (x-gateway-destination-endpoint-served)
    endpoints: tuple[str, ...] = ()  # the decision: primary first, then fallbacks
    matched_blocks: int = 0
    total_blocks: int = 0
    predicted_hit_ratio: float = 0.0  # 0-1
    # The time model's predicted TTFT (ms) at the primary (endpoints[0]) and at the best other endpoint it
    # scored (`alternative_endpoint`): what explains the decision. None when the policy has no time model
    # (or scored no other endpoint); compare with `ttft_ms` only when the primary served the request.
    predicted_ttft_ms: float | None = None
    alternative_endpoint: str | None = None
    alternative_ttft_ms: float | None = None
    # Where the primary's prefix match came from (routing.types.Decision.index_source): "events", "feedback",
    # "approximate"; None when nothing matched.
    index_source: str | None = None
    decision_us: float = 0.0  # time the router spent deciding
    ttft_ms: float | None = None  # request-header arrival to the first response body byte sent on
    latency_ms: float | None = None  # request-header arrival to the end of the response
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens reported by the model server
    stream: bool = False
    status: int = 0
    error: str | None = None  # short failure or refusal description (upstream reset, 5xx or 4xx message, ...)
    path: str = ""  # request path, e.g. /v1/chat/completions
    # Flow control: how long the request was held in the gateway queue (0: never held) and why it
    # left it: "released:REASON" (first_token, release, scrape, arrival) or "shed:REASON" (deadline,
    # predicted_deadline, queue_full, evicted, no_endpoint); None when it was never held nor shed.
    gateway_wait_ms: float = 0.0
    gateway_outcome: str | None = None
    # Envoy's clock: from the request's last byte received to its first byte sent upstream, the
    # routing filter's round trip (and any gateway queue wait, `gateway_wait_ms` of it); None without Envoy's
    # facts record (the observing path) or when Envoy did not wait to route.
    routing_ms: float | None = None

    @property
    def end_time(self) -> float:
        """Unix seconds at response end (start_time when the latency is unknown)."""
        return self.start_time + (self.latency_ms or 0.0) / 1000.0

    @property
    def is_refused(self) -> bool:
        """True for a 4xx: the request was refused (bad input, unknown model, too large...), the client's
        fault; `error` then holds the refusal message. A refusal is never an error."""
        return 400 <= self.status < 500

    @property
    def is_error(self) -> bool:
        """True for a 5xx, a reset (status 0), or a recorded failure of a request that was not refused
        (e.g. a 200 whose stream was cut short). A 4xx is a refusal (`is_refused`), not an error."""
        if self.is_refused:
            return False
        return self.error is not None or self.status == 0 or self.status >= 500

    @property
    def is_comparable_prediction(self) -> bool:
        """True when `predicted_ttft_ms` can be scored against `ttft_ms`: both known, the request neither
        failed nor was refused, and the endpoint that served it is the primary the prediction was for
        (a fallback's TTFT includes the failed attempt at the primary)."""
        return (self.predicted_ttft_ms is not None and self.ttft_ms is not None and not self.is_error
                and not self.is_refused and bool(self.endpoints) and self.endpoint == self.endpoints[0])

    def as_fields(self) -> dict[str, object]:
        """The `RECORD_FIELDS` and their values, in that order (`endpoints` a tuple)."""
        return dict(zip(RECORD_FIELDS, _FIELD_VALUES(self)))

    def to_dict(self) -> dict:
        """The dump form: JSON-able, `endpoints` as a list."""
        d = self.as_fields()
        d["endpoints"] = list(self.endpoints)
        return d

"""Envoy's own replies in the OpenAI error format (`local_reply_config`), and the CEL filter that spares the
router's replies (ext_proc ImmediateResponse) and direct responses."""

from __future__ import annotations

from envoy_data_plane.envoy.config.accesslog.v3 import (AccessLogFilter, AndFilter, ComparisonFilter,
                                                        ComparisonFilterOp, ExtensionFilter, StatusCodeFilter)
from envoy_data_plane.envoy.config.core.v3 import DataSource, RuntimeUInt32, SubstitutionFormatString
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (LocalReplyConfig,
                                                                                          ResponseMapper)
from envoy_data_plane.google.protobuf import Any as ProtoAny

from prefixroute.extproc.envoy_config.common import (UNAVAILABLE_CLOSED_ROUTE, UNAVAILABLE_STATEFUL_ROUTE, error_json,
                                                     set_header)
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.headers import TRANSPORTED_5XX, transport_status

# Local replies that are Envoy's own: not the router's (an ext_proc ImmediateResponse, whose details the
# servicer sets to "prefixroute_<status>", or an ext_authz denied answer, which only the router gives: both already
# carry their OpenAI body) and not a route's direct_response (written in OpenAI format here). CEL runs only when
# Envoy composes a local reply, never on routed traffic.
ENVOY_OWN_REPLY = ("!(response.code_details.startsWith('prefixroute_') || "
                   "response.code_details == 'ext_authz_denied' || response.code_details == 'direct_response')")


def cel_filter(expression: str) -> AccessLogFilter:
    return AccessLogFilter(extension_filter=ExtensionFilter(
        name="envoy.access_loggers.extension_filters.cel",
        typed_config=ProtoAny.pack(ExpressionFilter(expression=expression))))


# Envoy's reason tokens (%RESPONSE_CODE_DETAILS%) that get a sentence of their own; the others fall to their
# status's mapper. Exact tokens from Envoy's source (StreamInfo::ResponseCodeDetails). No literal '%' in a
# message: Envoy reads '%...%' as a substitution command.
_DETAIL_REPLIES: tuple[tuple[int, str, str, dict[str, str]], ...] = (
    (400, "path_normalization_failed",
     "Invalid request path: it cannot be normalised (a malformed percent-encoding or a character a path may not "
     "hold). Send the OpenAI API path, e.g. /v1/chat/completions (a model id's slash may be sent percent-encoded).",
     {}),
    (503, "no_healthy_upstream",
     "No healthy endpoint: no model server behind this gateway can be reached (none resolved, or each one is "
     "failing); retry shortly.", {"retry-after": "1"}),
)


def local_reply_config(s: EnvoySettings) -> LocalReplyConfig:
    own = cel_filter(ENVOY_OWN_REPLY)

    def mapper(status: int | None, message: str, headers: dict[str, str] | None = None, *,
               details: str | None = None) -> ResponseMapper:
        if status is None:  # any other status: the code is Envoy's, filled in at reply time
            body = error_json(500, message).replace('"type":"InternalServerError"', '"type":"Error"').replace(
                '"code":500', '"code":%RESPONSE_CODE%')
            filt = own
        else:
            body = error_json(status, message)
            conditions = [own, AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                op=ComparisonFilterOp.EQ,
                value=RuntimeUInt32(default_value=status, runtime_key=f"prefixroute.local_reply.{status}"))))]
            if details is not None:
                conditions.append(cel_filter(f"response.code_details == '{details}'"))
            filt = AccessLogFilter(and_filter=AndFilter(filters=conditions))
        return ResponseMapper(
            filter=filt,
            body_format_override=SubstitutionFormatString(text_format_source=DataSource(inline_string=body),
                                                          content_type="application/json"),
            headers_to_add=[set_header(k, v) for k, v in (headers or {}).items()])

    def unavailable(route: str, message: str) -> ResponseMapper:
        # The 503 of a route to UNAVAILABLE_CLUSTER (the routing service is down): its own message.
        return ResponseMapper(
            filter=AccessLogFilter(and_filter=AndFilter(filters=[
                own, AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                    op=ComparisonFilterOp.EQ,
                    value=RuntimeUInt32(default_value=503, runtime_key="prefixroute.local_reply.503")))),
                cel_filter(f"xds.route_name.startsWith('{route}')")])),
            body_format_override=SubstitutionFormatString(
                text_format_source=DataSource(inline_string=error_json(503, message)),
                content_type="application/json"),
            headers_to_add=[set_header("retry-after", "1")])

    # The first mapper that matches wins: reason-specific ones first (the routing-unavailable routes' own 503s,
    # then Envoy's details). %RESPONSE_CODE_DETAILS% / %RESPONSE_FLAGS% are Envoy's short reason tokens (e.g.
    # http1.codec_error, UF), kept in parentheses for the operator after a sentence for the client.
    def restored(status: int) -> ResponseMapper:
        # ext_authz over HTTP: the router's 5xx refusal travels at a transport status (authz_http.transport_status:
        # Envoy would take a 5xx for the service's failure); only that filter's denial can carry it. Body and
        # headers (the router's own) are kept.
        return ResponseMapper(
            filter=AccessLogFilter(and_filter=AndFilter(filters=[
                AccessLogFilter(status_code_filter=StatusCodeFilter(comparison=ComparisonFilter(
                    op=ComparisonFilterOp.EQ, value=RuntimeUInt32(
                        default_value=transport_status(status),
                        runtime_key=f"prefixroute.local_reply.authz_{status}")))),
                cel_filter("response.code_details == 'ext_authz_denied'")])),
            status_code=status)

    return LocalReplyConfig(mappers=[
        *(restored(status) for status in TRANSPORTED_5XX if s.routing_processing == "authz-http"),
        unavailable(UNAVAILABLE_STATEFUL_ROUTE, "The routing service is unavailable and a Responses API request must "
                    "reach the endpoint that holds its conversation; retry shortly."),
        unavailable(UNAVAILABLE_CLOSED_ROUTE, "The routing service is unavailable; retry shortly."),
        *(mapper(status, message, headers, details=details) for status, details, message, headers in _DETAIL_REPLIES),
        mapper(400, "Malformed HTTP request (%RESPONSE_CODE_DETAILS%)."),
        mapper(403, "Refused (%RESPONSE_CODE_DETAILS%): CONNECT and protocol upgrades are not supported."),
        mapper(404, "No such path on this gateway (%RESPONSE_CODE_DETAILS%)."),
        mapper(408, "The request did not arrive in time (%RESPONSE_CODE_DETAILS%)."),
        mapper(413, f"Request body too large: the limit is {s.max_request_body_bytes} bytes."),
        # Envoy answers 426 to every request line whose version is not HTTP/1.1 (1.0, 0.9, and 1.2 or 2.0 sent as
        # HTTP/1 text alike: one reason token, low_version), so the sentence names none of them.
        mapper(426, "Unsupported HTTP version: this gateway serves HTTP/1.1 and HTTP/2 only (an HTTP/2 request is "
                    "a binary connection, never an HTTP/2.0 request line)."),
        mapper(431, f"Request headers too large: the limit is {s.max_request_headers_kb} KiB."),
        mapper(501, "Not implemented (%RESPONSE_CODE_DETAILS%)."),
        mapper(502, "Bad response from the endpoint (%RESPONSE_FLAGS%)."),
        mapper(503, "No endpoint could serve the request: each one tried refused or dropped the connection; retry "
                    "shortly (%RESPONSE_FLAGS%).", {"retry-after": "1"}),
        mapper(504, "The endpoint did not answer in time (%RESPONSE_FLAGS%)."),
        mapper(None, "Gateway error (%RESPONSE_CODE_DETAILS%)."),
    ])

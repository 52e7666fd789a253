"""Envoy's own record of every routed request, as OTLP logs to the telemetry receiver (`records_otlp_address`)."""

from __future__ import annotations

from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog, AccessLogFilter, ExtensionFilter
from envoy_data_plane.envoy.config.cluster.v3 import Cluster
from envoy_data_plane.envoy.config.core.v3 import DataSource, GrpcService, GrpcServiceEnvoyGrpc, Http2ProtocolOptions
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.extensions.access_loggers.open_telemetry.v3 import OpenTelemetryAccessLogConfig
from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import GenericSecret, Secret
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (HttpProtocolOptions,
                                                                 HttpProtocolOptionsExplicitHttpConfig)
from envoy_data_plane.google.protobuf import Any as ProtoAny
from envoy_data_plane.opentelemetry.proto.common.v1 import AnyValue, KeyValue, KeyValueList

from prefixroute.extproc.envoy_config.auth import credential_filters
from prefixroute.extproc.envoy_config.clusters import strict_dns_cluster
from prefixroute.extproc.envoy_config.common import duration
from prefixroute.extproc.envoy_config.envoy_settings import EnvoySettings
from prefixroute.extproc.envoy_config.timing import TIMING_ATTRIBUTES

RECORDS_CLUSTER = "prefixroute_records_otlp"
RECORDS_TOKEN_SECRET = "prefixroute_records_token"
RECORD_ATTRIBUTES = {
    "prefixroute.envoy_record": "1", "prefixroute.request_id": "%REQ(X-REQUEST-ID)%", "prefixroute.path": "%PATH%",
    "prefixroute.status": "%RESPONSE_CODE%", "prefixroute.latency_ms": "%DURATION%",
    "prefixroute.start_time": "%START_TIME(%s.%6f)%", "prefixroute.endpoint": "%UPSTREAM_HOST%",
    "prefixroute.response_flags": "%RESPONSE_FLAGS%", "prefixroute.route": "%ROUTE_NAME%", **TIMING_ATTRIBUTES}
"""What Envoy's record of a request says (telemetry/otlp_decode.py `envoy_log_to_row` reads these names); the
timing ones (TTFT and duration from Envoy's clock) are described in timing.py."""


def records_access_log(s: EnvoySettings) -> tuple[list[AccessLog], Cluster | None, Secret | None]:
    """Envoy's own record of every routed request, as OTLP logs to `records_otlp_address` (requests in
    flight when the router died had no record). Not for Envoy's health route and the paths it refuses itself."""
    if not s.records_otlp_address:
        return [], None, None
    token = None
    if s.records_otlp_token_file:
        token = Secret(name=RECORDS_TOKEN_SECRET,
                       generic_secret=GenericSecret(secret=DataSource(filename=s.records_otlp_token_file)))
    cluster = strict_dns_cluster(RECORDS_CLUSTER, [s.records_otlp_address], 1.0, typed_extension_protocol_options={
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": ProtoAny.pack(HttpProtocolOptions(
            explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(http2_protocol_options=Http2ProtocolOptions()),
            http_filters=credential_filters(RECORDS_TOKEN_SECRET) if token is not None else []))})
    config = OpenTelemetryAccessLogConfig(
        log_name="prefixroute.requests", buffer_flush_interval=duration(1),
        grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=RECORDS_CLUSTER)),
        attributes=KeyValueList(values=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in (
            RECORD_ATTRIBUTES).items()]))
    skip = " || ".join(f"xds.route_name == '{r}'" for r in ("gateway_health", "path_not_allowed",
                                                            "connect_not_allowed"))
    log = AccessLog(name="envoy.access_loggers.open_telemetry", typed_config=ProtoAny.pack(config),
                    filter=AccessLogFilter(extension_filter=ExtensionFilter(
                        name="envoy.access_loggers.extension_filters.cel",
                        typed_config=ProtoAny.pack(ExpressionFilter(expression=f"!({skip})")))))
    return [log], cluster, token

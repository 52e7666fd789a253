"""The Envoy ext_proc wire protocol: upb protobuf message classes and the gRPC service binding.

The classes come from prefixroute's own subset of Envoy's protos (extproc/proto/, Envoy 1.40 API: same
packages, names and field numbers), compiled at build time into a descriptor set (setup.py) and loaded
here into a PRIVATE descriptor pool. Nothing is registered in protobuf's default pool, so any other copy of
`envoy.service.ext_proc.v3.*` in the same process (xds-protos, generated code of another project) cannot
clash with these, whatever the install order or import order.

Messages are the protobuf runtime's own (upb) classes: parsing and serialising cost what generated `_pb2`
classes cost. They are distinct from other pools' classes of the same name: a `Struct` for
`ProcessingResponse.dynamic_metadata` must be this module's `Struct`.

The service binding needs no generated `_pb2_grpc`: `add_to_server` registers a stream-stream handler
for `SERVICE_NAME`/`PROCESS_METHOD`, `process_call` is the client side (tests, tools). The gRPC health service
(grpc.health.v1, extproc/proto/health_v1.proto) is compiled into the same private pool: `add_health_to_server`,
`health_check_call`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

DESCRIPTOR_SET = Path(__file__).with_name("wire.binpb")
"""The compiled extproc/proto/*.proto with their imports (a serialized FileDescriptorSet), written by
setup.py's build_proto into the installed package (the source folder for an editable install)."""


def _load_pool(path: Path) -> descriptor_pool.DescriptorPool:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImportError(
            f"{path} is missing: prefixroute's ext_proc protocol classes are compiled when the package is built. "
            "Install the package (`pip install .`, or `pip install -e .` for development; ./scripts/test does) "
            "instead of importing it from a source checkout, and reinstall after editing extproc/proto/."
        ) from None
    pool = descriptor_pool.DescriptorPool()
    # protoc --include_imports lists files in dependency order, so each file's imports are already added.
    for file_proto in descriptor_pb2.FileDescriptorSet.FromString(data).file:
        pool.Add(file_proto)
    return pool


POOL = _load_pool(DESCRIPTOR_SET)
"""The private pool holding every descriptor of this module's classes."""


def _message(full_name: str) -> Any:
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(full_name))


_EXT_PROC = "envoy.service.ext_proc.v3"
ProcessingRequest = _message(f"{_EXT_PROC}.ProcessingRequest")
ProcessingResponse = _message(f"{_EXT_PROC}.ProcessingResponse")
HttpHeaders = _message(f"{_EXT_PROC}.HttpHeaders")
HttpBody = _message(f"{_EXT_PROC}.HttpBody")
HttpTrailers = _message(f"{_EXT_PROC}.HttpTrailers")
HeadersResponse = _message(f"{_EXT_PROC}.HeadersResponse")
BodyResponse = _message(f"{_EXT_PROC}.BodyResponse")
TrailersResponse = _message(f"{_EXT_PROC}.TrailersResponse")
CommonResponse = _message(f"{_EXT_PROC}.CommonResponse")
HeaderMutation = _message(f"{_EXT_PROC}.HeaderMutation")
ImmediateResponse = _message(f"{_EXT_PROC}.ImmediateResponse")
BodyMutation = _message(f"{_EXT_PROC}.BodyMutation")
StreamedBodyResponse = _message(f"{_EXT_PROC}.StreamedBodyResponse")
ProtocolConfiguration = _message(f"{_EXT_PROC}.ProtocolConfiguration")
HeaderValue = _message("envoy.config.core.v3.HeaderValue")
HeaderMap = _message("envoy.config.core.v3.HeaderMap")
HeaderValueOption = _message("envoy.config.core.v3.HeaderValueOption")
Metadata = _message("envoy.config.core.v3.Metadata")
HttpStatus = _message("envoy.type.v3.HttpStatus")
Struct = _message("google.protobuf.Struct")  # this pool's copy (protobuf's Struct helpers apply to it too)

FULL_DUPLEX_STREAMED: int = POOL.FindEnumTypeByName(
    "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode").values_by_name["FULL_DUPLEX_STREAMED"].number
"""`ProtocolConfiguration.request_body_mode` of a filter configured as the Gateway API Inference Extension's."""

_SERVICE = POOL.FindServiceByName(f"{_EXT_PROC}.ExternalProcessor")
SERVICE_NAME: str = _SERVICE.full_name
PROCESS_METHOD: str = _SERVICE.methods_by_name["Process"].name
PROCESS_PATH = f"/{SERVICE_NAME}/{PROCESS_METHOD}"

HealthCheckRequest = _message("grpc.health.v1.HealthCheckRequest")
HealthCheckResponse = _message("grpc.health.v1.HealthCheckResponse")
HEALTH_SERVICE_NAME: str = POOL.FindServiceByName("grpc.health.v1.Health").full_name
HEALTH_CHECK_PATH = f"/{HEALTH_SERVICE_NAME}/Check"


def header_value(headers: Iterable[Any], name: str) -> str | None:
    """The value of the first HeaderValue called `name` in `headers` (None when absent). Envoy sends
    `raw_value` (bytes, read as latin-1 like HTTP/1 octets); older senders `value`."""
    for h in headers:
        if h.key == name:
            raw = h.raw_value
            return raw.decode("latin-1") if raw else h.value
    return None


def header_dict(headers: Iterable[Any]) -> dict[str, str]:
    """HeaderValues as a dict (values read as `header_value` does; the last of a repeated name wins)."""
    out = {}
    for h in headers:
        raw = h.raw_value  # read once: each read of a upb field builds a new object
        out[h.key] = raw.decode("latin-1") if raw else h.value
    return out


def serialize(message: Any) -> bytes:
    """A ProcessingResponse's wire bytes; bytes pass through unchanged (answers.with_traceparent builds answers
    at the byte level)."""
    return message if message.__class__ is bytes else message.SerializeToString()


def add_to_server(server: grpc.aio.Server, process: Callable[..., Any]) -> None:
    """Serve `process(request_iterator, context)` as ExternalProcessor.Process (a stream both ways).
    Registered by name, so gRPC matches the method without a per-call handler lookup."""
    handler = grpc.stream_stream_rpc_method_handler(process, request_deserializer=ProcessingRequest.FromString,
                                                    response_serializer=serialize)
    server.add_registered_method_handlers(SERVICE_NAME, {PROCESS_METHOD: handler})


def add_health_to_server(server: grpc.aio.Server, check: Callable[..., Any]) -> None:
    """Serve `check(request, context)` as grpc.health.v1.Health/Check (unary). Watch is not registered, so gRPC
    answers it UNIMPLEMENTED (as GIE's reference picker does)."""
    handler = grpc.unary_unary_rpc_method_handler(check, request_deserializer=HealthCheckRequest.FromString,
                                                  response_serializer=HealthCheckResponse.SerializeToString)
    server.add_registered_method_handlers(HEALTH_SERVICE_NAME, {"Check": handler})


def health_check_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    """The client side of Health/Check on `channel` (tests, tools)."""
    return channel.unary_unary(HEALTH_CHECK_PATH, request_serializer=HealthCheckRequest.SerializeToString,
                               response_deserializer=HealthCheckResponse.FromString)


def process_call(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """The client side of Process on `channel`: calling it opens one stream."""
    return channel.stream_stream(PROCESS_PATH, request_serializer=ProcessingRequest.SerializeToString,
                                 response_deserializer=ProcessingResponse.FromString)

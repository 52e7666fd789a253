"""prefixroute's ext_proc wire classes (extproc/proto/, wire.py) against Envoy's own definitions.

Every message, field, enum value and the service in the built descriptor set is compared with
envoy-data-plane's classes of the Envoy API (number, type, repeated/map, oneof group, message or enum type
name, streaming), so a typo in a .proto cannot pass; the mutation cases show the comparison catches each
kind of mistake. Then: the classes stay private (nothing in protobuf's default pool; another definition of
the same names in the same process changes nothing: tests/integration/extproc/test_wire_processes.py) and they
speak the wire format Envoy's classes do.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import types
import typing
from pathlib import Path

import pytest
from envoy_data_plane.message_pool import default_message_pool
from google.protobuf import descriptor_pb2, descriptor_pool

from prefixroute.extproc import wire

ROOT = Path(__file__).resolve().parents[3]
ENVOY_PACKAGE = "envoy."


def _betterproto_module(package: str) -> types.ModuleType:
    return importlib.import_module(f"envoy_data_plane.{package}")


def _betterproto_message(descriptor) -> type | None:  # noqa: ANN001 - a message Descriptor
    _betterproto_module(descriptor.file.package)  # importing a package module registers its messages
    return default_message_pool.url_to_type.get(f"type.googleapis.com/{descriptor.full_name}")


def _betterproto_name(cls: type) -> str:
    """Full proto name of an envoy-data-plane class: messages are registered in its pool; enums are named
    <package module>.<nested names joined> (HeaderValueOption.HeaderAppendAction ->
    HeaderValueOptionHeaderAppendAction). Well-known types it unwraps to Python's own are named as the proto
    type they stand for (a Duration field is a `datetime.timedelta` there)."""
    if cls is datetime.timedelta:
        return "google.protobuf.Duration"
    url = default_message_pool.type_to_url.get(cls)
    if url is not None:
        return url.removeprefix("type.googleapis.com/")
    return f"{cls.__module__.removeprefix('envoy_data_plane.')}.{cls.__name__}"


def _flat_name(descriptor) -> str:  # noqa: ANN001 - a message or enum descriptor
    package = descriptor.file.package
    return f"{package}.{descriptor.full_name.removeprefix(package + '.').replace('.', '')}"


def _element_type(hint: typing.Any) -> typing.Any:
    """The class inside `X | None` / `list[X]` annotations."""
    if typing.get_origin(hint) in (list, types.UnionType, typing.Union):
        return _element_type(next(a for a in typing.get_args(hint) if a is not type(None)))
    return hint


def _proto_type(field) -> str:  # noqa: ANN001 - a FieldDescriptor
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "map"
    name = descriptor_pb2.FieldDescriptorProto.Type.Name(field.type)  # TYPE_MESSAGE
    return name.removeprefix("TYPE_").lower()


def _check_message(msg, problems: list[str]) -> None:  # noqa: ANN001 - a Descriptor
    cls = _betterproto_message(msg)
    if cls is None:
        problems.append(f"{msg.full_name}: no such message in Envoy's API")
        return
    theirs = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for field in msg.fields:
        where = f"{msg.full_name}.{field.name}"
        if field.name not in theirs:
            problems.append(f"{where}: no such field in Envoy's {msg.full_name}")
            continue
        meta = theirs[field.name].metadata["betterproto"]
        ours_type = _proto_type(field)
        checks = {
            "number": (field.number, meta.number),
            "type": (ours_type, meta.proto_type),
            "repeated": (field.is_repeated and ours_type != "map", meta.repeated),
            "oneof": (field.containing_oneof.name if field.containing_oneof else None, meta.group),
        }
        sub = field.message_type or field.enum_type
        if sub is not None and ours_type != "map":
            theirs_sub = _element_type(hints[field.name])
            ours_name = sub.full_name if field.message_type is not None else _flat_name(sub)
            checks["type name"] = (ours_name, _betterproto_name(theirs_sub))
        for what, (ours, envoys) in checks.items():
            if ours != envoys:
                problems.append(f"{where}: {what} {ours!r}, Envoy's is {envoys!r}")
    for nested in msg.nested_types:
        if not nested.GetOptions().map_entry:  # a map field's synthetic entry type (checked as the map field)
            _check_message(nested, problems)
    for enum in msg.enum_types:
        _check_enum(enum, problems)


def _check_enum(enum, problems: list[str]) -> None:  # noqa: ANN001 - an EnumDescriptor
    module = _betterproto_module(enum.file.package)
    cls = getattr(module, _flat_name(enum).rsplit(".", 1)[1], None)
    if cls is None:
        problems.append(f"{enum.full_name}: no such enum in Envoy's API")
        return
    members = {m.name: m.value for m in cls}
    for value in enum.values:
        if members.get(value.name) != value.number:
            problems.append(f"{enum.full_name}.{value.name} = {value.number}, Envoy's is {members.get(value.name)}")


def _check_service(service, problems: list[str]) -> None:  # noqa: ANN001 - a ServiceDescriptor
    base = getattr(_betterproto_module(service.file.package), f"{service.name}Base", None)
    if base is None:
        problems.append(f"{service.full_name}: no such service in Envoy's API")
        return
    handlers = object.__new__(base).__mapping__()
    for method in service.methods:
        path = f"/{service.full_name}/{method.name}"
        handler = handlers.get(path)
        if handler is None:
            problems.append(f"{path}: no such method in Envoy's API")
            continue
        streaming = {(False, False): "UNARY_UNARY", (True, False): "STREAM_UNARY", (False, True): "UNARY_STREAM",
                     (True, True): "STREAM_STREAM"}[(method.client_streaming, method.server_streaming)]
        checks = {"streaming": (streaming, handler.cardinality.name),
                  "input": (method.input_type.full_name, _betterproto_name(handler.request_type)),
                  "output": (method.output_type.full_name, _betterproto_name(handler.reply_type))}
        for what, (ours, envoys) in checks.items():
            if ours != envoys:
                problems.append(f"{path}: {what} {ours!r}, Envoy's is {envoys!r}")


def envoy_mismatches(files: list) -> list[str]:
    """Every difference between the Envoy-package parts of `files` (FileDescriptors) and Envoy's API."""
    problems: list[str] = []
    for file in files:
        if not file.package.startswith(ENVOY_PACKAGE):
            continue  # google/protobuf/struct.proto: protobuf's own, shipped with protoc
        for msg in file.message_types_by_name.values():
            _check_message(msg, problems)
        for enum in file.enum_types_by_name.values():
            _check_enum(enum, problems)
        for service in file.services_by_name.values():
            _check_service(service, problems)
    return problems


def _file_protos() -> list[descriptor_pb2.FileDescriptorProto]:
    return list(descriptor_pb2.FileDescriptorSet.FromString(wire.DESCRIPTOR_SET.read_bytes()).file)


def _files(protos: list[descriptor_pb2.FileDescriptorProto]) -> list:
    pool = descriptor_pool.DescriptorPool()
    for p in protos:
        pool.Add(p)
    return [pool.FindFileByName(p.name) for p in protos]


def test_built_descriptors_cover_the_envoy_packages_the_health_service_and_the_services():
    packages = {f.package for f in _files(_file_protos())}
    assert packages == {"envoy.service.ext_proc.v3", "envoy.config.core.v3", "envoy.type.v3",
                        "envoy.extensions.filters.http.ext_proc.v3", "grpc.health.v1", "google.protobuf"}
    assert wire.PROCESS_PATH == "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    assert wire.HEALTH_CHECK_PATH == "/grpc.health.v1.Health/Check"


def _shape(descriptor) -> dict:  # noqa: ANN001 - a message, enum or service descriptor
    """Names, numbers, types and nesting of a descriptor, for comparing two definitions of one proto."""
    if hasattr(descriptor, "values"):  # an enum
        return {v.name: v.number for v in descriptor.values}
    if hasattr(descriptor, "methods"):  # a service
        return {m.name: (m.input_type.full_name, m.output_type.full_name, m.client_streaming, m.server_streaming)
                for m in descriptor.methods}
    return {"fields": {f.name: (f.number, f.type, f.message_type.full_name if f.message_type else None,
                                f.enum_type.full_name if f.enum_type else None) for f in descriptor.fields},
            "enums": {e.name: _shape(e) for e in descriptor.enum_types}}


def test_the_health_service_matches_grpcs_own_definition():
    """extproc/proto/health_v1.proto against grpcio-health-checking's grpc/health/v1/health.proto (the gRPC
    project's release): same messages, fields, enum values and methods (theirs may hold more: List)."""
    from grpc_health.v1 import health_pb2

    theirs = health_pb2.DESCRIPTOR
    ours = wire.POOL.FindFileByName("health_v1.proto")
    for name in ("HealthCheckRequest", "HealthCheckResponse"):
        assert _shape(ours.message_types_by_name[name]) == _shape(theirs.message_types_by_name[name]), name
    our_methods = _shape(ours.services_by_name["Health"])
    their_methods = _shape(theirs.services_by_name["Health"])
    assert our_methods == {k: their_methods[k] for k in our_methods} and set(our_methods) == {"Check", "Watch"}


def test_every_message_field_enum_and_method_matches_envoys_api():
    assert envoy_mismatches(_files(_file_protos())) == []


def _mutate(protos: list, file_name: str, message: str, change) -> list:  # noqa: ANN001
    protos = [type(p).FromString(p.SerializeToString()) for p in protos]
    file = next(p for p in protos if p.name == file_name)
    change(next(m for m in file.message_type if m.name == message), file)
    return protos


def _field(msg, name: str):  # noqa: ANN001, ANN202
    return next(f for f in msg.field if f.name == name)


def _set(obj, **values) -> None:  # noqa: ANN001
    for k, v in values.items():
        setattr(obj, k, v)


T = descriptor_pb2.FieldDescriptorProto


@pytest.mark.parametrize(("file_name", "message", "change", "expected"), [
    ("ext_proc_v3.proto", "ProcessingRequest", lambda m, f: _set(_field(m, "request_body"), number=12),
     "ProcessingRequest.request_body: number 12, Envoy's is 4"),
    ("ext_proc_v3.proto", "HttpBody", lambda m, f: _set(_field(m, "body"), type=T.TYPE_STRING),
     "HttpBody.body: type 'string', Envoy's is 'bytes'"),
    ("ext_proc_v3.proto", "HeaderMutation", lambda m, f: _set(_field(m, "set_headers"), label=T.LABEL_OPTIONAL),
     "HeaderMutation.set_headers: repeated False, Envoy's is True"),
    ("ext_proc_v3.proto", "ProcessingResponse", lambda m, f: _field(m, "immediate_response").ClearField("oneof_index"),
     "ProcessingResponse.immediate_response: oneof None, Envoy's is 'response'"),
    ("ext_proc_v3.proto", "HttpHeaders",
     lambda m, f: _set(_field(m, "headers"), type_name=".envoy.config.core.v3.HeaderValue"),
     "HttpHeaders.headers: type name 'envoy.config.core.v3.HeaderValue', Envoy's is 'envoy.config.core.v3.HeaderMap'"),
    ("ext_proc_v3.proto", "CommonResponse", lambda m, f: _set(_field(m, "clear_route_cache"), name="clear_cache"),
     "CommonResponse.clear_cache: no such field"),
    ("core_v3.proto", "HeaderValueOption", lambda m, f: _set(m.enum_type[0].value[2], number=7),
     "HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD = 7, Envoy's is 2"),
    ("ext_proc_v3.proto", "ProcessingRequest", lambda m, f: _set(f.service[0].method[0], client_streaming=False),
     "Process: streaming 'UNARY_STREAM', Envoy's is 'STREAM_STREAM'"),
])
def test_the_comparison_catches_each_kind_of_mistake(file_name, message, change, expected):  # noqa: ANN001
    problems = envoy_mismatches(_files(_mutate(_file_protos(), file_name, message, change)))
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_descriptor_set_is_built_from_the_current_proto_sources():
    # An editable install compiles once: a .proto edited afterwards needs a reinstall (./scripts/test does).
    protos = sorted((ROOT / "extproc" / "proto").glob("*.proto"))
    assert protos, "no .proto sources found"
    assert {p.name for p in protos} == {f.name for f in _file_protos() if not f.name.startswith("google/")}
    built = wire.DESCRIPTOR_SET.stat().st_mtime
    stale = [p.name for p in protos if p.stat().st_mtime > built]
    assert not stale, f"{stale} changed after {wire.DESCRIPTOR_SET} was built: reinstall (pip install -e .)"


def test_nothing_is_registered_in_the_default_pool():
    default = descriptor_pool.Default()
    with pytest.raises(KeyError):
        default.FindMessageTypeByName("envoy.service.ext_proc.v3.ProcessingRequest")
    assert wire.ProcessingRequest.DESCRIPTOR.file.pool is wire.POOL


def test_messages_round_trip_with_envoys_own_classes():
    """Bytes from our classes parse as Envoy's (envoy-data-plane) and back, field for field."""
    from envoy_data_plane.envoy.service.ext_proc import v3 as envoy

    ours = wire.ProcessingResponse(
        request_body=wire.BodyResponse(response=wire.CommonResponse(
            header_mutation=wire.HeaderMutation(set_headers=[wire.HeaderValueOption(
                header=wire.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"),
                append_action=wire.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]),
            clear_route_cache=True)))
    ours.dynamic_metadata.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint"] = "10.0.0.1:8000"
    theirs = envoy.ProcessingResponse.parse(ours.SerializeToString())
    option = theirs.request_body.response.header_mutation.set_headers[0]
    assert (option.header.key, option.header.raw_value, option.append_action.name) == (
        "x-gateway-destination-endpoint", b"10.0.0.1:8000", "OVERWRITE_IF_EXISTS_OR_ADD")
    assert theirs.request_body.response.clear_route_cache is True
    assert theirs.dynamic_metadata.to_dict() == {"envoy.lb": {"x-gateway-destination-endpoint": "10.0.0.1:8000"}}

    immediate = wire.ProcessingResponse(immediate_response=wire.ImmediateResponse(
        status=wire.HttpStatus(code=503), body=b'{"error": {}}', details="prefixroute_503"))
    theirs_immediate = envoy.ProcessingResponse.parse(immediate.SerializeToString()).immediate_response
    assert (theirs_immediate.status.code.value, theirs_immediate.body, theirs_immediate.details) == (
        503, b'{"error": {}}', "prefixroute_503")

    request = envoy.ProcessingRequest(
        request_headers=envoy.HttpHeaders(headers=_core_header_map(), end_of_stream=True), observability_mode=True)
    parsed = wire.ProcessingRequest.FromString(bytes(request))
    assert parsed.WhichOneof("request") == "request_headers" and parsed.observability_mode
    assert [(h.key, h.raw_value) for h in parsed.request_headers.headers.headers] == [(":path", b"/v1/models")]
    assert parsed.request_headers.end_of_stream


def _core_header_map():  # noqa: ANN202
    from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue

    return HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/models")])


def test_a_source_checkout_without_a_build_fails_with_an_install_hint(tmp_path: Path):
    with pytest.raises(ImportError, match=r"Install the package \(`pip install \.`"):
        wire._load_pool(tmp_path / "wire.binpb")


def test_header_values_read_raw_value_as_latin1_else_value():
    headers = [wire.HeaderValue(key="a", raw_value="é".encode("latin-1")), wire.HeaderValue(key="b", value="old"),
               wire.HeaderValue(key="a", raw_value=b"second")]
    assert wire.header_dict(headers) == {"a": "second", "b": "old"}
    assert (wire.header_value(headers, "a"), wire.header_value(headers, "b"), wire.header_value(headers, "c")) == (
        "é", "old", None)

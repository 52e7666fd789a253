# Sourced by scripts/test and scripts/up after installing the project into "$VENV".
# xds-protos ships an old copy of the OpenTelemetry protos (opentelemetry/proto/...) that overwrites
# opentelemetry-proto's files when pip happens to install it second; the OTLP exporter then fails to import
# (`cannot import name 'InstrumentationScope'`). Reinstalling opentelemetry-proto alone puts its files back.
if ! "$VENV/bin/python" -c "from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope" 2>/dev/null; then
  otel_proto_version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('opentelemetry-proto'))")
  "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "opentelemetry-proto==$otel_proto_version"
fi

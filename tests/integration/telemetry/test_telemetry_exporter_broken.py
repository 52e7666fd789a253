"""A broken OTLP exporter library (another package overwrote opentelemetry-proto's files, as xds-protos does
when installed after it) turns traces off with a clear reason; the router still starts and routes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from helpers.procs import free_port

pytestmark = pytest.mark.integration

# Makes `import opentelemetry.exporter.otlp.proto.grpc.trace_exporter` raise ImportError, as the overwritten
# protobuf modules do (`cannot import name 'InstrumentationScope'`), then runs the real CLI.
_BROKEN_EXPORTER = textwrap.dedent("""
    import sys
    sys.modules["opentelemetry.exporter.otlp.proto.grpc.trace_exporter"] = None
    from prefixroute.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_recorder_starts_disabled_and_says_why():
    code = textwrap.dedent("""
        import sys
        sys.modules["opentelemetry.exporter.otlp.proto.grpc.trace_exporter"] = None
        from prefixroute.telemetry.recorder import TelemetryRecorder
        r = TelemetryRecorder(environ={})
        print(r.enabled, r.disabled_reason)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("False the OTLP exporter cannot be imported")
    assert "traces are off" in out.stderr


def test_extproc_serves_with_traces_off_when_the_exporter_cannot_be_imported(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _BROKEN_EXPORTER, "extproc", "--port", str(port),
                             "--listen-address", "127.0.0.1", "--endpoints", "127.0.0.1:1",
                             "--ready-timeout-s", "0.2", "--metrics-port", "-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if line.startswith("prefixroute extproc ready on"):
                break
        assert line.startswith("prefixroute extproc ready on"), (line, proc.poll())
        assert "traces off: the OTLP exporter cannot be imported" in line
    finally:
        proc.terminate()
        proc.wait(20)
    assert proc.returncode == 0

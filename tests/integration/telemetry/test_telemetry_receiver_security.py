"""The OTLP receiver's TLS, client certificates and bearer token (issue 11, finding 3), with real processes:
a `prefixroute telemetry` receiver, forged OTLP senders (raw gRPC) and the router's real exporter.

Forged spans without the client certificate or the token are refused and leave no rows; the router's
export with mTLS + token (standard OTEL_EXPORTER_OTLP_* variables, an https:// endpoint) lands rows; the
HTTP query API wants the same token; `telemetry dump --url` and the dashboard's HTTP source send it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from prefixroute.telemetry.client import HttpStoreClient, TelemetryUnavailable
from prefixroute.telemetry.recorder import TelemetryRecorder
from prefixroute.telemetry.records import RequestRecord
from prefixroute.telemetry.tracecontext import child_context
from helpers.receiver import start_receiver
from helpers.tls import make_pki
from helpers.waiting import until

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(pki, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secured")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    r = start_receiver(tmp / "telemetry.db", "--tls-cert-file", str(pki.server_cert), "--tls-key-file",
                       str(pki.server_key), "--tls-client-ca-file", str(pki.ca_cert), "--auth-token-file",
                       str(token_file))
    yield r
    r.stop()


def forged_request(n: int = 24) -> trace_service_pb2.ExportTraceServiceRequest:
    """What the afternoon's attacker sent: router spans with a perfect hit rate on invented endpoints."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    now = time.time_ns()
    for i in range(n):
        s = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name="prefixroute.route",
                 start_time_unix_nano=now, end_time_unix_nano=now + 1000)
        for k, v in (("prefixroute.endpoint", f"10.66.6.{i}:80"), ("prefixroute.request_id", f"forged-{i}")):
            s.attributes.append(KeyValue(key=k, value=AnyValue(string_value=v)))
        for k in ("gen_ai.usage.input_tokens", "prefixroute.cached_tokens"):
            s.attributes.append(KeyValue(key=k, value=AnyValue(int_value=1000)))
        spans.append(s)
    return req


def export(channel: grpc.Channel, metadata=()) -> grpc.StatusCode:
    stub = trace_service_pb2_grpc.TraceServiceStub(channel)
    try:
        stub.Export(forged_request(), metadata=metadata, timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


def num_rows(r) -> int:
    req = urllib.request.Request(r.http_url + "/api/stats", headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())["num_requests"]


def creds(pki, *, client: bool = True, ca=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(ca or pki.ca_cert).read_bytes(),
        private_key=pki.client_key.read_bytes() if client else None,
        certificate_chain=pki.client_cert.read_bytes() if client else None)


def test_forged_spans_without_certificate_or_token_are_refused_and_leave_no_rows(secured, pki, tmp_path):
    addr = f"127.0.0.1:{secured.otlp_port}"
    auth = (("authorization", f"Bearer {TOKEN}"),)
    other = make_pki(tmp_path / "other")  # a client certificate from a CA the receiver does not trust
    attempts = {
        "plaintext, with the token": export(grpc.insecure_channel(addr), auth),
        "TLS without a client certificate, with the token": export(grpc.secure_channel(addr, creds(pki, client=False)),
                                                                   auth),
        "TLS, untrusted client certificate, with the token": export(grpc.secure_channel(addr, grpc.ssl_channel_credentials(
            root_certificates=pki.ca_cert.read_bytes(), private_key=other.client_key.read_bytes(),
            certificate_chain=other.client_cert.read_bytes())), auth),
        "mTLS, no token": export(grpc.secure_channel(addr, creds(pki))),
        "mTLS, wrong token": export(grpc.secure_channel(addr, creds(pki)), (("authorization", f"Bearer {TOKEN}x"),)),
        "mTLS, token without the Bearer scheme": export(grpc.secure_channel(addr, creds(pki)),
                                                        (("authorization", TOKEN),)),
    }
    assert all(code != grpc.StatusCode.OK for code in attempts.values()), attempts
    assert attempts["mTLS, no token"] == grpc.StatusCode.UNAUTHENTICATED
    assert attempts["mTLS, wrong token"] == grpc.StatusCode.UNAUTHENTICATED
    time.sleep(0.3)  # lets time pass on purpose: nothing refused may be stored meanwhile
    assert num_rows(secured) == 0
    # Control: the same forged request with certificate and token is stored, so the refusals above were real.
    assert export(grpc.secure_channel(addr, creds(pki)), auth) == grpc.StatusCode.OK
    until(lambda: num_rows(secured) >= 24, 10, message="the control's 24 rows stored")
    assert num_rows(secured) == 24


def test_router_export_with_mtls_and_token_lands_rows(secured, pki, monkeypatch):
    before = num_rows(secured)
    # The standard OpenTelemetry variables, as an operator sets them for `prefixroute extproc` / `gateway`.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE", str(pki.ca_cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE", str(pki.client_cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", str(pki.client_key))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{TOKEN}")
    recorder = TelemetryRecorder(endpoint=f"https://localhost:{secured.otlp_port}", environ={}, schedule_delay_ms=20)
    ids = []
    for i in range(20):
        ctx = child_context(None)
        ids.append(ctx.trace_id)
        recorder.record(RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=time.time(),
                                      request_id=f"mtls-{i}", status=200, endpoint="127.0.0.1:8000"))
    assert recorder.force_flush(15)
    recorder.shutdown(5)
    assert recorder.num_exported == 20 and recorder.num_lost == 0, recorder.stats()
    until(lambda: num_rows(secured) >= before + 20, 10, message="the router's 20 rows stored")
    client = HttpStoreClient(secured.http_url, token=TOKEN)
    got = {r["trace_id"] for r in client.iter_requests(60)}
    assert set(ids) <= got


def test_router_export_with_a_wrong_token_is_counted_as_rejected(secured, pki, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(pki.ca_cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", str(pki.client_cert))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CLIENT_KEY", str(pki.client_key))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20nope")
    before = num_rows(secured)
    recorder = TelemetryRecorder(endpoint=f"https://localhost:{secured.otlp_port}", environ={}, schedule_delay_ms=20)
    for i in range(5):
        ctx = child_context(None)
        recorder.record(RequestRecord(trace_id=ctx.trace_id, span_id=ctx.span_id, start_time=time.time(), status=200))
    recorder.force_flush(10)
    recorder.shutdown(2)
    assert recorder.dropped_by_reason["rejected"] == 5 and recorder.num_exported == 0  # lost, but counted
    assert num_rows(secured) == before


def test_http_api_wants_the_token(secured):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {TOKEN}"}):
        req = urllib.request.Request(secured.http_url + "/api/recent", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 401
        body = json.loads(err.value.read())
        assert body["error"]["code"] == 401 and "token" in body["error"]["message"]
    with urllib.request.urlopen(secured.http_url + "/healthz", timeout=5) as resp:  # health checks need no token
        assert resp.status == 200
    with pytest.raises(TelemetryUnavailable, match="401"):
        HttpStoreClient(secured.http_url).summary(60)
    assert HttpStoreClient(secured.http_url, token=TOKEN).summary(60)["num_requests"] >= 0
    # `telemetry dump --url` authenticates with the receiver's own token variable.
    env = {**os.environ, "PREFIXROUTE_TELEMETRY_AUTH_TOKEN": TOKEN}
    res = subprocess.run([sys.executable, "-m", "prefixroute", "telemetry", "dump", "--since", "600", "--url",
                          secured.http_url], capture_output=True, text=True, timeout=30, env=env)
    assert res.returncode == 0, res.stderr
    env.pop("PREFIXROUTE_TELEMETRY_AUTH_TOKEN")
    res = subprocess.run([sys.executable, "-m", "prefixroute", "telemetry", "dump", "--since", "600", "--url",
                          secured.http_url], capture_output=True, text=True, timeout=30, env=env)
    assert res.returncode == 1 and "401" in res.stderr


def test_dashboard_http_source_sends_the_token(secured, monkeypatch):
    from prefixroute.dashboard.source import DataSource

    assert DataSource(url=secured.http_url, token=TOKEN).query(lambda q: q.num_requests()) >= 0
    with pytest.raises(TelemetryUnavailable):
        DataSource(url=secured.http_url).query(lambda q: q.num_requests())


@pytest.mark.parametrize(("argv", "message"), [
    (["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "/nonexistent.key"], "no such file"),
    (["--tls-client-ca-file", "/etc/hostname"], "go together"),
    (["--auth-token", "a", "--auth-token-file", "/etc/hostname"], "not both"),
])
def test_bad_security_settings_exit_2(tmp_path, argv, message):
    res = subprocess.run([sys.executable, "-m", "prefixroute", "telemetry", "--port", "0", "--http-port", "-1",
                          "--db", str(tmp_path / "t.db"), *argv], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and message in res.stderr


FLOOD_CODE = """
import grpc, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)])
call = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
msg = b"\\0" * (15 << 20)
futures = [call.future(msg, timeout=60) for _ in range(n)]
codes = set()
for f in futures:
    try:
        f.result(); codes.add("OK")
    except grpc.RpcError as e:
        codes.add(e.code().name)
print(sorted(codes))
"""


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_calls_without_the_token_are_refused_before_their_message_is_read(tmp_path):
    """4 senders x 8 calls of 15 MiB (under the receiver's 16 MiB message limit) without the token, at once: each
    is refused on its metadata, so at most its stream window is ever read (a refusal by a unary handler reads
    the whole message first: +400 MiB and more)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    r = start_receiver(tmp_path / "telemetry.db", "--auth-token-file", str(token_file))
    try:
        pid = r.proc.pid
        before, peak = _rss_mib(pid), 0.0
        senders = [subprocess.Popen([sys.executable, "-c", FLOOD_CODE, str(r.otlp_port), "8"],
                                    stdout=subprocess.PIPE, text=True) for _ in range(4)]
        while any(s.poll() is None for s in senders):
            peak = max(peak, _rss_mib(pid))
            time.sleep(0.02)
        outs = [s.communicate(timeout=60)[0].strip() for s in senders]
        grown = peak - before
        print(f"4 x 8 unauthenticated 15 MiB exports: {outs[0]}, receiver RSS peak +{grown:.1f} MiB")
        assert all(o == "['UNAUTHENTICATED']" for o in outs), outs
        assert grown < 48, grown
        # The receiver still serves a caller with the token.
        assert export(grpc.insecure_channel(f"127.0.0.1:{r.otlp_port}"),
                      (("authorization", f"Bearer {TOKEN}"),)) == grpc.StatusCode.OK
    finally:
        r.stop()

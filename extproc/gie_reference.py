"""The Gateway API Inference Extension's reference Envoy configuration (gie_reference.yaml, verbatim from GIE's
repository at `SOURCE_COMMIT`), adapted to run here: `render` changes only addresses and ports, and with
``fail_open`` GIE's FailOpen (``failure_mode_allow: true`` on the ext_proc filter, as llm-d's chart renders it).
What it is for: putting prefixroute's picker behind the gateway configuration GIE itself ships (tests, and
`prefixroute overhead-bench --gie`), so "drop-in" is checked against GIE's own file, not our idea of it.

The configuration reaches the picker over TLS without verifying its certificate (an empty validation context),
as GIE's pickers serve TLS by default: the picker must be started with ``--tls-cert-file``/``--tls-key-file``
(any certificate; `self_signed_certificate` makes one with the ``openssl`` command line).

Loaded with PyYAML, rendered as YAML; never imported by the ext_proc process.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import yaml

REFERENCE_FILE = Path(__file__).with_name("gie_reference.yaml")
SOURCE_REPO = "kubernetes-sigs/gateway-api-inference-extension"
SOURCE_COMMIT = "1748e829d1161147aaf35e76699ec86fd88406d2"
SOURCE_PATH = "config/charts/standalone/values.yaml (inferenceExtension.sidecar.presets.envoy)"
GATEWAY_LISTENER = "vllm"  # the listener clients send OpenAI requests to (port 8081 in the file)
READY_LISTENER = "envoy-proxy-ready-0.0.0.0-19001"  # /ready and /stats/prometheus (port 19001)
EXTPROC_CLUSTER = "ext_proc"
STATS_CLUSTER = "prometheus_stats"
EXTPROC_FILTER = "envoy.filters.http.ext_proc"


@dataclasses.dataclass(frozen=True)
class Ports:
    """Where a rendering listens: the gateway (clients), Envoy's admin, the ready/stats listener."""

    gateway: int
    admin: int
    ready: int


def load() -> dict[str, Any]:
    """The reference configuration as GIE ships it (a fresh copy each call)."""
    return yaml.safe_load(REFERENCE_FILE.read_text())


def _socket(node: dict[str, Any]) -> dict[str, Any]:
    return node["address"]["socket_address"]


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in config["static_resources"]["clusters"] if c["name"] == name)


def extproc_filter(config: dict[str, Any]) -> dict[str, Any]:
    """The gateway listener's ext_proc filter's typed_config (a view into `config`)."""
    listener = next(ls for ls in config["static_resources"]["listeners"] if ls["name"] == GATEWAY_LISTENER)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == EXTPROC_FILTER)["typed_config"]


def adapt(config: dict[str, Any], ports: Ports, extproc_address: str, *, fail_open: bool = False,
          listen_address: str = "127.0.0.1", plaintext: bool = False) -> dict[str, Any]:
    """A copy of `config` listening on `listen_address` at `ports`, reaching the picker at `extproc_address`
    (``host:port``; host an IP: the cluster is STATIC), failing open when `fail_open`. Nothing else changes, unless
    `plaintext`: a departure from GIE's file, for measuring only (overhead-bench ``--gie-plaintext``), which drops
    the TLS to the picker (the ext_proc cluster's transport socket and its health check's ALPN option), so the
    protocol's cost and TLS's can be told apart."""
    out = copy.deepcopy(config)
    out["admin"]["address"]["socket_address"].update(address=listen_address, port_value=ports.admin)
    for listener in out["static_resources"]["listeners"]:
        port = ports.gateway if listener["name"] == GATEWAY_LISTENER else ports.ready
        _socket(listener).update(address=listen_address, port_value=port)
    stats = _cluster(out, STATS_CLUSTER)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    _socket(stats).update(address=listen_address, port_value=ports.admin)
    host, _, port = extproc_address.rpartition(":")
    ext = _cluster(out, EXTPROC_CLUSTER)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    _socket(ext).update(address=host.strip("[]"), port_value=int(port))
    if fail_open:
        extproc_filter(out)["failure_mode_allow"] = True
    if plaintext:
        cluster = _cluster(out, EXTPROC_CLUSTER)
        cluster.pop("transport_socket", None)
        for hc in cluster.get("health_checks", []):
            hc.pop("tls_options", None)
    return out


def render(ports: Ports, extproc_address: str, *, fail_open: bool = False, plaintext: bool = False) -> str:
    """`adapt` of the reference file, as YAML for ``envoy -c``."""
    return yaml.safe_dump(adapt(load(), ports, extproc_address, fail_open=fail_open, plaintext=plaintext),
                          sort_keys=False)


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate and key for the picker's TLS (GIE's configuration does not verify it),
    made with the ``openssl`` command line: (cert file, key file). FileNotFoundError without openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "picker.crt", directory / "picker.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=prefixroute-picker",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True,
                   timeout=60)
    return cert, key

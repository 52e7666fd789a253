"""GIE gateways for integration tests: Envoy with GIE's reference configuration (extproc/gie_reference.yaml,
adapted by `gie_reference.render`), and an "override-host" gateway: the same ext_proc filter settings, but the
way Envoy-native GIE integrations pick the endpoint (Envoy's override_host load balancing policy over a cluster of
the pool's endpoints: GIE's comma list in ``envoy.lb`` metadata walked on retries, the served endpoint written to
``envoy.lb`` / ``x-gateway-destination-endpoint-served`` and forwarded to the picker, a subset hint set by a
set_metadata filter). Also: an Envoy process as a `ManagedProcess`, and the ext_proc host's health flags."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from prefixroute.extproc import gie_reference
from prefixroute.extproc.gateway import envoy_binary
from prefixroute.extproc.headers import (DESTINATION_HEADER, LB_METADATA_NAMESPACE, SERVED_HEADER, SUBSET_KEY,
                                         SUBSET_NAMESPACE)
from prefixroute.procs import ManagedProcess, free_ports, http_get, tcp_open


@dataclasses.dataclass
class Envoy:
    """A running Envoy: its process, config file and ports."""

    proc: ManagedProcess
    config_path: Path
    ports: gie_reference.Ports

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.gateway}"

    def clusters(self) -> str:
        return http_get(f"http://127.0.0.1:{self.ports.admin}/clusters", timeout_s=2.0)[1].decode()

    def extproc_health(self) -> list[str]:
        """The health flags of every host of the ext_proc cluster (``healthy``, ``/failed_active_hc``, ...)."""
        return re.findall(r"^ext_proc::[^:]+:\d+::health_flags::(\S+)$", self.clusters(), re.MULTILINE)


def override_host(config: dict[str, Any], endpoints: list[str], subset: list[str] | None) -> dict[str, Any]:
    """`config` (an adapted reference) turned into the override-host gateway (module docstring)."""
    out = copy.deepcopy(config)
    lb = LB_METADATA_NAMESPACE

    def key(name: str) -> dict:
        return {"key": lb, "path": [{"key": name}]}

    clusters = out["static_resources"]["clusters"]
    odst = next(c for c in clusters if c["name"] == "original_destination_cluster")
    for k in ("type", "lb_policy", "original_dst_lb_config"):
        odst.pop(k, None)
    odst["type"] = "STATIC"
    odst["connect_timeout"] = "1s"
    odst["load_assignment"] = {"cluster_name": odst["name"], "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": int(p)}}}}
        for h, _, p in (ep.rpartition(":") for ep in endpoints)]}]}
    odst["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [{"metadata": key(DESTINATION_HEADER)}],
            "selected_host_key": key(SERVED_HEADER),
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin"
                                          ".v3.RoundRobin"}}}]}}}}]}
    listener = next(ls for ls in out["static_resources"]["listeners"] if ls["name"] == gie_reference.GATEWAY_LISTENER)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 2}
    ext = gie_reference.extproc_filter(out)
    ext["metadata_options"] = {"receiving_namespaces": {"untyped": [lb]},
                               "forwarding_namespaces": {"untyped": [lb, SUBSET_NAMESPACE]}}
    if subset is not None:
        hcm["http_filters"].insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: subset}}]}})
    return out


def start_envoy(group: Any, name: str, config: dict[str, Any], ports: gie_reference.Ports, log_dir: Path) -> Envoy:
    """Write `config` and start Envoy on it in `group` (a ProcessGroup); ready when its admin says so and the
    gateway port accepts connections."""
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = ManagedProcess(name, [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
                                 "-l", "warning"], log_path=log_dir / f"{name}.log",
                          ready=lambda: (http_get(f"http://127.0.0.1:{ports.admin}/ready", timeout_s=0.5)[0] == 200
                                         and tcp_open(ports.gateway)),
                          ports=(ports.gateway, ports.admin, ports.ready))
    group.add(proc, wait=False)
    return Envoy(proc, path, ports)


def new_ports() -> gie_reference.Ports:
    return gie_reference.Ports(*free_ports(3))

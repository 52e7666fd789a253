"""GIE's reference Envoy configuration (extproc/gie_reference.yaml) and its run-time adaptation: the committed file
still says what GIE's says (the facts the picker relies on), a rendering differs from it in addresses, ports and
(FailOpen) failure_mode_allow only (real Envoy accepts the rendering:
tests/integration/extproc/test_envoy_accepts_renderings.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from prefixroute.extproc import gie_reference
from prefixroute.extproc.headers import DESTINATION_HEADER


def _leaves(node: Any, path: tuple = ()) -> dict[tuple, Any]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(value, (*path, key)).items()}
    if isinstance(node, list):
        return {k: v for i, value in enumerate(node) for k, v in _leaves(value, (*path, i)).items()}
    return {path: node}


def test_the_committed_file_names_its_source_and_holds_gies_protocol_facts() -> None:
    text = gie_reference.REFERENCE_FILE.read_text()
    assert gie_reference.SOURCE_COMMIT in text and gie_reference.SOURCE_REPO in text
    config = gie_reference.load()
    ext = gie_reference.extproc_filter(config)
    mode = ext["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED")
    assert (mode["request_trailer_mode"], mode["response_trailer_mode"]) == ("SEND", "SEND")
    assert "failure_mode_allow" not in ext  # GIE's default: fail closed
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    odst = clusters["original_destination_cluster"]
    assert odst["type"] == "ORIGINAL_DST" and odst["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER
    hc = clusters["ext_proc"]["health_checks"][0]["grpc_health_check"]
    assert hc["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert clusters["ext_proc"]["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    gateway = next(ls for ls in config["static_resources"]["listeners"] if ls["name"] == gie_reference.GATEWAY_LISTENER)
    assert gateway["per_connection_buffer_limit_bytes"] == 32768


@pytest.mark.parametrize("fail_open", [False, True])
def test_a_rendering_changes_only_addresses_ports_and_the_failure_mode(fail_open: bool) -> None:
    ports = gie_reference.Ports(gateway=18081, admin=18000, ready=18001)
    rendered = yaml.safe_load(gie_reference.render(ports, "127.0.0.1:19902", fail_open=fail_open))
    ours, theirs = _leaves(rendered), _leaves(gie_reference.load())
    changed = {p for p in ours.keys() | theirs.keys() if ours.get(p, "<absent>") != theirs.get(p, "<absent>")}
    allowed = {p for p in changed if p[-1] in ("address", "port_value")}
    assert changed - allowed == ({("static_resources", "listeners", 1, "filter_chains", 0, "filters", 0, "typed_config",
                                   "http_filters", 0, "typed_config", "failure_mode_allow")} if fail_open else set())
    assert {ours[p] for p in allowed if p[-1] == "port_value"} == {18081, 18000, 18001, 19902}
    assert {ours[p] for p in allowed if p[-1] == "address"} == {"127.0.0.1"}


def test_plaintext_drops_only_the_tls_to_the_picker() -> None:
    """The measuring-only departure (overhead-bench --gie-plaintext): the ext_proc cluster's transport socket and
    its health check's TLS options go, nothing else beyond a normal rendering."""
    ports = gie_reference.Ports(gateway=18081, admin=18000, ready=18001)
    normal = _leaves(yaml.safe_load(gie_reference.render(ports, "127.0.0.1:19902")))
    plain = _leaves(yaml.safe_load(gie_reference.render(ports, "127.0.0.1:19902", plaintext=True)))
    gone = normal.keys() - plain.keys()
    assert gone and all("transport_socket" in p or "tls_options" in p for p in gone)
    assert plain.keys() <= normal.keys() and all(plain[p] == normal[p] for p in plain)

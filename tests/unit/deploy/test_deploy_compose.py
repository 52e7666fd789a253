"""docker-compose.yml: valid against the Compose Specification, and every container runs a real,
parseable `prefixroute` command (there is no Docker engine here, so each part is checked directly)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from helpers.compose import COMPOSE, ROOT, SERVICES, prefixroute_argv
from prefixroute import cli

SHELL_ONLY = frozenset({"secrets", "nats"})
"""Services that run no prefixroute command (the one-shot that draws the tokens; the NATS server's own image)."""
REPLICAS = sorted(n for n in SERVICES if n.startswith("extproc-"))
PRODUCT_SERVICES = sorted(n for n in SERVICES if n not in SHELL_ONLY)


def test_valid_against_compose_spec():
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(COMPOSE)


def test_services_present():
    names = set(SERVICES)
    assert {"envoy", "extproc-0", "extproc-1", "nats", "telemetry", "dashboard", "traffic"} <= names
    assert sum(n.startswith("model-server-") for n in names) >= 2


MODEL_SERVERS = frozenset(n for n in SERVICES if n.startswith("model-server-"))
DEPENDENCIES = {
    "secrets": frozenset(),
    **{n: frozenset() for n in MODEL_SERVERS},
    "telemetry": frozenset({"secrets"}),  # its token
    "nats": frozenset(),
    # Each replica routes to the servers, exports its spans to the receiver, shares its picks through NATS.
    **{n: MODEL_SERVERS | {"telemetry", "secrets", "nats"} for n in REPLICAS},
    "envoy": frozenset({*REPLICAS, "secrets"}),  # asks a router replica for every request, with the token
    "dashboard": frozenset({"telemetry", "extproc-0", "secrets"}),  # the receiver's store, a router's /metrics
    "traffic": frozenset({"envoy"}),  # sends through the gateway
}
"""What each service must wait for (to be healthy) before it starts."""


def test_every_service_has_its_dependencies_declared_here():
    assert set(SERVICES) == set(DEPENDENCIES)  # a new service states what it waits for


@pytest.mark.parametrize("name", sorted(DEPENDENCIES))
def test_each_service_waits_for_its_dependencies_to_be_healthy(name):
    depends_on = SERVICES[name].get("depends_on") or {}
    assert set(depends_on) == DEPENDENCIES[name]
    for dep, cond in depends_on.items():
        if dep == "secrets":  # a one-shot: done, not healthy
            assert cond == {"condition": "service_completed_successfully"}, f"{name} starts before {dep} is done"
            continue
        assert cond == {"condition": "service_healthy"}, f"{name} starts before {dep} is healthy"
        assert "healthcheck" in SERVICES[dep], f"{dep} has no healthcheck but {name} waits for it"


@pytest.mark.parametrize("name", PRODUCT_SERVICES)
def test_command_parses_with_the_real_cli(name):
    argv = prefixroute_argv(SERVICES[name])
    assert argv[0] in cli.COMMANDS, f"{name} runs unknown command {argv[0]}"
    parser = cli.build_parser(argv[0])
    args = parser.parse_args(argv)  # exits (fails the test) on an unknown flag
    assert args.command == argv[0]


def test_only_the_gateway_and_the_dashboard_are_published_on_the_host():
    published = {name: svc["ports"] for name, svc in SERVICES.items() if svc.get("ports")}
    # The dashboard has no login: the host's loopback only (main published it on every interface).
    assert published == {"envoy": ["8080:8080"], "dashboard": ["127.0.0.1:8501:8501"]}
    assert not any(svc.get("network_mode") == "host" for svc in SERVICES.values())


LISTEN_FLAGS = {"model-server": "--host", "telemetry": "--host", "extproc": "--listen-address",
                "dashboard": "--host", "envoy-config": "--listen-address"}
"""The flag that sets where each command listens; its default is loopback, so compose must set it."""


@pytest.mark.parametrize("name", [n for n in PRODUCT_SERVICES if n != "traffic"])
def test_every_listening_service_sets_its_listen_address_for_the_private_network(name):
    argv = prefixroute_argv(SERVICES[name])
    flag = LISTEN_FLAGS[argv[0]]
    assert flag in argv, f"{name} relies on the default listen address of `prefixroute {argv[0]}`"
    assert argv[argv.index(flag) + 1] == "0.0.0.0"  # reachable from the other containers, not the host
    if argv[0] == "extproc":  # the dashboard reads its /metrics over the private network (not published)
        assert argv[argv.index("--metrics-host") + 1] == "0.0.0.0"


def test_internal_calls_carry_the_drawn_tokens():
    """Envoy -> ext_proc and router/dashboard -> receiver authenticate with the tokens the secrets service
    draws; each pair reads the same file."""
    extproc = prefixroute_argv(SERVICES["extproc-0"])
    envoy = prefixroute_argv(SERVICES["envoy"])
    telemetry = prefixroute_argv(SERVICES["telemetry"])
    token_of = {"extproc": extproc[extproc.index("--auth-token-file") + 1],
                "envoy": envoy[envoy.index("--extproc-auth-token-file") + 1],
                "telemetry": telemetry[telemetry.index("--auth-token-file") + 1]}
    assert token_of["extproc"] == token_of["envoy"] != token_of["telemetry"]
    secrets_line = SERVICES["secrets"]["command"][0]
    for path in token_of.values():
        assert Path(path).stem in secrets_line and path.startswith("/secrets/")
    for name in (*REPLICAS, "dashboard"):  # the receiver's token, read from its file at start
        assert f"$$(cat {token_of['telemetry']})" in SERVICES[name]["command"][0]
    assert all("OTEL_EXPORTER_OTLP_HEADERS" in SERVICES[n]["command"][0] for n in REPLICAS)
    assert "PREFIXROUTE_DASHBOARD_TELEMETRY_TOKEN" in SERVICES["dashboard"]["command"][0]
    dash = prefixroute_argv(SERVICES["dashboard"])
    assert dash[dash.index("--router-metrics-url") + 1] == f"http://extproc-0:{extproc[extproc.index('--metrics-port') + 1]}/metrics"


def test_replicas_are_one_service_but_for_their_index_and_envoy_lists_them_in_index_order():
    """Several replicas (issue 15): replica k runs --replica-index k (the route Envoy sends its observing streams
    by) under its own id, with everything else equal, and Envoy's --extproc-replica-addresses has it k-th."""
    assert len(REPLICAS) >= 2
    argvs = [prefixroute_argv(SERVICES[n]) for n in REPLICAS]
    envoy = prefixroute_argv(SERVICES["envoy"])
    addresses = envoy[envoy.index("--extproc-replica-addresses") + 1].split(",")
    assert len(addresses) == len(REPLICAS) and "--extproc-address" not in envoy
    for k, (name, argv) in enumerate(zip(REPLICAS, argvs)):
        assert argv[argv.index("--replica-index") + 1] == str(k)
        assert argv[argv.index("--replica-id") + 1] == name
        assert addresses[k] == f"{name}:{argv[argv.index('--port') + 1]}"
        assert SERVICES[name]["environment"]["PREFIXROUTE_PEERS_URL"] == "nats://nats:4222"

    def rest(argv: list[str]) -> list[str]:
        out = list(argv)
        for flag in ("--replica-index", "--replica-id"):
            i = out.index(flag)
            del out[i:i + 2]
        return out
    assert all(rest(a) == rest(argvs[0]) for a in argvs)
    assert all(SERVICES[n]["environment"] == SERVICES[REPLICAS[0]]["environment"] for n in REPLICAS)

"""docker-compose.yml: valid against the Compose Specification, and every container runs a real,
parseable `prefixroute` command (there is no Docker engine here, so each part is checked directly)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from prefixroute import cli

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _prefixroute_argv(service: dict) -> list[str]:
    """The prefixroute arguments a service runs (entrypoint `prefixroute`, or a `sh -c` line)."""
    command = service["command"]
    if service.get("entrypoint") == ["sh", "-c"]:
        first = command[0].split("&&")[0]
        argv = shlex.split(first)
        assert argv[0] == "prefixroute", first
        return argv[1:]
    return list(command)


def test_valid_against_compose_spec():
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(COMPOSE)


def test_services_present():
    names = set(SERVICES)
    assert {"envoy", "extproc", "telemetry", "dashboard", "traffic"} <= names
    assert sum(n.startswith("model-server-") for n in names) >= 2


MODEL_SERVERS = frozenset(n for n in SERVICES if n.startswith("model-server-"))
DEPENDENCIES = {
    **{n: frozenset() for n in MODEL_SERVERS},
    "telemetry": frozenset(),
    "extproc": MODEL_SERVERS | {"telemetry"},  # routes to the servers, exports its spans to the receiver
    "envoy": frozenset({"extproc"}),  # asks the router for every request
    "dashboard": frozenset({"telemetry"}),  # reads the receiver's store
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
        assert cond == {"condition": "service_healthy"}, f"{name} starts before {dep} is healthy"
        assert "healthcheck" in SERVICES[dep], f"{dep} has no healthcheck but {name} waits for it"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_command_parses_with_the_real_cli(name):
    argv = _prefixroute_argv(SERVICES[name])
    assert argv[0] in cli.COMMANDS, f"{name} runs unknown command {argv[0]}"
    parser = cli.build_parser(argv[0])
    args = parser.parse_args(argv)  # exits (fails the test) on an unknown flag
    assert args.command == argv[0]


def test_only_the_gateway_and_the_dashboard_are_published_on_the_host():
    published = {name: svc["ports"] for name, svc in SERVICES.items() if svc.get("ports")}
    assert published == {"envoy": ["8080:8080"], "dashboard": ["8501:8501"]}
    assert not any(svc.get("network_mode") == "host" for svc in SERVICES.values())


LISTEN_FLAGS = {"model-server": "--host", "telemetry": "--host", "extproc": "--listen-address",
                "dashboard": "--host", "envoy-config": "--listen-address"}
"""The flag that sets where each command listens; its default is loopback, so compose must set it."""


@pytest.mark.parametrize("name", sorted(n for n in SERVICES if n != "traffic"))
def test_every_listening_service_sets_its_listen_address_for_the_private_network(name):
    argv = _prefixroute_argv(SERVICES[name])
    flag = LISTEN_FLAGS[argv[0]]
    assert flag in argv, f"{name} relies on the default listen address of `prefixroute {argv[0]}`"
    assert argv[argv.index(flag) + 1] == "0.0.0.0"  # reachable from the other containers, not the host
    if argv[0] == "extproc":  # its metrics stay inside the container: nothing in compose scrapes them
        assert argv[argv.index("--metrics-host") + 1] == "127.0.0.1"


def test_envoy_admin_stays_on_loopback_inside_its_container(tmp_path):
    argv = _prefixroute_argv(SERVICES["envoy"])
    out = tmp_path / "envoy.yaml"
    argv[argv.index("--out") + 1] = str(out)
    subprocess.run([sys.executable, "-m", "prefixroute", *argv], check=True, timeout=60)
    admin = yaml.safe_load(out.read_text())["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1" and admin["port_value"] == 9901


def test_envoy_service_config_is_accepted_by_envoy(tmp_path):
    """Render the envoy service's configuration with its own flags and let real Envoy validate it."""
    argv = _prefixroute_argv(SERVICES["envoy"])
    out = tmp_path / "envoy.yaml"
    argv[argv.index("--out") + 1] = str(out)
    subprocess.run([sys.executable, "-m", "prefixroute", *argv], check=True, timeout=60)
    from prefixroute.extproc.gateway import envoy_binary

    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(out), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""`prefixroute up`'s layout: every listener on a fixed, documented default port unless asked otherwise
(`--ports random`, or 0), its files in the state folder, a new run id per start (a busy port names its flag:
tests/integration/stack/test_stack_busy_port.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from prefixroute.extproc.endpoints.settings import PoolSettings
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings, resolve_ports
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.stack.cli import StackSettings, resolve_layout

# The documented defaults (docs/operating.md, "The local stack"); a change here is a change users see.
UP_DEFAULTS = {"gateway": 8080, "ext_proc": 9002, "ext_proc metrics": 9464,
               "telemetry receiver": 4317, "telemetry HTTP API": 4320, "dashboard": 8501,
               "model-server-0": 8001, "model-server-3": 8004, "model-server-0 KV events": 5557}


def _listeners(st: StackSettings, gw: GatewaySettings, tmp_path: Path) -> dict[str, int]:
    lay = resolve_layout(st, gw, simulated=True)
    gateway = GatewayProcesses(gw, RoutingSettings(), PoolSettings(endpoints=("127.0.0.1:1",)), log_dir=tmp_path)
    out: dict[str, int] = {}
    for name, port, _flag in [*gateway.fixed_listeners(), *lay.listeners(st.dashboard)]:
        out.setdefault(name, port)
    return out


def test_up_listens_on_fixed_documented_ports_by_default(tmp_path: Path) -> None:
    found = _listeners(StackSettings(), GatewaySettings(extproc_replicas=1), tmp_path)
    assert {k: found[k] for k in UP_DEFAULTS} == UP_DEFAULTS
    assert "Envoy admin" not in found  # off by default (issue 27); on loopback when asked, at its fixed port
    assert _listeners(StackSettings(), GatewaySettings(extproc_replicas=1, envoy_admin="loopback"),
                      tmp_path)["Envoy admin"] == 9901
    lay = resolve_layout(StackSettings(), GatewaySettings(), simulated=True)
    assert lay.server_ports == (8001, 8002, 8003, 8004) and lay.event_ports == (5557, 5559, 5561, 5563)


def test_replicas_and_embedded_nats_have_fixed_ports_too(tmp_path: Path) -> None:
    found = _listeners(StackSettings(), GatewaySettings(extproc_replicas=3), tmp_path)
    assert [found[f"ext_proc (replica {k})"] for k in range(3)] == [9002, 9003, 9004]
    assert [found[f"ext_proc metrics (replica {k})"] for k in range(3)] == [9464, 9465, 9466]
    assert found["embedded nats-server"] == 4222






def test_files_go_to_the_state_folder_never_the_current_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXROUTE_STATE_DIR", str(tmp_path / "state"))
    lay = resolve_layout(StackSettings(), GatewaySettings(), simulated=True)
    assert (lay.state_dir, lay.db, lay.log_dir) == (tmp_path / "state", tmp_path / "state" / "telemetry.db",
                                                    tmp_path / "state" / "logs")
    lay = resolve_layout(StackSettings(state_dir=str(tmp_path / "s2"), db=str(tmp_path / "x.db")), GatewaySettings(),
                         simulated=True)
    assert (lay.db, lay.log_dir) == (tmp_path / "x.db", tmp_path / "s2" / "logs")
    again = resolve_layout(StackSettings(), GatewaySettings(), simulated=True)
    assert again.run_id != lay.run_id  # a new run per start


def test_without_simulated_servers_up_listens_on_no_server_port() -> None:
    lay = resolve_layout(StackSettings(), GatewaySettings(), simulated=False)
    assert lay.server_ports == () and lay.event_ports == ()
    lay = resolve_layout(dataclasses.replace(StackSettings(), kv_events=False), GatewaySettings(), simulated=True)
    assert lay.event_ports == ()


@pytest.mark.parametrize("traffic", ["none", "shared_prompts", "off"])
def test_an_unknown_traffic_workload_is_refused_before_start(traffic: str) -> None:
    with pytest.raises(ValueError, match=f"--traffic must be a workload .* got '{traffic}'"):
        StackSettings(traffic=traffic)
    assert StackSettings(traffic="").traffic == ""  # empty: no demo load, as documented
    assert StackSettings(traffic="mix").traffic == "mix"

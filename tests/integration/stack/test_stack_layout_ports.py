"""`up`'s ports drawn free on this host (the rest of its layout tests: tests/unit/stack/test_stack_layout.py)."""

from __future__ import annotations

from pathlib import Path
import pytest
from prefixroute.extproc.gateway import GatewayProcesses, GatewaySettings, resolve_ports
from prefixroute.stack.cli import StackSettings, resolve_layout
from unit.stack.test_stack_layout import UP_DEFAULTS

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


def test_random_ports_only_on_request_and_explicit_ports_are_kept(tmp_path: Path) -> None:
    st = StackSettings(dashboard_port=18501)
    gw = GatewaySettings(ports="random", extproc_replicas=1, admin_port=19901)
    lay = resolve_layout(st, gw, simulated=True)
    assert lay.dashboard_port == 18501  # given: kept
    drawn = [lay.telemetry_port, lay.telemetry_http_port, *lay.server_ports, *lay.event_ports]
    assert not set(drawn) & set(UP_DEFAULTS.values()) and len(set(drawn)) == len(drawn)
    resolved = resolve_ports(gw)
    assert resolved.admin_port == 19901 and resolved.port not in (0, 8080)
    assert (resolved.extproc_port, resolved.metrics_port, resolved.nats_port) == (0, 0, 0)  # drawn at start
    assert resolve_ports(GatewaySettings(ports="fixed")) == GatewaySettings(ports="fixed")  # fixed: unchanged
    assert resolve_ports(GatewaySettings(ports="random", metrics_port=-1)).metrics_port == -1  # off stays off
    with pytest.raises(ValueError, match="ports must be one of fixed, random"):
        resolve_ports(GatewaySettings(ports="any"))


def test_zero_draws_free_ports_for_one_setting() -> None:
    lay = resolve_layout(StackSettings(model_server_base_port=0, kv_events_base_port=0, telemetry_port=0),
                         GatewaySettings(ports="fixed"), simulated=True)
    assert 0 not in lay.server_ports and lay.telemetry_port not in (0, 4317) and lay.telemetry_http_port == 4320
    assert len(lay.event_ports) == 4 and all(p > 0 for p in lay.event_ports)

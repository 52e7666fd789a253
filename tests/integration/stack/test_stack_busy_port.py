"""A port some other process listens on stops `prefixroute up` before anything starts, naming the component,
the port and the flag that moves it."""

from __future__ import annotations

import socket

import pytest

from prefixroute.procs import PortBusy, check_ports_free

pytestmark = pytest.mark.integration


def test_a_busy_port_is_refused_naming_component_port_and_flag() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortBusy) as err:
            check_ports_free([("free", 0, "--x"), ("dashboard", port, "--dashboard-port")])
    msg = str(err.value)
    assert msg.startswith(f"dashboard: port {port} is already in use")
    assert "--dashboard-port" in msg and "--ports random" in msg

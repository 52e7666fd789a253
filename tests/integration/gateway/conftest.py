"""Fixtures for the gateway integration tests: real Envoy, real ext_proc process, real simulated servers.

The shared gateway (4 servers) is session-scoped: starting Envoy + ext_proc + 4 servers costs ~2 s.
Tests that kill or stop something start their own (function-scoped) gateway.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.fleet import Fleet, SpyListener, start_fleet, start_gateway
from prefixroute.extproc.gateway import GatewayProcesses


@pytest.fixture(scope="session")
def fleet_and_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, GatewayProcesses]]:
    log_dir = tmp_path_factory.mktemp("gateway-logs")
    with ExitStack() as stack:
        fleet = start_fleet(stack, 4, log_dir)
        gw = start_gateway(stack, fleet.endpoints, log_dir)
        yield fleet, gw


@pytest.fixture(scope="session")
def gateway(fleet_and_gateway: tuple[Fleet, GatewayProcesses]) -> GatewayProcesses:
    return fleet_and_gateway[1]


@pytest.fixture(scope="session")
def fleet(fleet_and_gateway: tuple[Fleet, GatewayProcesses]) -> Fleet:
    return fleet_and_gateway[0]


@pytest.fixture
def spy() -> Iterator[SpyListener]:
    s = SpyListener()
    yield s
    s.close()


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as st:
        yield st


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


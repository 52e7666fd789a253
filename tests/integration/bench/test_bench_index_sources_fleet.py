"""The bench's fleet publishes KV events exactly when today's `prefixroute model-server` can (its real --help, a
child process)."""

from __future__ import annotations

import subprocess

import pytest

from prefixroute.bench.fleet import fleet_publishes_events
from prefixroute.procs import prefixroute_argv

pytestmark = pytest.mark.integration


def test_fleet_publishes_events_matches_todays_model_server():
    """Against the real `prefixroute model-server --help`: True exactly when it lists --kv-events-config."""
    fleet_publishes_events.cache_clear()
    out = subprocess.run(prefixroute_argv("model-server", "--help"), capture_output=True, text=True,
                         timeout=60)
    assert fleet_publishes_events() is ("--kv-events-config" in out.stdout)

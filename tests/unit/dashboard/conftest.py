"""Shared fixtures of the dashboard tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def dashboard_env(monkeypatch, tmp_path):
    """No PREFIXROUTE_DASHBOARD_* setting from the caller's environment; benchmark results in a temp dir."""
    for var in ("DB", "TELEMETRY", "BENCH_DIR", "SCRAPE_ENDPOINTS", "WINDOW_S", "REFRESH_S", "ROUTER_METRICS_URL",
                "TELEMETRY_TOKEN"):
        monkeypatch.delenv(f"PREFIXROUTE_DASHBOARD_{var}", raising=False)
    monkeypatch.setenv("PREFIXROUTE_DASHBOARD_BENCH_DIR", str(tmp_path / "bench"))

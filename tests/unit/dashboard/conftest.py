"""Shared fixtures of the dashboard tests (defined in tests/helpers/dashboard.py, shared with tests/integration)."""

from __future__ import annotations

from helpers.dashboard import dashboard_env  # noqa: F401 - a fixture, found by pytest under this name

"""`prefixroute dashboard`: settings, validation and the Streamlit command line (a real launch:
tests/integration/dashboard/test_dashboard_cli_launch.py)."""

from __future__ import annotations

import os

import pytest

from prefixroute import settings
from prefixroute.cli import build_parser
from prefixroute.dashboard.cli import DashboardSettings, main, settings_env, streamlit_command


def parse(*argv: str):
    return build_parser("dashboard").parse_args(["dashboard", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--db", "a.db", "--telemetry", "http://127.0.0.1:4320"], "either --db or --telemetry"),
    (["--port", "0"], "--port must be"),
    (["--refresh-s", "0.1"], "--refresh-s must be"),
    (["--telemetry", "127.0.0.1:4320"], "must be an http"),
    (["--window-s", "-5"], "--window-s must be"),
    (["--router-metrics-url", "127.0.0.1:9464"], "--router-metrics-url must be an http"),
])
def test_bad_settings_exit_2_with_a_message(argv, message, capsys):
    assert main(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_settings_reach_the_app_through_env_with_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = settings.from_namespace(DashboardSettings, parse("--db", "x.db", "--router-metrics-url",
                                                           "http://127.0.0.1:9464/metrics", "--bench-dir", "b"),
                                  environ={})
    env = settings_env(cfg)
    assert env["PREFIXROUTE_DASHBOARD_DB"] == str(tmp_path / "x.db")
    assert env["PREFIXROUTE_DASHBOARD_BENCH_DIR"] == str(tmp_path / "b")
    assert env["PREFIXROUTE_DASHBOARD_ROUTER_METRICS_URL"] == "http://127.0.0.1:9464/metrics"
    # What the app reads back is what the CLI resolved.
    back = settings.from_namespace(DashboardSettings, None, environ=env)
    assert back.db == str(tmp_path / "x.db") and back.port == cfg.port
    assert back.router_metrics_url == "http://127.0.0.1:9464/metrics"


def test_streamlit_command_is_headless_private_and_pinned():
    cmd = streamlit_command(DashboardSettings(port=9999, host="127.0.0.1"))
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("app.py") and os.path.exists(cmd[4])
    assert flags["--server.headless"] == "true"
    assert flags["--browser.gatherUsageStats"] == "false"
    assert flags["--server.fileWatcherType"] == "none"
    assert flags["--server.port"] == "9999" and flags["--server.address"] == "127.0.0.1"

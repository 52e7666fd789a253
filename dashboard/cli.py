"""`prefixroute dashboard`: serve the live Streamlit dashboard (app.py) as a child process.

    prefixroute dashboard                                          # the store `prefixroute up` writes (state folder)
    prefixroute dashboard --db telemetry.db                        # or another SQLite store
    prefixroute dashboard --telemetry http://127.0.0.1:4320        # or the receiver's HTTP API
    prefixroute dashboard --port 8501 --host 127.0.0.1 --bench-dir bench-results
    prefixroute dashboard --router-metrics-url http://127.0.0.1:9464/metrics
    PREFIXROUTE_DASHBOARD_TELEMETRY_TOKEN=... prefixroute dashboard --telemetry http://127.0.0.1:4320

The child is ``python -m streamlit run app.py`` with a fixed port, headless (no browser is opened),
no usage statistics, no file watcher. The resolved settings reach the app through the
``PREFIXROUTE_DASHBOARD_*`` environment variables (the app reads them with the same settings class),
so the app also runs under `streamlit run` or AppTest with those variables set. SIGINT/SIGTERM stop
the child (SIGTERM, then SIGKILL after a grace period) and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from typing import ClassVar

from prefixroute import settings
from prefixroute.procs import parent_death_preexec, stop_group
from prefixroute.settings import Settings, setting
from prefixroute.state import default_db

APP_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")
STOP_GRACE_S = 5.0


@dataclasses.dataclass(frozen=True)
class DashboardSettings(Settings):
    ENV_PREFIX: ClassVar[str] = "PREFIXROUTE_DASHBOARD_"
    TITLE: ClassVar[str] = "Dashboard"

    db: str = setting("", "SQLite telemetry store to read (the receiver's --db); default, when --telemetry is not "
                          "given either: the receiver's default, telemetry.db in the state folder "
                          "($PREFIXROUTE_STATE_DIR, else $XDG_STATE_HOME/prefixroute, else ~/.local/state/prefixroute).")
    telemetry: str = setting("", "Receiver HTTP API base URL to read instead of a file, e.g. "
                                 "http://127.0.0.1:4320 (for a receiver on another host or container).")
    host: str = setting("127.0.0.1", "Address the dashboard listens on (loopback: nothing is exposed unless asked).")
    port: int = setting(8501, "Dashboard HTTP port (Streamlit's usual port).")
    bench_dir: str = setting("bench-results", "Directory searched (3 levels deep) for `prefixroute bench` "
                                             "results.json files for the Benchmarks page, besides the state "
                                             "folder's bench/ (where `prefixroute bench` writes without --out).")
    refresh_s: float = setting(2.0, "Seconds between live refreshes (2 s: live to the eye, and each refresh "
                                    "costs a few milliseconds of SQL even at thousands of requests per minute).")
    window_s: float = setting(300.0, "Initial time window in seconds (5 min: enough requests for stable p99s, "
                                     "short enough to show a change within a minute); selectable in the app.")
    telemetry_token: str = setting("", "Bearer token of the receiver's HTTP API (its auth token), sent with "
                                       "every --telemetry request; prefer the env var to the flag (a flag "
                                       "shows in `ps`).")
    router_metrics_url: str = setting("", "The router's Prometheus /metrics, e.g. http://127.0.0.1:9464/metrics: "
                                          "the live per-endpoint columns (healthy, running, waiting, KV usage) "
                                          "come from its endpoint pool. Empty: those columns are off. The "
                                          "dashboard opens no other URL (never one named in span data).")
    metrics_timeout_s: float = setting(0.5, "Timeout of one read of --router-metrics-url: a router slower than "
                                            "this leaves the live columns out instead of delaying the refresh.")

    def source_kwargs(self) -> dict:
        if self.telemetry:
            return {"url": self.telemetry, "token": self.telemetry_token or None}
        return {"db": self.db or default_db()}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, DashboardSettings)


def settings_env(cfg: DashboardSettings) -> dict[str, str]:
    """The PREFIXROUTE_DASHBOARD_* variables that carry `cfg` to the app process (paths made absolute,
    since Streamlit may change directory)."""
    env = {}
    values = dataclasses.asdict(cfg)
    for f, _tp in settings.fields(DashboardSettings):
        v = values[f.name]
        if f.name == "db" and v:
            v = os.path.abspath(v)
        if f.name == "bench_dir" and v:
            v = os.path.abspath(v)
        env[settings.env_name(DashboardSettings, f)] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return env


def streamlit_command(cfg: DashboardSettings) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", APP_PATH,
            "--server.headless", "true",
            "--server.address", cfg.host,
            "--server.port", str(cfg.port),
            "--server.fileWatcherType", "none",
            "--server.runOnSave", "false",
            "--browser.gatherUsageStats", "false",
            "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal",
            "--runner.magicEnabled", "false",
            "--theme.base", "light"]


def validate(cfg: DashboardSettings) -> None:
    if cfg.db and cfg.telemetry:
        raise ValueError("give either --db or --telemetry, not both")
    if not 0 < cfg.port < 65536:
        raise ValueError(f"--port must be 1-65535, got {cfg.port}")
    if not cfg.refresh_s >= 0.5:
        raise ValueError("--refresh-s must be >= 0.5")
    if not cfg.window_s > 0:
        raise ValueError("--window-s must be > 0")
    if cfg.telemetry and not cfg.telemetry.startswith(("http://", "https://")):
        raise ValueError(f"--telemetry must be an http(s):// URL, got {cfg.telemetry!r}")
    if cfg.router_metrics_url and not cfg.router_metrics_url.startswith(("http://", "https://")):
        raise ValueError(f"--router-metrics-url must be an http(s):// URL, got {cfg.router_metrics_url!r}")
    if not cfg.metrics_timeout_s > 0:
        raise ValueError("--metrics-timeout-s must be > 0")


def main(args: argparse.Namespace) -> int:
    try:
        cfg = settings.from_namespace(DashboardSettings, args)
        validate(cfg)
    except ValueError as exc:
        print(f"prefixroute dashboard: {exc}", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        print("prefixroute dashboard: Streamlit is not installed (pip install 'streamlit>=1.67,<2')", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_DASHBOARD_")}
    env.update(settings_env(cfg))
    env["STREAMLIT_BROWSER_GATHER_USAGE_STATS"] = "false"
    source = cfg.telemetry or os.path.abspath(cfg.source_kwargs()["db"])
    print(f"prefixroute dashboard: http://{cfg.host}:{cfg.port} (reading {source})", flush=True)
    # Parent-death signal: Streamlit goes with us even if we are SIGKILLed (e.g. by `prefixroute up`'s own).
    child = subprocess.Popen(streamlit_command(cfg), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=parent_death_preexec())
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.is_set():
            if child.poll() is not None:
                print(f"prefixroute dashboard: streamlit exited with {child.returncode}", file=sys.stderr)
                return child.returncode or 1
            stop.wait(0.2)
        return 0
    finally:
        _stop_child(child)
        for s, h in previous.items():
            signal.signal(s, h)


def _stop_child(child: subprocess.Popen) -> None:
    stop_group(child, STOP_GRACE_S)

"""Helpers: start real `prefixroute model-server` processes on free loopback ports (unique module name)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers.procs import terminate


class ServerProc:
    def __init__(self, proc: subprocess.Popen, host: str, port: int, admin_url: str | None = None) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.admin_url = admin_url  # the admin listener (/admin/faults), when started with --admin-port

    def stop(self) -> int:
        return terminate(self.proc)


def start_server(*args: str, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> ServerProc:
    """Start `prefixroute model-server --port 0 ARGS`; ambient PREFIXROUTE_MODEL_SERVER_* vars are dropped.
    With ``--admin-port 0`` in ARGS the admin listener's URL is `ServerProc.admin_url`."""
    cmd = [sys.executable, "-m", "prefixroute", "model-server", "--port", "0", *args]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_MODEL_SERVER_")}, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    admin_url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("ADMIN "):
            admin_url = "http://" + line.split()[1]
        if line.startswith("READY "):
            host, port = line.split()[1].rsplit(":", 1)
            return ServerProc(proc, host, int(port), admin_url)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"model server did not start: {cmd}")

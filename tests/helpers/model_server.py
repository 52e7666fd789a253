"""Helpers: start real `prefixroute model-server` processes on free loopback ports (unique module name)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers.procs import terminate


class ServerProc:
    def __init__(self, proc: subprocess.Popen, host: str, port: int) -> None:
        self.proc = proc
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"

    def stop(self) -> int:
        return terminate(self.proc)


def start_server(*args: str, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> ServerProc:
    """Start `prefixroute model-server --port 0 ARGS`; ambient PREFIXROUTE_MODEL_SERVER_* vars are dropped."""
    cmd = [sys.executable, "-m", "prefixroute", "model-server", "--port", "0", *args]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_MODEL_SERVER_")}, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("READY "):
            host, port = line.split()[1].rsplit(":", 1)
            return ServerProc(proc, host, int(port))
    proc.kill()
    proc.wait()
    raise RuntimeError(f"model server did not start: {cmd}")

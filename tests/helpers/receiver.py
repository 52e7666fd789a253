"""A real `prefixroute telemetry` receiver process on free loopback ports (for telemetry tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from helpers.procs import terminate
from helpers.waiting import until

PREFIXROUTE = [sys.executable, "-m", "prefixroute"]
_BANNER = re.compile(r"OTLP/gRPC on [\d.]+:(\d+), HTTP API on http://[\d.]+:(\d+)")


@dataclass
class ReceiverProc:
    proc: subprocess.Popen
    db: Path
    otlp_port: int
    http_port: int

    @property
    def otlp_url(self) -> str:
        return f"http://127.0.0.1:{self.otlp_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def api(self, route: str) -> tuple[int, object]:
        try:
            with urllib.request.urlopen(self.http_url + route, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def wait_rows(self, n: int, timeout_s: float = 20.0) -> dict:
        """The store's /api/stats once it holds at least `n` requests (fails the test after `timeout_s`)."""
        def stats() -> dict | None:
            got = self.api("/api/stats")[1]
            return got if got["num_requests"] >= n else None

        return until(stats, timeout_s, message=lambda: f"{n} rows in the store ({self.api('/api/stats')[1]})")

    def stop(self) -> int:
        return terminate(self.proc)


def start_receiver(db: Path, *extra: str, port: int = 0) -> ReceiverProc:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PREFIXROUTE_"))}
    cmd = [*PREFIXROUTE, "telemetry", "--port", str(port), "--http-port", "0", "--db", str(db), *extra]
    log_path = db.with_suffix(".log")
    with open(log_path, "w") as log:  # a file, not a pipe nobody reads (a full pipe would block the receiver)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line = proc.stdout.readline()  # the banner, printed once both servers are bound
    m = _BANNER.search(line)
    if not m:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"receiver did not start: {line!r} {log_path.read_text()}")
    return ReceiverProc(proc, db, int(m.group(1)), int(m.group(2)))

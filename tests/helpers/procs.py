"""Process launching for integration tests (real processes on loopback), over `prefixroute.procs`.

Contract:
- `start_process(cmd, ready_port=..., ready_url=...)` is a context manager: it starts `cmd` as a
  `ManagedProcess` (its own process group), waits until the port accepts and/or the URL answers 2xx, and on
  exit stops the whole group (SIGTERM, SIGKILL after a grace period). Output goes to a log file of its own
  whose tail is quoted in any readiness failure, so a failing start explains itself.
- Ports come from binding 127.0.0.1:0; there is a small race between picking and binding, which is
  acceptable on a test machine (the child fails fast and the readiness wait reports it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prefixroute.procs import (LOOPBACK, ManagedProcess, free_port, http_get, http_ok,  # noqa: F401 - re-exported
                               stop_group, tcp_open)
from prefixroute.procs import free_ports as _free_ports
from prefixroute.procs import prefixroute_argv as prefixroute_cmd  # noqa: F401 - the tests' name for it


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports, outside the ephemeral range (`prefixroute.procs.free_ports`)."""
    return _free_ports(n)


def terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """Stop a child started with plain Popen (not its own group: SIGTERM reaches it alone, its clean-shutdown
    path), SIGKILL after `grace_s`; its exit status."""
    return stop_group(proc, grace_s)


@contextlib.contextmanager
def start_process(cmd: Sequence[str], *, ready_port: int | None = None, ready_url: str | None = None,
                  timeout_s: float = 20.0, env: dict[str, str] | None = None,
                  log_dir: Path | None = None, name: str | None = None) -> Iterator[ManagedProcess]:
    """Start `cmd` in its own process group, wait for readiness, always stop the group on exit."""
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="prefixroute-test-"))
    label = name or Path(str(cmd[0])).name
    checks = [*([lambda: tcp_open(ready_port)] if ready_port is not None else []),
              *([lambda: http_ok(ready_url, timeout_s=1.0)] if ready_url is not None else [])]
    proc = ManagedProcess(label, cmd, log_path=log_dir / f"{label}-{os.getpid()}-{time.monotonic_ns()}.log",
                          env=env, ready=(lambda: all(check() for check in checks)) if checks else None)
    try:
        proc.spawn().wait_ready(timeout_s)
        yield proc
    finally:
        proc.stop()


def unix_http_get(socket_path: str | Path, path: str, *, method: str = "GET",
                  timeout_s: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 request to a server on a Unix socket (Envoy's admin with admin_mode unix)."""
    import http.client
    import socket

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout_s)
            self.sock.connect(str(socket_path))

    conn = _Conn("localhost", timeout=timeout_s)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@contextlib.contextmanager
def environ_set(values: dict[str, str]) -> Iterator[None]:
    """Set these environment variables for the block (children started in it inherit them), then restore each
    to its former value or absence. For module-scoped fixtures, where pytest's monkeypatch is not available."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

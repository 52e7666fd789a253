"""Process launching for integration tests (real processes on loopback).

Contract:
- `start_process(cmd, ready=...)` is a context manager: it starts `cmd` in a new session (its own
  process group), waits until `ready` succeeds (a TCP port accepts, or an HTTP URL answers 2xx), and
  on exit sends SIGTERM to the whole group, then SIGKILL after a grace period. Output goes to a log
  file whose tail is attached to any readiness failure, so a failing start explains itself.
- Ports come from binding 127.0.0.1:0; there is a small race between picking and binding, which is
  acceptable on a test machine (the child fails fast and the readiness wait reports it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prefixroute.procs import LOOPBACK, free_port  # noqa: F401 - re-exported for tests
from prefixroute.procs import tcp_open as port_open  # noqa: F401


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all sockets held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def prefixroute_cmd(*args: str) -> list[str]:
    """The command line that runs `prefixroute ARGS...` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "prefixroute", *args]


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """GET `url`; returns (status, body) for any HTTP status (errors included)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback only
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> int:
    """SIGTERM the process itself (its own clean-shutdown path), SIGKILL after `grace_s`; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(5)
    return proc.returncode


@dataclass
class ManagedProcess:
    """A started child process (own process group) and its log file."""

    cmd: Sequence[str]
    popen: subprocess.Popen
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL it. Returns the exit code."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Kill stragglers of the group too (grandchildren), whatever the leader did.
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace_s)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (simulates a crash)."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)


def wait_for_port(port: int, *, proc: ManagedProcess | None = None, timeout_s: float = 20.0,
                  host: str = LOOPBACK) -> None:
    """Wait until `host:port` accepts TCP connections; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_open(port, host):
            return
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.cmd} exited with {proc.popen.returncode} before port {port} opened:\n"
                               f"{proc.log_tail()}")
        time.sleep(0.05)
    tail = proc.log_tail() if proc else ""
    raise TimeoutError(f"port {port} not open after {timeout_s}s\n{tail}")


def wait_for_http(url: str, *, proc: ManagedProcess | None = None, timeout_s: float = 20.0,
                  ok_statuses: Sequence[int] = (200,)) -> None:
    """Wait until GET `url` answers one of `ok_statuses`; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status, _ = http_get(url, timeout_s=1.0)
            if status in ok_statuses:
                return
            last = f"status {status}"
        except OSError as exc:
            last = repr(exc)
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.cmd} exited with {proc.popen.returncode} before {url} was ready:\n"
                               f"{proc.log_tail()}")
        time.sleep(0.05)
    tail = proc.log_tail() if proc else ""
    raise TimeoutError(f"{url} not ready after {timeout_s}s ({last})\n{tail}")


@contextlib.contextmanager
def start_process(cmd: Sequence[str], *, ready_port: int | None = None, ready_url: str | None = None,
                  timeout_s: float = 20.0, env: dict[str, str] | None = None,
                  log_dir: Path | None = None, name: str | None = None) -> Iterator[ManagedProcess]:
    """Start `cmd` in its own process group, wait for readiness, always kill the group on exit."""
    log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="prefixroute-test-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    label = name or Path(str(cmd[0])).name
    log_path = log_dir / f"{label}-{os.getpid()}-{time.monotonic_ns()}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=full_env, start_new_session=True)
    proc = ManagedProcess(cmd=list(cmd), popen=popen, log_path=log_path)
    try:
        if ready_port is not None:
            wait_for_port(ready_port, proc=proc, timeout_s=timeout_s)
        if ready_url is not None:
            wait_for_http(ready_url, proc=proc, timeout_s=timeout_s)
        yield proc
    finally:
        proc.stop()

"""A small process supervisor for the local stack: start children in order, wait until each is ready,
watch them, and stop them all.

Contract:
- `Supervisor.start(component)` refuses a component whose ports are already taken (`PortBusy`, naming the
  component and the port) and raises `ComponentFailed` when the child exits or is not ready in time, with
  the tail of its log in the message.
- Every child runs in its own process group (``start_new_session``) so that stopping it also stops what
  it started (the gateway's Envoy, Streamlit's server).
- `Supervisor.stop_all()` stops children in reverse start order: SIGTERM to each group, SIGKILL for any
  still alive after the grace period; the total stays under `grace_s` + about a second. Idempotent.
- Not thread-safe: one supervisor is driven from one thread (the `prefixroute up` main thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from prefixroute.procs import free_port, http_ok, port_in_use, tcp_open  # noqa: F401 - re-exported for launchers


class PortBusy(RuntimeError):
    """A port that a component needs is already in use."""


class ComponentFailed(RuntimeError):
    """A component exited or did not become ready."""


@dataclasses.dataclass
class Component:
    """One child process of the stack."""

    name: str
    argv: Sequence[str]
    ports: Sequence[int] = ()  # checked free before start
    ready: Callable[[], bool] | None = None  # polled until True
    env: dict[str, str] | None = None  # added to the inherited environment
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    _log: IO[bytes] | None = None


class Supervisor:
    def __init__(self, log_dir: Path, *, ready_timeout_s: float = 60.0, grace_s: float = 8.0) -> None:
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.components: list[Component] = []

    def start(self, c: Component, *, wait: bool = True) -> Component:
        for port in c.ports:
            if port and port_in_use(port):
                raise PortBusy(f"{c.name}: port {port} is already in use (stop what holds it, e.g. "
                               f"`ss -ltnp 'sport = :{port}'`, or choose another port)")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        c.log_path = self.log_dir / f"{c.name}.log"
        c._log = open(c.log_path, "ab")  # noqa: SIM115 - closed in stop_all()
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if c.env:
            env.update(c.env)
        c.proc = subprocess.Popen(list(c.argv), stdout=c._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=env, start_new_session=True)
        self.components.append(c)
        if wait:
            self.wait_ready(c)
        return c

    def wait_ready(self, c: Component) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while c.ready is not None and not c.ready():
            if c.proc is not None and c.proc.poll() is not None:
                raise ComponentFailed(f"{c.name} exited with status {c.proc.returncode} while starting"
                                      f"{self.log_tail(c)}")
            if time.monotonic() > deadline:
                raise ComponentFailed(f"{c.name} not ready after {self.ready_timeout_s:.0f} s{self.log_tail(c)}")
            time.sleep(0.1)

    def dead(self) -> Component | None:
        """The first child that has exited, if any."""
        for c in self.components:
            if c.proc is not None and c.proc.poll() is not None:
                return c
        return None

    @staticmethod
    def log_tail(c: Component, num_lines: int = 15) -> str:
        if c.log_path is None or not c.log_path.exists():
            return ""
        lines = c.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        if not lines:
            return f" (log {c.log_path} is empty)"
        return f"; last lines of {c.log_path}:\n    " + "\n    ".join(lines)

    def stop_all(self) -> None:
        live = [c for c in reversed(self.components) if c.proc is not None and c.proc.poll() is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + self.grace_s
        for c in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
        for c in self.components:
            if c.proc is not None:
                # The group may hold grandchildren even when the child itself exited.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(timeout=1.0)
            if c._log is not None:
                c._log.close()
                c._log = None
        self.components.clear()

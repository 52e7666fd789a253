"""Child processes of a bench run: start, wait until ready, stop for sure.

Every process gets its own process group (so a router's children die with it), stdout+stderr to a log
file under the run's ``logs/`` folder, and is stopped with SIGTERM, then SIGKILL after a grace period.
`ProcessGroup` stops everything it started even when the run fails halfway (use it as a context manager).
Only loopback addresses are used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixroute.procs import LOOPBACK as HOST, free_port, http_get, stop_group  # noqa: F401


class ManagedProcess:
    """One child process with a log file. `stop` is idempotent."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, num_chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        stop_group(self.proc, grace_s)
        if not self._log.closed:
            self._log.close()


class ProcessGroup:
    """Processes started for one run; stops them all (reverse order) on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[ManagedProcess] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> ManagedProcess:
        p = ManagedProcess(name, argv, self.log_dir, env)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class StartupError(RuntimeError):
    """A process did not become ready; the message carries the tail of its log."""


def wait_ready(proc: ManagedProcess | None, check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` every 50-500 ms until it returns True; raise StartupError on timeout or process exit."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while True:
        if check():
            return
        if proc is not None and not proc.alive():
            raise StartupError(f"{what} exited with code {proc.proc.returncode} before it was ready; log tail:\n"
                               f"{proc.log_tail()}")
        if time.monotonic() > deadline:
            tail = proc.log_tail() if proc is not None else ""
            raise StartupError(f"{what} not ready after {timeout_s:g}s; log tail:\n{tail}")
        time.sleep(delay)
        delay = min(0.5, delay * 1.5)


def prefixroute_argv(*args: str) -> list[str]:
    """argv to run a prefixroute subcommand with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "prefixroute", *args]

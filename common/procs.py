"""Child processes and ports, for every launcher: `prefixroute up`, `prefixroute gateway`, the bench runner, the
dashboard launcher and the test helpers.

- `ManagedProcess`: one child in its own process group (``start_new_session``, so stopping it also stops
  what it started: the gateway's Envoy, Streamlit's server), its stdout+stderr appended to a log file (or
  inherited), the ports it will listen on checked free before it starts (`PortBusy`, naming it), a readiness
  wait that fails fast with the tail of its log when it exits (`StartupError`), and `stop`: SIGTERM to the
  group, SIGKILL after a grace period.
- `ProcessGroup`: the children of one launcher, stopped together in reverse start order (a front end before
  what it sends to); a context manager.

Seams for supervision, not implemented here: `ManagedProcess.spawn` may be called again once the child has
exited (a restart policy with backoff would call it for what `ProcessGroup.first_exited` returns), and
`ManagedProcess._popen_kwargs` is the one place where a parent-death signal (PR_SET_PDEATHSIG) would be set.

Not thread-safe: a process or a group is driven from one thread. Only loopback addresses are probed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

LOOPBACK = "127.0.0.1"

LOG_TAIL_LINES = 15
"""Lines of a child's log quoted in a startup error: enough for a Python traceback's last frames and message."""


class StartupError(RuntimeError):
    """A child could not be started, exited while starting or was not ready in time; the message names it and
    quotes the tail of its log."""


class PortBusy(StartupError):
    """A port a component needs is already in use (nothing was started for it)."""


def prefixroute_argv(*args: str) -> list[str]:
    """argv that runs ``prefixroute ARGS...`` with this interpreter (no console script or PATH lookup)."""
    return [sys.executable, "-m", "prefixroute", *args]


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True when something listens on host:port (a server could not bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as servers set it: a port whose old connections sit in TIME_WAIT is free to
        # listen on; only a live listener makes it busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports_free(ports: Iterable[tuple[str, int]]) -> None:
    """Raise `PortBusy` for the first (component, port) whose port is in use; ports <= 0 (any / none) pass."""
    for name, port in ports:
        if port > 0 and port_in_use(port):
            raise PortBusy(f"{name}: port {port} is already in use (stop what holds it, e.g. "
                           f"`ss -ltnp 'sport = :{port}'`, or choose another port)")


def tcp_open(port: int, host: str = LOOPBACK, timeout_s: float = 0.3) -> bool:
    """True when a TCP connection to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET, error statuses included; (0, b"") when no response came."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read() if exc.fp else b""
    except (OSError, ValueError):
        return 0, b""


def http_ok(url: str, timeout_s: float = 0.5) -> bool:
    """True when a GET of `url` answers 2xx."""
    return 200 <= http_get(url, timeout_s)[0] < 300


def _leads_group(proc: subprocess.Popen) -> bool:
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:  # already reaped: assume it led one, so its leftover group is still cleaned up
        return True


def stop_group(proc: subprocess.Popen | None, grace_s: float = 5.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, reap the child; its exit status (None
    when `proc` is None or would not die). Idempotent.

    The group is killed even when the leader already exited, so no grandchild lingers. A child that does not
    lead its own group (started without ``start_new_session``) is signalled alone: our own group is never."""
    if proc is None:
        return None
    if _leads_group(proc):
        def send(sig: int) -> None:
            os.killpg(proc.pid, sig)
    else:
        send = proc.send_signal  # a no-op once the child is reaped
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        send(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
    return proc.returncode


class ManagedProcess:
    """One child process (see the module doc). `spawn` starts it, `wait_ready` waits until it serves, `stop`
    stops it; `popen` is None until the first `spawn`.

    `log_path`: its stdout and stderr, appended across restarts (None: inherited from this process). `env`:
    added to this process's environment (with PYTHONUNBUFFERED=1 unless set, so a log shows what a Python
    child printed before it died). `ready`: polled by `wait_ready` (None: ready once started). `ports`:
    checked free before each spawn (0 = none, e.g. a child that picks its own).
    """

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, ready: Callable[[], bool] | None = None,
                 ports: Sequence[int] = ()) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = dict(env or {})
        self.ready = ready
        self.ports = tuple(ports)
        self.popen: subprocess.Popen[bytes] | None = None
        self.num_spawns = 0

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited (reaped here), None while it runs or before `spawn`."""
        return self.popen.poll() if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def spawn(self) -> ManagedProcess:
        """Start the child: `PortBusy` when one of `ports` is taken, RuntimeError when it is already running.
        Callable again once the child has exited or been stopped (a restart: same argv, same log)."""
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        check_ports_free((self.name, p) for p in self.ports)
        log: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")  # noqa: SIM115 - closed below: the child has its own copy
        try:
            self.popen = subprocess.Popen(self.argv, **self._popen_kwargs(log))
        finally:
            if log is not None:
                log.close()
        self.num_spawns += 1
        return self

    def _popen_kwargs(self, log: IO[bytes] | None) -> dict[str, Any]:
        # Own session = own process group, so `stop` reaches grandchildren; no stdin, so a child never blocks
        # on a terminal it shares with `prefixroute up`.
        return {"stdout": log, "stderr": subprocess.STDOUT if log is not None else None,
                "stdin": subprocess.DEVNULL, "start_new_session": True,
                "env": {"PYTHONUNBUFFERED": "1", **os.environ, **self.env}}

    def wait_ready(self, timeout_s: float, *, ready: Callable[[], bool] | None = None) -> None:
        """Poll `ready` (default: the one given at construction; none: return at once) every 20-200 ms until it
        is true. `StartupError` as soon as the child exits (its status and log tail) or after `timeout_s`."""
        check = ready if ready is not None else self.ready
        if check is None:
            return
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while not check():
            if not self.alive():
                status = "was never started" if self.popen is None else f"exited with status {self.returncode}"
                raise StartupError(f"{self.name} {status} while starting{self.log_excerpt()}")
            if time.monotonic() > deadline:
                raise StartupError(f"{self.name} not ready after {timeout_s:g} s{self.log_excerpt()}")
            time.sleep(delay)
            delay = min(0.2, delay * 1.5)

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        """The last `num_lines` lines of the log ("" without a log file or before anything was written)."""
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def log_excerpt(self) -> str:
        """For a message about the child: "; last lines of LOG:" and its tail, " (log LOG is empty)", or ""
        without a log file."""
        if self.log_path is None:
            return ""  # its output went to our own stdout/stderr, just above
        tail = self.log_tail()
        if not tail:
            return f" (log {self.log_path} is empty)"
        return f"; last lines of {self.log_path}:\n    " + tail.replace("\n", "\n    ")

    def signal(self, sig: int) -> None:
        """Send `sig` to the child's process group (nothing when it never started or its group is gone)."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, sig)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the group, SIGKILL it after `grace_s`; the exit status (None if never started). Idempotent."""
        return stop_group(self.popen, grace_s)

    def kill(self) -> int | None:
        """SIGKILL the group now, no SIGTERM first (what a crash looks like to its peers); the exit status."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5.0)
        return self.returncode


class ProcessGroup:
    """The children of one launcher: a stack, a gateway, a bench run. Started through it, they stop together,
    the last started first. A context manager: leaving it stops every child, on an exception too.

    `log_dir`: each child logs to ``log_dir/<name>.log`` (None: children inherit our stdout/stderr).
    `ready_timeout_s`: how long `start` and `wait_ready` wait for one child. `grace_s`: the whole `stop_all`.
    """

    def __init__(self, log_dir: Path | None = None, *, ready_timeout_s: float = 60.0, grace_s: float = 5.0) -> None:
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.procs: list[ManagedProcess] = []

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              ready: Callable[[], bool] | None = None, ports: Sequence[int] = (),
              wait: bool = True) -> ManagedProcess:
        """A new child, spawned now and, with `wait`, ready when this returns (else see `wait_ready`)."""
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        return self.add(ManagedProcess(name, argv, log_path=log_path, env=env, ready=ready, ports=ports), wait=wait)

    def add(self, proc: ManagedProcess, *, wait: bool = True) -> ManagedProcess:
        """Make `proc` a member (at the end, unless it is one: a restart keeps its place in the stop order),
        spawn it unless it runs and, with `wait`, wait until it is ready. A child that fails to start stays
        a member, so leaving the group still stops what it started."""
        if proc not in self.procs:
            self.procs.append(proc)
        if not proc.alive():
            proc.spawn()
        if wait:
            proc.wait_ready(self.ready_timeout_s)
        return proc

    def wait_ready(self, procs: Iterable[ManagedProcess] | None = None, *, timeout_s: float | None = None) -> None:
        """Wait for each of `procs` (default: every member) in turn, `timeout_s` (default `ready_timeout_s`)
        each: children started with ``wait=False`` then start in parallel."""
        for proc in list(self.procs if procs is None else procs):
            proc.wait_ready(self.ready_timeout_s if timeout_s is None else timeout_s)

    def first_exited(self) -> ManagedProcess | None:
        """The first member, in start order, that was started and has exited (None: all run)."""
        return next((p for p in self.procs if p.popen is not None and not p.alive()), None)

    def stop_all(self) -> None:
        """Stop every member, the last started first: SIGTERM to its group and wait for it to exit before the
        next, all within one `grace_s` (a member still running at the deadline gets SIGKILL right after its
        SIGTERM); then SIGKILL for every group, grandchildren included. Takes at most about `grace_s` + 1 s.
        Idempotent; afterwards the group is empty and can be used again."""
        deadline = time.monotonic() + self.grace_s
        for proc in reversed(self.procs):
            if proc.alive():
                proc.signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
        for proc in reversed(self.procs):
            proc.stop(0.0)
        self.procs.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

"""Child processes, for every launcher: `prefixroute up`, `prefixroute gateway`, the bench runner, the dashboard
launcher and the test helpers.

- `ManagedProcess`: one child in its own process group (``start_new_session``, so stopping it also stops
  what it started: the gateway's Envoy, Streamlit's server), its stdout+stderr appended to a log file (or
  inherited), the ports it will listen on checked free before it starts (`PortBusy`, naming it), a readiness
  wait that fails fast with the tail of its log when it exits (`StartupError`), and `stop`: SIGTERM to the
  group, SIGKILL after a grace period.
- `ProcessGroup`: the children of one launcher, stopped together in reverse start order (a front end before
  what it sends to); a context manager.
- Restarts of crashed members, and liveness probes: supervisor.py (`Supervisor`, `RestartPolicy`).
- Ports held for a child across its restarts (`held_listener`, `reset_pending`) and checked free before it
  starts (`check_ports_free`); free ports and loopback probes: ports.py (its names are importable from here).
- Logs are private: each child's log is created mode 0600 (an existing one is tightened to it),
  in a folder created mode 0700: debug logs may hold request headers.
- Children die with their parent: on Linux every child gets PR_SET_PDEATHSIG = SIGKILL
  (`parent_death_preexec`), so a launcher killed with SIGKILL leaves no process behind and no port busy.
  The signal fires when the *thread* that forked the child exits: spawn from the main thread (every
  launcher does). A child that starts its own children passes `parent_death_preexec()` to them too
  (`prefixroute dashboard` does for Streamlit), so the kill cascades.

Not thread-safe: a process or a group is driven from one thread. Only loopback addresses are probed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from prefixroute.ports import LOOPBACK, free_port, free_ports, http_get, http_ok, port_in_use, tcp_open
from prefixroute.ports import _handed_out  # noqa: F401 - bench/runner.py reads it as procs._handed_out

__all__ = ["LOG_TAIL_LINES", "LOOPBACK", "ManagedProcess", "PortBusy", "ProcessGroup", "StartupError", "Stopped",
           "check_ports_free", "describe_status", "die_with_parent", "free_port", "free_ports", "held_listener",
           "http_get", "http_ok", "open_private_log", "parent_death_preexec", "port_in_use", "prefixroute_argv",
           "reset_pending", "return_large_blocks", "stop_group", "stop_on_signals", "tcp_open"]

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


def check_ports_free(ports: Iterable[tuple[str, int] | tuple[str, int, str]]) -> None:
    """Raise `PortBusy` for the first (component, port[, flag]) whose port is in use; ports <= 0 (any / none)
    pass. With a flag (the setting that chose the port, e.g. ``--port``) the message says how to move it."""
    for name, port, *flag in ports:
        if port > 0 and port_in_use(port):
            how = (f"choose another with {flag[0]}, or draw free ports with --ports random (a second "
                   f"`prefixroute up` on this host: --ports random --state-dir DIR)" if flag
                   else "choose another port")
            raise PortBusy(f"{name}: port {port} is already in use (stop what holds it, e.g. "
                           f"`ss -ltnp 'sport = :{port}'`, or {how})")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()  # resolved once here, so the forked child only makes the call


def parent_death_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for `subprocess.Popen` that makes the child receive `sig` when this process (strictly:
    the thread calling Popen) dies, or None where that is not available (not Linux).

    SIGKILL by default: the signal only matters when the parent died without stopping its children (a
    launcher that exits normally stops them first), so the child must go even if it is wedged. Closes the
    race where the parent dies between fork and prctl: the child then kills itself at once. Works with
    ``start_new_session`` (the death signal is per process, not per group, and survives exec)."""
    if _PRCTL is None:
        return None
    prctl = _PRCTL
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h> mallopt parameters


def return_large_blocks(threshold_bytes: int = 1 << 20) -> bool:
    """Make this process's allocator (glibc malloc) serve every allocation of `threshold_bytes` or more with its
    own mmap, returned to the system when freed, and trim the heap above that much free memory. By default
    glibc raises its mmap threshold up to 32 MiB after large frees, so a burst of multi-megabyte request bodies
    leaves their memory in the heap and the RSS high for good (+69 MiB after 40 bodies of 7 MiB that
    the router had already freed). False where unavailable (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes))


def held_listener(port: int, host: str = LOOPBACK, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on host:`port`, inheritable, for a child to serve on (``pass_fds``): the launcher
    keeps it open while the child restarts, so the port is never free for another process to take (a
    local user bound a crashed model server's port 0.48 s after its death and was sent its requests). Connections
    that arrive while the child is down wait in the backlog for the restarted one. `PortBusy` when taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortBusy(f"port {port} is already in use ({exc.strerror}; stop what holds it, e.g. "
                       f"`ss -ltnp 'sport = :{port}'`, or choose another port)") from None
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def reset_pending(sock: socket.socket, max_connections: int = 1024) -> int:
    """Accept what waits on a held listener whose child is down and reset it at once (RST): a client (Envoy, a
    health probe) then sees the failure it would see on a closed port (Envoy retries the request on another
    endpoint) instead of waiting in the backlog for a restart that may not come. Returns how many."""
    n = 0
    sock.setblocking(False)
    try:
        while n < max_connections:
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()
            n += 1
    finally:
        sock.setblocking(True)
    return n


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Called in a child that was not started through `parent_death_preexec` (a multiprocessing worker): it
    gets `sig` when its parent dies, and exits now when `parent` is already gone. No-op where unavailable."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def describe_status(returncode: int | None) -> str:
    """'status 3', 'signal SIGKILL' (a negative Popen returncode) or 'an unknown status'."""
    if returncode is None:
        return "an unknown status"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"status {returncode}"


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
    checked free before each spawn (0 = none, e.g. a child that picks its own). `die_with_parent`: the child
    gets SIGKILL when this process dies (`parent_death_preexec`; spawn from the main thread).

    `stopped_on_purpose` is true from `stop` or `kill` until the next `spawn`: a supervisor leaves such a
    child alone.
    """

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, ready: Callable[[], bool] | None = None,
                 ports: Sequence[int] = (), die_with_parent: bool = True,
                 live: Callable[[], bool] | None = None, pass_fds: Sequence[int] = ()) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = dict(env or {})
        self.ready = ready
        self.live = live  # the supervisor's probe that it still serves (module docstring); None: alive = live
        self.pass_fds = tuple(pass_fds)  # inherited by every spawn (a listening socket the launcher holds)
        self.ports = tuple(ports)
        self.die_with_parent = die_with_parent
        self.popen: subprocess.Popen[bytes] | None = None
        self.num_spawns = 0
        self.started_at: float | None = None  # time.monotonic() of the last spawn
        self.stopped_on_purpose = False

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
            log = open_private_log(self.log_path)
        try:
            self.popen = subprocess.Popen(self.argv, **self._popen_kwargs(log))
        finally:
            if log is not None:
                log.close()
        self.num_spawns += 1
        self.started_at = time.monotonic()
        self.stopped_on_purpose = False
        return self

    def _popen_kwargs(self, log: IO[bytes] | None) -> dict[str, Any]:
        # Own session = own process group, so `stop` reaches grandchildren; no stdin, so a child never blocks
        # on a terminal it shares with `prefixroute up`.
        return {"stdout": log, "stderr": subprocess.STDOUT if log is not None else None,
                "stdin": subprocess.DEVNULL, "start_new_session": True, "pass_fds": self.pass_fds,
                "preexec_fn": parent_death_preexec() if self.die_with_parent else None,
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
        """SIGTERM the group, SIGKILL it after `grace_s`; the exit status (None if never started). Idempotent.
        A stop on purpose: a supervisor does not restart it."""
        self.stopped_on_purpose = True
        return stop_group(self.popen, grace_s)

    def kill(self) -> int | None:
        """SIGKILL the group now, no SIGTERM first (what a crash looks like to its peers); the exit status.
        Still a stop on purpose (a supervisor does not restart it); a crash is a signal from elsewhere."""
        self.stopped_on_purpose = True
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5.0)
        return self.returncode


def open_private_log(path: Path) -> IO[bytes]:
    """`path` opened for appending, created mode 0600 (an existing file is tightened to 0600) in a folder created
    mode 0700 (an existing folder is left as it is). The caller closes it."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


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
              wait: bool = True, pass_fds: Sequence[int] = ()) -> ManagedProcess:
        """A new child, spawned now and, with `wait`, ready when this returns (else see `wait_ready`)."""
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        return self.add(ManagedProcess(name, argv, log_path=log_path, env=env, ready=ready, ports=ports,
                                       pass_fds=pass_fds), wait=wait)

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
        for proc in self.procs:
            proc.stopped_on_purpose = True
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


@contextlib.contextmanager
def stop_on_signals(signals: Iterable[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                    ) -> Iterator[dict[str, int | None]]:
    """While inside, the first of `signals` raises `Stopped` in the main thread (so `finally` blocks and
    context managers stop the children) and later ones are ignored (so nothing interrupts that cleanup).
    Yields a dict whose "signal" is the number received (None while none was). Restores the previous
    handlers on exit. Main thread only."""
    got: dict[str, int | None] = {"signal": None}
    sigs = tuple(signals)

    def handler(signum: int, _frame: object) -> None:
        if got["signal"] is None:
            got["signal"] = signum
            for s in sigs:
                signal.signal(s, signal.SIG_IGN)
            raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield got
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class Stopped(BaseException):
    """Raised by `stop_on_signals` for a stop signal: a BaseException, so `except Exception` does not swallow
    it on the way out. `signum`: the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

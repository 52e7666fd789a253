"""Child processes and ports, for every launcher: `prefixroute up`, `prefixroute gateway`, the bench runner, the
dashboard launcher and the test helpers.

- `ManagedProcess`: one child in its own process group (``start_new_session``, so stopping it also stops
  what it started: the gateway's Envoy, Streamlit's server), its stdout+stderr appended to a log file (or
  inherited), the ports it will listen on checked free before it starts (`PortBusy`, naming it), a readiness
  wait that fails fast with the tail of its log when it exits (`StartupError`), and `stop`: SIGTERM to the
  group, SIGKILL after a grace period.
- `ProcessGroup`: the children of one launcher, stopped together in reverse start order (a front end before
  what it sends to); a context manager.
- `Supervisor`: restarts the members of a group that crash, with exponential backoff (`RestartPolicy`:
  0.2 s, doubling to 15 s, reset once a child has stayed up 30 s; it never gives up, like Kubernetes'
  CrashLoopBackOff), waiting for each restarted child's readiness check before counting it up again, and
  says so on stderr. No thread: the launcher's loop calls `Supervisor.poll` a few times a second. A child
  stopped on purpose (`stop`, `kill`, `stop_all`) is never restarted.
- Liveness (issue 27): a member may have a `live` probe (`ManagedProcess.live`, e.g. Envoy's health route
  through its own listener); the supervisor runs it every `RestartPolicy.live_interval_s` while the member is
  up and restarts a member that fails it `live_failures` times in a row: a process that runs but no longer
  serves (Envoy after an admin ``/drain_listeners``) is treated as crashed.
- Logs are private (issue 27): each child's log is created mode 0600 (an existing one is tightened to it),
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
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TextIO

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


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out: set[int] = set()
_rng = random.Random()  # its own generator: a test seeding `random` must not make two runs pick alike


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct TCP ports free a moment ago, drawn at random OUTSIDE the kernel's ephemeral range and never
    handed out twice by this process. Why: a port from bind(0) lies inside the ephemeral range, where any
    outgoing connection (a health probe, a client) can take it as its local port between this call and the
    server's bind (seen as a rare "port busy" under connection churn). Not reserved: another process may still
    bind one first, which its user reports as `PortBusy`. Falls back to bind(0) when no drawn port is free."""
    lo, hi = _ephemeral_port_range()
    spans = [(a, b) for a, b in ((10000, lo - 1), (hi + 1, 65535)) if b - a > 100]
    out: list[int] = []
    for _ in range(50 * n):
        if len(out) == n or not spans:
            break
        a, b = spans[0] if len(spans) == 1 else _rng.choices(spans, weights=[b - a for a, b in spans])[0]
        port = _rng.randint(a, b)
        if port in _handed_out or port in out or port_in_use(port, host):
            continue
        out.append(port)
    while len(out) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in out:
            out.append(port)
    _handed_out.update(out)
    return out


def free_port(host: str = LOOPBACK) -> int:
    """One port of `free_ports`."""
    return free_ports(1, host)[0]


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


def check_ports_free(ports: Iterable[tuple[str, int] | tuple[str, int, str]]) -> None:
    """Raise `PortBusy` for the first (component, port[, flag]) whose port is in use; ports <= 0 (any / none)
    pass. With a flag (the setting that chose the port, e.g. ``--port``) the message says how to move it."""
    for name, port, *flag in ports:
        if port > 0 and port_in_use(port):
            how = (f"choose another with {flag[0]}, or draw free ports with --ports random" if flag
                   else "choose another port")
            raise PortBusy(f"{name}: port {port} is already in use (stop what holds it, e.g. "
                           f"`ss -ltnp 'sport = :{port}'`, or {how})")


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
    leaves their memory in the heap and the RSS high for good (issue 27: +69 MiB after 40 bodies of 7 MiB that
    the router had already freed). False where unavailable (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes))


def held_listener(port: int, host: str = LOOPBACK, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on host:`port`, inheritable, for a child to serve on (``pass_fds``): the launcher
    keeps it open while the child restarts, so the port is never free for another process to take (issue 27: a
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


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a `Supervisor` restarts a crashed child: after `initial_delay_s`, doubling with each failure in a
    row (an exit, or a restart that exits or is not ready within `ready_timeout_s`) up to `max_delay_s`,
    and back to `initial_delay_s` once the child has stayed up `reset_after_s`. It never gives up.

    0.2 s: a one-off crash (the common case) costs well under a second of downtime; 15 s: a child that
    crashes at once in a loop (bad config, a port taken by someone else) costs a few spawns a minute and one
    line each; 30 s up counts as recovered (a child that crashes every minute still starts at 0.2 s)."""

    initial_delay_s: float = 0.2
    max_delay_s: float = 15.0
    reset_after_s: float = 30.0
    ready_timeout_s: float = 60.0
    live_interval_s: float = 1.0
    live_failures: int = 3
    """A member with a `live` probe is probed every `live_interval_s` while up; `live_failures` failures in a row
    (3 s by default: no restart on one slow answer) and it is killed and restarted like a crashed one."""

    def delay_s(self, num_failures: int) -> float:
        """The wait before the restart that follows `num_failures` (>= 1) failures in a row."""
        return min(self.max_delay_s, self.initial_delay_s * 2.0 ** max(0, num_failures - 1))


@dataclasses.dataclass
class _Watch:
    state: str  # "up" (ready), "waiting" (to restart at `due`), "starting" (spawned at `since`), "stopped"
    since: float
    due: float = 0.0
    num_failures: int = 0  # in a row: sets the delay
    num_restarts: int = 0  # in all
    next_probe: float = 0.0  # when its `live` probe runs next
    num_probe_failures: int = 0  # in a row


class Supervisor:
    """Restarts crashed members of `group` per `policy` and says so on `out` (default: stderr), each line
    starting with `label`. Call `poll` from the launcher's loop (every 0.1-0.25 s) once the members have
    started; it never blocks longer than one readiness check of a restarting child.

    A member that was stopped on purpose (`ManagedProcess.stop`/`kill`, `ProcessGroup.stop_all`) is left
    alone, and watched again once something spawns it. A restart kills what is left of the crashed child's
    process group first (a grandchild could hold its port), keeps its argv, log and place in the stop order,
    and counts it up again only when its readiness check passes."""

    def __init__(self, group: ProcessGroup, policy: RestartPolicy = RestartPolicy(), *, label: str = "prefixroute",
                 out: TextIO | None = None) -> None:
        self.group = group
        self.policy = policy
        self.label = label
        self.out = out
        self._watches: dict[int, _Watch] = {}

    def num_restarts(self, proc: ManagedProcess) -> int:
        """Restarts of `proc` so far (spawns by this supervisor, successful or not)."""
        w = self._watches.get(id(proc))
        return w.num_restarts if w is not None else 0

    def _say(self, msg: str) -> None:
        print(f"{self.label}: {msg}", file=self.out if self.out is not None else sys.stderr, flush=True)

    def poll(self) -> None:
        """Check every member once: note crashes, start restarts that are due, promote ready restarts."""
        now = time.monotonic()
        members = list(self.group.procs)
        live_ids = {id(p) for p in members}
        for key in [k for k in self._watches if k not in live_ids]:
            del self._watches[key]  # stop_all emptied the group: forget
        for proc in members:
            if proc.popen is None:
                continue  # never started
            w = self._watches.get(id(proc))
            if w is None:  # up since it was started (the launcher waited for it to be ready)
                w = self._watches[id(proc)] = _Watch("up", min(now, proc.started_at or now))
            if proc.stopped_on_purpose:
                w.state = "stopped"
                continue
            if w.state == "stopped":  # spawned again by its owner
                w.state, w.since, w.num_failures = "up", now, 0
                continue
            if w.state == "up":
                if not proc.alive():
                    up_s = now - w.since
                    if up_s >= self.policy.reset_after_s:
                        w.num_failures = 0
                    self._schedule(proc, w, now, f"exited with {describe_status(proc.returncode)} after "
                                                 f"{up_s:.1f} s up")
                elif proc.live is not None and now >= w.next_probe:
                    w.next_probe = now + self.policy.live_interval_s
                    if proc.live():
                        w.num_probe_failures = 0
                    else:
                        w.num_probe_failures += 1
                        if w.num_probe_failures >= self.policy.live_failures:
                            w.num_probe_failures = 0
                            stop_group(proc.popen, 0.0)  # runs but no longer serves: a crash, restarted as one
                            if now - w.since >= self.policy.reset_after_s:
                                w.num_failures = 0
                            self._schedule(proc, w, now, f"stopped serving ({self.policy.live_failures} health "
                                                         "probes in a row failed; killed)")
            elif w.state == "waiting":
                if now >= w.due:
                    self._restart(proc, w, now)
            elif w.state == "starting":
                if not proc.alive():
                    self._schedule(proc, w, now, f"exited with {describe_status(proc.returncode)} while "
                                                 "restarting")
                elif proc.ready is None or proc.ready():
                    w.state, w.since = "up", time.monotonic()
                    w.next_probe, w.num_probe_failures = w.since + self.policy.live_interval_s, 0
                    self._say(f"{proc.name} is back (restart {w.num_restarts}, pid {proc.pid}, ready "
                              f"{w.since - w.due:.1f} s after its restart)")
                elif now - w.since > self.policy.ready_timeout_s:
                    stop_group(proc.popen, 0.0)
                    self._schedule(proc, w, now, f"not ready {self.policy.ready_timeout_s:g} s after its restart "
                                                 "(killed)")

    def _schedule(self, proc: ManagedProcess, w: _Watch, now: float, what: str) -> None:
        w.num_failures += 1
        delay = self.policy.delay_s(w.num_failures)
        w.state, w.due = "waiting", now + delay
        # The log's tail once per streak of failures: it explains the first; the rest repeat it.
        detail = proc.log_excerpt() if w.num_failures == 1 else (f" (log {proc.log_path})" if proc.log_path else "")
        self._say(f"{proc.name} {what}; restart {w.num_restarts + 1} in {delay:.3g} s"
                  f"{' (crash loop: backing off)' if w.num_failures > 1 else ''}{detail}")

    def _restart(self, proc: ManagedProcess, w: _Watch, now: float) -> None:
        stop_group(proc.popen, 0.0)  # leftovers of its group; not proc.stop(): this is no stop on purpose
        w.num_restarts += 1
        try:
            proc.spawn()
        except (RuntimeError, OSError) as exc:  # PortBusy (someone took its port), an exec failure
            self._schedule(proc, w, now, f"could not be restarted: {exc}")
            return
        w.state, w.since, w.due = "starting", now, now
        self._say(f"{proc.name} restarted (restart {w.num_restarts}, pid {proc.pid}); waiting until it is ready")


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

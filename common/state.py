"""Where prefixroute keeps what it writes between runs: one state folder, never the current directory.

`state_dir()` is, first found: ``$PREFIXROUTE_STATE_DIR``, ``$XDG_STATE_HOME/prefixroute``,
``~/.local/state/prefixroute`` (the XDG Base Directory specification's place for "data that should persist
between restarts but is not important or portable enough for the data folder": logs, history). A relative
path is taken from the current directory. The folder holds:

    telemetry.db (+ -wal, -shm)   the request store: `prefixroute telemetry` writes it, `prefixroute dashboard`
                                  and `telemetry dump` read it (their default --db)
    logs/<component>.log          one log per component of `prefixroute up`, and logs/telemetry.token

`prefixroute up --state-dir DIR` moves all of it; `--db` and `--log-dir` move one part. `ensure_dir` creates
a folder owner-only (0700): the logs name the endpoints and the token file is a secret.

One state folder serves one running stack: `claim_state` takes an exclusive lock on ``<state dir>/stack.lock`` for
as long as `prefixroute up` runs (the kernel drops it when the process ends, however it ends), and a second
`up` on the same folder is refused with `StateInUse`, naming the running one and ``--state-dir``: two stacks
would otherwise share telemetry.db, append to the same logs and overwrite each other's telemetry.token.

`new_run_id()` names one run of the stack (one `prefixroute up`, or one receiver started alone): every request
the receiver stores carries it, so the dashboard can show the current run apart from earlier ones.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from pathlib import Path

STATE_DIR_ENV = "PREFIXROUTE_STATE_DIR"
DB_NAME = "telemetry.db"
LOCK_NAME = "stack.lock"
LOGS_NAME = "logs"


def state_dir(environ: os._Environ[str] | dict[str, str] | None = None) -> Path:
    """The state folder (see the module docstring); not created here."""
    env = os.environ if environ is None else environ
    explicit = env.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = env.get("XDG_STATE_HOME")
    # The XDG spec: a relative XDG_STATE_HOME is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "prefixroute"
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".local" / "state" / "prefixroute"


def default_db(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    """The request store's default path: ``<state dir>/telemetry.db``."""
    return str(state_dir(environ) / DB_NAME)


def ensure_dir(path: str | os.PathLike) -> Path:
    """Create `path` and each missing parent owner-only (0700, as the XDG specification asks of the folders it
    names); an existing folder keeps its mode."""
    p = Path(path).absolute()
    for d in (*reversed(p.parents), p):
        if not d.is_dir():
            d.mkdir(mode=0o700, exist_ok=True)
    return p


def new_run_id(now: float | None = None) -> str:
    """A run id: UTC start time to the second and 4 random hex digits, e.g. ``20250301-142233-9f1c``; ids sort
    by start time, and two runs started in the same second still differ."""
    t = time.gmtime(time.time() if now is None else now)
    return time.strftime("%Y%m%d-%H%M%S", t) + "-" + secrets.token_hex(2)


class StateInUse(RuntimeError):
    """Another running stack holds the state folder's lock (see the module docstring)."""


def claim_state(folder: str | os.PathLike, owner: str) -> int:
    """Lock `folder`/stack.lock for this process and write `owner` (who holds it, for the refusal a second stack
    gets) into it; returns the lock's file descriptor (closed at exit, or by the caller). Raises `StateInUse`,
    saying who holds it and how to run beside it, when another live process holds it. Creates `folder` (0700)."""
    path = ensure_dir(folder) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise StateInUse(f"the state folder {path.parent} is in use by another running stack ({holder}); two "
                         f"stacks would share its telemetry.db, logs and telemetry.token. Give this one its own: "
                         f"--state-dir DIR (or PREFIXROUTE_STATE_DIR=DIR), e.g. --state-dir "
                         f"{path.parent}-2") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner.encode("utf-8"), 0)
    return fd

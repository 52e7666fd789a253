"""Find the processes a launcher left behind: every process started under a marker environment variable
inherits it (children and grandchildren alike, whatever session they are in), so scanning /proc for it
counts them all, even after their parent died and they were re-parented.

Contract: `marked_env(marker)` is the environment to start the launcher with; `marked_pids(marker)` the
live processes (zombies excluded) carrying it, this test process excluded; `wait_none_left` waits for
zero and returns what stayed (with command lines) otherwise; `kill_marked` is the cleanup of last resort.
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from pathlib import Path

from helpers.waiting import until

MARKER_VAR = "PREFIXROUTE_TEST_MARKER"


def new_marker() -> str:
    return uuid.uuid4().hex


def marked_env(marker: str, **extra: str) -> dict[str, str]:
    return {**os.environ, MARKER_VAR: marker, **extra}


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


def marked_pids(marker: str) -> dict[int, str]:
    """pid -> command line of each live process whose environment carries `marker`."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if not _is_zombie(int(entry.name)):
            found[int(entry.name)] = cmdline
    return found


def wait_none_left(marker: str, timeout_s: float = 5.0) -> dict[int, str]:
    """Wait up to `timeout_s` for no marked process to be left; what is left ({} when none)."""
    try:
        until(lambda: not marked_pids(marker), timeout_s, interval_s=0.1)
    except AssertionError:
        return marked_pids(marker)
    return {}


def kill_marked(marker: str) -> None:
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def find_pid(marker: str, *words: str) -> int:
    """The one marked process whose command line contains every one of `words`."""
    hits = [pid for pid, cmd in marked_pids(marker).items() if all(w in cmd.split() for w in words)]
    assert len(hits) == 1, (words, marked_pids(marker))
    return hits[0]


def listening(port: int) -> bool:
    """True when something listens on 127.0.0.1:`port` (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False

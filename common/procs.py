"""Small process and port utilities shared by every launcher (gateway, `up`, dashboard, bench).

Contract: children are started in their own session (``start_new_session=True``) by the callers, so
`stop_group` can stop a child together with everything it started (Envoy, Streamlit's server). Only
loopback addresses are probed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request

LOOPBACK = "127.0.0.1"


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


def tcp_open(port: int, host: str = LOOPBACK, timeout_s: float = 0.3) -> bool:
    """True when a TCP connection to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET; (0, b"") when no response came."""
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


def stop_group(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group, SIGKILL it after `grace_s`, reap the child. Idempotent.

    The group is killed even when the leader already exited, so no grandchild lingers."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)

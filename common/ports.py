"""Ports and loopback probes for launchers and tests: free ports outside the kernel's ephemeral range
(`free_ports`), whether a port is taken (`port_in_use`), and TCP / HTTP probes (`tcp_open`, `http_get`,
`http_ok`). Only loopback addresses are probed. Not thread-safe (`free_ports` remembers what it handed out)."""

from __future__ import annotations

import random
import socket
import urllib.error
import urllib.request
from pathlib import Path

LOOPBACK = "127.0.0.1"


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

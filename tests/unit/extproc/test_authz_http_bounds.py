"""The HTTP check port's bounds, on one connection fed by hand (no sockets: a transport that records what is
written): the token checked at its header and at the end of the headers, header bytes and lines bounded, repeated
headers joined once and in order, bodies never kept before the caller is trusted, the timeouts and the limits on
connections. End to end against the real router: tests/integration/reliability/test_port_hardening.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from prefixroute.extproc import authz_http
from prefixroute.extproc.authz_http import (MAX_HEADERS, MAX_UNTRUSTED_CONNECTIONS, REQUEST_TIMEOUT_S, TOKEN_HEADER,
                                            AuthzHttpConnection, AuthzHttpService)


class FakeTransport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False
        self.aborted = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_write_buffer_size(self) -> int:
        return 0


class RecordingAuthz:
    """Stands for AuthzServicer.start: records the checks it is asked, answers a handoff."""

    def __init__(self) -> None:
        self.checks: list[tuple[dict[str, str], bytes]] = []

    def start(self, headers: dict[str, str], method: str, path: str, body: bytes, *_: Any) -> tuple[None, Any]:
        self.checks.append((dict(headers), body))
        return None, authz_http.HANDOFF


def service(token: str | None = "s3cret", max_header_bytes: int = 4096) -> AuthzHttpService:
    return AuthzHttpService(RecordingAuthz(), token=token, ready=lambda: True, max_body_bytes=1 << 20,
                            max_header_bytes=max_header_bytes)


def connect(svc: AuthzHttpService) -> tuple[AuthzHttpConnection, FakeTransport]:
    conn = AuthzHttpConnection(svc)
    t = FakeTransport()
    conn.connection_made(t)  # type: ignore[arg-type]
    return conn, t


CHECK = b"POST /check/v1/chat/completions HTTP/1.1\r\nhost: g\r\n"
TOKEN = f"{TOKEN_HEADER}: Bearer s3cret\r\n".encode()


async def test_a_wrong_token_is_refused_at_its_header_and_the_rest_is_never_read() -> None:
    svc = service()
    conn, t = connect(svc)
    conn.data_received(CHECK + f"{TOKEN_HEADER}: Bearer wrong\r\n".encode() + b"x-next: ")  # the request goes on
    assert t.out.startswith(b"HTTP/1.1 500 ") and b"bearer token" in t.out and t.closed
    conn.data_received(b"more\r\ncontent-length: 5\r\n\r\nhello")
    assert svc.authz.checks == [] and svc.num_refused_token == 1  # type: ignore[attr-defined]


async def test_a_missing_token_is_refused_at_the_end_of_the_headers_before_the_body() -> None:
    svc = service()
    conn, t = connect(svc)
    conn.data_received(CHECK + b"content-length: 1000000\r\n\r\n" + b"{" * 10)
    assert t.out.startswith(b"HTTP/1.1 500 ") and t.closed and conn.body == []
    assert svc.authz.checks == []  # type: ignore[attr-defined]


async def test_repeated_headers_are_joined_once_in_order() -> None:
    svc = service()
    conn, t = connect(svc)
    conn.data_received(CHECK + TOKEN + b"x-a: 1\r\nx-b: q\r\nX-A: 2\r\nx-a: 3\r\ncontent-length: 2\r\n\r\n{}")
    ((headers, body),) = svc.authz.checks  # type: ignore[attr-defined]
    assert headers["x-a"] == "1,2,3" and headers["x-b"] == "q" and body == b"{}"
    assert t.out.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("case", ["lines", "bytes", "one long line", "long path"])
async def test_headers_over_the_limits_get_431_and_the_connection_closed(case: str) -> None:
    svc = service(max_header_bytes=4096)
    conn, t = connect(svc)
    data = {"lines": CHECK + TOKEN + b"x: y\r\n" * (MAX_HEADERS + 1),
            "bytes": CHECK + TOKEN + b"x-long: " + b"a" * 3000 + b"\r\n" + b"x-more: " + b"b" * 2000,
            "one long line": CHECK + b"x-big: " + b"a" * 5000,
            "long path": b"GET /check/" + b"p" * 5000}[case]
    for i in range(0, len(data), 1000):  # as it comes in, piece by piece
        conn.data_received(data[i:i + 1000])
    assert t.out.startswith(b"HTTP/1.1 431 ") and t.closed, t.out[:100]
    assert svc.authz.checks == [] and svc.num_too_large_headers == 1  # type: ignore[attr-defined]


async def test_health_and_other_paths_need_no_token_but_keep_no_body() -> None:
    svc = service()
    conn, t = connect(svc)
    conn.data_received(b"POST /health HTTP/1.1\r\ncontent-length: 100000\r\n\r\n" + b"x" * 100000)
    assert t.out.startswith(b"HTTP/1.1 200 ") and conn.body == [] and not conn.is_trusted
    conn.data_received(b"GET /elsewhere HTTP/1.1\r\n\r\n")
    assert b"HTTP/1.1 404 " in t.out and not t.closed


async def test_a_connection_is_trusted_once_it_presents_the_token() -> None:
    svc = service()
    conn, _ = connect(svc)
    assert conn in svc.untrusted
    conn.data_received(CHECK + TOKEN + b"content-length: 2\r\n\r\n{}")
    assert conn.is_trusted and conn not in svc.untrusted and conn in svc.connections
    svc_open = service(token=None)
    conn2, _ = connect(svc_open)
    conn2.data_received(CHECK + b"content-length: 2\r\n\r\n{}")  # no token configured: its first check
    assert conn2.is_trusted


async def test_timeouts_close_half_sent_and_idle_connections() -> None:
    svc = service()
    now = time.monotonic()
    half, _ = connect(svc)
    half.data_received(CHECK)  # and nothing more
    silent, _ = connect(svc)
    trusted, _ = connect(svc)
    trusted.data_received(CHECK + TOKEN + b"content-length: 2\r\n\r\n{}")
    later = half.loop.time() + REQUEST_TIMEOUT_S + 0.1
    assert half.expired(later) and silent.expired(later)
    assert not trusted.expired(later)  # idle between checks, trusted: IDLE_TIMEOUT_S
    assert trusted.expired(later + authz_http.IDLE_TIMEOUT_S)
    assert not half.expired(half.loop.time()) and time.monotonic() - now < 1


async def test_untrusted_connections_beyond_the_limit_close_the_idlest_first() -> None:
    svc = service()
    trusted, _ = connect(svc)
    trusted.data_received(CHECK + TOKEN + b"content-length: 2\r\n\r\n{}")
    flood = [connect(svc) for _ in range(MAX_UNTRUSTED_CONNECTIONS)]
    newest, newest_t = connect(svc)  # one more: the idlest untrusted one goes, not the newcomer, not Envoy's
    assert flood[0][1].aborted and not newest_t.aborted and not any(t.aborted for _, t in flood[1:])
    assert len(svc.untrusted) == MAX_UNTRUSTED_CONNECTIONS and trusted in svc.connections
    assert svc.num_refused_connections == 1


async def test_a_client_that_pipelines_without_end_is_read_no_further() -> None:
    svc = service()
    conn, t = connect(svc)
    conn.busy = True  # a decision under way: what follows waits its turn
    conn.data_received((CHECK + TOKEN + b"content-length: 2\r\n\r\n{}") * authz_http.MAX_PIPELINED)
    assert t.paused and len(conn.pending) == authz_http.MAX_PIPELINED
    conn._next()
    assert len(svc.authz.checks) == authz_http.MAX_PIPELINED  # type: ignore[attr-defined]
    assert not t.paused


async def test_a_closed_connection_lets_go_of_what_it_held() -> None:
    svc = service()
    conn, _ = connect(svc)
    conn.data_received(CHECK + b"x-partial: " + b"a" * 1000)
    conn.connection_lost(None)
    assert conn.parser is None and conn not in svc.connections and conn not in svc.untrusted

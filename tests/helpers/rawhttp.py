"""Raw HTTP/1.x over a socket, for requests an HTTP client library would refuse to send or would repair
(dot segments, absolute-URI targets, bad chunking, HTTP/1.0, CONNECT, oversized headers)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names; the last of a repeated name wins
    body: bytes

    def json_error(self) -> dict:
        """The OpenAI error object of this reply; AssertionError when it is not one, or its code disagrees."""
        assert self.headers.get("content-type", "").startswith("application/json"), (self.status, self.headers,
                                                                                     self.body[:300])
        err = json.loads(self.body)["error"]
        assert err["code"] == self.status and err["message"] and err["type"], err
        assert set(err) == {"message", "type", "param", "code"}, err
        return err


def send(port: int, data: bytes, *, timeout_s: float = 10.0, host: str = "127.0.0.1") -> Reply | None:
    """Send `data` on a fresh connection and read one response (None when the connection closed without one).
    socket.timeout when no full response came within `timeout_s`."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(data)
        return read_reply(s)


def read_reply(s: socket.socket) -> Reply | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        n = int(headers["content-length"])
        while len(rest) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return Reply(status, headers, rest[:n])
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += s.recv(65536)
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                rest += s.recv(65536)
            body += rest[:size]
            rest = rest[size + 2:]
            if size == 0:
                return Reply(status, headers, body)
    return Reply(status, headers, rest)


def request(method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None,
            version: str = "HTTP/1.1") -> bytes:
    """Bytes of one request (Host and Content-Length added unless given)."""
    hdrs = {"host": "gateway", **({"content-length": str(len(body))} if body or method == "POST" else {}),
            **(headers or {})}
    head = f"{method} {target} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    return head.encode("latin-1") + body

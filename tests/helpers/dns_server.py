"""A tiny authoritative DNS server on loopback (UDP, dnslib) whose records a test changes while it runs.

`records` maps a fully qualified name (with or without the trailing dot) to its addresses (IPv4 -> A,
IPv6 -> AAAA). `mode` picks the answer to every query: "answer" (the records; a name absent -> NXDOMAIN,
present without that type -> NOERROR/empty), "servfail", or "drop" (no reply at all: a DNS outage).
"""

from __future__ import annotations

import ipaddress
import socket
import threading

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord


class LocalDns:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.records: dict[str, list[str]] = {}
        self.mode = "answer"
        self.num_queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.1)
        self.host, self.port = self._sock.getsockname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="local-dns", daemon=True)

    @property
    def address(self) -> str:
        """``IP:PORT``, as --endpoints-dns-nameservers takes it."""
        return f"{self.host}:{self.port}"

    def set(self, name: str, *addresses: str) -> None:
        self.records[name.rstrip(".") + "."] = list(addresses)

    def start(self) -> LocalDns:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> LocalDns:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.num_queries += 1
            if self.mode == "drop":
                continue
            query = DNSRecord.parse(data)
            reply = query.reply()
            reply.header.aa = 1
            qname = str(query.q.qname)
            if self.mode == "servfail":
                reply.header.rcode = RCODE.SERVFAIL
            elif qname not in self.records:
                reply.header.rcode = RCODE.NXDOMAIN
            else:
                for addr in self.records[qname]:
                    v6 = ipaddress.ip_address(addr).version == 6
                    if query.q.qtype == (QTYPE.AAAA if v6 else QTYPE.A):
                        reply.add_answer(RR(qname, query.q.qtype, rdata=AAAA(addr) if v6 else A(addr), ttl=5))
            self._sock.sendto(reply.pack(), peer)

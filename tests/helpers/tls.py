"""Test certificates: a private CA, a server certificate for 127.0.0.1/localhost and a client certificate,
made with the `openssl` command line (Debian's openssl package; docs/security.md's TLS recipe uses the same
commands). `make_pki(dir)` writes them and returns their paths; every call makes a fresh CA, so a
certificate from another call is a certificate from an untrusted CA."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _leaf(d: Path, name: str, subject: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject, "-out", f"{name}.csr",
         cwd=d)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


def make_pki(d: Path) -> Pki:
    """A CA plus server and client certificates under `d` (created). Takes about a second."""
    d.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=prefixroute test CA", cwd=d)
    _leaf(d, "server", "/CN=localhost",
          "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "/CN=prefixroute-client", "extendedKeyUsage=clientAuth\n")
    return Pki(ca_cert=d / "ca.crt", ca_key=d / "ca.key", server_cert=d / "server.crt", server_key=d / "server.key",
               client_cert=d / "client.crt", client_key=d / "client.key")

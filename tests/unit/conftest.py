"""The unit layer's rule, enforced: a unit test opens no network socket and starts no process (docs/development.md).
A test that binds or connects an IP socket, starts a gRPC server or a child process fails here, naming what to
do: move it to tests/integration/<area>. (Unix socket pairs stay allowed: asyncio's event loop uses one.)"""

from __future__ import annotations

import socket
import subprocess

import pytest

MOVE_IT = "a unit test opens no socket and starts no process: move this test to tests/integration/<area>"


@pytest.fixture(autouse=True)
def _no_sockets_or_processes(monkeypatch):
    real_bind, real_connect, real_connect_ex = socket.socket.bind, socket.socket.connect, socket.socket.connect_ex

    def guarded(real):
        def call(self, address, *args):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                raise AssertionError(f"{MOVE_IT} (it used {real.__name__} {address!r})")
            return real(self, address, *args)
        return call

    monkeypatch.setattr(socket.socket, "bind", guarded(real_bind))
    monkeypatch.setattr(socket.socket, "connect", guarded(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(real_connect_ex))

    def no_process(self, args, *a, **k):
        raise AssertionError(f"{MOVE_IT} (it started {args!r:.120})")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    try:
        import grpc.aio
        from grpc.aio import _server

        def no_grpc_port(self, address, *a, **k):
            raise AssertionError(f"{MOVE_IT} (a gRPC server on {address})")

        monkeypatch.setattr(_server.Server, "add_insecure_port", no_grpc_port)
        monkeypatch.setattr(_server.Server, "add_secure_port", no_grpc_port)
        del grpc
    except ImportError:
        pass
    yield

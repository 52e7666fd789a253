"""tests/unit/conftest.py's guard: inside a unit test an IP socket or a child process fails, naming where the test
belongs; a Unix socket pair (asyncio's event loop) still works."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def test_an_ip_socket_in_a_unit_test_fails_naming_integration():
    with socket.socket() as s, pytest.raises(AssertionError, match="move this test to tests/integration"):
        s.bind(("127.0.0.1", 0))
    with socket.socket() as s, pytest.raises(AssertionError, match="move this test to tests/integration"):
        s.connect(("127.0.0.1", 9))


def test_a_child_process_in_a_unit_test_fails_naming_integration():
    with pytest.raises(AssertionError, match="starts no process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_unix_socket_pair_still_works():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"

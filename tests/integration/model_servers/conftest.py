"""Fixtures for the model-server integration tests: real server processes, always killed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.model_server import ServerProc, start_server


@pytest.fixture
def server_factory() -> Iterator:
    procs: list[ServerProc] = []

    def factory(*args: str, env: dict[str, str] | None = None) -> ServerProc:
        s = start_server(*args, env=env)
        procs.append(s)
        return s

    yield factory
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()

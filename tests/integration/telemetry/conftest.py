"""Fixtures: a real `prefixroute telemetry` receiver process on free loopback ports."""

from __future__ import annotations

import pytest

from helpers.receiver import ReceiverProc, start_receiver


@pytest.fixture
def receiver(tmp_path):
    r = start_receiver(tmp_path / "telemetry.db")
    yield r
    r.stop()


@pytest.fixture
def receiver_factory(tmp_path):
    """Start receivers (e.g. on a chosen port) that are all stopped at teardown."""
    started: list[ReceiverProc] = []

    def start(*extra: str, port: int = 0) -> ReceiverProc:
        r = start_receiver(tmp_path / f"telemetry{len(started)}.db", *extra, port=port)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()

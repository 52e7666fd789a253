"""`extproc.cli.KVEventsLink`: the endpoints matched by events are those whose subscriber is connected; a
server whose KV block size differs from --kv-block-tokens is reported once."""

from __future__ import annotations

import logging

from prefixroute.extproc.cli import KVEventsLink
from prefixroute.extproc.kv_events import KVEventIndex, SubscriberStats
from prefixroute.extproc.routing.router import RouterCore
from prefixroute.extproc.routing.settings import RoutingSettings
from prefixroute.extproc.routing.types import EndpointId, EndpointState

A, B = EndpointId("10.0.0.1:8000"), EndpointId("10.0.0.2:8000")


class _Manager:
    def __init__(self) -> None:
        self.connected = {A: True, B: False}

    def stats(self):
        return {ep: SubscriberStats(pub_address="tcp://x:1", replay_address=None, connected=c, last_seq=3)
                for ep, c in self.connected.items()}


def test_sources_follow_the_connection_and_block_sizes_are_checked(caplog):
    core = RouterCore(RoutingSettings(tokenizer="sim"), event_index=KVEventIndex(16))
    mgr = _Manager()
    snap = (EndpointState(A, block_size=16), EndpointState(B, block_size=32))
    link = KVEventsLink(core, mgr, {A: ("tcp://a:1", None), B: ("tcp://b:1", None)}, lambda: snap)  # type: ignore[arg-type]
    link.endpoints = [A, B]
    with caplog.at_level(logging.WARNING, logger="prefixroute.extproc"):
        link.check()
        link.check()
    assert core.index_sources([A, B]) == {A: "events", B: "feedback"}
    assert link.info[A]["source"] == "events" and link.info[B]["source"] == "feedback"
    assert link.info[B]["connected"] is False
    size_warnings = [r for r in caplog.records if "KV block size 32" in r.getMessage()]
    assert len(size_warnings) == 1 and B in size_warnings[0].getMessage()
    mgr.connected[B] = True
    link.check()
    assert core.index_sources([A, B]) == {A: "events", B: "events"}

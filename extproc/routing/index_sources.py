"""`SourcedIndex`: what the scheduler matches a request against, per endpoint from the source it has.

An endpoint that publishes KV events (and the router subscribes) is matched against the events index (what the
server reported it stores); every other endpoint against the router's own `PrefixIndex` (its picks, with an LRU
sized from the endpoint's KV capacity, and in *feedback* mode that LRU shrunk when a response's cached tokens
show the server held less than predicted: `router.RouterCore.on_usage`). Both are keyed by the request's
`block_hashes` (token blocks when the router tokenizes, text blocks otherwise), so one `match` merges them.

Invariants: an events endpoint never has entries in the own index (`RouterCore` records picks only for the
others), so merging is a dict union without conflicts; the events index's entries of an endpoint not in
`event_endpoints` (its events not trusted now: syncing, down, undecodable, mismatched) are never returned; `source_of` names the source every endpoint's match
came from. Not thread-safe (the router's event loop), except `sources`, a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from prefixroute.extproc.routing.prefix_index import PrefixIndex
from prefixroute.types import BlockHash, EndpointId

EVENTS = "events"
FEEDBACK = "feedback"
APPROXIMATE = "approximate"


class BlockIndex(Protocol):
    """The contract `PrefixIndex` and the KV-events index share."""

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        """Endpoints holding the first block -> consecutive leading blocks held (absent: none)."""
        ...

    def clear_endpoint(self, endpoint: EndpointId) -> None: ...

    def remove_endpoint(self, endpoint: EndpointId) -> None: ...


class SourcedIndex:
    """The own index for most endpoints, the events index for `event_endpoints` (module docstring)."""

    __slots__ = ("own", "events", "own_source", "event_endpoints")

    def __init__(self, own: PrefixIndex, events: BlockIndex | None = None, *, own_source: str = APPROXIMATE,
                 event_endpoints: Iterable[EndpointId] = ()) -> None:
        self.own = own
        self.events = events
        self.own_source = own_source
        self.event_endpoints: frozenset[EndpointId] = frozenset(event_endpoints) if events is not None else frozenset()

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        own = self.own.match(block_hashes)
        if self.events is None or not self.event_endpoints:
            return own
        ev = self.events.match(block_hashes)
        if not ev:
            return own
        if not ev.keys() <= self.event_endpoints:
            # The events index also holds endpoints not matched by events now (syncing, down, undecodable:
            # a partial or stale view): their matches come from the own index only.
            ev = {ep: n for ep, n in ev.items() if ep in self.event_endpoints}
            if not ev:
                return own
        if not own:
            return ev
        merged = dict(own)
        merged.update(ev)
        return merged

    def source_of(self, endpoint: EndpointId) -> str:
        return EVENTS if endpoint in self.event_endpoints else self.own_source

    def sources(self, endpoints: Iterable[EndpointId]) -> dict[EndpointId, str]:
        ev = self.event_endpoints
        own = self.own_source
        return {ep: EVENTS if ep in ev else own for ep in endpoints}

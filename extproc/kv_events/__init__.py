"""KV events in the router: the precise prefix index (`index.KVEventIndex`, keyed by the router's token-block
hashes, fed by the servers' BlockStored / BlockRemoved / AllBlocksCleared events) and the ZMQ subscribers that
feed it (`subscriber.KVEventsManager`, one `EndpointSubscriber` per endpoint: sequence gaps, replay,
publisher restarts). The wire format is `prefixroute.kv_events_wire`; the token hashing `routing.hashing`."""

from prefixroute.extproc.kv_events.index import IndexCounters, KVEventIndex
from prefixroute.extproc.kv_events.subscriber import (CLEAR_REASONS, EndpointSubscriber, KVEventsManager,
                                                      SubscriberStats)

__all__ = ["CLEAR_REASONS", "EndpointSubscriber", "IndexCounters", "KVEventIndex", "KVEventsManager",
           "SubscriberStats"]

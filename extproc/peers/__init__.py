"""Replicas sharing routing state through NATS (docs/operating.md: Several replicas: what they share).

- `settings.PeerSettings`: ``--peers-url`` (empty: route alone), ``--replica-id``, subjects, TTLs, bounds.
- `codec`: the messages (pick, done, failover, response) and their msgpack batches.
- `bus.PeerBus`: publish without awaiting (one batch per event-loop tick), apply what the others send.
- `server`: the nats-server binary and its loopback argv (the gateway's embedded server, tests).
"""

"""The messages replicas exchange (msgspec structs, msgpack on the wire) and their encoder/decoder.

One NATS message is one `Batch`: every message one replica produced in one event-loop tick, with the sender's
`replica` id and `incarnation` (random per process: a replica restarted under the same id never has its new
picks confused with the old ones' pending state). A pick is named by (replica, incarnation, seq) everywhere.

Compatibility: structs are array-like (positional) and tagged by an int; new fields go at the end with
defaults, so an older replica reading a newer message ignores nothing it needs (msgspec fills defaults for
missing trailing fields; extra trailing fields are rejected, so upgrade readers first).
"""

from __future__ import annotations

import msgspec


class Pick(msgspec.Struct, array_like=True, tag=0, frozen=True):
    """A request was routed to `endpoint` (the primary): it counts in flight there until its `Release`.
    `block_hashes`: its prefix (may be empty). `pending_tokens`: the uncached prefill the prefix policy queued
    for it there (None: the sender's policy keeps no queue; then no `Done` follows). `session_key` with `tenant`: the chat session it continues, when
    the sender keeps sessions."""

    seq: int
    endpoint: str
    block_hashes: list[int]
    pending_tokens: float | None = None
    tenant: str | None = None
    session_key: str | None = None


class Done(msgspec.Struct, array_like=True, tag=1, frozen=True):
    """Pick `seq`'s first token came: it leaves its endpoint's prefill queue (it still counts in flight)."""

    seq: int


class Release(msgspec.Struct, array_like=True, tag=4, frozen=True):
    """Pick `seq`'s request ended (any reason): it leaves its endpoint's in-flight count (and its queue, if no
    first token came first)."""

    seq: int


class Failover(msgspec.Struct, array_like=True, tag=2, frozen=True):
    """Pick `seq` (its prefix and session) was really served by `endpoint`, a fallback: its in-flight count
    moves there."""

    seq: int
    endpoint: str
    block_hashes: list[int]
    tenant: str | None = None
    session_key: str | None = None


class Response(msgspec.Struct, array_like=True, tag=3, frozen=True):
    """Responses API: `endpoint` holds `response_id`; `prompt_tokens`: its request's prompt tokens, when known."""

    response_id: str
    endpoint: str
    prompt_tokens: int | None = None


class Observed(msgspec.Struct, array_like=True, tag=5, frozen=True):
    """The prefix policy learned from one of the sender's responses at `endpoint` (`TimeModel.observe`'s
    arguments, in the router's units): every replica feeds the same observation to its rate estimate, so all
    price endpoints alike (each alone would learn from 1/N of the responses, and drift apart)."""

    endpoint: str
    prompt_tokens: float
    cached_tokens: float
    ttft_s: float
    queued_tokens: float
    num_decoding: int = 0


Message = Pick | Done | Release | Failover | Response | Observed
KINDS: dict[type, str] = {Pick: "pick", Done: "done", Release: "release", Failover: "failover",
                          Response: "response", Observed: "observed"}
"""Each message type's ``kind`` label on /metrics."""


class Batch(msgspec.Struct, array_like=True, frozen=True):
    """One NATS message. An empty one is a heartbeat (sent every second): a replica silent for
    `PeerSettings.peer_timeout_s` is gone, and what it had in flight and pending is dropped."""

    replica: str
    incarnation: int
    messages: list[Message]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def encode(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode(data: bytes) -> Batch:
    """Raises `msgspec.DecodeError` (a `msgspec.ValidationError` for a well-formed message of the wrong shape)."""
    return _decoder.decode(data)

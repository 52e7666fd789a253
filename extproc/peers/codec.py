"""The messages replicas exchange (msgspec structs, msgpack on the wire) and their encoder/decoder.

One NATS message is one `Batch`: every message one replica produced in one event-loop tick, with the sender's
`replica` id and `incarnation` (random per process: a replica restarted under the same id never has its new
picks confused with the old ones' pending state). A pick is named by (replica, incarnation, seq) everywhere.

Compatibility: structs are array-like (positional) and tagged by an int; new fields go at the end with
defaults, so an older replica reading a newer message ignores nothing it needs (msgspec fills defaults for
missing trailing fields; extra trailing fields are rejected, so upgrade readers first). A later version changed the
format (sessions and response ids by digest, the batch's own sequence number): replicas of one gateway are
upgraded together; in Kubernetes a rolling update counts the other version's batches as invalid until done.

Bounds: every field a batch carries has a size limit the decoder enforces (`MAX_*`), so one
message costs a receiver a bounded amount whatever a sender put in it, and no client value travels raw: a
session is its `sessions.session_id` digest, a response id its `responses.response_key` digest (ids are
capabilities: whoever knows one can read the response).

Authentication (`seal` / `open_sealed`): with a bus key (``--peers-key-file``; the gateway draws one per run),
each NATS message is ``HMAC-SHA256(key, subject + payload)`` followed by the payload; a receiver drops any
message whose tag does not verify, so a process that can reach the NATS server but does not hold the key
cannot inject picks, and the NATS server itself (or an impostor on its port) learns nothing it can use.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

import msgspec

MAX_BLOCK_HASHES = 4096
"""Most block hashes one message carries (a request hashes at most max_blocks / max_token_blocks: 256 / 1024)."""
MAX_ENDPOINT_CHARS = 512
MAX_DIGEST_BYTES = 32
MAX_REPLICA_CHARS = 200
MAX_BATCH_MESSAGES = 4096
MAX_PAYLOAD_BYTES = 1024 * 1024
"""NATS's default max_payload: a sender splits a batch that would encode larger (`encode_split`)."""
TAG_BYTES = 32

Hashes = Annotated[list[int], msgspec.Meta(max_length=MAX_BLOCK_HASHES)]
Endpoint = Annotated[str, msgspec.Meta(max_length=MAX_ENDPOINT_CHARS)]
Digest = Annotated[bytes, msgspec.Meta(max_length=MAX_DIGEST_BYTES)]


class Pick(msgspec.Struct, array_like=True, tag=0, frozen=True):
    """A request was routed to `endpoint` (the primary): it counts in flight there until its `Release`.
    `block_hashes`: its prefix (may be empty). `pending_tokens`: the uncached prefill the prefix policy queued
    for it there (None: the sender's policy keeps no queue; then no `Done` follows). `session`: the
    `sessions.session_id` of the chat session it continues, when the sender keeps sessions."""

    seq: int
    endpoint: Endpoint
    block_hashes: Hashes
    pending_tokens: float | None = None
    session: Digest | None = None


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
    endpoint: Endpoint
    block_hashes: Hashes
    session: Digest | None = None


class Response(msgspec.Struct, array_like=True, tag=3, frozen=True):
    """Responses API: `endpoint` holds the response id whose `responses.response_key` is `key`, produced by the
    sender's pick `seq` (a receiver takes it only for an endpoint that pick went to); `prompt_tokens`: its
    request's prompt tokens, when known."""

    seq: int
    key: Digest
    endpoint: Endpoint
    prompt_tokens: int | None = None


class Observed(msgspec.Struct, array_like=True, tag=5, frozen=True):
    """The prefix policy learned from one of the sender's responses at `endpoint` (`TimeModel.observe`'s
    arguments, in the router's units): every replica feeds the same observation to its rate estimate, so all
    price endpoints alike (each alone would learn from 1/N of the responses, and drift apart)."""

    endpoint: Endpoint
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
    `PeerSettings.peer_timeout_s` is gone, and what it had in flight and pending is dropped. `seq` counts the
    sender's batches (per incarnation, from 1): a receiver applies only batches newer than the last it took
    from that sender, so a recorded batch replayed later changes nothing."""

    replica: Annotated[str, msgspec.Meta(max_length=MAX_REPLICA_CHARS)]
    incarnation: int
    messages: Annotated[list[Message], msgspec.Meta(max_length=MAX_BATCH_MESSAGES)]
    seq: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def encode(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode(data: bytes) -> Batch:
    """Raises `msgspec.DecodeError` (a `msgspec.ValidationError` for a well-formed message of the wrong shape,
    or a field over its bound)."""
    return _decoder.decode(data)


def encode_split(replica: str, incarnation: int, first_seq: int, messages: list[Message],
                 max_messages: int, max_bytes: int = MAX_PAYLOAD_BYTES - TAG_BYTES) -> list[tuple[bytes, int]]:
    """`messages` as encoded batches of at most `max_messages` messages and `max_bytes` bytes each, in order,
    numbered from `first_seq` on: (payload, number of messages). A batch over `max_bytes` is halved until it
    fits, so one large message never takes the others down with it (NATS refuses a payload over its
    max_payload); a single message alone over `max_bytes` cannot occur (every field is bounded: ~45 KB at
    most) and would be sent alone. No messages: one empty batch (a heartbeat)."""
    out: list[tuple[bytes, int]] = []
    seq = first_seq

    def emit(chunk: list[Message]) -> None:
        nonlocal seq
        data = _encoder.encode(Batch(replica, incarnation, chunk, seq))
        if len(data) > max_bytes and len(chunk) > 1:
            half = len(chunk) // 2
            emit(chunk[:half])
            emit(chunk[half:])
            return
        out.append((data, len(chunk)))
        seq += 1

    if not messages:
        emit([])
    for i in range(0, len(messages), max_messages):
        emit(messages[i:i + max_messages])
    return out


def seal(key: bytes | None, subject: str, payload: bytes) -> bytes:
    """The NATS message for `payload` on `subject`: ``HMAC-SHA256(key, subject 0x00 payload) + payload`` with a
    key, the payload alone without."""
    if not key:
        return payload
    tag = hmac.new(key, subject.encode() + b"\0" + payload, hashlib.sha256).digest()
    return tag + payload


def open_sealed(key: bytes | None, subject: str, data: bytes) -> bytes | None:
    """The payload of a NATS message `seal` made, None when its tag does not verify (without a key: `data`)."""
    if not key:
        return data
    if len(data) < TAG_BYTES:
        return None
    tag, payload = data[:TAG_BYTES], data[TAG_BYTES:]
    want = hmac.new(key, subject.encode() + b"\0" + payload, hashlib.sha256).digest()
    return payload if hmac.compare_digest(tag, want) else None

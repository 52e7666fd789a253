"""vLLM KV-cache events: the wire format (msgpack over ZMQ), shared by the simulated servers' publisher and the
router's subscriber. Pure data and codecs; no sockets here.

Follows ``vllm/distributed/kv_events.py`` at vLLM main commit 0181ea3 (2026; the format of the v0.11+ releases):
msgspec structs with ``omit_defaults``, encoded as msgpack *maps*; events are tagged unions whose tag is the
``"type"`` key holding the class name. Field order (the order of a struct's keys on the wire, and of its
elements in the array form)::

    EventBatch(ts: float, events: list, data_parallel_rank: int | None = None)
    BlockStored(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int], block_size: int,
                lora_id: int | None, medium: str | None, lora_name: str | None,
                extra_keys: list[tuple | None] | None = None, group_idx: int | None = None,
                kv_cache_spec_kind: str | None = None, kv_cache_spec_sliding_window: int | None = None)
    BlockRemoved(block_hashes: list[int], medium: str | None, group_idx: int | None = None)
    AllBlocksCleared()

Releases before v0.11 declared the structs ``array_like=True``: a batch is ``[ts, [event, ...], dp_rank]`` and
an event ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]`` (tag first,
later fields absent when the release predates them). `decode_batch` accepts both forms; `encode_batch` writes
the map form (``array_like=True`` writes the old one, for tests of the old format).

Block hashes are the server's ``ExternalBlockHash``: an int (vLLM publishes the low 64 bits of its sha256 block
hash as an unsigned int) or, from some releases, bytes; both decode to an int (bytes big-endian, low 64 bits).

Transport (vLLM's ``ZmqEventPublisher``): PUB socket, multipart ``(topic, seq, payload)`` with ``seq`` an 8-byte
big-endian sequence number from 0 per publisher process; an optional ROUTER *replay* socket answers a request
``(b"", start_seq)`` (8-byte big-endian) with every buffered ``(seq, payload)`` from ``start_seq`` on, then
``(END_SEQ, b"")``. A publisher that restarts starts again from sequence 0.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The replay socket's end-of-replay marker, in place of a sequence number."""

_MASK64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """`block_hashes` (server hashes, in chain order) were stored, holding `token_ids` (``len(block_hashes) x
    block_size`` of them); the first one's parent is `parent_block_hash` (None: it starts a prompt)."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """`block_hashes` were evicted from `medium`."""

    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The server's whole prefix cache was emptied (``/reset_prefix_cache``, sleep)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one engine step, in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# The pre-v0.11 array form: same fields, positional, tag first.
class _StoredA(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _RemovedA(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedA(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _BatchA(msgspec.Struct, omit_defaults=True, gc=False, array_like=True):
    ts: float
    events: list[Union[_StoredA, _RemovedA, _ClearedA]]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(EventBatch)
_array_decoder = msgspec.msgpack.Decoder(_BatchA)


class KVEventsDecodeError(ValueError):
    """A payload that is neither form of `EventBatch` (the message is dropped and counted, never raised on)."""


def block_hash_int(h: Any) -> int:
    """A server block hash as a non-negative int: ints as they are (mod 2**64), bytes as big-endian, low 64
    bits (vLLM's ExternalBlockHash is either, depending on the release)."""
    if type(h) is int:  # noqa: E721 - the common case first, and bool is not a hash
        return h & _MASK64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise KVEventsDecodeError(f"block hash of type {type(h).__name__}")


def encode_batch(batch: EventBatch, *, array_like: bool = False) -> bytes:
    """msgpack payload of `batch`: the current map form, or (`array_like`) the pre-v0.11 array form."""
    if not array_like:
        return _encoder.encode(batch)
    conv = {BlockStored: _StoredA, BlockRemoved: _RemovedA, AllBlocksCleared: _ClearedA}
    events = [conv[type(e)](**{f: getattr(e, f) for f in e.__struct_fields__}) for e in batch.events]
    return _encoder.encode(_BatchA(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes) -> EventBatch:
    """The `EventBatch` in `payload`, either form. Raises `KVEventsDecodeError` (never another exception)."""
    if payload[:1] and 0x90 <= payload[0] <= 0x9F or payload[:1] in (b"\xdc", b"\xdd"):  # msgpack array
        try:
            a = _array_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise KVEventsDecodeError(str(exc)) from None
        conv = {_StoredA: BlockStored, _RemovedA: BlockRemoved, _ClearedA: AllBlocksCleared}
        events = [conv[type(e)](**{f: getattr(e, f) for f in e.__struct_fields__}) for e in a.events]
        return EventBatch(a.ts, events, a.data_parallel_rank)
    try:
        return _map_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KVEventsDecodeError(str(exc)) from None


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def seq_from_bytes(raw: bytes) -> int:
    """A sequence frame as an int; -1 for `END_SEQ`. Raises `KVEventsDecodeError` on a frame not 8 bytes long."""
    if len(raw) != SEQ_BYTES:
        raise KVEventsDecodeError(f"sequence frame of {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=raw == END_SEQ)

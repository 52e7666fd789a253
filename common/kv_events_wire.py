"""KV-cache events: the wire format (msgpack over ZMQ) of vLLM's and SGLang's publishers, shared by the simulated
servers' publisher and the router's subscriber. Pure data and codecs; no sockets here.

Every form a vLLM or SGLang release publishes decodes (golden payloads of the releases' own code in
tests/data/kv_events/, the table in docs/engines.md). The forms, detected per batch (`BatchDecoder`):

==========  ===================================================  ==============================================
form        wire shape                                           published by
==========  ===================================================  ==============================================
``array``   batch ``[ts, [event, ...], dp_rank]``, each event    vLLM 0.9 .. 0.23 (``array_like`` batch and
            ``["BlockStored", block_hashes, parent, ...]``       events), SGLang 0.4 .. 0.5.15
``mixed``   batch ``[ts, [event, ...], dp_rank]``, each event    vLLM 0.24 .. 0.33 (events lost
            a tagged map ``{"type": "BlockStored", ...}``        ``array_like``), SGLang 0.5.16 .. 0.5.23
``map``     batch ``{"ts", "events", "data_parallel_rank"}``,    vLLM main commit 0181ea3 (2026; no release)
            events tagged maps
==========  ===================================================  ==============================================

Fields by release (an older publisher omits the later ones; msgspec's ``omit_defaults`` also drops optional
fields left at their default, and SGLang omits ``medium``/``lora_name`` when None, so every field but
``block_hashes`` defaults here; unknown keys and trailing array elements of a future release are ignored):

- ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id`` (vLLM 0.9), ``medium``
  (0.10.2; SGLang 0.5.6), ``lora_name`` (0.14), ``extra_keys`` (0.17), ``group_idx`` (0.20),
  ``kv_cache_spec_kind, kv_cache_spec_sliding_window`` (0.22), ``locality`` (0.26), ``ownership`` (0.29),
  ``session_id`` (0.30; SGLang), ``lookahead_token_ids`` (0.33), ``cache_salt`` (SGLang only). In the array
  form the positions are this order (vLLM's declaration order up to 0.23, SGLang's up to ``medium``).
- ``BlockRemoved``: ``block_hashes, medium, group_idx, locality, ownership``.
- ``AllBlocksCleared``: no fields.
- An event of a type no release defines (a future one) is skipped and counted (`BatchDecoder.num_unknown_events`);
  a known event that does not fit its type makes the whole batch undecodable (applying the rest could keep a
  block the server evicted).

Block hashes are the server's ``ExternalBlockHash``: vLLM publishes the low 64 bits of its sha256 block hash as
an unsigned int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or the 32 hash bytes; vLLM 0.9 Python's
signed ``hash()``; SGLang a signed int64. `block_hash_int` maps all of them to one non-negative int (bytes:
big-endian, low 64 bits; ints mod 2**64), so a parent published as bytes finds its child published as an int.

Placeholders: vLLM 0.33's offloading connector publishes a ``BlockStored`` with empty ``token_ids`` and
``block_size`` 0 for chunks whose content it did not capture (`BlockStored.is_placeholder`); ``medium`` says
where a block lives ("GPU" or None: device memory; vLLM "CPU", "STORAGE"; SGLang "CPU_PINNED", "DISK",
"EXTERNAL").

Transport (``ZmqEventPublisher`` of both engines): PUB socket, multipart ``(topic, seq, payload)`` with ``seq``
an 8-byte big-endian sequence number from 0 per publisher process; an optional ROUTER *replay* socket answers a
request ``(b"", start_seq)`` with every buffered batch from ``start_seq`` on, as ``(seq, payload)`` (vLLM
<= 0.25, SGLang <= 0.5.19) or ``(topic, seq, payload)`` (vLLM >= 0.26, SGLang 0.5.23), then an end marker
``(END_SEQ, b"")`` / ``(b"", END_SEQ, b"")``: a reader takes the last two frames. A publisher that restarts
starts again from sequence 0.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"
GPU_MEDIA = (None, MEDIUM_GPU, "gpu")
"""``medium`` values of blocks in device memory (None: a release before ``medium``, or SGLang omitting it)."""
SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The replay socket's end-of-replay marker, in place of a sequence number."""
FORMS = ("mixed", "array", "map")
"""The wire forms (module docstring), in the order a decoder without a hint tries them."""

_MASK64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """`block_hashes` (server hashes, in chain order) were stored, holding `token_ids` (``len(block_hashes) x
    block_size`` of them); the first one's parent is `parent_block_hash` (None: it starts a prompt). Field
    order = the array form's positions (module docstring)."""

    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None] = None
    token_ids: list[Any] = []  # ints; SGLang's EAGLE bigram pages carry [a, b] pairs (not indexable)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None
    cache_salt: str | None = None

    @property
    def is_placeholder(self) -> bool:
        """A store without content (vLLM 0.33's offloading connector: ``block_size`` 0, no token ids): the
        hashes are real, the tokens they hold unknown."""
        return self.block_size <= 0 or len(self.token_ids) == 0


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """`block_hashes` were evicted from `medium`."""

    block_hashes: list[Union[int, bytes]]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The server's whole prefix cache was emptied (``/reset_prefix_cache``, sleep)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES: dict[str, type] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                                "AllBlocksCleared": AllBlocksCleared}


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one engine step, in order. `data_parallel_rank` is SGLang's ``attn_dp_rank``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --- decoding structs: the array form (same fields, positional, tag first) --------------------------------
# Exactly the fields any array release had (vLLM 0.23's; SGLang's array events are a prefix of them): a
# later trailing element is ignored rather than read as the wrong field.
class _StoredA(msgspec.Struct, gc=False, array_like=True, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None] = None
    token_ids: list[Any] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _RemovedA(msgspec.Struct, gc=False, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedA(msgspec.Struct, gc=False, array_like=True, tag="AllBlocksCleared"):
    pass


_ArrayEvent = Union[_StoredA, _RemovedA, _ClearedA]


class _BatchMixed(msgspec.Struct, gc=False, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _BatchArray(msgspec.Struct, gc=False, array_like=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _BatchMap(msgspec.Struct, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _BatchMapArray(msgspec.Struct, gc=False):  # a map batch of array events: no release, but cheap to accept
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


_FROM_ARRAY = {_StoredA: BlockStored, _RemovedA: BlockRemoved, _ClearedA: AllBlocksCleared}
_TO_ARRAY = {BlockStored: _StoredA, BlockRemoved: _RemovedA, AllBlocksCleared: _ClearedA}
_astuple = msgspec.structs.astuple


def _canonical(events: list) -> list:
    """Array-form events as the canonical classes (same field order: a positional copy)."""
    conv = _FROM_ARRAY
    return [conv[type(e)](*_astuple(e)) for e in events]


_MSGPACK_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])
_MSGPACK_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_DECODERS: dict[str, tuple[msgspec.msgpack.Decoder, bool]] = {
    "mixed": (msgspec.msgpack.Decoder(_BatchMixed), False),
    "array": (msgspec.msgpack.Decoder(_BatchArray), True),
    "map": (msgspec.msgpack.Decoder(_BatchMap), False),
    "map-array": (msgspec.msgpack.Decoder(_BatchMapArray), True),
}
_ARRAY_BATCH_FORMS = ("mixed", "array")
_MAP_BATCH_FORMS = ("map", "map-array")
_generic = msgspec.msgpack.Decoder()


class KVEventsDecodeError(ValueError):
    """A payload that is no form of `EventBatch` (the message is dropped and counted, never raised on)."""


class BatchDecoder:
    """Decodes payloads of any form (module docstring), detected per batch: the batch's first byte says array or
    map; the form that decoded the last batch is tried first, then the others; a batch none of them takes
    whole (an unknown event type, say) goes through a tolerant path that decodes event by event.

    Cost: one msgspec decode per batch in the steady state (the form does not change within a stream); a
    failed attempt stops at the first element that does not fit, so a miss costs little. Not thread-safe
    (one per subscriber); `num_unknown_events` counts skipped events of unknown types."""

    __slots__ = ("form", "num_unknown_events")

    def __init__(self) -> None:
        self.form: str | None = None  # the form of the last batch decoded ("mixed", "array", "map", ...)
        self.num_unknown_events = 0

    def decode(self, payload: bytes) -> EventBatch:
        """The `EventBatch` in `payload`, events as the canonical classes. Raises `KVEventsDecodeError` (never
        another exception) for a payload of no known form."""
        if not payload:
            raise KVEventsDecodeError("empty payload")
        head = payload[0]
        if head in _MSGPACK_ARRAY_HEADS:
            forms = _ARRAY_BATCH_FORMS
        elif head in _MSGPACK_MAP_HEADS:
            forms = _MAP_BATCH_FORMS
        else:
            raise KVEventsDecodeError(f"not a msgpack array or map (first byte 0x{head:02x})")
        hint = self.form
        if hint in forms and hint != forms[0]:
            forms = (hint, *[f for f in forms if f != hint])
        first_error = None
        for form in forms:
            dec, array_events = _DECODERS[form]
            try:
                b = dec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                if first_error is None:
                    first_error = exc
                continue
            self.form = form
            return EventBatch(b.ts, _canonical(b.events) if array_events else b.events, b.data_parallel_rank)
        return self._tolerant(payload, first_error)

    def _tolerant(self, payload: bytes, first_error: Exception | None) -> EventBatch:
        """Event by event: unknown event types skipped (counted), anything else that does not fit raises."""
        try:
            obj = _generic.decode(payload)
        except msgspec.DecodeError as exc:
            raise KVEventsDecodeError(str(exc)) from None
        if isinstance(obj, list) and len(obj) >= 2:
            ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
        elif isinstance(obj, dict) and "events" in obj:
            ts, events, rank = obj.get("ts"), obj["events"], obj.get("data_parallel_rank")
        else:
            raise KVEventsDecodeError(str(first_error) if first_error else "not an EventBatch")
        if not isinstance(events, list) or not isinstance(ts, (int, float)) or not (
                rank is None or type(rank) is int):  # noqa: E721
            raise KVEventsDecodeError(str(first_error) if first_error else "not an EventBatch")
        out: list = []
        forms = set()
        for i, ev in enumerate(events):
            if isinstance(ev, dict) and isinstance(ev.get("type"), str):
                tag, cls, forms_key = ev["type"], EVENT_TYPES.get(ev["type"]), "map"
            elif isinstance(ev, list) and ev and isinstance(ev[0], str):
                tag, cls, forms_key = ev[0], EVENT_TYPES.get(ev[0]), "array"
                cls = _TO_ARRAY.get(cls) if cls is not None else None  # type: ignore[arg-type]
            else:
                raise KVEventsDecodeError(f"event {i} is neither a tagged map nor a tagged array - at `$[1][{i}]`")
            if cls is None:
                self.num_unknown_events += 1  # a future event type: skipped
                continue
            try:
                e = msgspec.convert(ev, cls)
            except (msgspec.ValidationError, TypeError, ValueError) as exc:
                raise KVEventsDecodeError(f"{tag}: {exc} - at `$[1][{i}]`") from None
            out.append(_FROM_ARRAY[type(e)](*_astuple(e)) if type(e) in _FROM_ARRAY else e)
            forms.add(forms_key)
        batch_form = "map" if isinstance(obj, dict) else "mixed"
        if forms == {"array"}:
            batch_form = "array" if isinstance(obj, list) else "map-array"
        self.form = batch_form
        return EventBatch(float(ts), out, rank)


_default_decoder = BatchDecoder()


def decode_batch(payload: bytes) -> EventBatch:
    """The `EventBatch` in `payload`, any form (`BatchDecoder`; a shared one: use your own per stream).
    Raises `KVEventsDecodeError` (never another exception)."""
    return _default_decoder.decode(payload)


# --- encoding: the forms as the releases write them -------------------------------------------------------
class _V033Stored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    """vLLM 0.33's BlockStored: the first seven fields required (always on the wire), the rest optional."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: Any
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class _V033Removed(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _V033Cleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class _V023Stored(msgspec.Struct, omit_defaults=True, gc=False, array_like=True, tag="BlockStored"):
    """vLLM 0.23's (the last array release's) BlockStored."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: Any
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _V023Removed(msgspec.Struct, omit_defaults=True, gc=False, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class _V023Cleared(msgspec.Struct, omit_defaults=True, gc=False, array_like=True, tag="AllBlocksCleared"):
    pass


class _BatchOut(msgspec.Struct, omit_defaults=True, gc=False, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _BatchOutMap(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_MAP_EVENTS = {BlockStored: (_V033Stored, 15), BlockRemoved: (_V033Removed, 5), AllBlocksCleared: (_V033Cleared, 0)}
_ARRAY_EVENTS = {BlockStored: (_V023Stored, 11), BlockRemoved: (_V023Removed, 3), AllBlocksCleared: (_V023Cleared, 0)}
_encoder = msgspec.msgpack.Encoder()


def _convert_events(events: list, table: dict) -> list:
    out = []
    for e in events:
        cls, n = table[type(e)]
        out.append(cls(*_astuple(e)[:n]))
    return out


def encode_batch(batch: EventBatch, *, form: str = "mixed", array_like: bool | None = None) -> bytes:
    """msgpack payload of `batch` in `form` (module docstring): "mixed" (vLLM 0.24 .. 0.33, what a current
    vLLM publishes: vLLM 0.33's field set), "array" (vLLM 0.23's), "map" (the 0181ea3 commit). Fields a form's
    release did not have are dropped (``cache_salt`` always: SGLang's). `array_like` (deprecated): True =
    "array", False = "map". Token ids may be a `msgspec.Raw` (pre-encoded, spliced in verbatim)."""
    if array_like is not None:
        form = "array" if array_like else "map"
    if form == "mixed":
        return _encoder.encode(_BatchOut(batch.ts, _convert_events(batch.events, _MAP_EVENTS),
                                         batch.data_parallel_rank))
    if form == "array":
        return _encoder.encode(_BatchOut(batch.ts, _convert_events(batch.events, _ARRAY_EVENTS),
                                         batch.data_parallel_rank))
    if form == "map":
        return _encoder.encode(_BatchOutMap(batch.ts, _convert_events(batch.events, _MAP_EVENTS),
                                            batch.data_parallel_rank))
    raise ValueError(f"form must be one of mixed, array, map; got {form!r}")


def block_hash_int(h: Any) -> int:
    """A server block hash as a non-negative int: ints mod 2**64 (a signed int64 and its unsigned twin are one
    hash), bytes as big-endian, low 64 bits (vLLM's ``maybe_convert_block_hash`` of the same block)."""
    if type(h) is int:  # noqa: E721 - the common case first, and bool is not a hash
        return h & _MASK64
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    raise KVEventsDecodeError(f"block hash of type {type(h).__name__}")


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def seq_from_bytes(raw: bytes) -> int:
    """A sequence frame as an int; -1 for `END_SEQ`. Raises `KVEventsDecodeError` on a frame not 8 bytes long."""
    if len(raw) != SEQ_BYTES:
        raise KVEventsDecodeError(f"sequence frame of {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=raw == END_SEQ)

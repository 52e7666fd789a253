"""`SessionTable`: which endpoint served each chat session's last turn, and how much of that turn's prompt it
holds. Pure: no I/O, no clock (times come from the caller, as `RouterCore.route`'s `now_s`).

A session is named by the request's session key (`InferenceRequest.session_key`, parsed per
``RoutingSettings.session_key``) salted by its tenant (`InferenceRequest.tenant`): two tenants sending the same
key never share a session, as they never share a block hash.

What a session remembers of its last turn: the endpoint it was routed to (the primary, or the fallback that
really served it), the number of leading block hashes of that turn's prompt, and the last of those hashes. Block
hashes are chained (each covers every block before it), so a new turn whose hash at that position is the same
extends the old prompt block for block: one comparison proves it, whatever the prompt's length. A new turn that
does not (the client rewrote or truncated its history, switched model or tokenizer mode) gets no credit.

Bounds: at most ``max_sessions`` entries, least recently recorded first out; an entry expires
``session_ttl_s`` after its last turn (checked on lookup, and expired entries at the old end are dropped as new
turns are recorded). Without a clock (``now_s`` None) entries never expire and only the LRU bounds them.
Every operation is O(1) except `forget_endpoint`, which is O(sessions of that endpoint).

Memory: the table keys a session by `session_id` (a 16-byte digest of tenant and key), never by the client's
strings, so every entry costs the same whatever the client sent (`SESSION_ENTRY_BYTES`, measured in
tests/unit/routing/test_memory_bounds.py), and the replicas share sessions by that digest (extproc/peers),
never by the raw key.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

from prefixroute.types import BlockHash, EndpointId

SessionId = bytes
"""`session_id(tenant, key)`: the table's key."""

SESSION_ENTRY_BYTES = 400
"""Most bytes one session costs the table (its key, its `Session`, the LRU and per-endpoint index entries),
measured with tracemalloc on CPython 3.11 (tests/unit/routing/test_memory_bounds.py checks it): what
`memory.plan` divides the sessions' share of the memory budget by."""


def session_id(tenant: str | None, key: str) -> SessionId:
    """The 16-byte BLAKE2b digest naming session (`tenant`, `key`): the same on every replica; tenant "" and
    None are the same tenant (no tenant); the length prefix keeps (``"a"``, ``"b\x1fc"``) and
    (``"a\x1fb"``, ``"c"``) apart."""
    t = tenant or ""
    return hashlib.blake2b(f"{len(t)}:{t}\x1f{key}".encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Session:
    """One session's last turn. Mutable only through `SessionTable`."""

    __slots__ = ("endpoint", "last_s", "num_blocks", "tail_hash")

    def __init__(self, endpoint: EndpointId, num_blocks: int, tail_hash: BlockHash | None,
                 last_s: float | None) -> None:
        self.endpoint = endpoint
        self.num_blocks = num_blocks  # leading block hashes of the last turn's prompt (capped as hashed)
        self.tail_hash = tail_hash  # the last of them (None when there were none)
        self.last_s = last_s  # the caller's clock at the last turn; None: no clock

    def credit(self, block_hashes: Sequence[BlockHash]) -> int | None:
        """Blocks of `block_hashes` that the last turn's prompt covers, when the new prompt extends it (its
        hash at the last turn's last block is the same: chained hashes, so every block before is too); None
        when it does not (history rewritten or shortened, another model or hashing mode). 0 when the last
        turn had no block (a prompt shorter than one block): trivially extended, nothing to credit."""
        n = self.num_blocks
        if n == 0:
            return 0
        if len(block_hashes) >= n and block_hashes[n - 1] == self.tail_hash:
            return n
        return None


class SessionTable:
    """Session -> `Session`, bounded (module docstring). Not thread-safe (one event loop)."""

    __slots__ = ("_by_endpoint", "_entries", "max_sessions", "num_expired", "num_evicted", "ttl_s")

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        if max_sessions < 1 or not ttl_s > 0:
            raise ValueError("max_sessions must be >= 1 and ttl_s > 0")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        # Least recently recorded first; with a monotonic clock also the order of expiry.
        self._entries: collections.OrderedDict[SessionId, Session] = collections.OrderedDict()
        self._by_endpoint: dict[EndpointId, set[SessionId]] = {}
        self.num_expired = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _expired(self, s: Session, now_s: float | None) -> bool:
        return now_s is not None and s.last_s is not None and now_s - s.last_s > self.ttl_s

    def _drop(self, key: SessionId, s: Session) -> None:
        del self._entries[key]
        keys = self._by_endpoint.get(s.endpoint)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_endpoint[s.endpoint]

    def lookup(self, tenant: str | None, key: str, now_s: float | None = None) -> Session | None:
        """The live session (`tenant`, `key`), None when unknown or expired at `now_s` (then dropped)."""
        return self.lookup_id(session_id(tenant, key), now_s)

    def lookup_id(self, sid: SessionId, now_s: float | None = None) -> Session | None:
        """`lookup` by `session_id`."""
        s = self._entries.get(sid)
        if s is not None and self._expired(s, now_s):
            self._drop(sid, s)
            self.num_expired += 1
            return None
        return s

    def record(self, tenant: str | None, key: str, endpoint: EndpointId, block_hashes: Sequence[BlockHash],
               now_s: float | None = None) -> None:
        """Turn of session (`tenant`, `key`) routed to `endpoint` with this prompt at `now_s`: it becomes the
        session's last turn (most recently used). Drops expired entries at the old end, then the least
        recently recorded beyond ``max_sessions``."""
        self.record_id(session_id(tenant, key), endpoint, block_hashes, now_s)

    def record_id(self, sid: SessionId, endpoint: EndpointId, block_hashes: Sequence[BlockHash],
                  now_s: float | None = None) -> None:
        """`record` by `session_id` (another replica's turn: it sends the digest, never the key)."""
        n = len(block_hashes)
        tail = block_hashes[-1] if n else None
        entries = self._entries
        s = entries.get(sid)
        if s is None:
            entries[sid] = Session(endpoint, n, tail, now_s)
            self._by_endpoint.setdefault(endpoint, set()).add(sid)
        else:
            if s.endpoint != endpoint:
                self._move(sid, s, endpoint)
            s.num_blocks, s.tail_hash, s.last_s = n, tail, now_s
            entries.move_to_end(sid)
        if now_s is not None:
            for _ in range(2):  # amortised: each record drops at most two expired entries at the old end
                old_sid, old = next(iter(entries.items()))
                if old_sid == sid or not self._expired(old, now_s):
                    break
                self._drop(old_sid, old)
                self.num_expired += 1
        while len(entries) > self.max_sessions:
            old_sid, old = next(iter(entries.items()))
            self._drop(old_sid, old)
            self.num_evicted += 1

    def _move(self, sid: SessionId, s: Session, endpoint: EndpointId) -> None:
        keys = self._by_endpoint.get(s.endpoint)
        if keys is not None:
            keys.discard(sid)
            if not keys:
                del self._by_endpoint[s.endpoint]
        self._by_endpoint.setdefault(endpoint, set()).add(sid)
        s.endpoint = endpoint

    def moved(self, tenant: str | None, key: str, endpoint: EndpointId,
              block_hashes: Sequence[BlockHash]) -> None:
        """A turn with prompt `block_hashes` was served by `endpoint` after all (a fallback, Envoy's failover):
        if it is still the session's last turn (same prompt: a later turn may have been recorded since), the
        session follows it, with the same prompt and time."""
        self.moved_id(session_id(tenant, key), endpoint, block_hashes)

    def moved_id(self, sid: SessionId, endpoint: EndpointId, block_hashes: Sequence[BlockHash]) -> None:
        """`moved` by `session_id`."""
        s = self._entries.get(sid)
        if s is None or s.endpoint == endpoint or s.num_blocks != len(block_hashes):
            return
        if s.num_blocks and s.tail_hash != block_hashes[-1]:
            return
        self._move(sid, s, endpoint)

    def forget_endpoint(self, endpoint: EndpointId) -> int:
        """`endpoint` left the pool or its cache emptied: its sessions go (their next turn is routed as a
        request without a session would be, then recorded afresh). Returns how many went."""
        keys = self._by_endpoint.pop(endpoint, None)
        if not keys:
            return 0
        entries = self._entries
        for sid in keys:
            del entries[sid]
        return len(keys)

    def num_sessions_by_endpoint(self) -> dict[EndpointId, int]:
        """Sessions per endpoint (expired ones included until purged), for metrics: built from a copy
        (``dict(d)`` is one C call under the GIL), so another thread may call it while the event loop routes."""
        return {ep: len(keys) for ep, keys in dict(self._by_endpoint).items()}


class SessionsCollector:
    """A prometheus_client collector of a `SessionTable`'s figures (register it on the router's metrics registry).
    Read by the metrics thread: plain integers and one dict copy, a torn read costs at most one count."""

    def __init__(self, table: SessionTable) -> None:
        self.table = table

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        t = self.table
        by_endpoint = GaugeMetricFamily("prefixroute_sessions", "Chat sessions the router remembers, by the "
                                        "endpoint of their last turn (bounded by --max-sessions).",
                                        labels=["endpoint"])
        for ep, n in sorted(t.num_sessions_by_endpoint().items()):
            by_endpoint.add_metric([str(ep)], n)
        yield by_endpoint
        dropped = CounterMetricFamily("prefixroute_sessions_dropped", "Sessions forgotten, by reason: expired "
                                      "(--session-ttl-s after their last turn), evicted (--max-sessions).",
                                      labels=["reason"])
        dropped.add_metric(["expired"], t.num_expired)
        dropped.add_metric(["evicted"], t.num_evicted)
        yield dropped

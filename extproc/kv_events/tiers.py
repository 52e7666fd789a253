"""A tier-aware KV-events index: each endpoint's blocks per medium, GPU and CPU.

`TieredKVEventIndex` is the precise index (`KVEventIndex`: GPU blocks keyed by the router's token-block hashes)
plus, per endpoint, the blocks its host-memory tier holds: vLLM's native offloading (``--kv-offloading-size``)
publishes them with ``medium: "CPU"`` (SGLang's HiCache: ``"CPU_PINNED"``), many as *placeholders* (a
`BlockStored` with the server hash only: empty ``token_ids``, ``block_size`` 0). The rules:

- A CPU `BlockStored` never counts as GPU (the base index skips other media).
- Its server hashes are resolved to router hashes through the endpoint's server-hash map: the GPU map as it was
  before the batch (vLLM writes a block to the host while the GPU still holds it), else the hashes this
  endpoint's GPU recently removed (``recent``: a block evicted from the GPU and written to the host in the same
  or a later batch, as the simulated servers do), else, for a self-describing store with token ids, from its
  parent's router hash (or the adapter/salt seed for a prompt's first block), as the GPU index keys blocks.
  One that none of these resolves is dropped and counted (``num_cpu_unresolved_blocks``).
- A GPU `BlockRemoved` of a block that moved to the CPU leaves it CPU-resident (the CPU set is separate); a CPU
  `BlockRemoved` drops it from the CPU set only; ``AllBlocksCleared`` and `clear_endpoint` drop both (the events
  can no longer be trusted for either).
- `match(hashes)`: per endpoint, its GPU leading blocks g (the base index), then the CPU-resident blocks that
  follow them, c (what vLLM's offloading connector loads for the request), credited as ``g + c x weight``
  blocks (rounded), weight = `tier_pricing.cpu_block_weight` at the endpoint's rate in the router's time model
  (`price_with`): the time model then prices the CPU part at its load time, not as a miss and not as a GPU hit.
  `tiers(hashes)` gives the unweighted (g, c) per endpoint, for telemetry.

Cost: ingestion of a CPU batch is one dict operation per block, on the router's event loop like the GPU's (the
base index's chunking applies to the GPU part); `match` adds one dict lookup per endpoint holding CPU blocks
(its first block not on the GPU there, or the block after its GPU prefix), then one per CPU block matched.
Not thread-safe (the router's event loop), like `KVEventIndex`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice, takewhile
from typing import Any

from prefixroute.extproc.kv_events.index import KVEventIndex, _server_hashes, _token_bytes
from prefixroute.extproc.routing.hashing import hash_token_blocks, token_seed_for
from prefixroute.extproc.routing.tier_pricing import DEFAULT_LOAD_US_PER_TOKEN, cpu_block_weight
from prefixroute.kv_events_wire import GPU_MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventsDecodeError
from prefixroute.kv_events_wire import block_hash_int
from prefixroute.types import BlockHash, EndpointId

CPU_MEDIA = frozenset({"CPU", "cpu", "CPU_PINNED"})
"""``medium`` values of host-memory tiers (vLLM's offloading connector, SGLang's HiCache)."""
_MASK64 = (1 << 64) - 1
RECENT_REMOVED = 1 << 17
"""GPU-removed (server hash -> router hash) pairs kept per endpoint to resolve later CPU placeholders."""


@dataclasses.dataclass
class TierCounters:
    num_cpu_stored_blocks: int = 0
    num_cpu_removed_blocks: int = 0
    num_cpu_unresolved_blocks: int = 0  # CPU stores whose router hash could not be found
    num_cpu_placeholder_blocks: int = 0  # of the stored, placeholders (resolved through the hash maps)


class _CPUState:
    __slots__ = ("s2r", "held", "recent", "counters")

    def __init__(self) -> None:
        self.s2r: dict[int, BlockHash] = {}  # CPU-resident server hash -> router hash
        self.held: dict[BlockHash, int] = {}  # router hash -> number of CPU server hashes mapped to it
        # GPU-removed server hash -> router hash, oldest first (kept only once the endpoint has a CPU tier)
        self.recent: dict[int, BlockHash] = {}
        self.counters = TierCounters()


class TieredKVEventIndex(KVEventIndex):
    """`KVEventIndex` with each endpoint's CPU tier (module docstring)."""

    __slots__ = ("_cpu", "load_s_per_token", "_model", "_fixed_weight", "_last_gpu", "_last_cpu")

    def __init__(self, block_size: int = 16, load_us_per_token: float = DEFAULT_LOAD_US_PER_TOKEN, *,
                 cpu_weight: float | None = None) -> None:
        """`load_us_per_token`: a token's KV load time from the CPU tier; `cpu_weight` a fixed weight instead of
        the time model's (llm-d's 0.8, say), or None (price by `price_with`; 1 - load x the prior rate)."""
        super().__init__(block_size)
        self._cpu: dict[EndpointId, _CPUState] = {}
        self.load_s_per_token = load_us_per_token * 1e-6
        self._model: Any = None
        self._fixed_weight = cpu_weight
        self._last_gpu: dict[EndpointId, int] = {}  # the last `match`: GPU leading blocks per endpoint
        self._last_cpu: dict[EndpointId, int] = {}  # and the CPU blocks after them, where any

    def price_with(self, model: Any) -> None:
        """Price CPU blocks with `model` (a `timemodel.TimeModel`: its ``cpu_block_weight``); None: weight 1."""
        self._model = model

    def cpu_weight(self, endpoint: EndpointId) -> float:
        if self._fixed_weight is not None:
            return self._fixed_weight
        if self._model is None:
            return 1.0
        return self._model.cpu_block_weight(endpoint, self.load_s_per_token)

    # --- queries -------------------------------------------------------------------------------------------
    def tiers(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, tuple[int, int]]:
        """Endpoint -> (leading blocks on its GPU, blocks after them in its CPU tier); endpoints with neither
        absent."""
        gpu = super().match(block_hashes)
        out = {ep: (g, 0) for ep, g in gpu.items()}
        n = len(block_hashes)
        for ep, cs in self._cpu.items():
            if not cs.held:
                continue
            g = gpu.get(ep, 0)
            if g >= n or block_hashes[g] not in cs.held:
                continue
            out[ep] = (g, _leading(cs.held, block_hashes, g))
        return out

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:  # type: ignore[override]
        """Endpoint -> GPU leading blocks + following CPU blocks x `cpu_weight`, rounded to whole blocks (an
        endpoint credited 0 is absent, as the base index's contract)."""
        gpu = out = super().match(block_hashes)
        self._last_gpu = gpu
        self._last_cpu = {}
        cpu = self._cpu
        if not cpu or not block_hashes:
            return out
        n = len(block_hashes)
        for ep, cs in cpu.items():
            held = cs.held
            if not held:
                continue
            g = gpu.get(ep, 0)
            if g >= n or block_hashes[g] not in held:
                continue
            c = _leading(held, block_hashes, g)
            self._last_cpu[ep] = c
            # whole blocks (the match contract): the credit rounded to the nearest block
            credited = g + int(c * self.cpu_weight(ep) + 0.5)
            if credited > 0:
                if out is gpu:
                    out = dict(gpu)
                out[ep] = credited
        return out

    def last_tiers(self, endpoint: EndpointId) -> tuple[int, int]:
        """(GPU blocks, CPU blocks) the last `match` found for `endpoint`: what its server should serve from each
        tier if the request goes there now (the router's prediction by tier)."""
        return self._last_gpu.get(endpoint, 0), self._last_cpu.get(endpoint, 0)

    def num_cpu_blocks(self, endpoint: EndpointId) -> int:
        """Server blocks `endpoint`'s CPU tier holds (its sub-blocks counted once: `index.split_events`)."""
        cs = self._cpu.get(endpoint)
        return len(cs.s2r) // self.split_of(endpoint) if cs else 0

    def num_cpu_blocks_by_endpoint(self) -> dict[EndpointId, int]:
        """Safe from another thread (single C calls under the GIL)."""
        return {ep: len(cs.s2r) // self.split_of(ep) for ep, cs in list(self._cpu.items()) if cs.s2r}

    def tier_counters(self, endpoint: EndpointId) -> TierCounters:
        cs = self._cpu.get(endpoint)
        return dataclasses.replace(cs.counters) if cs else TierCounters()


    # --- updates -------------------------------------------------------------------------------------------
    def _apply(self, endpoint: EndpointId, st: Any, events: list[Any], chunk_blocks: int) -> Iterator[int]:
        """(`apply_events`, after the split into router-sized blocks.) The CPU side of `events` first (against
        the GPU map as before them), then the base index's GPU side; CPU stores unresolved then are tried again
        after it (a GPU store in the same batch). Yields like the base index: blocks applied since the last
        yield, about `chunk_blocks` at most."""
        retry: list[BlockStored] = []
        yield from self._cpu_pass(endpoint, events, chunk_blocks, retry)
        yield from super()._apply(endpoint, st, events, chunk_blocks)
        for ev in retry:
            self._cpu_store(endpoint, ev, final=True)

    def _cpu_pass(self, endpoint: EndpointId, events: list, chunk_blocks: int,
                  retry: list[BlockStored]) -> Iterator[int]:
        """Apply the CPU-medium events, remember the GPU removals (once the endpoint has a CPU tier); a single-hash
        placeholder (what vLLM 0.33 and our servers send per offloaded block) takes a fast path."""
        cs = self._cpu.get(endpoint)
        st = self._eps.get(endpoint)
        n = 0
        for ev in events:
            t = type(ev)
            if t is BlockStored:
                if ev.medium not in CPU_MEDIA or ev.group_idx not in (None, 0):
                    continue
                if cs is None:
                    cs = self._state(endpoint)
                hs = ev.block_hashes
                n += len(hs)
                h = hs[0] if len(hs) == 1 else None
                if type(h) is int and ev.is_placeholder:  # noqa: E721
                    s = h & _MASK64
                    s2r = cs.s2r
                    if s in s2r:
                        continue
                    r = st.s2r.get(s) if st is not None else None
                    if r is None:
                        r = cs.recent.get(s)
                    if r is None:
                        retry.append(ev)
                        continue
                    s2r[s] = r
                    held = cs.held
                    held[r] = held.get(r, 0) + 1
                    c = cs.counters
                    c.num_cpu_stored_blocks += 1
                    c.num_cpu_placeholder_blocks += 1
                elif not self._cpu_store(endpoint, ev, final=False):
                    retry.append(ev)
            elif t is BlockRemoved:
                if ev.medium in GPU_MEDIA:
                    if cs is not None and st is not None:
                        self._remember_removed(st.s2r, cs.recent, ev.block_hashes)
                        n += len(ev.block_hashes)
                elif ev.medium in CPU_MEDIA:
                    self._cpu_remove(endpoint, ev.block_hashes)
                    n += len(ev.block_hashes)
            if n >= chunk_blocks:
                yield n
                n = 0
        if n:
            yield n

    def clear_endpoint(self, endpoint: EndpointId) -> None:
        super().clear_endpoint(endpoint)
        if endpoint in self._cpu:
            cs = self._cpu[endpoint]
            cs.s2r, cs.held, cs.recent = {}, {}, {}

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        super().remove_endpoint(endpoint)
        self._cpu.pop(endpoint, None)

    # --- internals -----------------------------------------------------------------------------------------
    def _state(self, endpoint: EndpointId) -> _CPUState:
        cs = self._cpu.get(endpoint)
        if cs is None:
            cs = self._cpu[endpoint] = _CPUState()
        return cs

    @staticmethod
    def _remember_removed(gpu_s2r: dict[int, BlockHash], recent: dict[int, BlockHash], hashes: Sequence[Any]) -> None:
        try:
            server = _server_hashes(hashes)
        except KVEventsDecodeError:
            return
        get = gpu_s2r.get
        for s in server:
            r = get(s)
            if r is not None:
                recent[s] = r
        over = len(recent) - RECENT_REMOVED
        if over > 0:
            for s in list(islice(recent, over)):
                del recent[s]

    def _resolve(self, endpoint: EndpointId, cs: _CPUState, s: int) -> BlockHash | None:
        st = self._eps.get(endpoint)
        r = st.s2r.get(s) if st is not None else None
        if r is None:
            r = cs.recent.get(s)
        if r is None:
            r = cs.s2r.get(s)
        return r

    def _cpu_store(self, endpoint: EndpointId, ev: BlockStored, *, final: bool) -> bool:
        """Add `ev`'s blocks to the endpoint's CPU set; False when some could not be resolved yet (counted only
        when `final`)."""
        cs = self._state(endpoint)
        c = cs.counters
        try:
            server = _server_hashes(ev.block_hashes)
        except KVEventsDecodeError:
            return True
        routed = [self._resolve(endpoint, cs, s) for s in server]
        if None in routed and not ev.is_placeholder and ev.block_size == self.block_size:
            routed = self._hash_stored(endpoint, cs, ev, len(server)) or routed
        if None in routed and not final:
            return False
        placeholder = ev.is_placeholder
        s2r, held = cs.s2r, cs.held
        for s, r in zip(server, routed):
            if r is None:
                c.num_cpu_unresolved_blocks += 1
                continue
            if s in s2r:
                continue  # stored again (a second copy): one CPU residency
            s2r[s] = r
            held[r] = held.get(r, 0) + 1
            c.num_cpu_stored_blocks += 1
            c.num_cpu_placeholder_blocks += placeholder
        return True

    def _hash_stored(self, endpoint: EndpointId, cs: _CPUState, ev: BlockStored, n: int) -> list | None:
        """Router hashes of a self-describing CPU store (token ids present), chained from its parent."""
        if len(ev.token_ids) != n * ev.block_size:
            return None
        if ev.parent_block_hash is None:
            seed = token_seed_for(ev.lora_name, ev.cache_salt)
        else:
            try:
                seed = self._resolve(endpoint, cs, block_hash_int(ev.parent_block_hash))
            except KVEventsDecodeError:
                return None
            if seed is None:
                return None
        try:
            return hash_token_blocks(_token_bytes(ev.token_ids), ev.block_size, seed)
        except (OverflowError, ValueError, TypeError):
            return None

    def _cpu_remove(self, endpoint: EndpointId, hashes: Sequence[Any]) -> None:
        cs = self._cpu.get(endpoint)
        if cs is None:
            return
        try:
            server = _server_hashes(hashes)
        except KVEventsDecodeError:
            return
        s2r, held = cs.s2r, cs.held
        n = 0
        for s in server:
            r = s2r.pop(s, None)
            if r is None:
                continue
            n += 1
            k = held[r]
            if k > 1:
                held[r] = k - 1
            else:
                del held[r]
        cs.counters.num_cpu_removed_blocks += n


def _leading(held: dict, block_hashes: Sequence[BlockHash], start: int) -> int:
    """How many of `block_hashes[start:]` are in `held`, from the first on (C-level passes, as the base index)."""
    has = held.__contains__
    rest = block_hashes[start:]
    if has(rest[-1]) and all(map(has, rest)):
        return len(rest)
    return len(list(takewhile(has, rest)))


def attach(index: Any, core: Any) -> None:
    """Price `index`'s CPU blocks with `core`'s time model when it is a `TieredKVEventIndex` and the core's policy
    has one (the prefix policy); a no-op otherwise. One call where a router builds its core."""
    from prefixroute.extproc.routing.scheduling.policies import PrefixPolicy

    policy = core.scheduler.policy
    if isinstance(index, TieredKVEventIndex) and isinstance(policy, PrefixPolicy):
        index.price_with(policy.model)

"""Time-agnostic engine core shared by the HTTP (real-time) and virtual-time runners.

The core is vLLM's v1 scheduler in miniature; it never reads a clock and never sleeps. A runner drives it::

    plan = core.plan_step()            # schedule a batch, allocate KV blocks, register block hashes
    ... wait plan.duration_s (real sleep or virtual time) ...
    emitted = core.finish_step(plan, now_s)   # advance requests; those that sampled a token are returned

Scheduling rules (vLLM v1 semantics):
- running requests first, in admission order, then the FIFO waiting queue; at most `max_num_seqs`
  running; each step computes at most `max_num_batched_tokens` tokens (chunked prefill: a long prompt
  takes several steps);
- a request is admitted with the longest chain of cached prompt blocks, capped so that at least the last
  prompt token is computed (``cached_tokens <= prompt_len - 1``, rounded down to whole blocks);
- when a running request needs a KV block and none is free, the most recently admitted running request
  is preempted (recompute: its blocks are released, it goes back to the head of the waiting queue with no
  computed tokens); admission of waiting requests stops for that step;
- full prompt blocks are hashed into the prefix cache when scheduled (as vLLM does); generated tokens
  occupy blocks but are not hashed (a simplification: the simulated output text does not re-tokenize to
  the same ids anyway);
- a request samples a token when all its known tokens (prompt + outputs) are computed; it finishes after
  exactly `max_tokens` tokens (the simulated model never emits EOS).

Step time: `CostModel.step_time_s` of the batch sums (see cost_model.py) times `time_scale`.
Not thread-safe: one runner owns a core.

KV events (vLLM's, see kv_events.py; on when the core is built with `on_kv_events`): the blocks a step
registers become `BlockStored` events (one per contiguous run of newly stored blocks of a request: its
hashes in chain order, the parent hash, those blocks' token ids, `lora_name`/`lora_id` of an adapter request,
and vLLM's per-block extra keys: the adapter name on every block, the cache_salt on block 0), evictions
`BlockRemoved`, a prefix-cache reset `AllBlocksCleared`. Each `plan_step` (and `finish_decode_run`) that
changed the cache hands its events, in order, to `on_kv_events` as one list (one `EventBatch`). A reset's
`AllBlocksCleared` is queued, not published: it goes out with the next engine step's batch, first in it, as
vLLM's (its ``BlockPool.reset_prefix_cache`` queues it and the scheduler publishes a step's events when the
step's output is processed; an idle server publishes nothing until its next request). Until then subscribers
still hold the cleared blocks: the stale window a router must live with. Off, the only cost is one attribute
test per registration and per step.

CPU tier (``EngineConfig.num_cpu_blocks`` > 0: vLLM's ``--kv-offloading-size``, see cpu_tier.py): hashes the GPU
evicts go to the host tier; a request admitted with a GPU prefix hit of k blocks then loads the next blocks of
its chain that the host holds into fresh GPU blocks (registered, so they are GPU-cached again and published
as GPU `BlockStored`), and counts them as cached tokens (vLLM's ``cached_tokens`` includes a connector's
hits); the step that admits it lasts the transfer time longer (``num_blocks x cpu_load_s_per_block x
time_scale``). The tier's own events (medium "CPU") follow the GPU events of the same step in its batch.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from prefixroute.kv_events_wire import MEDIUM_GPU, BlockStored
from prefixroute.model_servers.cost_model import CostModel
from prefixroute.model_servers.cpu_tier import CPUTier
from prefixroute.model_servers.kv_cache import KVCache, hash_blocks

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's buckets for vllm:time_to_first_token_seconds."""

WAITING, RUNNING, FINISHED, ABORTED = 0, 1, 2, 3


class EngineRequest:
    """One request inside an engine. Runners read the public fields; only the core mutates them."""

    __slots__ = ("request_id", "prompt_ids", "block_hashes", "num_prompt_tokens", "max_tokens", "arrival_s",
                 "num_computed", "num_output", "blocks", "num_registered", "num_cached_tokens", "first_token_s",
                 "finished_s", "status", "num_preemptions", "sink", "first_scheduled", "num_tokens", "lora_name",
                 "lora_id", "cache_salt", "num_cpu_cached_tokens")

    def __init__(self, request_id: str, prompt_ids: np.ndarray, max_tokens: int, *, block_size: int,
                 root: int, arrival_s: float = 0.0, sink: Any = None, lora_name: str | None = None,
                 lora_id: int | None = None, cache_salt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.num_prompt_tokens = len(prompt_ids)
        self.block_hashes = hash_blocks(prompt_ids, block_size, root)
        self.max_tokens = max_tokens
        self.arrival_s = arrival_s
        self.num_computed = 0
        self.num_output = 0
        self.num_tokens = self.num_prompt_tokens  # known tokens: prompt + outputs so far
        self.blocks: list[int] = []
        self.num_registered = 0
        self.num_cached_tokens = 0  # prefix-cache hit tokens at first admission (reported in usage)
        self.num_cpu_cached_tokens = 0  # of which loaded from the CPU tier
        self.first_scheduled = False
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.status = WAITING
        self.num_preemptions = 0
        self.sink = sink  # the runner's handle (stream writer / result record)
        # for KV events only (the hashes already include them through `root`)
        self.lora_name = lora_name  # the adapter name when the request's model is a LoRA adapter
        self.lora_id = lora_id
        self.cache_salt = cache_salt

    @property
    def finished(self) -> bool:
        return self.status == FINISHED


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One scheduled step: (request, tokens computed) pairs and the step's modelled duration."""

    scheduled: list[tuple[EngineRequest, int]]
    duration_s: float
    num_new_tokens: int


@dataclasses.dataclass(slots=True)
class DecodeRun:
    """`num_steps` consecutive pure-decode steps of an unchanged batch (virtual time only).

    Step j (0-based) lasts ``first_s + j * slope_s``: the batch is fixed, each step adds one token of context
    per sequence, and step time is linear in the context sums.
    """

    num_steps: int
    first_s: float
    slope_s: float
    start_s: float = 0.0

    def end_s(self, num_steps: int) -> float:
        """Time at which the first `num_steps` steps have ended."""
        j = num_steps
        return self.start_s + j * self.first_s + self.slope_s * j * (j - 1) * 0.5

    def steps_started_by(self, t: float) -> int:
        """Index (1-based) of the step in progress at `t` (a step spans [end(j-1), end(j)))."""
        lo, hi = 1, self.num_steps
        while lo < hi:
            mid = (lo + hi) // 2
            if self.end_s(mid) > t:
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclasses.dataclass(slots=True)
class EngineStats:
    """Cumulative counters (the /metrics counters) of one engine."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at admission (vllm:prefix_cache_queries)
    prefix_cache_hits: int = 0  # of which served from the GPU cache (vllm:prefix_cache_hits)
    external_prefix_cache_queries: int = 0  # prompt tokens looked up with a CPU tier (vllm:external_prefix_cache_*)
    external_prefix_cache_hits: int = 0  # of which loaded from the CPU tier
    kv_offload_load_s: float = 0.0  # modelled host-to-device transfer time (vllm:kv_offload_load_time)
    prompt_tokens: int = 0  # prompt tokens of finished+running requests at first admission
    generation_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    busy_s: float = 0.0  # sum of modelled step durations
    ttft_bucket_counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(TTFT_BUCKETS_S) + 1))
    ttft_sum_s: float = 0.0
    ttft_count: int = 0

    def observe_ttft(self, ttft_s: float) -> None:
        i = 0
        for i, b in enumerate(TTFT_BUCKETS_S):  # noqa: B007
            if ttft_s <= b:
                break
        else:
            i = len(TTFT_BUCKETS_S)
        self.ttft_bucket_counts[i] += 1
        self.ttft_sum_s += ttft_s
        self.ttft_count += 1


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    time_scale: float = 1.0
    num_cpu_blocks: int = 0  # CPU tier capacity (0: no offloading)
    cpu_load_s_per_block: float = 0.0  # host-to-device time of one block
    cpu_bytes_per_block: int = 0  # bytes one block moves per TP rank (metrics)


class EngineCore:
    """Scheduler + KV cache + cost model of one simulated GPU engine (see module docstring)."""

    def __init__(self, config: EngineConfig, cost: CostModel,
                 on_kv_events: Callable[[list], Any] | None = None) -> None:
        self.config = config
        self.cost = cost
        self.cache = KVCache(config.num_gpu_blocks, config.block_size)
        self.block_size = config.block_size
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []
        self.stats = EngineStats()
        self._step_cost = cost.step_time_s
        self._time_scale = config.time_scale
        self._on_kv_events = on_kv_events
        self.tier: CPUTier | None = None
        self._load_s = 0.0  # transfer time of this step's CPU loads
        if config.num_cpu_blocks > 0:
            self.tier = CPUTier(config.num_cpu_blocks, config.cpu_load_s_per_block, config.cpu_bytes_per_block)
            self.cache.evicted = []
        if on_kv_events is not None:
            self._enable_events()

    def _enable_events(self) -> None:
        self.cache.enable_events()
        if self.tier is not None:
            self.tier.enable_events()

    def set_kv_events_sink(self, on_kv_events: Callable[[list], Any] | None) -> None:
        """Hand each step's KV events to `on_kv_events` from now on (None: stop); recording starts now, so
        a consumer that starts here sees every block stored after this call (none before)."""
        self._on_kv_events = on_kv_events
        if on_kv_events is not None:
            self._enable_events()

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (FIFO). Its prompt + max_tokens must fit in the KV cache (checked by the caller)."""
        req.status = WAITING
        self.waiting.append(req)

    def abort_request(self, req: EngineRequest) -> None:
        """Drop a request (client went away); releases its blocks. Idempotent."""
        if req.status == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        elif req.status == RUNNING:
            self.running.remove(req)
            self.cache.release(req.blocks)
            req.blocks = []
        else:
            return
        req.status = ABORTED
        self.stats.num_aborted += 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- scheduling -------------------------------------------------------------------------------
    def _grow(self, req: EngineRequest, num_tokens: int) -> bool:
        """Make req hold enough blocks for num_computed + num_tokens tokens; False if the pool is short."""
        need = -(-(req.num_computed + num_tokens) // self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        got = self.cache.allocate(need)
        if got is None:
            return False
        req.blocks.extend(got)
        return True

    def _register(self, req: EngineRequest, num_tokens: int) -> None:
        full = min((req.num_computed + num_tokens) // self.block_size, len(req.block_hashes))
        if full > req.num_registered:
            k = req.num_registered
            blocks, hashes = req.blocks[k:full], req.block_hashes[k:full]
            n = self.cache.register_many(blocks, hashes)
            if n and self._on_kv_events is not None:
                self._record_stored(req, k, full, blocks, hashes, n)
            req.num_registered = full

    def _record_stored(self, req: EngineRequest, k: int, full: int, blocks: list[int], hashes: list[int],
                       n: int) -> None:
        """BlockStored events for the `n` blocks of req's blocks[k:full] that `register_many` just stored."""
        if n == full - k:
            runs = [(k, full)]
        else:  # some hashes were cached already (by a concurrent request): one event per stored run
            cached = self.cache.cached
            runs = []
            start = -1
            for i, (b, h) in enumerate(zip(blocks, hashes)):
                if cached.get(h) == b:
                    if start < 0:
                        start = k + i
                elif start >= 0:
                    runs.append((start, k + i))
                    start = -1
            if start >= 0:
                runs.append((start, full))
        bs = self.block_size
        lora, salt = req.lora_name, req.cache_salt
        record = self.cache.record_stored
        for s, e in runs:
            if lora is not None:  # vLLM: the adapter name on every block, the salt on block 0
                extra: list | None = [(lora,)] * (e - s)
                if s == 0 and salt:
                    extra[0] = (lora, salt)  # type: ignore[index]
            elif salt and s == 0:
                extra = [(salt,)] + [None] * (e - s - 1)
            else:
                extra = None
            # token ids stay a numpy view here: the publisher thread makes the list (kv_events.materialize)
            record(BlockStored(req.block_hashes[s:e], req.block_hashes[s - 1] if s else None,
                               req.prompt_ids[s * bs:e * bs], bs, req.lora_id, MEDIUM_GPU, lora, extra))

    def _drain_evicted(self) -> None:
        """Hand the hashes the GPU evicted to the CPU tier (no-op without one)."""
        evicted = self.cache.evicted
        if evicted:
            self.tier.offload(evicted)  # type: ignore[union-attr]
            evicted.clear()

    def _flush_kv_events(self) -> None:
        tier = self.tier
        if tier is not None:
            self._drain_evicted()
            if self._on_kv_events is not None and (self.cache.has_events() or tier.events):
                self._on_kv_events(self.cache.take_events() + tier.take_events())
            return
        if self._on_kv_events is not None and self.cache.has_events():
            self._on_kv_events(self.cache.take_events())

    def _load_from_cpu(self, req: EngineRequest, start: int, max_hit: int) -> int:
        """Load the blocks of req's chain from `start` on that the CPU tier holds (at most up to `max_hit`) into
        new GPU blocks appended to req.blocks; returns how many (0 when the tier holds none or the GPU has no
        room). Their transfer time is added to this step."""
        self._drain_evicted()  # blocks this step already evicted are host-resident now
        tier = self.tier
        hashes = req.block_hashes[start:max_hit]
        k = tier.num_leading(hashes)  # type: ignore[union-attr]
        if not k:
            return 0
        got = self.cache.allocate(k)
        if got is None:
            return 0
        hashes = hashes[:k]
        n = self.cache.register_many(got, hashes)
        if n and self._on_kv_events is not None:
            self._record_stored(req, start, start + k, got, hashes, n)
        req.blocks.extend(got)
        tier.num_loaded_blocks += k  # type: ignore[union-attr]
        load_s = tier.load_time_s(k)  # type: ignore[union-attr]
        self._load_s += load_s
        self.stats.kv_offload_load_s += load_s
        return k

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's prefix-cache reset: drop every cached hash, only when no block is held (False otherwise).
        `reset_running_requests` first preempts every running request (they go back to the waiting queue
        and recompute), as vLLM's ``reset_prefix_cache(reset_running_requests=True)`` does. With events on,
        `AllBlocksCleared` is queued for the next step's batch (module docstring), not published here."""
        if reset_running_requests and self.running:
            running, self.running = self.running, []
            for req in reversed(running):  # appendleft in reverse keeps their admission order
                self._preempt(req)
        ok = self.cache.reset_prefix_cache()
        if ok and self.tier is not None:
            self.cache.evicted.clear()  # type: ignore[union-attr]
            self.tier.clear()
        return ok

    def _preempt(self, req: EngineRequest) -> None:
        self.cache.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def plan_step(self) -> StepPlan | None:
        """Schedule the next step; None when there is nothing to run. Mutates queues and the KV cache."""
        budget = self.config.max_num_batched_tokens
        bs = self.block_size
        scheduled: list[tuple[EngineRequest, int]] = []
        n_sum = 0
        attn = 0.0
        kv = 0
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed
            n = req.num_tokens - c
            if n > budget:
                n = budget
            if c + n > len(req.blocks) * bs:
                while not self._grow(req, n):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status != RUNNING:
                    break  # req itself was preempted: it was the last running request
            scheduled.append((req, n))
            if req.num_registered < len(req.block_hashes):
                self._register(req, n)
            n_sum += n
            attn += n * (c + n * 0.5)
            kv += c
            budget -= n
            i += 1
        if not preempted:
            budget, n_sum, attn, kv = self._admit_waiting(scheduled, budget, n_sum, attn, kv)
        if scheduled or running or self.waiting:  # vLLM's engine does not step without requests
            self._flush_kv_events()
        if not scheduled:
            return None
        duration = self._step_cost(n_sum, attn, kv, len(scheduled)) * self._time_scale
        if self._load_s:
            duration += self._load_s * self._time_scale
            self._load_s = 0.0
        self.stats.num_steps += 1
        self.stats.busy_s += duration
        return StepPlan(scheduled, duration, n_sum)

    def _admit_waiting(self, scheduled: list[tuple[EngineRequest, int]], budget: int, n_sum: int, attn: float,
                       kv: int) -> tuple[int, int, float, int]:
        """`plan_step`'s second half: admit waiting requests in order (prefix-cache hit first) while the token
        budget, `max_num_seqs` and free blocks allow, appending them to `scheduled`; returns the step's
        (budget left, tokens, attention work, KV tokens read), accumulated on from the running requests' in the
        same order as one loop would (the step time's float sums must not change)."""
        waiting, running, cache = self.waiting, self.running, self.cache
        max_seqs = self.config.max_num_seqs
        bs = self.block_size
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            known = req.num_tokens
            loaded = 0
            if not req.blocks:
                max_hit = min((known - 1) // bs, len(req.block_hashes))
                hit = cache.take_prefix(req.block_hashes[:max_hit]) if max_hit else []
                req.blocks = hit
                if self.tier is not None and len(hit) < max_hit:
                    loaded = self._load_from_cpu(req, len(hit), max_hit) * bs
                req.num_computed = len(req.blocks) * bs
                req.num_registered = len(req.blocks)
            n = known - req.num_computed
            if n > budget:
                n = budget
            if not self._grow(req, n):
                cache.release(req.blocks)
                req.blocks = []
                req.num_computed = 0
                req.num_registered = 0
                break
            waiting.popleft()
            req.status = RUNNING
            running.append(req)
            st = self.stats
            st.prefix_cache_queries += known
            st.prefix_cache_hits += req.num_computed - loaded
            if self.tier is not None:
                st.external_prefix_cache_queries += known
                st.external_prefix_cache_hits += loaded
            if not req.first_scheduled:
                req.first_scheduled = True
                req.num_cached_tokens = req.num_computed
                req.num_cpu_cached_tokens = loaded
                st.prompt_tokens += req.num_prompt_tokens
            c = req.num_computed
            self._register(req, n)
            scheduled.append((req, n))
            n_sum += n
            attn += n * (c + n * 0.5)
            kv += c
            budget -= n
        return budget, n_sum, attn, kv

    def plan_decode_run(self, max_steps: int = 1 << 30) -> DecodeRun | None:
        """Plan several identical pure-decode steps at once (virtual-time fast path), or None.

        Only when nothing waits, every running request is decoding, at least two steps remain before any
        request finishes, and the free blocks cover the run's growth (so no preemption can happen in it).
        Nothing is allocated here: `finish_decode_run` allocates in the exact order single steps would, so
        the cache ends in the same state as after the same number of `plan_step`/`finish_step` calls.
        """
        running = self.running
        if self.waiting or not running or len(running) > self.config.max_num_batched_tokens:
            return None
        k = max_steps
        ctx = 0
        for r in running:
            c = r.num_computed
            # A request whose chunked prefill left exactly its last prompt token is still prefilling
            # (num_output == 0): its first-token step must go through plan_step to set the TTFT.
            if c != r.num_tokens - 1 or r.num_output == 0:
                return None
            rem = r.max_tokens - r.num_output
            if rem < k:
                k = rem
            ctx += c
        if k < 2:
            return None
        bs = self.block_size
        need = 0
        for r in running:
            need += -(-(r.num_computed + k) // bs) - len(r.blocks)
        if need > self.cache.num_free_blocks:
            return None
        b = len(running)
        d0 = self._step_cost(b, ctx + 0.5 * b, ctx, b) * self._time_scale
        d1 = self._step_cost(b, ctx + 1.5 * b, ctx + b, b) * self._time_scale
        return DecodeRun(k, d0, d1 - d0)

    def finish_decode_run(self, run: DecodeRun, num_steps: int, now_s: float) -> list[EngineRequest]:
        """Apply the first `num_steps` steps of `run`; returns the requests that finished."""
        running = self.running
        bs = self.block_size
        # blocks in the order single steps would take them: by step, then by batch order
        needs = []
        for idx, r in enumerate(running):
            have = len(r.blocks) * bs
            last = r.num_computed + num_steps
            while have < last:
                # the step whose computed token is token number `have + 1` needs a new block
                needs.append((have + 1 - r.num_computed, idx))
                have += bs
        if needs:
            needs.sort()
            got = self.cache.allocate(len(needs))
            assert got is not None  # checked in plan_decode_run
            for (_, idx), blk in zip(needs, got):
                running[idx].blocks.append(blk)
        self._flush_kv_events()
        st = self.stats
        st.num_steps += num_steps
        st.busy_s += num_steps * run.first_s + run.slope_s * num_steps * (num_steps - 1) * 0.5
        st.generation_tokens += num_steps * len(running)
        done = []
        for r in running:
            r.num_computed += num_steps
            r.num_output += num_steps
            r.num_tokens += num_steps
            if r.num_output >= r.max_tokens:
                r.status = FINISHED
                r.finished_s = now_s
                self.cache.release(r.blocks)
                r.blocks = []
                st.num_finished += 1
                done.append(r)
        if done:
            self.running = [r for r in running if r.status == RUNNING]
        return done

    def finish_step(self, plan: StepPlan, now_s: float) -> list[EngineRequest]:
        """Apply a planned step ending at `now_s`; returns the requests that sampled a token, in batch order.

        A returned request with ``finished`` set has produced its last token and released its blocks.
        """
        out = []
        finished_any = False
        for req, n in plan.scheduled:
            if req.status != RUNNING:
                continue  # aborted or preempted after planning
            c = req.num_computed + n
            req.num_computed = c
            if c == req.num_tokens:
                k = req.num_output + 1
                req.num_output = k
                req.num_tokens = c + 1
                if k == 1:
                    req.first_token_s = now_s
                    self.stats.observe_ttft(now_s - req.arrival_s)
                if k >= req.max_tokens:
                    req.status = FINISHED
                    req.finished_s = now_s
                    self.cache.release(req.blocks)
                    req.blocks = []
                    self.stats.num_finished += 1
                    finished_any = True
                out.append(req)
        self.stats.generation_tokens += len(out)
        if finished_any:
            self.running = [r for r in self.running if r.status == RUNNING]
        return out

"""A time model of each endpoint: predicted time-to-first-token (TTFT) of a request there. Pure: no
I/O, no clock; the caller says when a request was picked, got its first token or ended.

For a request and a candidate endpoint::

    predicted TTFT = base_s + work / rate
    work = queued + own + decode_cost_tokens x decoding x steps,   steps = 1 + (queued + own) / step_tokens

- ``queued``: uncached prefill tokens of the requests picked for the endpoint and not yet past their first
  token (`add_pending` / `remove_pending`): the prefill work ahead of this request there (engines schedule
  prefills first come, first served);
- ``decoding``: requests in flight there past their first token; each adds about ``decode_cost_tokens`` of
  work to every engine step the prefill shares with them, and the prefill ahead and ours take ``steps``
  steps of at most ``step_tokens`` (the engine's token budget per step: chunked prefill);
- ``own``: this request's uncached prefill there (the caller's estimate: prompt less the matched prefix);
- ``rate`` (tokens/s) and ``base_s`` (seconds: one engine step, scheduling) are learned per endpoint by
  `RateEstimate` from (work ahead at pick + own, observed TTFT) pairs, starting from a prior, so a fleet mixing
  GPUs or models is priced per endpoint. Rate classes: endpoints whose learned rate is within
  a factor `RATE_CLASS_FACTOR` of the fleet's pooled estimate are priced at it (noise between identical endpoints is
  not a reason to prefer one), and so are endpoints not learned yet (a new endpoint of a fleet whose prior
  was wrong is priced as its peers, not at the prior).

Draining queue: given times (``now_s``, any monotonic clock: the router's, or the simulation's virtual time),
the prefill queued on an endpoint is a backlog that drains at its rate between events: at a pick, ``queued``
= min(tokens of its pending requests, backlog at the last pick - rate x time since). A request half through
its prefill is half a request of work ahead, not a whole one (counting it whole overstated the work of busy
endpoints by ~30% at 40% load and taught the rate that much too fast). Without times ``queued`` is the
pending tokens.

Pending prefixes: the block hashes of pending requests are remembered per endpoint (`pending_match`), so a
second request of a brand-new prefix, arriving while the first one is still prefilling, sees a match on the
endpoint that will hold it (priced as cached: the first one's prefill populates it before ours runs).

Invariants: every figure is >= 0; ``pending_tokens(ep)`` is the sum of the uncached tokens of its pending
requests (0 when none); removing an unknown key is a no-op; a rate stays within [prior / MAX_RATE_RATIO,
prior x MAX_RATE_RATIO]. Not thread-safe (one event loop, like the router).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import NewType

from prefixroute.extproc.routing.tier_pricing import cpu_block_weight as _cpu_block_weight
from prefixroute.types import BlockHash, EndpointId

try:  # the C loop behind collections.Counter.update, without its per-call Python checks (~1 us)
    from _collections import _count_elements
except ImportError:  # another Python implementation: the same in Python
    def _count_elements(mapping: dict, iterable: Sequence) -> None:  # type: ignore[misc]
        get = mapping.get
        for item in iterable:
            mapping[item] = get(item, 0) + 1

Seconds = NewType("Seconds", float)
Tokens = NewType("Tokens", float)
TokensPerSecond = NewType("TokensPerSecond", float)

RATE_CLASS_FACTOR = 2.0
"""Endpoints whose learned rate is within a factor 2 of the fleet's pooled rate are one class (the same GPU and
model) and are all priced at the pooled fit (one estimate over all their responses: ~N times the data of
each endpoint's), as are endpoints not learned yet. Each endpoint's own estimate carries the error of the
queue it saw (each sees its own mix of hits, misses and bursts): identical endpoints learned rates up to 2x
apart in the virtual and real sweeps, above all while a wrong prior was being unlearned (simulated GPUs 6x
slower than the prior), and priced as they were, the one that looked fastest took cold prefixes and ties
while the one that looked slowest starved (P99 TTFT +45% over sglang-router's model on 300 x 8k-token prompts
at 40% load with a 15% class bound; +3% with one price). Fleets that mix GPUs or models beyond 2x (an 8B on
an H200 prefills ~35k tokens/s, a 70B on TP4 ~13k) keep their own price."""

POOL_WARMUP = 32
"""Until an endpoint has this many responses of its own, its own fit is mostly the prior and says nothing of
its class: it is priced at the pool and feeds it; afterwards, only while within RATE_CLASS_FACTOR."""

REPRICE_EVERY = 16
"""The median is recomputed every 16 responses (O(endpoints log endpoints)); between, a response reprices only
its own endpoint against the last median (O(1))."""

MAX_BASE_RATIO = 4.0
MIN_MAX_BASE_S = 0.05
"""A learned base (TTFT at zero work: one engine step plus scheduling) stays within [0, max(4 x prior, 50 ms)]
(60 ms with the default prior), scaled by how much slower than the prior the learned rate is: a small step of a 70B on TP4 H200s takes ~18 ms, not seconds. Unbounded, a
window of saturated observations (long queues only) moved the intercept to 1.2 s and predicted an idle
endpoint 60x slow (virtual sweep, 300 x 8k-token prompts at 100% load: prediction error 300%; 0.1 s: 190%;
60 ms: 107%, routing unchanged)."""

LOAD_WINDOW_S = 10.0
"""`TimeModel.utilization` averages the work routed to an endpoint over ~10 s: several turns of each agent or
chat at the think times they keep (0.5-3 s), so one burst does not make an endpoint look loaded for long, yet a
busy endpoint's load is seen within a few seconds."""

ROBUST_CLIP_SCALES = 3.0
ROBUST_AFTER = 8
RESIDUAL_SCALE_STEP = 1 / 16
"""After its first 8 responses, an estimate learns each TTFT clipped to its prediction +- 3 typical residuals (a
running median of |TTFT - prediction|, steps of 1/16 of it): Huber's bound on least squares. TTFTs on a shared or
overloaded host have a heavy tail (stalls of several times the typical response): least squares followed them
and over-predicted the typical TTFT (a synthetic fleet with 10% of its responses 2-8x slower: median error 49%
at the prior's own speed; clipped: 15%, tests/unit/routing/test_routing_timemodel.py). A real change of speed
moves every residual, so the scale and the clip grow with it."""

IDLE_BASE_STEP = 1 / 16
IDLE_BASE_MARGIN = 1.25
"""The base's bound also follows what the endpoint shows when nothing was queued ahead of a request (an *idle*
observation: its TTFT is the base plus its own prefill): a running median of such TTFTs less their own prefill
at the fitted rate (steps of 1/16 of it, so a few dozen idle responses find it and a host's occasional stall does
not move it), times 1.25, when that is above the prior's bound. An engine whose every
step carries a fixed cost far above a GPU's (a CPU server: ~150 ms a step with the tiny test model, against the
prior's 15 ms) was held at the 60 ms bound and predicted at a third of its TTFT (real vLLM on CPU: 52.8 ms
predicted, 155 ms measured); a saturated window has no idle observation and keeps the prior's bound."""

IDLE_BASE_MIN_CV = 0.25
"""...but only while the observations' work sizes spread (coefficient of variation >= 0.25): responses of one
size cannot tell a slow rate from a large base."""

MAX_RATE_RATIO = 20.0
"""A learned rate stays within 20x of the prior either way: GPUs and models in one fleet differ by up to ~10x
(an 8B on an H200 prefills ~35k tokens/s, a 70B on TP4 ~13k, on one older GPU a few thousand), and a bound
keeps a burst of odd observations (a stalled server, a clock step) from making an endpoint look free."""


@dataclasses.dataclass(slots=True)
class RateEstimate:
    """Exponentially weighted least squares of ``ttft_s = base_s + work_tokens / rate`` over observations.

    The prior enters as `prior_weight` pseudo-observations on the prior's line (at zero work and at
    `prior_work_tokens`), so the first real observations move the estimate gradually and a single observation
    never makes the slope undefined. Each observation multiplies the old weights by ``1 - 1 / window``, so the
    estimate follows an endpoint whose speed changes within ~`window` responses. `rate` is clamped to
    [prior / MAX_RATE_RATIO, prior x MAX_RATE_RATIO] and `base_s` to >= 0."""

    prior_rate: float
    prior_base_s: float
    window: float = 64.0
    prior_weight: float = 4.0
    prior_work_tokens: float = 8192.0
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    num_observations: int = 0
    _cache: tuple[float, float] | None = None
    idle_base_s: float = 0.0  # running median of idle TTFTs less own prefill (0: none seen); see IDLE_BASE_*
    residual_scale_s: float = 0.0  # running median of |TTFT - prediction| (0: none seen); see ROBUST_*
    # The real observations' work: weight, sum, sum of squares (the same decay): whether their sizes spread enough
    # to tell a base from a rate (`_spread`).
    _rw: float = 0.0
    _rx: float = 0.0
    _rxx: float = 0.0

    def __post_init__(self) -> None:
        half = self.prior_weight / 2.0
        for x in (0.0, self.prior_work_tokens):
            self._add(x, self.prior_base_s + x / self.prior_rate, half)

    def _add(self, x: float, y: float, w: float) -> None:
        self._w += w
        self._sx += w * x
        self._sy += w * y
        self._sxx += w * x * x
        self._sxy += w * x * y

    def observe(self, work_tokens: float, ttft_s: float, idle: bool = False) -> None:
        """One response: `work_tokens` of prefill were ahead of and including it at its pick, and its first
        token came `ttft_s` after; `idle`: nothing was queued ahead of it (its work is its own). Negative or
        non-finite inputs are ignored."""
        if not (work_tokens >= 0.0 and ttft_s >= 0.0) or work_tokens == float("inf") or ttft_s == float("inf"):
            return
        rate, base = self._fit()
        predicted = base + work_tokens / rate
        residual = abs(ttft_s - predicted)
        scale = self.residual_scale_s
        if scale and self.num_observations >= ROBUST_AFTER:
            # Clipped to the prediction +- ROBUST_CLIP_SCALES typical residuals: a stall of the host or the
            # server (a TTFT of seconds now and then) moves the fit no more than a response that far off would,
            # so the fit follows the typical response; a real change of speed moves every residual, hence the
            # scale, and is learned at the pace of the window.
            bound = ROBUST_CLIP_SCALES * scale
            ttft_s = min(max(ttft_s, predicted - bound), predicted + bound)
        self.residual_scale_s = residual if not scale else scale * (
            1.0 + RESIDUAL_SCALE_STEP if residual > scale else 1.0 - RESIDUAL_SCALE_STEP)
        if idle:
            b = max(0.0, ttft_s - work_tokens / rate)
            m = self.idle_base_s
            # A running median (multiplicative steps): a host's stalls (seconds, now and then) must not move it.
            self.idle_base_s = b if not m else m * (1.0 + IDLE_BASE_STEP if b > m else 1.0 - IDLE_BASE_STEP)
        decay = 1.0 - 1.0 / self.window
        self._w *= decay
        self._sx *= decay
        self._sy *= decay
        self._sxx *= decay
        self._sxy *= decay
        self._add(work_tokens, ttft_s, 1.0)
        self._rw = self._rw * decay + 1.0
        self._rx = self._rx * decay + work_tokens
        self._rxx = self._rxx * decay + work_tokens * work_tokens
        # The prior keeps a small floor of weight (in steady state ~prior_weight / window observations, ~0.06
        # by default): after many observations it still anchors a degenerate window (every observation at one
        # work size) instead of letting the slope go undefined, yet cannot bias a real spread of observations.
        floor = self.prior_weight * 0.5 / (self.window * self.window)
        self._add(0.0, self.prior_base_s, floor)
        self._add(self.prior_work_tokens, self.prior_base_s + self.prior_work_tokens / self.prior_rate, floor)
        self.num_observations += 1
        self._cache = None

    def _fit(self) -> tuple[float, float]:
        if self._cache is not None:
            return self._cache
        w, sx, sy = self._w, self._sx, self._sy
        mx, my = sx / w, sy / w
        var = self._sxx / w - mx * mx
        cov = self._sxy / w - mx * my
        lo, hi = self.prior_rate / MAX_RATE_RATIO, self.prior_rate * MAX_RATE_RATIO
        slope = cov / var if var > 1e-9 else 1.0 / self.prior_rate
        slope = min(max(slope, 1.0 / hi), 1.0 / lo)
        base = my - slope * mx
        # The bound scales with the learned slowness: an engine whose prefill is 6x slower than the prior's
        # has 6x longer steps too.
        max_base = max(MAX_BASE_RATIO * self.prior_base_s * self.prior_rate * slope, MIN_MAX_BASE_S,
                       IDLE_BASE_MARGIN * self.idle_base_s if self._spread() else 0.0)
        if not 0.0 <= base <= max_base:
            # The intercept is outside what one engine step can be (a saturated window, where every
            # observation has a long queue, lets it absorb queueing): fix it at the bound and fit the slope
            # through it, so the queue is priced by the rate and an idle endpoint is not predicted seconds.
            base = min(max(base, 0.0), max_base)
            sxx = self._sxx / w
            if sxx > 1e-12:
                slope = min(max((self._sxy / w - base * mx) / sxx, 1.0 / hi), 1.0 / lo)
        self._cache = (1.0 / slope, base)
        return self._cache

    def _spread(self) -> bool:
        """Whether the observations' work sizes spread enough (coefficient of variation >= IDLE_BASE_MIN_CV) for
        their intercept to say anything: TTFTs of one size cannot tell a slow rate from a large base, and
        the prior's bound then keeps the base a GPU step's."""
        w = self._rw
        if w <= 0.0 or self._rx <= 0.0:
            return False
        mean = self._rx / w
        var = self._rxx / w - mean * mean
        return var > 0.0 and var >= (IDLE_BASE_MIN_CV * mean) ** 2

    @property
    def rate(self) -> TokensPerSecond:
        """Learned prefill tokens per second (the inverse slope)."""
        return TokensPerSecond(self._fit()[0])

    @property
    def base_s(self) -> Seconds:
        """Learned TTFT at zero work (intercept), >= 0."""
        return Seconds(self._fit()[1])


@dataclasses.dataclass(slots=True)
class _Pending:
    endpoint: EndpointId
    tokens: float
    hashes: tuple[BlockHash, ...]


class _PendingBlocks:
    """The block hashes of the requests pending on one endpoint, as a multiset kept as two counts so that both
    updates are one C-level count (`Counter.update`'s loop; a Python loop per block cost ~20-25 us per request at
    256 blocks, and a pick pays it on every replica: its own and each peer's).

    Invariant: ``added[h] - removed[h]`` is the number of pending requests on the endpoint whose prefix holds
    ``h`` (>= 0); ``num_blocks`` is the sum of their prefix lengths. Since block hashes are chained, the set of
    held hashes is prefix-closed along any one chain, which `match` relies on. Removed counts pile up until
    `needs_compaction`; the owner then rebuilds from the live prefixes (`reset`), so memory stays within a
    constant factor of the live blocks."""

    __slots__ = ("added", "removed", "num_blocks", "num_removed")

    def __init__(self) -> None:
        self.added: dict[BlockHash, int] = {}
        self.removed: dict[BlockHash, int] = {}
        self.num_blocks = 0
        self.num_removed = 0

    def add(self, hashes: tuple[BlockHash, ...]) -> None:
        _count_elements(self.added, hashes)
        self.num_blocks += len(hashes)

    def remove(self, hashes: tuple[BlockHash, ...]) -> None:
        _count_elements(self.removed, hashes)
        self.num_blocks -= len(hashes)
        self.num_removed += len(hashes)

    def needs_compaction(self) -> bool:
        """More removed block counts than a rebuild would cost to redo (amortised O(1) per block)."""
        return self.num_removed > 4 * self.num_blocks + 1024

    def reset(self, live: list[tuple[BlockHash, ...]]) -> None:
        """Rebuild from the live prefixes (those of the endpoint's pending requests)."""
        self.added = {}
        self.removed = {}
        self.num_blocks = self.num_removed = 0
        for hashes in live:
            self.add(hashes)

    def match(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` held. Held hashes are prefix-closed along a chain (a pending prefix
        holding block i of this chain holds blocks 0..i too), so a binary search finds the first one not held:
        O(log n) lookups instead of one per matched block."""
        aget, rget = self.added.get, self.removed.get
        lo, hi = 0, len(block_hashes)  # blocks [0, lo) held; [hi, n) not
        while lo < hi:
            mid = (lo + hi) // 2
            h = block_hashes[mid]
            if aget(h, 0) > rget(h, 0):
                lo = mid + 1
            else:
                hi = mid
        return lo


DECODE_S_WEIGHT = 1 / 64
"""Weight of the newest request in `TimeModel.mean_decode_s`."""


class _Load:
    """One endpoint's recent prefill seconds, an exponentially decaying sum (time constant ``window_s``): divided
    by the window, its prefill utilisation."""

    __slots__ = ("prefill", "t")

    def __init__(self) -> None:
        self.prefill = 0.0
        self.t: float | None = None

    def at(self, now_s: float, window_s: float) -> float:
        if self.t is None:
            return 0.0
        dt = now_s - self.t
        return self.prefill * (math.exp(-dt / window_s) if dt > 0 else 1.0) / window_s

    def add(self, prefill_s: float, now_s: float, window_s: float) -> None:
        if self.t is not None and now_s > self.t:
            self.prefill *= math.exp(-(now_s - self.t) / window_s)
        if self.t is None or now_s > self.t:
            self.t = now_s
        self.prefill += prefill_s


class TimeModel:
    """Per-endpoint rates and pending prefill (module docstring). Keys of pending requests are any hashable
    the caller chooses (the policy uses the request object's identity)."""

    def __init__(self, prior_tokens_per_s: float, prior_base_s: float = 0.015, *, decode_cost_tokens: float = 2.0,
                 step_tokens: float = 8192.0, window: float = 64.0, prior_weight: float = 4.0,
                 attention_tokens: float = 0.0, load_window_s: float = LOAD_WINDOW_S) -> None:
        if prior_tokens_per_s <= 0:
            raise ValueError("prior_tokens_per_s must be > 0")
        if attention_tokens < 0 or not load_window_s > 0:
            raise ValueError("attention_tokens must be >= 0 and load_window_s > 0")
        self.prior_tokens_per_s = prior_tokens_per_s
        self.prior_base_s = prior_base_s
        self.decode_cost_tokens = decode_cost_tokens
        self.step_tokens = step_tokens
        self.attention_tokens = attention_tokens
        # A cold chunk of step_tokens is `step_tokens` of work (what the prior rate was measured on): the
        # attention of its tokens is inside that rate already.
        self.work_norm = 1.0 / (1.0 + step_tokens * 0.5 / attention_tokens) if attention_tokens else 1.0
        self.inv_attention = 1.0 / attention_tokens if attention_tokens else 0.0  # 0: attention not priced
        self.load_window_s = load_window_s
        self.window = window
        self.prior_weight = prior_weight
        self._rates: dict[EndpointId, RateEstimate] = {}
        self._pending: dict[Hashable, _Pending] = {}
        self._tokens: dict[EndpointId, float] = {}
        self._count: dict[EndpointId, int] = {}
        # Read-only views for a caller scoring many endpoints in one loop (what `terms` returns, without a
        # call per endpoint): the priced (rate, base_s) of endpoints with a learned estimate (absent:
        # `default_fit`), pending tokens and pending requests (absent: 0). `fits` is replaced whole.
        self.fits: dict[EndpointId, tuple[float, float]] = {}
        # endpoint -> (backlog tokens, time): the fluid estimate of its prefill queue (`queued_at`)
        self._backlog: dict[EndpointId, tuple[float, float]] = {}
        self.backlog: Mapping[EndpointId, tuple[float, float]] = self._backlog
        self.default_fit: tuple[float, float] = (prior_tokens_per_s, prior_base_s)
        # One estimate over every response of the main class's endpoints: the fleet's price (`RATE_CLASS_FACTOR`).
        self._pooled = RateEstimate(prior_tokens_per_s, prior_base_s, window, prior_weight)
        self._num_observed = 0
        self.queued_tokens: Mapping[EndpointId, float] = self._tokens
        self.queued_counts: Mapping[EndpointId, int] = self._count
        self._prefixes: dict[EndpointId, _PendingBlocks] = {}
        # first block hash -> endpoints with a pending request starting with it (count): `pending_matches`
        # looks only at those, not at every endpoint with something pending.
        self._first: dict[BlockHash, dict[EndpointId, int]] = {}
        # Requests past their first token (decoding): key -> (endpoint, context tokens); per endpoint their
        # count and context sum (`decode_context`), what each engine step spends on them.
        self._decoding: dict[Hashable, tuple[EndpointId, float, float | None]] = {}
        self._decode_ctx: dict[EndpointId, tuple[int, float]] = {}
        self.decode_ctx: Mapping[EndpointId, tuple[int, float]] = self._decode_ctx
        # endpoint -> its recent prefill seconds (`utilization`).
        self._loads: dict[EndpointId, _Load] = {}
        self.loads: Mapping[EndpointId, _Load] = self._loads  # read-only view (`ConversationLoad.costs` reads it)
        self.mean_decode_s = 0.0  # exponential average of the requests' decode durations (first token to end)

    # --- rates ------------------------------------------------------------------------------------------------
    def estimate(self, endpoint: EndpointId) -> RateEstimate:
        """The endpoint's estimate (created from the prior on first use)."""
        r = self._rates.get(endpoint)
        if r is None:
            r = self._rates[endpoint] = RateEstimate(self.prior_tokens_per_s, self.prior_base_s, self.window,
                                                      self.prior_weight)
        return r

    def num_observations_by_endpoint(self) -> dict[EndpointId, int]:
        """Responses each endpoint's estimate learned from (a copy; safe from another thread)."""
        return {ep: r.num_observations for ep, r in list(self._rates.items())}

    def rate(self, endpoint: EndpointId) -> TokensPerSecond:
        """The rate predictions use for `endpoint` (`priced`); its own learned one is `estimate(ep).rate`."""
        return TokensPerSecond(self.priced(endpoint)[0])

    def observe(self, endpoint: EndpointId, prompt_tokens: float, cached_tokens: float, ttft_s: float,
                queued_tokens_at_pick: float, decoding_at_pick: int = 0, decode_context_at_pick: float = 0.0) -> None:
        """A response from `endpoint`: its true prompt and cached tokens (usage), its TTFT, and the work the
        model saw ahead of it at its pick (``queued`` work and ``decoding`` requests at their mean context, as
        `predict` took them)."""
        cached = max(0.0, min(cached_tokens, prompt_tokens))
        own = self.prefill_work(max(0.0, prompt_tokens - cached), cached)
        work = self.work_tokens(queued_tokens_at_pick, own, decoding_at_pick, decode_context_at_pick)
        est = self.estimate(endpoint)
        idle = queued_tokens_at_pick <= 0.0
        est.observe(work, ttft_s, idle)
        pooled = self._pooled
        if self._in_class(est):
            pooled.window = self.window * max(1, len(self._rates))  # ~`window` responses of each endpoint
            pooled.observe(work, ttft_s, idle)
        self._num_observed += 1
        if endpoint not in self.fits or self._num_observed % REPRICE_EVERY == 0:
            self._reprice()
        else:
            self.fits[endpoint] = self._class_fit(est)

    def _in_class(self, est: RateEstimate) -> bool:
        """True while `est`'s endpoint is priced at the pooled fit: not learned enough to tell yet, or its rate
        within a factor RATE_CLASS_FACTOR of the pool's."""
        if est.num_observations < POOL_WARMUP:
            return True
        ratio = est._fit()[0] / self._pooled._fit()[0]
        return 1.0 / RATE_CLASS_FACTOR <= ratio <= RATE_CLASS_FACTOR

    def _class_fit(self, est: RateEstimate) -> tuple[float, float]:
        return self.default_fit if self._in_class(est) else est._fit()

    def _reprice(self) -> None:
        """The pooled fit of the main class (the price of its endpoints and of those not learned yet), and
        every learned endpoint's price against it; `fits` is replaced whole (the metrics thread reads a copy)."""
        self.default_fit = self._pooled._fit()
        self.fits = {ep: self._class_fit(r) for ep, r in self._rates.items() if r.num_observations > 0}

    def cpu_block_weight(self, endpoint: EndpointId, load_s_per_token: float) -> float:
        """A CPU-tier block of `endpoint` as a fraction of a GPU hit, at its priced rate (tier_pricing.py)."""
        return _cpu_block_weight(load_s_per_token, self.priced(endpoint)[0])

    def priced(self, endpoint: EndpointId) -> tuple[float, float]:
        """(rate tokens/s, base s) predictions use for `endpoint` (module docstring: rate classes)."""
        return self.fits.get(endpoint, self.default_fit)

    def predict(self, endpoint: EndpointId, own_uncached_tokens: float, num_decoding: int = 0,
                extra_queued_tokens: float = 0.0) -> Seconds:
        """Predicted TTFT of a request needing `own_uncached_tokens` of prefill work on `endpoint`, now: its
        pending prefill (+ `extra_queued_tokens`) and `num_decoding` requests ahead of it (at the mean context of
        the requests decoding there). >= 0."""
        rate, base = self.priced(endpoint)
        work = self.work_tokens(self._tokens.get(endpoint, 0.0) + extra_queued_tokens, own_uncached_tokens,
                                num_decoding, self.mean_decode_context(endpoint))
        return Seconds(base + work / rate)

    def predict_many(self, endpoints: Sequence[EndpointId], own_tokens: Sequence[float],
                     in_flight: Mapping[EndpointId, int], now_s: float | None = None,
                     ) -> list[tuple[float, float, int]]:
        """`predict` for many candidates at once, as a scheduler scores them: for each endpoint (with the
        request's uncached prefill there, `own_tokens`, in the same order) its (predicted TTFT s, priced rate
        tokens/s, decoding requests). Decoding = `in_flight` there less its pending requests (>= 0); the queue
        ahead is `queued_at(ep, now_s)`, the work `work_tokens`: the figures of `predict`, in one loop over local
        lookups (the hot path of every prefix decision)."""
        get_fit = self.fits.get
        prior = self.default_fit
        get_tokens = self._tokens.get
        get_count = self._count.get
        get_in_flight = in_flight.get
        get_ctx = self._decode_ctx.get
        queued_at = self.queued_at
        # `work_tokens` and `decode_step_tokens`, inlined (one call per candidate less on every decision).
        cost, inv, inv_step = self.decode_cost_tokens, self.inv_attention, 1.0 / self.step_tokens
        out: list[tuple[float, float, int]] = []
        for ep, own in zip(endpoints, own_tokens):
            rate, base = get_fit(ep, prior)
            decoding = get_in_flight(ep, 0) - get_count(ep, 0)
            if decoding < 0:
                decoding = 0
            queued = get_tokens(ep, 0.0)
            if queued and now_s is not None:
                queued = queued_at(ep, now_s)
            prefill = queued + own
            if decoding:
                ctx = get_ctx(ep)
                per_step = decoding * (cost + ctx[1] / ctx[0] * inv) if ctx else decoding * cost
                prefill += per_step * (1.0 + prefill * inv_step)
            out.append((base + prefill / rate, rate, decoding))
        return out

    def work_tokens(self, queued_tokens: float, own_tokens: float, num_decoding: int,
                    decode_context_tokens: float = 0.0) -> float:
        """Prefill-token equivalents until a request's first token (module docstring): the prefill ahead and
        its own, plus each decoding request's share of every step they take (`decode_step_tokens` at
        `decode_context_tokens` of context each). >= 0."""
        prefill = queued_tokens + own_tokens
        return prefill + self.decode_step_tokens(num_decoding, decode_context_tokens) * (
            1.0 + prefill / self.step_tokens)

    def decode_step_tokens(self, num_decoding: int, context_tokens: float = 0.0) -> float:
        """Prefill-token equivalents that `num_decoding` sequences of `context_tokens` each add to one engine
        step: ``decode_cost_tokens`` each (weights, sampling) plus their attention over their context
        (``context / attention_tokens``, as a prefill token's attention over that context costs). >= 0."""
        return num_decoding * (self.decode_cost_tokens + context_tokens * self.inv_attention)

    def prefill_work(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Prefill work, in tokens of a cold ``step_tokens`` chunk, of computing `new_tokens` on top of
        `cached_tokens` already in the KV cache: each new token costs 1 + (tokens it attends to) /
        ``attention_tokens`` (the context at which attention doubles a token's cost; the engines' step cost is
        linear in new tokens plus new x context, model_servers/cost_model.py), normalised so a cold chunk of
        ``step_tokens`` costs its length (the unit the rate is learned in). Without ``attention_tokens``,
        `new_tokens`. >= 0."""
        if new_tokens <= 0.0:
            return 0.0
        inv = self.inv_attention
        if not inv:
            return new_tokens
        return new_tokens * (1.0 + (cached_tokens + new_tokens * 0.5) * inv) * self.work_norm

    def mean_decode_context(self, endpoint: EndpointId) -> float:
        """Mean context tokens of the requests decoding on `endpoint` (0 when none is known)."""
        c = self._decode_ctx.get(endpoint)
        return c[1] / c[0] if c else 0.0

    # --- decoding requests and load ---------------------------------------------------------------------------
    def add_decoding(self, key: Hashable, endpoint: EndpointId, context_tokens: float,
                     since_s: float | None = None) -> None:
        """`key` got its first token on `endpoint` (at `since_s`, when known): it decodes there with
        `context_tokens` of context until `remove_decoding`. A key already decoding is moved."""
        self.remove_decoding(key)
        ctx = max(0.0, context_tokens)
        self._decoding[key] = (endpoint, ctx, since_s)
        n, total = self._decode_ctx.get(endpoint, (0, 0.0))
        self._decode_ctx[endpoint] = (n + 1, total + ctx)

    def remove_decoding(self, key: Hashable, now_s: float | None = None) -> bool:
        """`key` ended (at `now_s`, when known): its context leaves its endpoint's decode batch, and the time it
        spent decoding joins `mean_decode_s`. True if it was decoding."""
        d = self._decoding.pop(key, None)
        if d is None:
            return False
        ep, ctx, since_s = d
        n, total = self._decode_ctx.get(ep, (1, ctx))
        if n <= 1:
            self._decode_ctx.pop(ep, None)
        else:
            self._decode_ctx[ep] = (n - 1, max(0.0, total - ctx))
        if now_s is not None and since_s is not None and now_s >= since_s:
            decode_s = now_s - since_s
            self.mean_decode_s += DECODE_S_WEIGHT * (decode_s - self.mean_decode_s) if self.mean_decode_s \
                else decode_s
        return True

    def _load(self, endpoint: EndpointId) -> _Load:
        load = self._loads.get(endpoint)
        if load is None:
            load = self._loads[endpoint] = _Load()
        return load

    def add_busy(self, endpoint: EndpointId, seconds: float, now_s: float) -> None:
        """`seconds` of prefill were routed to `endpoint` at `now_s` (a pick's prefill work at its rate)."""
        self._load(endpoint).add(seconds, now_s, self.load_window_s)

    def utilizations(self, now_s: float) -> dict[EndpointId, float]:
        """`utilization` of every endpoint with load recorded (built from a copy: the metrics thread may call it
        while the event loop routes)."""
        return {ep: load.at(now_s, self.load_window_s) for ep, load in list(self._loads.items())}

    def utilization(self, endpoint: EndpointId, now_s: float) -> float:
        """`endpoint`'s recent prefill utilisation at `now_s`: the prefill seconds routed there per second,
        exponentially weighted over ``load_window_s`` (0 when nothing was). >= 0; can pass 1 on an overloaded
        endpoint (more work routed than it computes)."""
        load = self._loads.get(endpoint)
        return load.at(now_s, self.load_window_s) if load is not None else 0.0

    # --- pending requests -------------------------------------------------------------------------------------
    def pending_tokens(self, endpoint: EndpointId) -> Tokens:
        """Uncached prefill tokens of the requests pending on `endpoint` (picked, no first token yet)."""
        return Tokens(self._tokens.get(endpoint, 0.0))

    def num_pending(self, endpoint: EndpointId) -> int:
        return self._count.get(endpoint, 0)

    def queued_at(self, endpoint: EndpointId, now_s: float | None = None) -> Tokens:
        """Prefill tokens still ahead on `endpoint` at `now_s` (module docstring: the backlog drains at the
        endpoint's rate between events), never more than its pending requests' tokens; without a time, those."""
        q = self._tokens.get(endpoint, 0.0)
        if q and now_s is not None:
            b = self._backlog.get(endpoint)
            if b is not None:
                left = b[0] - self.priced(endpoint)[0] * (now_s - b[1])
                if left < q:
                    q = left if left > 0.0 else 0.0
        return Tokens(q)

    def add_pending(self, key: Hashable, endpoint: EndpointId, uncached_tokens: float,
                    block_hashes: Sequence[BlockHash] = (), now_s: float | None = None) -> Tokens:
        """`key` was picked for `endpoint` at `now_s` with `uncached_tokens` to prefill; its blocks become a
        pending prefix there. Returns the tokens queued ahead of it (`queued_at`: what `observe` later wants).
        A key already pending is moved (its old entry removed first)."""
        self.remove_pending(key)
        ahead = self.queued_at(endpoint, now_s)
        tokens = max(0.0, uncached_tokens)
        if now_s is not None:
            self._backlog[endpoint] = (ahead + tokens, now_s)
        hashes = tuple(block_hashes)
        self._pending[key] = _Pending(endpoint, tokens, hashes)
        self._tokens[endpoint] = self._tokens.get(endpoint, 0.0) + tokens
        self._count[endpoint] = self._count.get(endpoint, 0) + 1
        if hashes:
            pre = self._prefixes.get(endpoint)
            if pre is None:
                pre = self._prefixes[endpoint] = _PendingBlocks()
            pre.add(hashes)
            firsts = self._first.setdefault(hashes[0], {})
            firsts[endpoint] = firsts.get(endpoint, 0) + 1
        return Tokens(ahead)

    def remove_pending(self, key: Hashable) -> bool:
        """`key`'s first token came (or it ended first): its prefill leaves its endpoint's queue. True if it was
        pending."""
        p = self._pending.pop(key, None)
        if p is None:
            return False
        ep = p.endpoint
        left = self._tokens.get(ep, 0.0) - p.tokens
        n = self._count.get(ep, 1) - 1
        if n <= 0:
            self._tokens.pop(ep, None)
            self._count.pop(ep, None)
            self._backlog.pop(ep, None)
        else:
            left = left if left > 0.5 else 0.0  # under half a token is float residue
            self._tokens[ep] = left
            self._count[ep] = n
            b = self._backlog.get(ep)
            if b is not None and b[0] > left:
                self._backlog[ep] = (left, b[1])
        if p.hashes:
            firsts = self._first.get(p.hashes[0])
            if firsts is not None:
                c = firsts.get(ep, 0) - 1
                if c > 0:
                    firsts[ep] = c
                else:
                    firsts.pop(ep, None)
                    if not firsts:
                        del self._first[p.hashes[0]]
        pre = self._prefixes.get(ep)
        if pre is not None and p.hashes:
            pre.remove(p.hashes)
            # Kept when nothing is pending (the next pick of the same prefix then updates counts in place, no
            # table regrown); compacted once the stale counts outweigh the live ones.
            if pre.needs_compaction():
                pre.reset([q.hashes for q in self._pending.values() if q.endpoint == ep and q.hashes]
                          if pre.num_blocks else [])
        return True

    def pending_match(self, endpoint: EndpointId, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `block_hashes` that a request pending on `endpoint` shares (chained hashes: a hash
        names its whole prefix, so the held blocks are a prefix of the query and a binary search finds its end;
        hashes that are not one chain, which only a faulty peer sends, can make it stop at any held block)."""
        pre = self._prefixes.get(endpoint)
        return pre.match(block_hashes) if pre is not None and pre.num_blocks else 0

    def pending_matches(self, block_hashes: Sequence[BlockHash]) -> dict[EndpointId, int]:
        """`pending_match` for every endpoint where it is > 0: only endpoints with a pending request that starts
        with the same block are looked at (cheap for a cold prefix: one dict lookup)."""
        if not block_hashes:
            return {}
        firsts = self._first.get(block_hashes[0])
        if not firsts:
            return {}
        return {ep: self.pending_match(ep, block_hashes) for ep in firsts}

    def terms(self, endpoint: EndpointId) -> tuple[float, float, float, int]:
        """(rate tokens/s, base s, pending tokens, pending requests) of `endpoint`: what `predict` combines, for
        a caller scoring many endpoints in one loop."""
        rate, base = self.priced(endpoint)
        return rate, base, self._tokens.get(endpoint, 0.0), self._count.get(endpoint, 0)

    def pending_queue_endpoints(self) -> list[EndpointId]:
        """Endpoints with pending requests (a prefill queue > 0 tokens or not)."""
        return list(self._count)

    def pending_endpoints(self) -> list[EndpointId]:
        """Endpoints with pending prefixes (usually few)."""
        return [ep for ep, pre in self._prefixes.items() if pre.num_blocks > 0]

    def forget_endpoint(self, endpoint: EndpointId) -> None:
        """`endpoint` left the pool: its rate and pending requests go; late removals are absorbed."""
        if self._rates.pop(endpoint, None) is not None:
            self._reprice()
        for key in [k for k, p in self._pending.items() if p.endpoint == endpoint]:
            self.remove_pending(key)
        for key in [k for k, d in self._decoding.items() if d[0] == endpoint]:
            self.remove_decoding(key)
        self._prefixes.pop(endpoint, None)
        self._loads.pop(endpoint, None)

    def clear_prefixes(self, endpoint: EndpointId) -> None:
        """`endpoint`'s cache was cleared: its pending prefixes no longer promise a hit (the queue stays)."""
        self._prefixes.pop(endpoint, None)
        for p in self._pending.values():
            if p.endpoint == endpoint and p.hashes:
                firsts = self._first.get(p.hashes[0])
                if firsts is not None:
                    firsts.pop(endpoint, None)
                    if not firsts:
                        del self._first[p.hashes[0]]
                p.hashes = ()

"""Flow control's decisions: admit, hold, release, shed. Pure and synchronous: the caller passes the
time (``now_s``: the router's loop time, or a simulation's virtual time) and the detector's `Saturation`, so
the live router (`gate.FlowGate`, asyncio) and the virtual fleet run the same code.

- `offer`: below saturation a request is admitted at once (never held while an endpoint could start it); past
  it, it is held, unless no endpoint is healthy (503), its predicted wait exceeds its deadline (429; judged
  only once the drain rate is measured over `MIN_PREDICT_RELEASES` releases, and only while the prediction is
  shown right: `WaitPredictions`; otherwise it is held and counted as such), or the queue is full in count or
  bytes and holds nothing it would give up for it (429). A full queue gives up, newest first, requests of a
  lower priority class, then of its own class those of a tenant holding more than the newcomer's tenant would
  (`FlowQueue.lowest`: the tenant holding the most): whoever fills the queue loses its newest requests, a
  newcomer with fewer held keeps its place.
- `release`: while some endpoint has room, the next held request in the queue's order (`queue.FlowQueue`); under
  deadline pressure its aging is bounded by the time first come, first served would take to release what is
  held (held requests / the drain rate, `FIFO_BOUND_DEADLINE_RATIO`), so shortest-first does not push the same
  requests back past their deadline where arrival order would have served them in time.
- `expire` / `drop`: a held request whose deadline passed is shed (429, or 503 when no endpoint is healthy); one
  whose client left is dropped.

A slow router or host is not a slow fleet: the drain rate leaves out the time the router's own event loop
stalled (``stall_s``, the pool's `LoopLag`), during which nothing could be released whatever the engines did.

Every shed answer carries ``retry_after_s``, the time the queue's drain rate (measured since the queue last
emptied) needs to release what is held now (1-60 s): what the OpenAI SDK's retry honours. Not thread-safe (one
event loop).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable

from prefixroute.openai_errors import OpenAIError

from .queue import FlowQueue, QueuedRequest
from .saturation import Saturation
from .settings import FlowSettings

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
"""Retry-After is whole seconds (RFC 9110); a minute caps what a stalled drain estimate can tell clients."""

DRAIN_WINDOW = 64
"""Releases the drain rate is measured over: at saturation a few seconds of traffic."""

MIN_PREDICT_RELEASES = 16
"""Releases a busy period must have measured before its drain rate may shed a request at arrival
(`ShedReason.PREDICTED_DEADLINE`). Its first releases understate the drain: the engines still hold the work
admitted before the pool saturated, so only a few held requests go out at first (5-6 releases in 2-4 s read as
1 req/s on a fleet serving 6-9; the virtual mix sweep shed requests at 80% load on that reading). A held request
whose deadline really passes is shed all the same (`expire`)."""

FIFO_BOUND_DEADLINE_RATIO = 0.5
"""Under deadline pressure (first come, first served would take at least half the default deadline to release
what is held) the oldest held request goes first once it has waited that long, whatever the average wait: past
it, shortest-first starves the dear requests to their deadline (virtual fleet, 288 prompts of 8k tokens at 250%
of capacity: 62 of 1,500 shed, every one of which met its deadline with no queue; 0 with this bound). Applied
always (ratio 0), the bound took the conversation trace's order back to arrival order (its median 2.4 s ->
11.5 s, hit ratio -0.010); at 0.5 it leaves that trace as it was."""

PREDICTION_WINDOW = 32
"""Held requests whose predicted wait is compared with their actual one (`WaitPredictions`): the last 32."""

MIN_PREDICTIONS = 16
"""Predicted waits that must have been checked (their request released or shed) before a prediction may shed a
request at arrival: half the window, so one or two odd waits cannot open the gate."""

PREDICTION_TOLERANCE = 0.25
"""A prediction is trusted to shed while the median of actual / predicted wait over the window is at least
1 - 0.25: the queue drains no faster than predicted, so a request predicted late would be late. A predictor that
overestimates waits by more than that (a drain rate bent by a stalled loop, engines speeding up as the cache
warms) would shed requests that would have made their deadline: they are held instead (and shed at their
deadline if it really passes). An underestimate only sheds later, never falsely, so it does not block."""

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram bounds of the gateway wait (seconds), for /metrics."""


class Verdict(enum.Enum):
    ADMIT = "admit"  # not saturated: place it now
    HOLD = "hold"  # held: wait for `release`
    SHED = "shed"  # answered with `Offer.error`


class ShedReason(str, enum.Enum):
    NO_ENDPOINT = "no_endpoint"
    DEADLINE = "deadline"  # its deadline passed while held
    PREDICTED_DEADLINE = "predicted_deadline"  # at arrival, the drain rate said it would wait past its deadline
    QUEUE_FULL = "queue_full"
    EVICTED = "evicted"  # held, then pushed out of a full queue (a higher class, or a tenant holding less)


class ReleaseReason(str, enum.Enum):
    FIRST_TOKEN = "first_token"
    RELEASE = "release"  # a request ended (or was given back) on some endpoint
    SCRAPE = "scrape"  # a scrape showed room
    ARRIVAL = "arrival"  # a new arrival found room (the queue drains before it)


class NeedsHold(Exception):  # noqa: N818 - a control-flow signal, like NeedsLookup
    """Raised by the router service's `route(..., can_hold=True)` past saturation: the caller awaits its
    ``hold(request, headers)`` (the queue), then routes the request with the ticket it returns (servicer.py)."""

    def __init__(self, request: object) -> None:
        super().__init__("held in the gateway queue")
        self.request = request


class Shed(OpenAIError):
    """A shed request's answer (429, or 503 with no healthy endpoint), with why it was shed."""

    def __init__(self, status: int, message: str, reason: ShedReason, retry_after_s: int) -> None:
        super().__init__(status, message, retry_after_s=retry_after_s)
        self.reason = reason
        self.wait_s = 0.0  # how long it was held before it was shed (0: shed on arrival); set by the gate


def gateway_outcome(error: Exception) -> tuple[float, str | None]:
    """A refusal's gateway wait (ms) and outcome for its record: ``(wait_ms, "shed:REASON")`` for a `Shed`,
    ``(0.0, None)`` for any other refusal (never held)."""
    if isinstance(error, Shed):
        return error.wait_s * 1000.0, f"shed:{error.reason.value}"
    return 0.0, None


@dataclasses.dataclass(slots=True)
class Offer:
    """`offer`'s answer: the verdict, the error of a shed request (status 429 or 503, OpenAI format, with
    retry_after_s), and the held requests evicted to make room (each to be answered with `evicted_error`)."""

    verdict: Verdict
    error: Shed | None = None
    reason: ShedReason | None = None
    evicted: list[QueuedRequest] = dataclasses.field(default_factory=list)


class DrainRate:
    """Releases per second over the last `DRAIN_WINDOW` releases (None until two, or while they share a
    timestamp). ``stall_s(since_s, now_s)``: seconds of that interval the router's event loop was stalled
    (`LoopLag.stall_s`); they are left out of the span (nothing is released while the loop is stalled, however
    fast the engines drain)."""

    def __init__(self, window: int = DRAIN_WINDOW,
                 stall_s: Callable[[float, float], float] | None = None) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._stall_s = stall_s

    def record(self, now_s: float) -> None:
        self._times.append(now_s)

    def restart(self) -> None:
        """Forget the releases so far: the queue emptied, and the next busy period is measured on its own."""
        self._times.clear()

    def __len__(self) -> int:
        """Releases measured (at most the window)."""
        return len(self._times)

    def per_s(self, now_s: float) -> float | None:
        if len(self._times) < 2:
            return None
        # The span runs to now: a drain that stopped (no release for a while) reads as slowing down.
        end = max(now_s, self._times[-1])
        span = end - self._times[0]
        if self._stall_s is not None and span > 0:
            span -= min(span, self._stall_s(self._times[0], end))
        return (len(self._times) - 1) / span if span > 0 else None


class WaitPredictions:
    """How right the drain rate's predicted waits have been (`PREDICTION_TOLERANCE`): for held requests, the
    predicted wait at arrival against the actual one at release (or at its deadline shed: a lower bound).
    Invariant: at most `PREDICTION_WINDOW` checked ratios; `trusted()` is False until `MIN_PREDICTIONS`."""

    def __init__(self, window: int = PREDICTION_WINDOW) -> None:
        self._pending: dict[int, float] = {}  # id(entry) of a held request -> its predicted wait (s)
        self._ratios: deque[float] = deque(maxlen=window)  # actual / predicted, oldest first

    def predict(self, entry: QueuedRequest, wait_s: float) -> None:
        if wait_s > 0:
            self._pending[id(entry)] = wait_s

    def check(self, entry: QueuedRequest, waited_s: float) -> None:
        """`entry` left the queue after `waited_s` (released or shed at its deadline)."""
        predicted = self._pending.pop(id(entry), None)
        if predicted is not None:
            self._ratios.append(waited_s / predicted)

    def forget(self, entry: QueuedRequest) -> None:
        self._pending.pop(id(entry), None)

    def trusted(self) -> bool:
        if len(self._ratios) < MIN_PREDICTIONS:
            return False
        return statistics.median(self._ratios) >= 1.0 - PREDICTION_TOLERANCE


@dataclasses.dataclass(slots=True)
class FlowStats:
    """Counters for /metrics and reports. Monotonic except ``saturation_signal`` (the last one seen)."""

    num_admitted: int = 0  # admitted at once, never held
    num_held: int = 0
    held_by_bound: Counter = dataclasses.field(default_factory=Counter)  # saturation.BOUND_* -> requests held
    released: Counter = dataclasses.field(default_factory=Counter)  # ReleaseReason value -> count
    shed: Counter = dataclasses.field(default_factory=Counter)  # (ShedReason value, status) -> count
    # Arrivals whose predicted wait passed their deadline: "shed" (the prediction was trusted) or "held" (not
    # shown right on recent requests: held instead, `WaitPredictions`)
    predicted_late: Counter = dataclasses.field(default_factory=Counter)
    num_dropped: int = 0  # held requests whose client left
    wait_buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * len(WAIT_BUCKETS_S))
    wait_count: int = 0
    wait_sum_s: float = 0.0
    saturation_signal: float = 0.0

    def observe_wait(self, wait_s: float) -> None:
        self.wait_count += 1
        self.wait_sum_s += wait_s
        for i, bound in enumerate(WAIT_BUCKETS_S):
            if wait_s <= bound:
                self.wait_buckets[i] += 1


class FlowControl:
    """The queue and its admission, release and shedding rules (module docstring)."""

    def __init__(self, settings: FlowSettings, *, stall_s: Callable[[float, float], float] | None = None) -> None:
        """`stall_s(since_s, now_s)`: the router's own loop stalls in that interval (the pool's
        `LoopLag.stall_s`, on the clock of ``now_s``), left out of the drain rate; None: not measured."""
        self.settings = settings
        self.queue = FlowQueue(max_wait_ratio=settings.max_wait_ratio, min_aging_s=settings.aging_min_s)
        self.drain = DrainRate(stall_s=stall_s)
        self.predictions = WaitPredictions()
        self.stats = FlowStats()
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._rows = itertools.count()

    def retry_after_s(self, now_s: float) -> int:
        """Seconds the drain rate needs to release what is held now and one more, within [1, 60]."""
        rate = self.drain.per_s(now_s)
        if rate is None:
            return MIN_RETRY_AFTER_S
        return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil((len(self.queue) + 1) / rate))))

    def shed_error(self, reason: ShedReason, saturation: Saturation, now_s: float) -> Shed:
        """The answer to a shed request: 503 with no healthy endpoint, else 429; OpenAI format, Retry-After."""
        status = 503 if saturation.num_healthy == 0 else 429
        message = {
            ShedReason.NO_ENDPOINT: "no healthy endpoint can serve this request",
            ShedReason.DEADLINE: "the fleet is saturated and this request waited past its deadline in the queue",
            ShedReason.PREDICTED_DEADLINE: "the fleet is saturated and this request would wait past its deadline",
            ShedReason.QUEUE_FULL: "the fleet is saturated and the gateway queue is full",
            ShedReason.EVICTED: "the fleet is saturated and the gateway queue is full: a request of a higher "
                                "priority, or of a tenant holding fewer requests, took this one's place",
        }[reason]
        self.stats.shed[(reason.value, status)] += 1
        return Shed(status, message, reason, self.retry_after_s(now_s))

    def offer(self, entry: QueuedRequest, saturation: Saturation, now_s: float) -> Offer:
        """A new request (`entry`, its deadline and enqueue time set by the caller): admit, hold or shed it."""
        self.stats.saturation_signal = saturation.signal
        if not saturation.saturated:
            self.stats.num_admitted += 1
            return Offer(Verdict.ADMIT)
        if saturation.num_healthy == 0:
            reason = ShedReason.NO_ENDPOINT
            return Offer(Verdict.SHED, self.shed_error(reason, saturation, now_s), reason)
        predicted_wait_s = self._predicted_wait_s(entry, now_s)
        if predicted_wait_s is not None and predicted_wait_s > entry.deadline_s - now_s:
            if self.predictions.trusted():
                self.stats.predicted_late["shed"] += 1
                reason = ShedReason.PREDICTED_DEADLINE
                return Offer(Verdict.SHED, self.shed_error(reason, saturation, now_s), reason)
            self.stats.predicted_late["held"] += 1
        evicted: list[QueuedRequest] = []
        s = self.settings
        queue = self.queue
        while len(queue) + 1 > s.max_queued_requests or queue.num_bytes + entry.num_bytes > s.max_queued_bytes:
            victim = queue.lowest()
            if victim is None or victim.priority > entry.priority or (
                    victim.priority == entry.priority and (
                        victim.tenant == entry.tenant or queue.num_queued_of(victim.priority, victim.tenant)
                        <= queue.num_queued_of(entry.priority, entry.tenant) + 1)):
                reason = ShedReason.QUEUE_FULL
                # The victims already taken out stay out: they are answered like the rest of the evicted.
                return Offer(Verdict.SHED, self.shed_error(reason, saturation, now_s), reason, evicted)
            queue.remove(victim)
            self.predictions.forget(victim)
            evicted.append(victim)
        if not len(self.queue):
            # A busy period starts: the rate of the last one (its span running to now, through the idle spell
            # since) would read as a crawl and shed this burst on a stale figure.
            self.drain.restart()
        self.queue.push(entry)
        if predicted_wait_s is not None:
            self.predictions.predict(entry, predicted_wait_s)
        heapq.heappush(self._deadlines, (entry.deadline_s, next(self._rows), entry))
        self.stats.num_held += 1
        self.stats.held_by_bound[saturation.bound or "none"] += 1
        return Offer(Verdict.HOLD, evicted=evicted)

    def evicted_error(self, saturation: Saturation, now_s: float) -> Shed:
        return self.shed_error(ShedReason.EVICTED, saturation, now_s)

    def _predicted_wait_s(self, entry: QueuedRequest, now_s: float) -> float | None:
        """`entry`'s predicted wait: the time the drain rate, once measured over `MIN_PREDICT_RELEASES`
        releases, needs to release the requests that would go before it; None before that. The cheap bound
        (everything of its class or above) when it is within the deadline; the exact count (a scan of its
        class) only when that bound is past it (so the answer to "past the deadline?" is exact)."""
        rate = self.drain.per_s(now_s) if len(self.drain) >= MIN_PREDICT_RELEASES else None
        if rate is None:
            return None
        bound_s = self.queue.num_queued_at_or_above(entry.priority) / rate
        if bound_s <= entry.deadline_s - now_s:
            return bound_s
        return self.queue.num_ahead(entry.priority, entry.cost_s) / rate

    def release(self, saturation: Saturation, now_s: float, reason: ReleaseReason) -> QueuedRequest | None:
        """The next held request to place now, or None (nothing held, or no endpoint has room)."""
        self.stats.saturation_signal = saturation.signal
        if saturation.saturated or not len(self.queue):
            return None
        entry = self.queue.pop(now_s, self._fifo_wait_s(now_s))
        if entry is None:
            return None
        self.drain.record(now_s)
        self.stats.released[reason.value] += 1
        self.stats.observe_wait(entry.waited_s(now_s))
        self.predictions.check(entry, entry.waited_s(now_s))
        return entry

    def _fifo_wait_s(self, now_s: float) -> float | None:
        """Aging's bound under deadline pressure (`FIFO_BOUND_DEADLINE_RATIO`): the time first come, first served
        would take to release what is held now (held / the drain rate), once the drain rate is measured and that
        time is at least that share of the default deadline; None otherwise (aging by the average alone)."""
        rate = self.drain.per_s(now_s) if len(self.drain) >= MIN_PREDICT_RELEASES else None
        if not rate:
            return None
        fifo_s = len(self.queue) / rate
        return fifo_s if fifo_s >= FIFO_BOUND_DEADLINE_RATIO * self.settings.deadline_s else None

    def drop(self, entry: QueuedRequest) -> bool:
        """`entry`'s client left while it was held: it leaves the queue. True if it was held."""
        if self.queue.remove(entry):
            self.stats.num_dropped += 1
            self.predictions.forget(entry)
            return True
        return False

    def expire(self, saturation: Saturation, now_s: float) -> list[tuple[QueuedRequest, Shed]]:
        """Held requests whose deadline is at or before `now_s`, taken out, each with its answer."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            entry = heapq.heappop(self._deadlines)[2]
            if self.queue.remove(entry):
                self.stats.observe_wait(entry.waited_s(now_s))
                self.predictions.check(entry, entry.waited_s(now_s))
                out.append((entry, self.shed_error(ShedReason.DEADLINE, saturation, now_s)))
        if len(self._deadlines) > 2 * len(self.queue) + 64:
            self._deadlines = [r for r in self._deadlines if r[2].queued]
            heapq.heapify(self._deadlines)
        return out

    def next_deadline_s(self) -> float | None:
        """The earliest deadline of a held request (None when nothing is held)."""
        while self._deadlines and not self._deadlines[0][2].queued:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

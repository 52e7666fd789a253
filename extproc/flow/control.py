"""Flow control's decisions: admit, hold, release, shed. Pure and synchronous: the caller passes the
time (``now_s``: the router's loop time, or a simulation's virtual time) and the detector's `Saturation`, so
the live router (`gate.FlowGate`, asyncio) and the virtual fleet run the same code.

- `offer`: below saturation a request is admitted at once (never held while an endpoint could start it); past
  it, it is held, unless no endpoint is healthy (503), its predicted wait exceeds its deadline (429; judged
  only once the drain rate is measured over `MIN_PREDICT_RELEASES` releases), or the queue is full in count or
  bytes and holds nothing it would give up for it (429). A full queue gives up, newest first, requests of a
  lower priority class, then of its own class those of a tenant holding more than the newcomer's tenant would
  (`FlowQueue.lowest`: the tenant holding the most): whoever fills the queue loses its newest requests, a
  newcomer with fewer held keeps its place.
- `release`: while some endpoint has room, the next held request in the queue's order (`queue.FlowQueue`).
- `expire` / `drop`: a held request whose deadline passed is shed (429, or 503 when no endpoint is healthy); one
  whose client left is dropped.

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
from collections import Counter, deque

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
    timestamp)."""

    def __init__(self, window: int = DRAIN_WINDOW) -> None:
        self._times: deque[float] = deque(maxlen=window)

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
        span = max(now_s, self._times[-1]) - self._times[0]
        return (len(self._times) - 1) / span if span > 0 else None


@dataclasses.dataclass(slots=True)
class FlowStats:
    """Counters for /metrics and reports. Monotonic except ``saturation_signal`` (the last one seen)."""

    num_admitted: int = 0  # admitted at once, never held
    num_held: int = 0
    held_by_bound: Counter = dataclasses.field(default_factory=Counter)  # saturation.BOUND_* -> requests held
    released: Counter = dataclasses.field(default_factory=Counter)  # ReleaseReason value -> count
    shed: Counter = dataclasses.field(default_factory=Counter)  # (ShedReason value, status) -> count
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

    def __init__(self, settings: FlowSettings) -> None:
        self.settings = settings
        self.queue = FlowQueue(max_wait_ratio=settings.max_wait_ratio, min_aging_s=settings.aging_min_s)
        self.drain = DrainRate()
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
        if self._predicted_late(entry, now_s):
            reason = ShedReason.PREDICTED_DEADLINE
            return Offer(Verdict.SHED, self.shed_error(reason, saturation, now_s), reason)
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
            evicted.append(victim)
        if not len(self.queue):
            # A busy period starts: the rate of the last one (its span running to now, through the idle spell
            # since) would read as a crawl and shed this burst on a stale figure.
            self.drain.restart()
        self.queue.push(entry)
        heapq.heappush(self._deadlines, (entry.deadline_s, next(self._rows), entry))
        self.stats.num_held += 1
        self.stats.held_by_bound[saturation.bound or "none"] += 1
        return Offer(Verdict.HOLD, evicted=evicted)

    def evicted_error(self, saturation: Saturation, now_s: float) -> Shed:
        return self.shed_error(ShedReason.EVICTED, saturation, now_s)

    def _predicted_late(self, entry: QueuedRequest, now_s: float) -> bool:
        """True when the drain rate, once measured over `MIN_PREDICT_RELEASES` releases, says the requests that
        would go before `entry` take longer to release than its deadline allows. The cheap bound (everything of
        its class or above) is tried first; the exact count (a scan of its class) only when that bound is past
        the deadline."""
        rate = self.drain.per_s(now_s) if len(self.drain) >= MIN_PREDICT_RELEASES else None
        if rate is None:
            return False
        allowed_s = entry.deadline_s - now_s
        if self.queue.num_queued_at_or_above(entry.priority) / rate <= allowed_s:
            return False
        return self.queue.num_ahead(entry.priority, entry.cost_s) / rate > allowed_s

    def release(self, saturation: Saturation, now_s: float, reason: ReleaseReason) -> QueuedRequest | None:
        """The next held request to place now, or None (nothing held, or no endpoint has room)."""
        self.stats.saturation_signal = saturation.signal
        if saturation.saturated or not len(self.queue):
            return None
        entry = self.queue.pop(now_s)
        if entry is None:
            return None
        self.drain.record(now_s)
        self.stats.released[reason.value] += 1
        self.stats.observe_wait(entry.waited_s(now_s))
        return entry

    def drop(self, entry: QueuedRequest) -> bool:
        """`entry`'s client left while it was held: it leaves the queue. True if it was held."""
        if self.queue.remove(entry):
            self.stats.num_dropped += 1
            return True
        return False

    def expire(self, saturation: Saturation, now_s: float) -> list[tuple[QueuedRequest, Shed]]:
        """Held requests whose deadline is at or before `now_s`, taken out, each with its answer."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            entry = heapq.heappop(self._deadlines)[2]
            if self.queue.remove(entry):
                self.stats.observe_wait(entry.waited_s(now_s))
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

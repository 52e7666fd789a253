"""The live gate: `FlowControl` on an asyncio event loop. A held request is an asyncio future and a
deadline timer, so it costs no CPU while it waits (nothing polls); it is released by a capacity event.

    ticket = await gate.admit(key, flow_class, cost_s=..., num_bytes=...)   # raises Shed (429/503)
    ... place it with the state at this moment (late binding), register the pick ...
    gate.placed(ticket)

- Capacity events: the router calls `pump` on a first token, a released request, a scrape showing room. `pump`
  releases one held request at a time: the next is released when the previous one is `placed` (its pick is in
  the time model, so the detector sees its load), or after `placement_timeout_s` if its holder never says so.
  Releasing several on one stale reading would push a burst into one engine's queue, what holding avoids.
- Client disconnect: the holder's task is cancelled; its request leaves the queue (`FlowControl.drop`).
- Groups: when a placed request has a ``group`` (requests sharing a prefix), the held members are re-costed with
  ``recost(key)`` (its prefix is now pending on an endpoint: they have become hits).

Contract: below saturation `admit` returns at once without holding. Not thread-safe: call from the loop's thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Hashable, Iterable

from .control import FlowControl, ReleaseReason, Shed, Verdict
from .queue import QueuedRequest
from .saturation import EndpointLoad, Saturation, SaturationDetector
from .settings import FlowClass

PLACEMENT_TIMEOUT_S = 1.0
"""A released request's holder that has not called `placed` within 1 s (a pick takes milliseconds) no longer
blocks the next release."""


@dataclasses.dataclass(slots=True)
class Ticket:
    """An admitted request: ``wait_s`` in the gateway (0 when not held) and why it was released (None: admitted
    at once)."""

    key: Hashable
    wait_s: float = 0.0
    released_by: ReleaseReason | None = None
    group: Hashable | None = None
    _open: bool = True

    @property
    def held(self) -> bool:
        return self.released_by is not None


class FlowGate:
    """Holds, releases and sheds requests on the running loop (module docstring). ``loads()`` returns each
    endpoint's load now (time model and scrapes), read at every decision; ``recost(key)`` the predicted
    service seconds of a held request now."""

    def __init__(self, control: FlowControl, detector: SaturationDetector,
                 loads: Callable[[], Iterable[EndpointLoad]], *,
                 recost: Callable[[Hashable], float] | None = None,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        self.control = control
        self.detector = detector
        self.loads = loads
        self.recost = recost
        self.placement_timeout_s = placement_timeout_s
        self._futures: dict[QueuedRequest, asyncio.Future[ReleaseReason]] = {}
        self._timers: dict[QueuedRequest, asyncio.TimerHandle] = {}
        self._unplaced: Ticket | None = None
        # The event that started the current run of releases: a release after a placement is owed to it.
        self._reason = ReleaseReason.RELEASE
        self._unplaced_timer: asyncio.TimerHandle | None = None

    def saturation(self) -> Saturation:
        return self.detector.detect(self.loads())

    @property
    def num_held(self) -> int:
        return len(self.control.queue)

    async def admit(self, key: Hashable, flow_class: FlowClass, *, cost_s: float, num_bytes: int,
                    group: Hashable | None = None) -> Ticket:
        """Admit the request now, or hold it until released; raises `Shed` (an OpenAIError: 429 or 503 with
        retry_after_s) when it is shed, at once or later. Cancelling the caller drops a held request."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        saturation = self.saturation()
        entry = QueuedRequest(key, flow_class.priority, flow_class.fairness_id, cost_s, num_bytes, now,
                              now + flow_class.deadline_s, group)
        offer = self.control.offer(entry, saturation, now)
        for victim in offer.evicted:
            self._fail(victim, self.control.evicted_error(saturation, now))
        if offer.verdict is Verdict.ADMIT:
            if self.num_held:
                self.pump(ReleaseReason.ARRIVAL)
            return Ticket(key, group=group)
        if offer.verdict is Verdict.SHED:
            assert offer.error is not None
            raise offer.error
        fut: asyncio.Future[ReleaseReason] = loop.create_future()
        self._futures[entry] = fut
        self._timers[entry] = loop.call_at(entry.deadline_s, self._expire)
        try:
            reason = await fut
        except asyncio.CancelledError:
            self.control.drop(entry)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._clear_unplaced()  # released, then its client left: the next may go
                self.pump(ReleaseReason.RELEASE)
            raise
        finally:
            self._futures.pop(entry, None)
            timer = self._timers.pop(entry, None)
            if timer is not None:
                timer.cancel()
        return Ticket(key, entry.waited_s(loop.time()), reason, group)

    def placed(self, ticket: Ticket) -> None:
        """`ticket`'s pick is registered (or it failed to place): the next held request may be released. Held
        members of its group are re-costed. Idempotent. A release that follows is credited to the event that
        started the run (a first token may make room for several requests)."""
        if not ticket._open:
            return
        ticket._open = False
        if ticket.group is not None and self.recost is not None:
            queue = self.control.queue
            for member in queue.group_members(ticket.group):
                queue.update_cost(member, self.recost(member.key))
        if self._unplaced is ticket or (self._unplaced is not None and self._unplaced.key == ticket.key):
            self._clear_unplaced()
        if self.num_held:
            self.pump(self._reason)

    def pump(self, reason: ReleaseReason) -> None:
        """Capacity may have freed: release the next held request if some endpoint has room (one at a time:
        module docstring). Cheap when nothing is held."""
        if not self.num_held or self._unplaced is not None:
            return
        self._reason = reason
        loop = asyncio.get_running_loop()
        while self.num_held:
            now = loop.time()
            entry = self.control.release(self.saturation(), now, reason)
            if entry is None:
                return
            fut = self._futures.get(entry)
            if fut is None or fut.done():
                continue  # its holder is gone: try the next
            fut.set_result(reason)
            self._unplaced = Ticket(entry.key, group=entry.group)
            self._unplaced_timer = loop.call_later(self.placement_timeout_s, self._placement_timed_out)
            return

    def _placement_timed_out(self) -> None:
        self._unplaced_timer = None
        self._unplaced = None
        self.pump(ReleaseReason.RELEASE)

    def _clear_unplaced(self) -> None:
        self._unplaced = None
        if self._unplaced_timer is not None:
            self._unplaced_timer.cancel()
            self._unplaced_timer = None

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        for entry, error in self.control.expire(self.saturation(), now):
            self._fail(entry, error)

    def _fail(self, entry: QueuedRequest, error: Shed) -> None:
        fut = self._futures.get(entry)
        if fut is not None and not fut.done():
            error.wait_s = entry.waited_s(asyncio.get_running_loop().time())
            fut.set_exception(error)

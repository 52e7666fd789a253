"""The gateway queue: held requests ordered by priority class, tenant fairness and predicted service
time, with aging. Pure: no I/O, no clock of its own (the caller passes ``now_s``, any monotonic clock: the
router's loop time or a simulation's virtual time). Not thread-safe (one event loop, like the router).

Order of `pop`:

1. **Priority class**, strictly: the highest ``priority`` with a queued request goes first (GIE's
   InferenceObjective priority: higher is more important, unset is 0, < 0 is sheddable).
2. **Tenant fairness** within a class: start-time fair queuing over fairness ids. Each tenant with queued
   requests carries a virtual time, the predicted service seconds it has been given; the tenant with the least
   goes next, and a tenant that becomes active starts at the class's virtual clock (the start tag of the last
   dispatch), so a tenant cannot bank idle time and one tenant's burst does not push the others behind all of it.
3. **Shortest predicted service first** within a tenant: ``cost_s`` is the caller's prediction of the request's
   prefill on the endpoint it would get (a prefix hit costs a fraction of a cold prompt), so at saturation the
   cheap requests (what cuts the median) start first.
4. **Aging**: the oldest request of the tenant goes first instead once it has waited more than
   ``max_wait_ratio`` x the class's average wait (an exponentially weighted mean of the waits of the requests
   released from it), or more than ``fifo_wait_s`` when the caller gives it (`pop`: how long first come, first
   served would take to release what is held now; `FlowControl` gives it under deadline pressure), whichever is
   less, and at least ``min_aging_s``. The average alone bounds no tail past saturation: the waits of aged
   requests raise the average, which raises the bound.

Bounds: ``len(queue)`` and ``queue.num_bytes`` are what the caller checks against its limits (`FlowControl`);
when they are reached, `lowest` names the request to give up first: the newest of the tenant holding the most in
the lowest class, so a full queue sheds from whoever fills it, not from a newcomer.

Invariants: every queued entry is in exactly one tenant's heap and age list; ``len`` and ``num_bytes`` are the
count and the byte sum of the queued entries; a removed or popped entry is never returned again; `pop` on an
empty queue returns None.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator

AVERAGE_WAIT_WEIGHT = 0.05
"""Weight of one released wait in a class's average (~the last 20 releases): it follows a queue that builds up
or drains within seconds at a few hundred requests a second, yet one odd wait does not flip the order."""

_ROWS = itertools.count()

MIN_SERVICE_S = 0.001
"""A tenant is charged at least 1 ms of virtual time per request, so a tenant of full cache hits (cost ~0) still
takes turns with the others instead of being served without bound."""


@dataclasses.dataclass(eq=False, slots=True)
class QueuedRequest:
    """One held request. ``key`` is the caller's handle (a request id, a future's owner); ``cost_s`` >= 0 the
    predicted service seconds; ``num_bytes`` >= 0 what it holds in memory (its body); ``group`` an optional
    key of requests that share a prefix (their costs change together when one of them is placed)."""

    key: Hashable
    priority: int
    tenant: str
    cost_s: float
    num_bytes: int
    enqueued_s: float
    deadline_s: float = float("inf")
    group: Hashable | None = None
    seq: int = 0
    queued: bool = False

    def waited_s(self, now_s: float) -> float:
        return max(0.0, now_s - self.enqueued_s)


class _Tenant:
    __slots__ = ("name", "heap", "ages", "vtime", "num_queued", "num_bytes")

    def __init__(self, name: str, vtime: float) -> None:
        self.name = name
        # (cost, seq, row, entry): stale rows (entry no longer queued, or re-costed since) are skipped; `row` is
        # unique, so two rows of one entry never compare the entries themselves.
        self.heap: list[tuple[float, int, int, QueuedRequest]] = []
        self.ages: deque[QueuedRequest] = deque()  # enqueue order; entries no longer queued skipped
        self.vtime = vtime
        self.num_queued = 0
        self.num_bytes = 0

    def _trim(self) -> None:
        while self.heap and not (self.heap[0][3].queued and self.heap[0][0] == self.heap[0][3].cost_s):
            heapq.heappop(self.heap)
        while self.ages and not self.ages[0].queued:
            self.ages.popleft()

    def compact(self) -> None:
        """Drop stale rows once they outnumber the live ones (removals from the middle of a busy tenant's queue
        would otherwise stay until they reach the front): memory stays O(queued)."""
        if len(self.heap) > 2 * self.num_queued + 64:
            self.heap = [r for r in self.heap if r[3].queued and r[0] == r[3].cost_s]
            heapq.heapify(self.heap)
        if len(self.ages) > 2 * self.num_queued + 64:
            self.ages = deque(e for e in self.ages if e.queued)

    def oldest(self) -> QueuedRequest:
        self._trim()
        return self.ages[0]

    def cheapest(self) -> QueuedRequest:
        self._trim()
        return self.heap[0][3]


class _Class:
    __slots__ = ("priority", "tenants", "vclock", "average_wait_s", "num_queued")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.tenants: dict[str, _Tenant] = {}
        self.vclock = 0.0
        self.average_wait_s = 0.0
        self.num_queued = 0

    def next_tenant(self) -> _Tenant:
        return min(self.tenants.values(), key=lambda t: (t.vtime, t.name))


class FlowQueue:
    """Held requests in release order (module docstring). ``max_wait_ratio`` >= 1 and ``min_aging_s`` >= 0
    bound how long the shortest-first order may pass over the oldest request."""

    def __init__(self, *, max_wait_ratio: float = 2.0, min_aging_s: float = 1.0) -> None:
        if max_wait_ratio < 1.0:
            raise ValueError("max_wait_ratio must be >= 1")
        if min_aging_s < 0.0:
            raise ValueError("min_aging_s must be >= 0")
        self.max_wait_ratio = max_wait_ratio
        self.min_aging_s = min_aging_s
        self._classes: dict[int, _Class] = {}
        self._groups: dict[Hashable, set[QueuedRequest]] = {}
        self._seq = itertools.count()
        self._count = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[QueuedRequest]:
        """The queued entries, in no particular order."""
        for cls in self._classes.values():
            for tenant in cls.tenants.values():
                yield from (e for e in tenant.ages if e.queued)

    def push(self, entry: QueuedRequest) -> None:
        """Queue `entry` (not queued already). Its tenant joins its class at the class's virtual clock."""
        if entry.queued:
            raise ValueError("entry already queued")
        cls = self._classes.get(entry.priority)
        if cls is None:
            cls = self._classes[entry.priority] = _Class(entry.priority)
        tenant = cls.tenants.get(entry.tenant)
        if tenant is None:
            tenant = cls.tenants[entry.tenant] = _Tenant(entry.tenant, cls.vclock)
        entry.seq = next(self._seq)
        entry.cost_s = max(0.0, entry.cost_s)
        entry.queued = True
        heapq.heappush(tenant.heap, (entry.cost_s, entry.seq, next(_ROWS), entry))
        tenant.ages.append(entry)
        tenant.num_queued += 1
        tenant.num_bytes += entry.num_bytes
        cls.num_queued += 1
        self._count += 1
        self.num_bytes += entry.num_bytes
        if entry.group is not None:
            self._groups.setdefault(entry.group, set()).add(entry)

    def peek(self, now_s: float, fifo_wait_s: float | None = None) -> QueuedRequest | None:
        """The entry `pop` would return at `now_s`, left queued."""
        if not self._count:
            return None
        cls = self._classes[max(p for p, c in self._classes.items() if c.num_queued)]
        return self._choose(cls, cls.next_tenant(), now_s, fifo_wait_s)

    def _choose(self, cls: _Class, tenant: _Tenant, now_s: float, fifo_wait_s: float | None) -> QueuedRequest:
        oldest = tenant.oldest()
        bound = self.max_wait_ratio * cls.average_wait_s
        if fifo_wait_s is not None:
            bound = min(bound, fifo_wait_s)
        if oldest.waited_s(now_s) > max(bound, self.min_aging_s):
            return oldest
        return tenant.cheapest()

    def pop(self, now_s: float, fifo_wait_s: float | None = None) -> QueuedRequest | None:
        """Remove and return the next request to release (module docstring), or None when empty. Its wait
        enters its class's average and its tenant is charged its cost in virtual time. `fifo_wait_s`: how long
        first come, first served would take to release what is held now (the drain rate's figure); the oldest
        goes first once it has waited that long, whatever the average (None: the average alone)."""
        entry = self.peek(now_s, fifo_wait_s)
        if entry is None:
            return None
        cls = self._classes[entry.priority]
        tenant = cls.tenants[entry.tenant]
        cls.vclock = max(cls.vclock, tenant.vtime)
        tenant.vtime += max(entry.cost_s, MIN_SERVICE_S)
        w = AVERAGE_WAIT_WEIGHT
        cls.average_wait_s = (1.0 - w) * cls.average_wait_s + w * entry.waited_s(now_s)
        self._unlink(entry)
        return entry

    def remove(self, entry: QueuedRequest) -> bool:
        """Take `entry` out (its client left, its deadline passed, it was evicted). True if it was queued."""
        if not entry.queued:
            return False
        self._unlink(entry)
        return True

    def _unlink(self, entry: QueuedRequest) -> None:
        entry.queued = False
        cls = self._classes[entry.priority]
        tenant = cls.tenants[entry.tenant]
        tenant.num_queued -= 1
        tenant.num_bytes -= entry.num_bytes
        cls.num_queued -= 1
        self._count -= 1
        self.num_bytes -= entry.num_bytes
        if tenant.num_queued == 0:
            del cls.tenants[entry.tenant]  # rejoins at the class's clock: idle time is not banked
        else:
            tenant.compact()
        if cls.num_queued == 0:
            # The class's clock and average wait go with it: a class that empties starts afresh.
            del self._classes[entry.priority]
        if entry.group is not None:
            members = self._groups.get(entry.group)
            if members is not None:
                members.discard(entry)
                if not members:
                    del self._groups[entry.group]

    def update_cost(self, entry: QueuedRequest, cost_s: float) -> None:
        """`entry`'s predicted service changed (a request sharing its prefix was placed: it now hits). No-op for
        an entry no longer queued or an unchanged cost."""
        cost_s = max(0.0, cost_s)
        if not entry.queued or cost_s == entry.cost_s:
            return
        entry.cost_s = cost_s
        tenant = self._classes[entry.priority].tenants[entry.tenant]
        heapq.heappush(tenant.heap, (cost_s, entry.seq, next(_ROWS), entry))  # the old row goes stale (cost differs)

    def group_members(self, group: Hashable) -> list[QueuedRequest]:
        """The queued requests of `group` (a copy)."""
        return list(self._groups.get(group, ()))

    def lowest(self) -> QueuedRequest | None:
        """The request to evict first when the queue is full: in the lowest priority class, the most recently
        queued request of the tenant holding the most there (by count, then bytes, then name: deterministic), or
        None when empty. O(tenants of that class)."""
        if not self._count:
            return None
        cls = self._classes[min(p for p, c in self._classes.items() if c.num_queued)]
        largest = max(cls.tenants.values(), key=lambda t: (t.num_queued, t.num_bytes, t.name))
        for e in reversed(largest.ages):
            if e.queued:
                return e
        return None  # unreachable: a tenant in its class holds a queued entry

    def num_queued_of(self, priority: int, tenant: str) -> int:
        """Requests `tenant` holds in class `priority`."""
        cls = self._classes.get(priority)
        t = cls.tenants.get(tenant) if cls is not None else None
        return t.num_queued if t is not None else 0

    def num_ahead(self, priority: int, cost_s: float) -> int:
        """Queued requests that would go before a new one of `priority` and `cost_s` if no tenant or aging rule
        intervened: every one of a higher class, and those of its class no dearer. O(queued of its class)."""
        n = 0
        for p, cls in self._classes.items():
            if p > priority:
                n += cls.num_queued
            elif p == priority:
                n += sum(1 for t in cls.tenants.values() for e in t.ages if e.queued and e.cost_s <= cost_s)
        return n

    def num_queued_at_or_above(self, priority: int) -> int:
        return sum(c.num_queued for p, c in self._classes.items() if p >= priority)

    def lengths(self) -> dict[tuple[int, str], int]:
        """(priority, tenant) -> queued requests (a copy, for metrics). Safe from another thread: each dict is
        copied whole first (one C call under the GIL), so a concurrent change cannot break the iteration."""
        return {(p, name): t.num_queued for p, c in list(self._classes.items())
                for name, t in list(c.tenants.items())}

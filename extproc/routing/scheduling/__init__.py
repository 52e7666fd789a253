"""Scheduling, pure: filters -> weighted scorers -> picker, composed by policies (GIE-like split).

- filters.py: which endpoints may take a request at all (healthy, serves the model) and which are under the
  concurrency threshold.
- scorers.py: each scorer maps every candidate endpoint to a score in [0, 1] (higher = better).
- pickers.py: max weighted score with ties broken by load then randomly; rendezvous (HRW) ordering.
- policies.py: the `Policy` base and the selectable policies (names: `routing.settings.POLICIES`).
- scheduler.py: `Scheduler(settings).schedule(request, endpoints, in_flight, index) -> Decision`.

No I/O and no clock: the only state is the injected `random.Random` and the round-robin counter.
"""

from prefixroute.extproc.routing.scheduling.scheduler import Scheduler

__all__ = ["Scheduler"]

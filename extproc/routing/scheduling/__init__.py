"""Scheduling, pure: filters -> a score per candidate -> picker, composed by policies (GIE-like split).

- filters.py: which endpoints may take a request at all (healthy, serves the model).
- the score of the default `prefix` policy is a predicted TTFT from routing/timemodel.py (seconds).
- pickers.py: max score with ties broken by load then randomly; rendezvous (HRW) ordering; sampling.
- policies.py: the `Policy` base and the selectable policies (names: `routing.settings.POLICIES`).
- scheduler.py: `Scheduler(settings).schedule(request, endpoints, in_flight, index) -> Decision`.

No I/O and no clock: the only state is the injected `random.Random` and the round-robin counter.
"""

from prefixroute.extproc.routing.scheduling.scheduler import Scheduler

__all__ = ["Scheduler"]

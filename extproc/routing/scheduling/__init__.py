"""Scheduling, pure: filters -> a score per candidate -> picker, composed by policies (GIE-like split).

- filters.py: which endpoints may take a request at all (healthy, serves the model), and the subset of a large
  pool that is scored (`sample_candidates`).
- scorers.py: `TtftScorer`, the default `prefix` policy's score: a predicted TTFT from ONE
  `timemodel.TimeModel.predict_many` call over the candidates (seconds).
- placement.py: placement under cache pressure (off by default): `VictimScorer` prices what a candidate's new
  blocks would evict there (eviction order from the KV-events index, reuse from a count-min sketch),
  `ReplicaScorer` the blocks it would duplicate; their seconds add to `TtftScorer`'s score.
- pickers.py: the tie rule and the primary among the tied (`tied_best`, `pick_tied`); least-load and
  rendezvous (HRW) ordering.
- policies.py: the `Policy` base and the selectable policies (names: `routing.settings.POLICIES`).
- scheduler.py: `Scheduler(settings).schedule(request, endpoints, in_flight, index) -> Decision`.

No I/O and no clock: the only state is the injected `random.Random` and the round-robin counter.
"""

from prefixroute.extproc.routing.scheduling.scheduler import Scheduler

__all__ = ["Scheduler"]

"""Worked example of docs/extending.md, "Add a scorer": a policy that sends each request to the endpoint whose
scraped KV cache is least used (vLLM's ``vllm:kv_cache_usage_perc``), ties in rendezvous order.

Register it with two lines (docs/extending.md shows them): its name and help note in
``extproc/routing/settings.py`` ``POLICIES``, its class in ``extproc/routing/scheduling/policies.py``
``_CLASSES_BY_NAME``. tests/unit/routing/test_extending_examples.py imports and runs this file.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixroute.extproc.routing.scheduling.policies import PolicyInput, ScoredPolicy


class LeastKvUsagePolicy(ScoredPolicy):
    """The least-used KV cache first (an endpoint that reported nothing counts as empty)."""

    name = "least-kv-usage"

    def score(self, inp: PolicyInput) -> Sequence[float]:
        return [s.kv_cache_usage_ratio or 0.0 for s in inp.eligible]

"""Worked example of docs/extending.md, "Add a lifecycle listener": counts, per endpoint, the first tokens that
came more than twice as late as the time model predicted (a sign that an endpoint is slower than its rate
class, or that its queue is not what the router believes).

Register it with one line: ``router.add_listener(SlowFirstTokens())`` on the `PoolRouter` the factory built
(extproc/factory.py), or add it to the tuple of listeners in ``PoolRouter.__init__`` (extproc/service.py) to
have it in every router. tests/unit/routing/test_extending_examples.py imports and runs this file.
"""

from __future__ import annotations

from prefixroute.extproc.lifecycle import LifecycleListener, Pick
from prefixroute.types import EndpointId


class SlowFirstTokens(LifecycleListener):
    """`slow[endpoint]`: first tokens later than `factor` x the predicted TTFT; `seen[endpoint]`: first tokens
    of picks that had a prediction (the prefix policy's)."""

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor
        self.slow: dict[EndpointId, int] = {}
        self.seen: dict[EndpointId, int] = {}

    def on_first_token(self, pick: Pick) -> None:
        predicted_ms = pick.decision.predicted_ttft_ms
        if predicted_ms is None or pick.ttft_s is None:
            return  # a baseline policy predicts nothing
        ep = pick.counted  # the endpoint that served (after a failover: the fallback)
        self.seen[ep] = self.seen.get(ep, 0) + 1
        if pick.ttft_s * 1000.0 > self.factor * predicted_ms:
            self.slow[ep] = self.slow.get(ep, 0) + 1

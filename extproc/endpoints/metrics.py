"""The endpoint pool's health figures on the router's /metrics: what its health judgement got right and wrong.

- ``prefixroute_endpoint_probes_total{endpoint,outcome}``: health probes by outcome (ok, timeout, connection,
  status, identity, discounted_for_lag: timed out while the router's own loop stalled, not counted against
  the endpoint);
- ``prefixroute_endpoint_ejections_total{endpoint,cause}``: times the endpoint was marked down, by the outcome of
  the probes that took it down (timeout, connection, status, identity) or moved (its name resolved elsewhere);
- ``prefixroute_pool_panic``: 1 while the pool is in panic mode (too few endpoints pass their probes: the ones
  down only for timeouts are routed to as if healthy), ``prefixroute_pool_panic_seconds_total`` its time and
  ``prefixroute_pool_panics_total`` how often it began;
- ``prefixroute_endpoint_panic_routed{endpoint}``: 1 while the endpoint is routed to only by panic mode, and
  ``prefixroute_pool_panic_picks_total`` the requests picked for such endpoints (what panic mode risked);
- ``prefixroute_endpoint_discounted_probes_judged_total{next}``: probes discounted for lag, by the endpoint's next
  counted probe (ok: the discount spared a healthy endpoint; failed: it may have delayed a real ejection);
- ``prefixroute_router_loop_lag_seconds``: the router's event loop's worst stall of the last 10 s (what probes and
  scrape ages are judged against), ``prefixroute_router_loop_stall_seconds_total`` all its stalls;
- ``prefixroute_endpoint_metrics_kept_for_lag_total``: scrapes whose figures outlived ``metrics_stale_after_s``
  only because the router's loop stalled (kept, not expired).

Read by the metrics thread (prometheus_client's collect): `EndpointPool.health_figures` returns copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prefixroute.extproc.endpoints.pool import EndpointPool


class PoolHealthCollector:
    """A prometheus_client collector of one `EndpointPool`'s health figures (module docstring)."""

    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        f = self.pool.health_figures()
        probes = CounterMetricFamily("prefixroute_endpoint_probes", "Health probes by outcome: ok, timeout, "
                                     "connection (refused, reset), status (not 200), identity (failed its identity "
                                     "check), discounted_for_lag (timed out while the router's own event loop "
                                     "stalled: not counted against the endpoint).", labels=["endpoint", "outcome"])
        for (ep, outcome), n in sorted(f["probes"].items()):  # type: ignore[attr-defined]
            probes.add_metric([str(ep), outcome], n)
        yield probes
        ejections = CounterMetricFamily("prefixroute_endpoint_ejections", "Times the endpoint was marked down, by "
                                        "cause: the outcome of the probes that took it down (timeout, connection, "
                                        "status, identity) or moved (its name resolved elsewhere).",
                                        labels=["endpoint", "cause"])
        for (ep, cause), n in sorted(f["ejections"].items()):  # type: ignore[attr-defined]
            ejections.add_metric([str(ep), cause], n)
        yield ejections
        yield GaugeMetricFamily("prefixroute_pool_panic", "1 while the endpoint pool is in panic mode: fewer than "
                                "--healthy-panic-threshold-ratio of the endpoints pass their probes, so those "
                                "down only for timeouts are routed to as if healthy.", value=f["panic"])
        yield CounterMetricFamily("prefixroute_pool_panic_seconds", "Time the endpoint pool spent in panic mode.",
                                  value=f["panic_seconds"])
        yield CounterMetricFamily("prefixroute_pool_panics", "Times the endpoint pool entered panic mode.",
                                  value=f["num_panics"])
        routed = GaugeMetricFamily("prefixroute_endpoint_panic_routed", "1 while the endpoint fails its probes "
                                   "and is routed to only because the pool is in panic mode.", labels=["endpoint"])
        for st in self.pool.snapshot():
            routed.add_metric([str(st.endpoint)], 1.0 if st.panic else 0.0)
        yield routed
        yield CounterMetricFamily("prefixroute_pool_panic_picks", "Requests picked for an endpoint routed only "
                                  "because the pool is in panic mode (its probes fail).", value=f["panic_picks"])
        judged = CounterMetricFamily("prefixroute_endpoint_discounted_probes_judged", "Probes discounted for the "
                                     "router's loop lag, by the endpoint's next counted probe: ok (the discount "
                                     "spared a healthy endpoint) or failed (it may have delayed a real ejection).",
                                     labels=["next"])
        for nxt, n in sorted(f["discounted_judged"].items()):  # type: ignore[attr-defined]
            judged.add_metric([nxt], n)
        yield judged
        yield GaugeMetricFamily("prefixroute_router_loop_lag_seconds", "The router's event loop's worst stall of "
                                "the last 10 s (probe timeouts and scrape ages are judged against its stalls).",
                                value=f["loop_lag_s"])
        yield CounterMetricFamily("prefixroute_router_loop_stall_seconds", "Time the router's event loop ran late "
                                  "(stalls over 2 ms, sampled every 50 ms).", value=f["loop_stall_s"])
        yield CounterMetricFamily("prefixroute_endpoint_metrics_kept_for_lag", "Scrapes whose figures outlived "
                                  "--metrics-stale-after-s only because the router's event loop stalled (kept, "
                                  "not expired).", value=f["metrics_kept_for_lag"])

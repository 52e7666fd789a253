"""Flow control's figures on the router's /metrics. Names:

- ``prefixroute_flow_queue_length{priority}``: requests held now, by class; ``prefixroute_flow_queue_flows{priority}``:
  how many flows (fairness ids) hold them. No flow's name is a label: a flow is a tenant, or a client's address,
  and /metrics must not show one tenant another's (nor grow a series per client);
- ``prefixroute_flow_held_total``, ``prefixroute_flow_admitted_total``: requests held, and admitted at once;
- ``prefixroute_flow_held_by_bound_total{bound}``: requests held, by the detector's bound that held them
  (queued_s: the time model's predicted queueing; num_waiting / kv_usage: the servers' scraped figures);
- ``prefixroute_flow_released_total{reason}``: held requests released, by the event that freed capacity
  (first_token, release, scrape, arrival);
- ``prefixroute_flow_shed_total{reason,code}``: requests answered 429/503, by reason (deadline,
  predicted_deadline, queue_full, evicted, no_endpoint);
- ``prefixroute_flow_predicted_late_total{decision}``: arrivals whose predicted wait passed their deadline, by
  what was done: ``shed`` (the prediction had been right on recent requests) or ``held`` (it had not: held, and
  shed only if the deadline really passes);
- ``prefixroute_flow_dropped_total``: held requests whose client left;
- ``prefixroute_flow_wait_seconds``: histogram of the time held requests waited (released or shed);
- ``prefixroute_flow_saturation``: the detector's last signal (>= 1 saturated; inf: no healthy endpoint);
- ``prefixroute_flow_queue_bytes``: request bytes held now.

Read by the metrics thread: plain integers and copies, a torn read costs at most one count.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .control import WAIT_BUCKETS_S, FlowControl, FlowStats

QUEUE_LENGTH = "prefixroute_flow_queue_length"
QUEUE_FLOWS = "prefixroute_flow_queue_flows"
HELD = "prefixroute_flow_held"
HELD_BY_BOUND = "prefixroute_flow_held_by_bound"
ADMITTED = "prefixroute_flow_admitted"
RELEASED = "prefixroute_flow_released"
SHED = "prefixroute_flow_shed"
DROPPED = "prefixroute_flow_dropped"
PREDICTED_LATE = "prefixroute_flow_predicted_late"
WAIT = "prefixroute_flow_wait_seconds"
SATURATION = "prefixroute_flow_saturation"
QUEUE_BYTES = "prefixroute_flow_queue_bytes"


def metrics_families(control: FlowControl) -> Iterable[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    stats = control.stats
    lengths = GaugeMetricFamily(QUEUE_LENGTH, "Requests held in the gateway queue now, by priority class.",
                                labels=["priority"])
    flows = GaugeMetricFamily(QUEUE_FLOWS, "Flows (tenants, or clients by address) with requests held in the "
                              "gateway queue now, by priority class.", labels=["priority"])
    by_class: dict[int, list[int]] = {}
    for (priority, _), n in control.queue.lengths().items():
        held = by_class.setdefault(priority, [0, 0])
        held[0] += n
        held[1] += 1
    for priority, (n, num_flows) in sorted(by_class.items()):
        lengths.add_metric([str(priority)], n)
        flows.add_metric([str(priority)], num_flows)
    yield lengths
    yield flows
    yield GaugeMetricFamily(QUEUE_BYTES, "Request body bytes held in the gateway queue now.",
                            value=control.queue.num_bytes)
    yield CounterMetricFamily(HELD, "Requests held in the gateway queue (the fleet was saturated).",
                              value=stats.num_held)
    by_bound = CounterMetricFamily(HELD_BY_BOUND, "Requests held in the gateway queue, by the saturation bound "
                                   "that held them (the least loaded endpoint's figure over its bound).",
                                   labels=["bound"])
    for bound, n in sorted(dict(stats.held_by_bound).items()):
        by_bound.add_metric([bound], n)
    yield by_bound
    yield CounterMetricFamily(ADMITTED, "Requests admitted at once (some endpoint had room).",
                              value=stats.num_admitted)
    released = CounterMetricFamily(RELEASED, "Held requests released, by the event that freed capacity.",
                                   labels=["reason"])
    for reason, n in sorted(dict(stats.released).items()):
        released.add_metric([reason], n)
    yield released
    shed = CounterMetricFamily(SHED, "Requests shed with 429 (503: no healthy endpoint), by reason.",
                               labels=["reason", "code"])
    for (reason, status), n in sorted(dict(stats.shed).items()):
        shed.add_metric([reason, str(status)], n)
    yield shed
    late = CounterMetricFamily(PREDICTED_LATE, "Arrivals predicted to wait past their deadline, by decision: shed "
                               "(the prediction was right on recent requests) or held (it was not).",
                               labels=["decision"])
    for decision in ("shed", "held"):
        late.add_metric([decision], stats.predicted_late.get(decision, 0))
    yield late
    yield CounterMetricFamily(DROPPED, "Held requests whose client left before release.", value=stats.num_dropped)
    # observe_wait counts a wait in every bucket it fits under: the counts are already cumulative
    buckets = [(str(bound), n) for bound, n in zip(WAIT_BUCKETS_S, list(stats.wait_buckets))]
    buckets.append(("+Inf", stats.wait_count))
    yield HistogramMetricFamily(WAIT, "Seconds held requests waited in the gateway queue (released or shed).",
                                buckets=buckets, sum_value=stats.wait_sum_s)
    yield GaugeMetricFamily(SATURATION, "The saturation detector's last signal: the least loaded healthy "
                            "endpoint's largest load figure over its bound (>= 1: saturated).",
                            value=stats.saturation_signal)


_COUNTER_RE = re.compile(r'^prefixroute_flow_(held|held_by_bound|admitted|released|shed|dropped|predicted_late)'
                         r'_total'
                         r'(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$', re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_LABEL_OF = {"held_by_bound": "bound", "released": "reason", "shed": "reason", "predicted_late": "decision"}


def parse_flow_counts(text: str) -> dict[str, Any] | None:
    """Flow control's counters from /metrics text (several replicas' texts joined add up): ``num_held``,
    ``num_admitted``, ``num_dropped``, ``released`` / ``shed`` (reason -> count; shed summed over codes) and
    ``held_by_bound`` (bound -> count). None when the text has no flow counter (flow control off)."""
    out: dict[str, Any] = {"num_held": 0, "num_admitted": 0, "num_dropped": 0, "released": {}, "shed": {},
                           "held_by_bound": {}, "predicted_late": {}}
    found = False
    for m in _COUNTER_RE.finditer(text):
        found = True
        name, value = m.group(1), int(float(m.group(3)))
        label = _LABEL_OF.get(name)
        if label is None:
            out[f"num_{name}"] += value
            continue
        key = dict(_LABEL_RE.findall(m.group(2) or "")).get(label, "")
        out[name][key] = out[name].get(key, 0) + value
    return out if found else None


def flow_counts(stats: FlowStats) -> dict[str, Any]:
    """`stats` in `parse_flow_counts`'s shape (shed summed over status codes): what a bench run reports, live
    (scraped) or virtual (read from the queue itself)."""
    shed: dict[str, int] = {}
    for (reason, _status), n in stats.shed.items():
        shed[reason] = shed.get(reason, 0) + n
    return {"num_held": stats.num_held, "num_admitted": stats.num_admitted, "num_dropped": stats.num_dropped,
            "released": dict(stats.released), "shed": shed, "held_by_bound": dict(stats.held_by_bound),
            "predicted_late": {"held": stats.predicted_late.get("held", 0),
                               "shed": stats.predicted_late.get("shed", 0)}}


class FlowCollector:
    """A prometheus_client collector of `metrics_families` (register it on the router's metrics registry)."""

    def __init__(self, control: FlowControl) -> None:
        self.control = control

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: ANN201
        yield from metrics_families(self.control)

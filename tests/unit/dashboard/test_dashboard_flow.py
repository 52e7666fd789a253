"""The dashboard's gateway-queue panel (dashboard/router_metrics.py `parse_flow_metrics`, dashboard/flow_panel.py;
issue 24), read from the router's real flow collector's Prometheus text."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

from prefixroute.dashboard import flow_panel
from prefixroute.dashboard.router_metrics import parse_flow_metrics
from prefixroute.dashboard.source import DataSource
from prefixroute.extproc.flow.control import FlowControl, ReleaseReason
from prefixroute.extproc.flow.metrics import FlowCollector
from prefixroute.extproc.flow.queue import QueuedRequest
from prefixroute.extproc.flow.saturation import Saturation
from prefixroute.extproc.flow.settings import FlowSettings

SATURATED = Saturation(1.7, 2, 0)


def _text(fc: FlowControl) -> str:
    registry = CollectorRegistry()
    registry.register(FlowCollector(fc))
    return generate_latest(registry).decode()


def _control() -> FlowControl:
    fc = FlowControl(FlowSettings(max_queued_requests=3))
    for key, priority, tenant in (("a", 5, "team-a"), ("b", 0, "team-b"), ("c", 0, "team-b"), ("d", 0, "x")):
        for _ in fc.offer(QueuedRequest(key, priority, tenant, 1.0, 10, 0.0, 30.0), SATURATED, 0.0).evicted:
            fc.evicted_error(SATURATED, 0.0)  # what the gate answers an evicted request
    fc.release(Saturation(0.5, 2, 1), 2.0, ReleaseReason.SCRAPE)
    return fc


def test_the_panel_reads_what_the_router_exports() -> None:
    flow = parse_flow_metrics(_text(_control()))
    assert flow is not None
    # "d" of flow x found the queue full: team-b held the most, so its newest ("c") gave up its place
    assert flow.queue == {"0": 2.0} and flow.flows == {"0": 2.0} and flow.num_held == 2
    assert flow.released == {"scrape": 1.0} and flow.shed == {("evicted", "429"): 1.0}
    assert (flow.num_held_total, flow.mean_wait_s) == (4.0, 2.0)
    assert flow.saturation == 0.5
    frame = flow_panel.queue_frame(flow)
    assert frame.to_dict("records") == [{"priority": "0", "flows": 2, "held now": 2}]
    text = flow_panel.counts_text(flow)
    assert "4 held" in text and "scrape 1" in text and "evicted (429) 1" in text


def test_no_flow_families_no_panel_and_saturation_words() -> None:
    assert parse_flow_metrics("# HELP x y\n# TYPE x gauge\nx 1\n") is None
    flow = parse_flow_metrics(_text(FlowControl(FlowSettings())))
    assert flow is not None and flow.num_held == 0 and flow.mean_wait_s is None
    assert flow_panel.saturation_text(flow) == "0.00"
    fc = FlowControl(FlowSettings())
    fc.offer(QueuedRequest("z", 0, "t", 1.0, 1, 0.0), Saturation(math.inf, 0, 0), 0.0)
    assert flow_panel.saturation_text(parse_flow_metrics(_text(fc))) == "no healthy endpoint"


def test_one_read_of_the_router_metrics_gives_both_live_views() -> None:
    calls = []

    def fetch(url: str, timeout_s: float) -> str:
        calls.append(url)
        return _text(_control())

    src = DataSource(db="/nonexistent.db", router_metrics_url="http://127.0.0.1:1/metrics")
    live, flow = src.router_live(fetch)
    assert live == {} and flow is not None and flow.num_held == 2 and len(calls) == 1
    assert DataSource(db="/nonexistent.db").router_live(fetch) == ({}, None)

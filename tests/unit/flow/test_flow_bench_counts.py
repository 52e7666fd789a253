"""A real bench run keeps flow control's counters (issue 24): the router's /metrics text, as `FlowCollector` writes
it, read back by the bench's scrape (`runner.parse_router_metrics`, two replicas adding up) and shown in report.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from prefixroute.bench import report, runner
from prefixroute.extproc.flow.control import FlowControl, ReleaseReason
from prefixroute.extproc.flow.metrics import FlowCollector, parse_flow_counts
from prefixroute.extproc.flow.queue import QueuedRequest
from prefixroute.extproc.flow.saturation import EndpointLoad, Saturation, SaturationDetector
from prefixroute.extproc.flow.settings import FlowSettings
from prefixroute.types import EndpointId

ROOM = Saturation(signal=0.5, num_healthy=1, num_with_room=1)


def _text(fc: FlowControl) -> str:
    registry = CollectorRegistry()
    registry.register(FlowCollector(fc))
    return generate_latest(registry).decode()


def _replica() -> FlowControl:
    fc = FlowControl(FlowSettings(max_queued_requests=2))
    det = SaturationDetector(0.25, 5, 0.8)
    full = det.detect([EndpointLoad(EndpointId("a:1"), 1.0)])
    for i in range(3):  # two held, the third finds the queue full
        fc.offer(QueuedRequest(i, 0, "t", 1.0, 10, 0.0, 30.0), full, 0.0)
    fc.offer(QueuedRequest(9, 0, "t", 1.0, 10, 0.0, 30.0), ROOM, 0.0)
    fc.release(ROOM, 1.0, ReleaseReason.FIRST_TOKEN)
    return fc


def test_the_bench_scrape_keeps_held_released_and_shed_counts_and_the_report_shows_them() -> None:
    text = _text(_replica()) + "\n" + _text(_replica())  # two replicas' /metrics add up
    got = runner.parse_router_metrics(text)["flow"]
    assert got == {"num_held": 4, "num_admitted": 2, "num_dropped": 0, "released": {"first_token": 2},
                   "shed": {"queue_full": 2}, "held_by_bound": {"queued_s": 4},
                   "predicted_late": {"held": 0, "shed": 0}}
    assert parse_flow_counts("prefixroute_prompt_tokens_total 5\n") is None  # flow control off: nothing
    assert "flow" not in runner.parse_router_metrics("prefixroute_prompt_tokens_total 5\n")
    runs = [{"router": "prefixroute:prefix+flow", "extra": {"router_metrics": {"flow": got}}},
            {"router": "sglang-router", "extra": {}}]
    lines = report.render_flow_counts(runs)
    assert any(line.startswith("| prefixroute:prefix+flow | 2 | 4 | first_token 2 | queue_full 2 | queued_s 4 | 0 |")
               for line in lines)
    assert report.render_flow_counts(runs[1:]) == []


def test_a_real_sweeps_entry_and_report_carry_the_counters() -> None:
    from prefixroute.bench import sweep, sweep_report

    flow = {"num_held": 3, "num_admitted": 7, "num_dropped": 0, "released": {"first_token": 3}, "shed": {},
            "held_by_bound": {"queued_s": 3}}
    summary = {"ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "hit_ratio": 0.5, "errors": 0, "requests": 10,
               "extra": {"router_metrics": {"flow": flow}}}
    entry = sweep._real_entry(summary, 1.0, None, {})
    assert entry["flow"] == flow
    lines = sweep_report.flow_count_lines([("110% prefixroute:prefix+flow", entry["flow"]), ("110% sglang", None)])
    assert lines[2].startswith("| router |") and len([x for x in lines if x.startswith("| 110%")]) == 1

"""Goodput and false sheds (bench/results.py): requests served within their deadline, sheds counted as missed; a
shed judged against the same requests replayed with shedding off. Counting on constructed cases, the report's
columns, and the virtual fleet's counterfactual replay (bench/virtual_run.py `judge_sheds`)."""

from __future__ import annotations

from prefixroute.bench import report, results, sweep_report, virtual_run, workloads as wl_mod
from prefixroute.bench.client import RequestResult
from prefixroute.extproc.flow.settings import FlowSettings


def R(index: int, *, ttft_s: float | None = 1.0, status: int = 200, start_s: float = 0.0) -> RequestResult:
    if status != 200:
        return RequestResult(index=index, start_s=start_s, status=status, error=f"http {status}: shed")
    return RequestResult(index=index, start_s=start_s, status=200, ttft_ms=ttft_s * 1000.0,
                         e2e_ms=ttft_s * 1000.0 + 500, prompt_tokens=100, completion_tokens=5, cached_tokens=0,
                         endpoint="a:1")


def test_goodput_counts_requests_within_the_deadline_and_sheds_as_missed() -> None:
    res = [R(0, ttft_s=1.0), R(1, ttft_s=29.0), R(2, ttft_s=31.0), R(3, status=429), R(4, status=503)]
    g = results.goodput(res, deadline_s=30.0)
    # met: 0 and 1; the span runs from the first start (0) to the last served finish (31.5 s)
    assert g == {"deadline_s": 30.0, "num_met": 2, "met_ratio": 0.4, "rps": round(2 / 31.5, 3)}
    assert results.goodput(res, deadline_s=60.0)["num_met"] == 3
    assert results.goodput([], 30.0) == {"deadline_s": 30.0, "num_met": 0, "met_ratio": None, "rps": 0.0}


def test_a_shed_is_false_when_the_replay_without_shedding_met_its_deadline() -> None:
    shed_run = [R(0, ttft_s=2.0), R(1, status=429), R(2, status=429), R(3, status=503), R(4, ttft_s=3.0)]
    # without shedding: 1 would have had its first token in 12 s (the shed was not needed), 2 in 45 s (past
    # its 30 s deadline: needed), 3 failed anyway (needed)
    unshed = [R(0, ttft_s=2.5), R(1, ttft_s=12.0), R(2, ttft_s=45.0), R(3, status=503), R(4, ttft_s=3.5)]
    assert results.false_sheds(shed_run, unshed, deadline_s=30.0) == {
        "num_shed": 3, "num_false": 1, "num_needed": 2, "false_ratio": round(1 / 3, 4)}
    # a longer deadline makes the second shed false too
    assert results.false_sheds(shed_run, unshed, deadline_s=50.0)["num_false"] == 2
    assert results.false_sheds(unshed[:2], unshed)["false_ratio"] is None  # nothing shed


def test_the_reports_show_goodput_and_false_sheds(tmp_path) -> None:
    res = [R(0, ttft_s=1.0), R(1, status=429), R(2, ttft_s=40.0)]
    run = results.summarize_run("prefixroute:prefix+flow", res, ["a:1"], extra={
        "false_sheds": results.false_sheds(res, [R(1, ttft_s=5.0)], unqueued=[R(1, ttft_s=50.0)])})
    assert run["extra"]["num_shed"] == 1 and run["extra"]["goodput"]["num_met"] == 1
    md = report.render_markdown(results.results_document({"name": "x"}, 0.5, [run]))
    head = next(line for line in md.splitlines() if line.startswith("| router |"))
    assert "| goodput req/s | met deadline | shed |" in head
    row = next(line for line in md.splitlines() if line.startswith("| prefixroute:prefix+flow"))
    assert f"| {round(1 / 40.5, 3):.2f} | 33.3% (<= 30 s) | 1 (false 1, 0 with no queue) |" in row
    assert len(row.split("|")) == len(head.split("|"))
    assert report.GOODPUT_NOTE in md


def test_a_virtual_sweep_reports_goodput_and_false_sheds() -> None:
    wl = wl_mod.shared_prompts(num_groups=24, prefix_tokens=4096, question_tokens=64, num_requests=160,
                               output_tokens=32, seed=0)
    spec = virtual_run.engine_spec("", ["--time-scale=1.8"])
    from prefixroute.bench import sweep

    doc = sweep.run_virtual_sweep(wl, ["prefixroute:prefix+flow"], num_servers=2, spec=spec, load_percents=(250.0,),
                                  log=lambda s: None)
    e = doc["points"][0]["runs"]["prefixroute:prefix+flow"]
    assert e["goodput"]["deadline_s"] == results.DEADLINE_S and e["goodput"]["num_met"] > 0
    if e["num_shed"]:
        assert e["false_sheds"]["num_shed"] == e["num_shed"]
    md = sweep_report.render_report(doc)
    head = next(line for line in md.splitlines() if line.startswith("| load |"))
    row = next(line for line in md.splitlines() if "prefixroute:prefix+flow |" in line)
    assert "goodput req/s | met deadline | shed" in head and len(row.split("|")) == len(head.split("|"))


def test_the_virtual_counterfactual_replays_the_same_requests_without_sheds() -> None:
    """A deadline so short that the queue sheds: the replay with shedding off serves every request, and the
    false sheds are exactly the shed requests that met the deadline in that replay."""
    wl = wl_mod.shared_prompts(num_groups=24, prefix_tokens=4096, question_tokens=64, num_requests=200,
                               output_tokens=32, seed=0)
    wl = wl_mod.apply_arrivals(wl, "poisson", rate_rps=40.0, seed=0)
    spec = virtual_run.engine_spec("", ["--time-scale=1.8"])
    flow = FlowSettings(deadline_s=0.5)
    kw = dict(num_servers=2, spec=spec, flow=flow)
    shed_run, _, _ = virtual_run.simulate_policy(wl, "prefix", **kw)
    unshed, _, _ = virtual_run.simulate_policy(wl, "prefix", shed=False, **kw)
    assert sum(results.is_shed(r) for r in shed_run) > 10
    assert not any(results.is_shed(r) for r in unshed) and all(r.ok for r in unshed)
    unqueued, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, spec=spec)
    judged = virtual_run.judge_sheds(shed_run, lambda queued: unshed if queued else unqueued)["false_sheds"]
    by_index = {r.index: r for r in unshed}
    deadline_s = results.DEADLINE_S  # goodput's deadline, not the queue's
    expected = sum(1 for r in shed_run if results.is_shed(r) and by_index[r.index].ttft_ms <= deadline_s * 1000)
    assert judged["num_false"] == expected and judged["num_shed"] == sum(results.is_shed(r) for r in shed_run)
    plain = {r.index: r for r in unqueued}
    assert judged["num_false_unqueued"] == sum(1 for r in shed_run if results.is_shed(r)
                                               and results.met_deadline(plain[r.index]))
    assert virtual_run.judge_sheds(unshed, lambda queued: 1 / 0) == {}  # nothing shed: no replay


def test_a_virtual_run_reports_the_queues_counters() -> None:
    """Held, shed by reason and predicted-late arrivals of the queue itself, in the run's document and report."""
    wl = wl_mod.shared_prompts(num_groups=24, prefix_tokens=4096, question_tokens=64, num_requests=200,
                               output_tokens=32, seed=0)
    wl = wl_mod.apply_arrivals(wl, "poisson", rate_rps=40.0, seed=0)
    spec = virtual_run.engine_spec("", ["--time-scale=1.8"])
    counts: dict = {}
    res, _, _ = virtual_run.simulate_policy(wl, "prefix", num_servers=2, spec=spec, flow=FlowSettings(deadline_s=0.5),
                                            flow_counts=counts)
    assert counts["num_held"] > 0 and sum(counts["shed"].values()) == sum(results.is_shed(r) for r in res)
    assert set(counts["predicted_late"]) == {"held", "shed"}
    run = results.summarize_run("prefixroute:prefix+flow", res, extra={"flow": counts})
    md = report.render_markdown(results.results_document({"name": "x"}, 0.5, [run]))
    assert "Gateway queue" in md and "predicted late (by decision)" in md
    none: dict = {}
    virtual_run.simulate_policy(wl, "prefix", num_servers=2, spec=spec, flow_counts=none)
    assert none == {}  # flow control off: no counters

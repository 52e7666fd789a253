"""The virtual suite (bench/suite.py): points against the baseline from single-run and sweep documents, the
aggregate and its lost points, the files it writes, its command line (a real set run end to end:
tests/integration/bench/test_bench_suite_run.py)."""

from __future__ import annotations

import json
import math

import pytest

from prefixroute.bench import suite

BASE = suite.DEFAULT_BASELINE


def _run(router, hit, p50, p90, p99, met=1.0, shed=0):
    return {"router": router, "hit_ratio": hit, "ttft_ms": {"p50": p50 * 1000, "p90": p90 * 1000, "p99": p99 * 1000},
            "extra": {"goodput": {"met_ratio": met}, "num_shed": shed}}


def _single(*runs):
    return {"runs": list(runs)}


def _sweep(points):
    """points: {load_percent: [runs]}; a sweep's runs keep their figures at their top level, keyed by name."""
    out = []
    for load, runs in points.items():
        out.append({"load_percent": load, "runs": {
            r["router"]: {"hit_ratio": r["hit_ratio"], "ttft_ms": r["ttft_ms"], **r["extra"]} for r in runs}})
    return {"points": out}


def test_points_of_a_single_run_against_the_baseline():
    doc = _single(_run("ours", 0.50, 1.0, 2.0, 4.0, met=0.9, shed=3), _run(BASE, 0.52, 2.0, 2.0, 2.0, met=0.8))
    [p] = suite.points_of("s", doc, BASE)
    assert (p.router, p.load, p.num_shed) == ("ours", "", 3)
    assert p.ttft_ratios == pytest.approx((0.5, 1.0, 2.0))
    assert p.hit_ratio - p.base_hit_ratio == pytest.approx(-0.02)
    assert p.lost  # P99 2x and hit 0.02 under


def test_points_of_a_sweep_pair_each_load_with_the_baseline_at_that_load():
    doc = _sweep({110: [_run("ours", 0.8, 1, 1, 1), _run(BASE, 0.8, 2, 2, 2)],
                  300: [_run("ours", 0.8, 4, 4, 4), _run(BASE, 0.8, 2, 2, 2)]})
    pts = suite.points_of("sp", doc, BASE)
    assert [(p.load, p.ttft_ratios[0]) for p in pts] == [("110%", 0.5), ("300%", 2.0)]
    assert [p.lost for p in pts] == [False, True]


def test_without_the_baseline_there_are_no_points():
    assert suite.points_of("s", _single(_run("ours", 0.5, 1, 1, 1)), BASE) == []


def test_lost_counts_tails_and_hit_ratio_not_the_median():
    doc = _single(_run("a", 0.5, 9.0, 1.04, 1.04), _run("b", 0.494, 1, 1, 1), _run("c", 0.496, 1, 1.06, 1),
                  _run(BASE, 0.5, 1, 1, 1))
    lost = {p.router: p.lost for p in suite.points_of("s", doc, BASE)}
    assert lost == {"a": False, "b": True, "c": True}


def test_aggregate_geometric_means_and_sums():
    doc1 = _single(_run("ours", 0.6, 1, 2, 4, met=0.9, shed=2), _run(BASE, 0.5, 2, 2, 2, met=1.0))
    doc2 = _single(_run("ours", 0.4, 4, 2, 1, met=1.0, shed=1), _run(BASE, 0.5, 2, 2, 2, met=0.8))
    pts = suite.points_of("a", doc1, BASE) + suite.points_of("b", doc2, BASE)
    agg = suite.aggregate(pts)["ours"]
    assert agg["points"] == 2 and agg["num_shed"] == 3 and agg["num_lost"] == 2  # P99 2x; hit 0.1 under
    assert agg["mean_hit_diff"] == pytest.approx(0.0)
    assert agg["ttft_p50_ratio"] == pytest.approx(math.sqrt(0.5 * 2.0))
    assert agg["ttft_p99_ratio"] == pytest.approx(math.sqrt(2.0 * 0.5))
    assert agg["met_ratio_diff_sum"] == pytest.approx(0.1)


def test_collect_writes_the_suite_document_and_report(tmp_path):
    name = suite.SETS[0].name
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(_single(_run("ours", 0.5, 1, 1, 3), _run(BASE, 0.5, 1, 1, 1))))
    doc = suite.collect(tmp_path, BASE, env={"X": "1"})
    assert json.loads((tmp_path / "suite.json").read_text()) == json.loads(json.dumps(doc))
    assert doc["env"] == {"X": "1"} and doc["aggregate"]["ours"]["num_lost"] == 1
    report = (tmp_path / "report.md").read_text()
    assert f"| {name} |  | ours |" in report and "| ours | 1 |" in report


def test_compare_prints_each_suite_aggregate(tmp_path, capsys):
    for d, p99 in (("a", 1.0), ("b", 3.0)):
        (tmp_path / d / suite.SETS[0].name).mkdir(parents=True)
        (tmp_path / d / suite.SETS[0].name / "results.json").write_text(
            json.dumps(_single(_run("ours", 0.5, 1, 1, p99), _run(BASE, 0.5, 1, 1, 1))))
        suite.collect(tmp_path / d, BASE)
    assert suite.main(["--compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "1.000 / 1.000 / 1.000" in out and "1.000 / 1.000 / 3.000" in out


@pytest.mark.parametrize("argv, message", [
    (["--out", "x", "--env", "NOVALUE"], "--env takes NAME=VALUE"),
    (["--out", "x", "--only", "no-such-set"], "unknown sets: no-such-set"),
    (["--out", "x", "--trace", "/no/such/trace.jsonl"], "no such file"),
    ([], "--out is required"),
    (["--compare", "/no/such/suite"], "not found"),
])
def test_bad_command_lines_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        suite.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_collect_also_judges_each_router_against_the_others(tmp_path):
    """Ours with its queue against ours without it: what the queue itself gains and loses, beside the baseline."""
    name = suite.SETS[0].name
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(_single(
        _run("ours+q", 0.5, 1, 1, 3), _run("ours-q", 0.5, 2, 1, 1), _run(BASE, 0.5, 1, 1, 1))))
    doc = suite.collect(tmp_path, BASE)
    against = doc["aggregate_by_baseline"]
    assert set(against) == {"ours+q", "ours-q"}  # never the baseline against itself
    assert against["ours-q"]["ours+q"]["ttft_p50_ratio"] == pytest.approx(0.5)
    assert against["ours-q"]["ours+q"]["num_lost"] == 1  # P99 3x its own router without the queue
    assert against["ours+q"]["ours-q"]["ttft_p99_ratio"] == pytest.approx(1 / 3, abs=1e-3)
    assert "Against ours-q (same points)" in (tmp_path / "report.md").read_text()


def test_false_sheds_are_counted_per_point_and_summed(tmp_path):
    """A shed the virtual fleet judged false (the request met its deadline in the replay without shedding, or with
    no queue at all) is counted beside the sheds, per point and per router."""
    run = _run("ours", 0.5, 1, 1, 1, shed=10)
    run["extra"]["false_sheds"] = {"num_shed": 10, "num_false": 2, "num_false_unqueued": 7}
    doc = _sweep({250: [run, _run(BASE, 0.5, 1, 1, 1)], 300: [dict(run), _run(BASE, 0.5, 1, 1, 1)]})
    pts = suite.points_of("sp", doc, BASE)
    assert [(p.num_shed, p.num_false_shed, p.num_false_shed_unqueued) for p in pts] == [(10, 2, 7)] * 2
    agg = suite.aggregate(pts)["ours"]
    assert (agg["num_shed"], agg["num_false_shed"], agg["num_false_shed_unqueued"]) == (20, 4, 14)
    text = suite.render(pts, {"ours": agg}, BASE)
    assert "| 10 (2 / 7) |" in text and "| 20 (4 / 14) |" in text

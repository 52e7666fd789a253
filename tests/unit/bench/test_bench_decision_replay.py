"""The decision replay tool (bench/decision_replay.py): a recording replays identically on the same code, and a
changed tie-break or feedback rule is reported as differing picks."""

from __future__ import annotations

import json
from pathlib import Path

from prefixroute.bench import decision_replay
from prefixroute.extproc.routing import router
from prefixroute.extproc.routing.scheduling import pickers


def test_a_recording_replays_identically_and_covers_every_policy(tmp_path, capsys):
    path = tmp_path / "golden.json"
    assert decision_replay.main(["record", str(path), "--scale", "0.05"]) == 0
    doc = json.loads(path.read_text())
    names = set(doc["scenarios"])
    for policy in ("prefix", "consistent-hash", "least-load", "round-robin", "random"):
        assert any(n.startswith(f"service/{policy}@") for n in names)
        for source in decision_replay.VIRTUAL_SOURCES:
            assert f"virtual/{policy}@{source}/mix" in names
    capsys.readouterr()
    assert decision_replay.main(["check", str(path)]) == 0
    assert capsys.readouterr().out.strip().endswith(" identical, 0 differ")


def test_a_changed_tie_break_or_feedback_rule_differs(tmp_path, monkeypatch, capsys):
    path = tmp_path / "golden.json"
    assert decision_replay.main(["record", str(path), "--scale", "0.1"]) == 0
    with monkeypatch.context() as m:
        m.setattr(pickers, "TTFT_TIE_RATIO", 1.0)  # every score within 2x of the best ties
        assert decision_replay.main(["check", str(path), "--only", "service/prefix"]) == 1
    with monkeypatch.context() as m:
        m.setattr(router, "FEEDBACK_SHRINK_RATIO", 0.5)
        assert decision_replay.main(["check", str(path), "--only", "@feedback"]) == 1
    capsys.readouterr()
    assert decision_replay.main(["check", str(path), "--only", "service/"]) == 0


GOLDEN = Path(__file__).resolve().parents[3] / "bench-results" / "decision-replay" / "decisions-golden.json.gz"


def test_the_committed_recording_replays_identically(capsys):
    """The picks recorded on main after the second pass (issue 23) are still the router's picks. A change meant
    to move decisions re-records the file (docs/extending.md) and says so; a refactor must leave it at 0."""
    assert decision_replay.main(["check", str(GOLDEN)]) == 0, capsys.readouterr().out[-2000:]
    assert capsys.readouterr().out.strip().endswith(" identical, 0 differ")

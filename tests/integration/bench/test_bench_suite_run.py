"""The virtual suite (bench/suite.py) running a real, tiny set through ``prefixroute bench --virtual`` in a
process of its own."""

from __future__ import annotations

import json

from prefixroute.bench import suite


def test_a_tiny_set_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """The suite drives the real `prefixroute bench --virtual` and reads what it writes (a change of the bench's
    results document that the suite does not follow fails here). Its --env reaches the run."""
    tiny = suite.SuiteSet("tiny", ("--workload", "shared-prompts", "--num-groups", "4", "--num-requests", "24",
                                   "--prefix-tokens", "256", "--servers", "2"))
    conv = suite.SETS[0]
    assert conv.trace
    monkeypatch.setattr(suite, "SETS", (tiny, conv))  # the trace set is skipped: no --trace
    assert suite.main(["--out", str(tmp_path), "--routers", "prefixroute:prefix,prefixroute:random",
                       "--env", "PREFIXROUTE_TTFT_WORK_WEIGHT=3", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "conversation-trace sets are skipped" in out and "tiny: done" in out
    doc = json.loads((tmp_path / "suite.json").read_text())
    assert {p["router"] for p in doc["points"]} == {"prefixroute:prefix", "prefixroute:random"}
    assert doc["env"] == {"PREFIXROUTE_TTFT_WORK_WEIGHT": "3"}
    assert not (tmp_path / conv.name).exists()
    # A second run keeps the set already there.
    assert suite.main(["--out", str(tmp_path), "--jobs", "1"]) == 0
    assert "tiny: kept the results already in" in capsys.readouterr().out

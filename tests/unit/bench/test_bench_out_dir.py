"""`prefixroute bench` without --out writes under the state folder, a new folder per run, never the current
folder (a checkout)."""

from __future__ import annotations

from prefixroute.bench.cli import default_out_dir
from prefixroute.bench.settings import BenchSettings


def test_without_out_a_run_writes_under_the_state_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXROUTE_STATE_DIR", str(tmp_path / "state"))
    assert BenchSettings().out == ""
    out = default_out_dir("shared-prompts", now=1796645745.0)
    assert out == tmp_path / "state" / "bench" / "20261207-121545-shared-prompts"
    # A trace's name is a path: only its last part, made safe for a folder name.
    assert default_out_dir("/data/my trace.jsonl", now=0).name == "19700101-000000-my-trace.jsonl"

"""`prefixroute bench --virtual` as a process: its exit codes and outputs (the rest of its tests:
tests/unit/bench/test_bench_virtual.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import pytest
from prefixroute.bench.traces import TraceRecord, trace_workload, write_trace

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test


def test_cli_rejects_unsimulated_server_args_with_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", "--virtual", "--num-requests", "4",
                           "--server-args=--fail-ratio=0.5", "--out", str(tmp_path / "o"), "--no-progress"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--fail-ratio is not simulated by --virtual" in proc.stderr, proc.stderr


def test_cli_virtual_trace_writes_outputs(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace, [TraceRecord(i * 100, 700 + i, 8, (0, 10 + i % 3)) for i in range(30)])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "bench", "--virtual", "--trace", str(trace),
                           "--trace-stop", "20", "--trace-time-scale", "0.5", "--servers", "8", "--routers",
                           "prefixroute:round-robin,prefixroute:prefix", "--profile", "llama-3.1-8b-h200",
                           "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["workload"]["num_requests"] == 20 and doc["workload"]["duration_s"] == pytest.approx(0.95)
    assert doc["workload"]["virtual"] is True
    assert [r["requests"] for r in doc["runs"]] == [20, 20]
    assert (out / "report.md").exists() and (out / "ttft_cdf.png").exists()

"""The bench's CPU by kind of process (runner.process_cpu_s, cpu_by_role_ms) and its report table."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from prefixroute.bench import report, runner

pytestmark = pytest.mark.integration  # loopback servers or child processes: not a unit test

# A child that names a router role in its argv and starts a worker whose argv names none; both spin for a while.
_SPIN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(5)\n"
_PARENT = textwrap.dedent(f"""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", {_SPIN!r}])
    exec({_SPIN!r})
""")


def test_a_router_and_its_worker_count_as_router_and_the_bench_itself_as_client() -> None:
    before = runner.process_cpu_s()
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, "sglang_router.launch_router"])
    try:
        for _ in range(100):  # both spun their 0.3 s
            now = runner.process_cpu_s()
            mine = [v for p, v in now.items() if p != proc.pid and v[0] == "router"]
            if now.get(proc.pid, ("", 0.0))[1] >= 0.29 and mine and mine[0][1] >= 0.29:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"children never spun: {now}")
        assert now[proc.pid][0] == "router"
        cpu = runner.cpu_by_role_ms(before, now, 1)
        # Two processes x 0.3 s, in ms per (one) request; /proc counts whole clock ticks.
        assert cpu is not None and cpu["router"] >= 500
        assert cpu["client"] >= 0  # (other roles: whatever else runs below this test process, e.g. fixtures)
    finally:
        proc.kill()
        proc.wait()


def test_roles_from_argv() -> None:
    py = sys.executable
    assert runner._process_role([py, "-m", "prefixroute", "model-server", "--port", "1"]) == "servers"
    assert runner._process_role([py, "-m", "prefixroute", "extproc", "--port", "1"]) == "router"
    assert runner._process_role(["/x/bin/envoy", "-c", "e.yaml"]) == "envoy"
    assert runner._process_role([py, "-m", "sglang_router.launch_router", "--host"]) == "router"
    assert runner._process_role(["sglang::router", ""]) == "router"  # its own name once started
    assert runner._process_role([py, "-c", "pass"]) == "other"
    assert runner._process_role([]) == "other"


def test_cpu_by_role_counts_only_what_ran_between_readings() -> None:
    before = {1: ("router", 1.0), 2: ("servers", 5.0)}
    after = {1: ("router", 1.5), 2: ("servers", 6.0), 3: ("envoy", 0.25)}  # 3 started in between
    assert runner.cpu_by_role_ms(before, after, 10) == {"envoy": 25.0, "router": 50.0, "servers": 100.0}
    assert runner.cpu_by_role_ms(before, after, 0) is None and runner.cpu_by_role_ms(before, {}, 3) is None


def test_the_report_shows_a_row_per_run_that_measured_cpu() -> None:
    runs = [{"router": "prefixroute:prefix", "extra": {"cpu_ms_per_request": {"router": 4.5, "envoy": 3.0,
                                                                              "servers": 6.0, "client": 2.5},
                                                       "host_cpu_busy_ratio": 0.09}},
            {"router": "random", "extra": {}},
            {"router": "sglang-router", "extra": {"cpu_ms_per_request": {"router": 2.5, "servers": 5.0}}}]
    lines = report.render_cpu(runs)
    rows = [line for line in lines if line.startswith("| prefixroute") or line.startswith("| sglang")]
    assert rows == ["| prefixroute:prefix | 4.50 | 3.00 | 6.00 | 2.50 | 0.00 | 16.00 | 9% |",
                    "| sglang-router | 2.50 | 0.00 | 5.00 | 0.00 | 0.00 | 7.50 | - |"]
    assert report.render_cpu([{"router": "random", "extra": {}}]) == []

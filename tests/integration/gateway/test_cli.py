"""The `prefixroute extproc` and `prefixroute gateway` commands as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import free_port, http_get, prefixroute_cmd, start_process
from helpers.fleet import MODEL, start_fleet
from helpers.waiting import until

pytestmark = pytest.mark.integration


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def test_extproc_prints_ready_line_and_stops_cleanly_on_sigterm(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 1, log_dir, prefix="x")
    port, metrics_port = free_port(), free_port()
    proc = stack.enter_context(start_process(
        prefixroute_cmd("extproc", "--port", str(port), "--listen-address", "127.0.0.1",
                        "--endpoints", fleet.endpoints[0], "--metrics-port", str(metrics_port), "--no-traces"),
        ready_port=port, log_dir=log_dir, name="extproc"))
    until(lambda: "ready on" in proc.log_tail(), 5, message=proc.log_tail)
    assert (f"prefixroute extproc ready on 127.0.0.1:{port} (policy prefix, index feedback, 1/1 endpoints healthy, "
            f"metrics http://127.0.0.1:{metrics_port}/metrics, traces off)") in proc.log_tail()
    status, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert status == 200 and b"prefixroute_decision_duration_seconds" in body
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=10) == 0


@pytest.mark.parametrize(("args", "message"), [
    ([], "no endpoints configured"),
    (["--endpoints", "nohost"], "nohost"),
    (["--endpoints", "127.0.0.1:1", "--policy", "fastest"], "policy"),
])
def test_extproc_rejects_bad_configuration_with_exit_2(args: list[str], message: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXROUTE_")}
    r = subprocess.run(prefixroute_cmd("extproc", "--port", "0", *args), capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr


def test_gateway_command_serves_and_stops_both_children_on_sigterm(stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="g")
    port = free_port()
    proc = stack.enter_context(start_process(
        prefixroute_cmd("gateway", "--port", str(port), "--ports", "random", "--endpoints", ",".join(fleet.endpoints)),
        ready_url=f"http://127.0.0.1:{port}/v1/models", log_dir=log_dir, name="gateway", timeout_s=30))
    status, body = http_get(f"http://127.0.0.1:{port}/v1/models")
    assert status == 200 and MODEL.encode() in body
    ready_line = f"prefixroute gateway ready: http://127.0.0.1:{port}"
    # Envoy may answer a moment before the launcher prints its line
    until(lambda: ready_line in proc.log_tail(), 10, message=proc.log_tail)
    line = next(x for x in proc.log_tail().splitlines() if x.startswith(ready_line))
    metrics_url = line.rsplit("metrics ", 1)[1].rstrip(")")
    status, body = http_get(metrics_url)  # the launcher picked a free port for the router's /metrics
    assert status == 200 and b"prefixroute_decisions_total" in body
    children = _children(proc.pid)
    assert len(children) == 2, children  # Envoy and the ext_proc service
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=15) == 0
    until(lambda: not any(_alive(c) for c in children), 5, message=lambda: f"children {children} gone")


@pytest.mark.slow
def test_overhead_bench_runs_and_prints_added_latency() -> None:
    r = subprocess.run(prefixroute_cmd("overhead-bench", "--mode", "latency", "--prompt-kb", "4",
                                       "--num-requests", "50", "--num-rounds", "1",
                                       "--num-connections", "4", "--rate-duration-s", "0.3"),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # Rows: "4 KB <config> <p50> <p99> <req/s>..."; split() gives ["4", "KB", config, p50, p99, rps, ...].
    rows = {line.split()[2]: line.split()[3:] for line in r.stdout.splitlines() if line.strip().startswith("4 KB")}
    assert set(rows) == {"baseline", "routed", "added"}
    base_p50, routed_p50 = float(rows["baseline"][0]), float(rows["routed"][0])
    assert float(rows["added"][0]) == pytest.approx(routed_p50 - base_p50, abs=0.002)
    assert float(rows["routed"][2]) > 0  # requests per second over the routed gateway


@pytest.mark.slow
def test_overhead_bench_itl_mode_prints_itl_with_telemetry_on_and_off() -> None:
    r = subprocess.run(prefixroute_cmd("overhead-bench", "--mode", "itl", "--num-rounds", "1", "--itl-streams", "3",
                                       "--itl-tokens", "10", "--itl-ms", "4"),
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()
            if line.strip().split(" ", 1)[0] in ("on", "off", "on/off")}
    assert set(rows) == {"on", "off", "on/off"}
    for name in ("on", "off"):
        p50, p99 = float(rows[name][0]), float(rows[name][1])
        assert 3.0 < p50 <= p99  # the upstream's 4 ms spacing comes through (gaps are never shorter on average)
    assert float(rows["on/off"][0].lstrip("x")) == pytest.approx(float(rows["on"][0]) / float(rows["off"][0]),
                                                                 abs=0.002)

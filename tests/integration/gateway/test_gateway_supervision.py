"""`prefixroute gateway` under crashes (issue 11, finding 5): a SIGKILLed ext_proc leaves Envoy running and
serving fail-open (round robin) until the ext_proc service is restarted and routes again; a SIGKILLed Envoy
is restarted on the same port; SIGTERM then leaves no process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import free_port, http_get, prefixroute_cmd
from helpers.fleet import chat_once, start_fleet
from helpers.leftovers import find_pid, kill_marked, marked_env, new_marker, wait_none_left
from helpers.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _chat(port: int, i: int) -> tuple[int, str]:
    return chat_once(port, f"question {i}")


def _decisions(metrics_port: int) -> float:
    """prefixroute_decisions_total summed over labels; -1 when the ext_proc service does not answer."""
    status, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
    if status != 200:
        return -1.0
    return sum(float(m.group(1)) for m in re.finditer(r"^prefixroute_decisions_total\{[^}]*\} ([0-9.e+]+)$",
                                                      body.decode(), re.M))


def test_gateway_keeps_serving_fail_open_while_ext_proc_restarts_and_restarts_envoy(
        stack: ExitStack, log_dir: Path) -> None:
    fleet = start_fleet(stack, 2, log_dir, prefix="g")
    port, metrics_port = free_port(), free_port()
    marker = new_marker()
    # Its children inherit its stdout/stderr (no log dir): one file holds everything it and they said.
    out = open(log_dir / "gateway-output.txt", "w")  # noqa: SIM115 - closed by the stack
    stack.callback(out.close)
    proc = subprocess.Popen(
        prefixroute_cmd("gateway", "--port", str(port), "--ports", "random", "--endpoints", ",".join(fleet.endpoints),
                        "--metrics-port", str(metrics_port), "--policy", "round-robin", "--no-telemetry",
                        "--expose-served-endpoint"),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=marked_env(marker))
    stack.callback(kill_marked, marker)

    def said() -> str:
        return (log_dir / "gateway-output.txt").read_text(errors="replace")

    until(lambda: "prefixroute gateway ready" in said() or proc.poll() is not None, 60, message=said)
    assert proc.poll() is None, said()
    for i in range(4):
        assert _chat(port, i)[0] == 200
    assert _decisions(metrics_port) >= 4

    results: list[tuple[float, int, str]] = []
    stop = threading.Event()
    stack.callback(stop.set)

    def client() -> None:
        i = 100
        while not stop.is_set():
            t0 = time.monotonic()
            results.append((t0, *_chat(port, i)))
            i += 1
            time.sleep(0.01)  # the client's pace

    t = threading.Thread(target=client, daemon=True)
    t.start()
    until(lambda: len(results) >= 3, 10, message="requests before the kill")
    killed_at = time.monotonic()
    os.kill(find_pid(marker, "extproc"), signal.SIGKILL)
    until(lambda: "extproc is back (restart 1" in said(), 20, interval_s=0.02, message=said)
    back_at = time.monotonic()
    until(lambda: sum(r[0] >= back_at for r in results) >= 3, 10, message="requests after the restart")
    stop.set()
    t.join(timeout=15)

    gap = [r for r in results if killed_at <= r[0] < back_at]
    assert len(gap) >= 3, (len(gap), said())  # requests were sent while ext_proc was down ...
    assert [r for r in gap if r[1] != 200] == [], gap  # ... and every one succeeded: fail-open round robin
    assert {r[2] for r in gap} == set(fleet.endpoints)
    assert "extproc exited with signal SIGKILL after " in said() and "restart 1 in 0.2 s" in said()
    assert proc.poll() is None  # the gateway (and its Envoy) stayed up
    # The new ext_proc routes again: its own decision counter (a fresh process) counts these requests.
    before = max(_decisions(metrics_port), 0.0)
    for i in range(5):
        assert _chat(port, 200 + i)[0] == 200
    assert _decisions(metrics_port) >= before + 5

    os.kill(find_pid(marker, "-c", "--disable-hot-restart"), signal.SIGKILL)  # Envoy
    until(lambda: "envoy is back (restart 1" in said(), 20, message=said)
    assert "envoy exited with signal SIGKILL after " in said()
    assert _chat(port, 300)[0] == 200

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, said()
    assert wait_none_left(marker, 3.0) == {}

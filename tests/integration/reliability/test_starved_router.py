"""A starved router ejects no healthy endpoint and answers no request 503, through real Envoy, the real ext_proc
process (uvloop, as deployed) and simulated servers.

The starvation: the router's own event loop is blocked 1.2 s at a time (past the 0.5 s probe timeout),
iteration after iteration, for 3 s, then runs freely for 1.5 s, four times (tests/helpers/loop_stall: a
test-only sitecustomize that stalls the loop of the ``prefixroute extproc`` process while a file exists). The
servers run in their own processes and answer /health in milliseconds throughout. On the code before probes were
judged against the router's loop lag, every endpoint was marked down in the first stalled stretch (a probe's
timer fires in the iteration after the stall, before its answer is read) and 1,321 of 2,176 requests got 503
"no healthy endpoint": the failure measured in front of real vLLM on a loaded host. Requests decided during a
stall may be answered late enough that Envoy fails them open (round robin, still 200): what matters is that none
is refused.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers.fleet import chat_once, start_fleet, start_gateway

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STALL_HELPER = Path(__file__).resolve().parents[2] / "helpers" / "loop_stall"
DOWN_RE = re.compile(r"endpoint (\S+) (?:is down after|marked down)")


def _metric_sum(port: int, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_router_whose_loop_stalls_ejects_nothing_and_refuses_nothing(tmp_path, monkeypatch):
    stall_file = tmp_path / "stall"
    monkeypatch.setenv("PYTHONPATH", f"{STALL_HELPER}:" + (__import__("os").environ.get("PYTHONPATH") or ""))
    monkeypatch.setenv("PREFIXROUTE_TEST_LOOP_STALL_FILE", str(stall_file))
    with ExitStack() as stack:
        fleet = start_fleet(stack, 3, tmp_path)
        gw = start_gateway(stack, fleet.endpoints, tmp_path)
        assert all(chat_once(gw.gateway.port, f"warm-up {i}")[0] == 200 for i in range(6))
        statuses: dict[int, int] = {}
        stop = threading.Event()
        lock = threading.Lock()

        def client(c: int) -> None:
            i = 0
            while not stop.is_set():
                status, _ = chat_once(gw.gateway.port, f"client {c} request {i}", timeout_s=20.0)
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1
                i += 1

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(4)]
        for t in threads:
            t.start()
        # The fixed sleeps pace the starvation on purpose (stalled 3 s, free 1.5 s, four times); nothing waits
        # here for a condition.
        for _ in range(4):
            stall_file.write_text("1.2")
            time.sleep(3.0)
            stall_file.unlink()
            time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(30)
        log = (tmp_path / "extproc.log").read_text()
        downs = DOWN_RE.findall(log)
        assert not downs, f"healthy endpoints marked down: {downs}\n{statuses}"
        assert statuses.get(503, 0) == 0 and set(statuses) == {200}, statuses
        assert sum(statuses.values()) >= 20, statuses
        discounted = _metric_sum(gw.metrics_port, "prefixroute_endpoint_probes_total", outcome="discounted_for_lag")
        ejections = _metric_sum(gw.metrics_port, "prefixroute_endpoint_ejections_total")
        stalled_s = _metric_sum(gw.metrics_port, "prefixroute_router_loop_stall_seconds_total")
        print(f"requests {statuses}; probes discounted for the loop's lag {discounted:.0f}; loop stalled "
              f"{stalled_s:.1f} s; ejections {ejections:.0f}")
        assert discounted >= 1 and stalled_s >= 4.0 and ejections == 0

"""`prefixroute bench` stopped by SIGTERM, SIGINT or SIGHUP mid-run (issue 11, finding 6) stops every process
it started (model servers, ext_proc, Envoy) and frees their ports before it exits with 128 + the signal."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from helpers.leftovers import kill_marked, listening, marked_env, marked_pids, new_marker, wait_none_left
from helpers.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# Small and slow enough that the signal lands while requests are being replayed (~20 s of arrivals).
SMALL = ["--workload", "shared-prompts", "--num-requests", "200", "--num-groups", "2", "--prefix-tokens", "512",
         "--question-tokens", "16", "--output-tokens", "4", "--rate-rps", "10", "--servers", "2",
         "--profile", "llama-3.1-8b-h200", "--server-args=--time-scale=0.2", "--no-progress",
         "--routers", "prefixroute:round-robin"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_bench_stopped_by_a_signal_leaves_no_process_and_no_port(tmp_path, sig):
    marker = new_marker()
    proc = subprocess.Popen([sys.executable, "-m", "prefixroute", "bench", *SMALL, "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=marked_env(marker))
    try:
        def envoy_up() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            return any("--disable-hot-restart" in cmd for cmd in marked_pids(marker).values())

        until(envoy_up, 60, message="the bench's gateway (Envoy) started")
        time.sleep(2.0)  # on purpose, past the router's settle time: requests are in flight when the signal comes
        children = marked_pids(marker)
        ports = {int(p) for cmd in children.values() for p in re.findall(r"--port (\d+)", cmd)}
        assert len(children) >= 4 and len(ports) >= 3, children  # 2 servers, ext_proc, Envoy (+ bench)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        left = wait_none_left(marker, 2.0)
        assert left == {}, f"{len(left)} processes left: {left}"
        assert [p for p in ports if listening(p)] == []
        assert proc.returncode == 128 + sig, err[-2000:]
        assert f"stopped by {sig.name}" in err
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(marker)

"""`prefixroute dashboard` for real: it serves, and stops cleanly on SIGTERM / SIGINT with its Streamlit child."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import pytest

from helpers.procs import free_port, prefixroute_cmd
from helpers.waiting import until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_real_launch_serves_then_stops_cleanly(tmp_path, sig):
    port = free_port()
    proc = subprocess.Popen(prefixroute_cmd("dashboard", "--db", str(tmp_path / "t.db"), "--port", str(port)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def serving() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    return r.read() == b"ok"
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                return False

        until(serving, 60, interval_s=0.2, message="the dashboard serving")
        proc.send_signal(sig)
        assert proc.wait(15) == 0
        # The Streamlit child went with it: the port is closed.
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

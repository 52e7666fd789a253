"""`prefixroute up` as a user runs it: readiness, a request through the gateway, the dashboard answering,
Ctrl-C stopping everything with no process or port left; and a clear error for a busy port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prefixroute.telemetry.store_reader import StoreReader

from helpers import free_ports
from helpers.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _pids_mentioning(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (our unique temp dir), this test excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry.name))
    return found


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are not listeners
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _up_cmd(tmp_path: Path, ports: list[int], *extra: str) -> list[str]:
    gw, tel, tel_http, dash, ms = ports
    return [sys.executable, "-m", "prefixroute", "up", "--servers", "2", "--ports", "random", "--port", str(gw),
            "--telemetry-port", str(tel), "--telemetry-http-port", str(tel_http),
            "--dashboard-port", str(dash), "--model-server-base-port", str(ms),
            "--state-dir", str(tmp_path / "state"), "--model-server-time-scale", "0.2", "--expose-served-endpoint",
            *extra]


def _contiguous_free_pair(avoid: tuple[int, ...] = ()) -> int:
    """A port whose next one is free too, neither of them in `avoid` (ports handed out, not bound yet)."""
    for _ in range(50):
        (base,) = free_ports(1)
        if base not in avoid and base + 1 not in avoid and not _listening(base + 1):
            return base
    raise RuntimeError("no two adjacent free ports")


def test_up_serves_and_stops_clean(tmp_path):
    gw, tel, tel_http, dash = free_ports(4)
    ms = _contiguous_free_pair((gw, tel, tel_http, dash))
    ports = [gw, tel, tel_http, dash, ms]
    cwd = tmp_path / "cwd"  # where a user runs it: nothing may be written there
    cwd.mkdir()
    proc = subprocess.Popen(_up_cmd(tmp_path, ports), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=cwd)
    out_lines: list[str] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out_lines.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        summary = "".join(out_lines)
        assert "prefixroute is up" in summary, summary + _logs(tmp_path)
        assert f"http://127.0.0.1:{gw}" in summary and f"http://127.0.0.1:{dash}" in summary
        assert "Envoy admin off" in summary  # off by default: no port (it said 127.0.0.1:0)
        run_id = re.search(r"prefixroute is up \(run (\S+)\)", summary).group(1)

        body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hello " * 50}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            served = r.headers.get("x-gateway-destination-endpoint-served")
            reply = json.loads(r.read())
        assert served in {f"127.0.0.1:{ms}", f"127.0.0.1:{ms + 1}"}
        assert reply["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{dash}/_stcore/health", timeout=10) as r:
            assert r.status == 200
        # The request is stored in the state folder, marked with this run (the span arrives within a second).
        def stored_runs() -> list[dict]:
            with StoreReader(tmp_path / "state" / "telemetry.db") as reader:
                return reader.runs()

        def with_the_request() -> list[dict] | None:
            runs = stored_runs()
            return runs if runs and runs[0]["num_requests"] else None

        runs = until(with_the_request, 15, interval_s=0.2, message=lambda: f"the request stored ({stored_runs()})")
        assert [(r["run_id"], r["num_requests"]) for r in runs] == [(run_id, 1)], runs
        logs = tmp_path / "state" / "logs"
        assert {p.name for p in logs.iterdir()} >= {
            "telemetry.log", "extproc.log", "envoy.log", "dashboard.log", "model-server-0.log", "telemetry.token"}
        # A clean start says so at INFO: no component logs a warning or an error for it.
        said = {f.name: f.read_text(errors="replace") for f in logs.glob("*.log")}
        assert " INFO model server server-0 listening on " in said["model-server-0.log"]
        alarming = {name: [ln for ln in text.splitlines() if re.search(r"\b(WARNING|ERROR|CRITICAL)\b|\]\[(warning|error|critical)\]", ln)]
                    for name, text in said.items()}
        assert not any(alarming.values()), alarming

        # A second stack on the same state folder (its own ports) is refused before it starts anything: it
        # would share the store, append to the logs and overwrite the token.
        token = (logs / "telemetry.token").read_text()
        second = subprocess.run(_up_cmd(tmp_path, [*free_ports(4), _contiguous_free_pair(tuple(ports))]),
                                capture_output=True, text=True, timeout=60, cwd=cwd)
        assert second.returncode == 1, second.stdout + second.stderr
        assert "is in use by another running stack" in second.stderr and "--state-dir" in second.stderr
        assert f"API on port {gw}" in second.stderr
        assert (logs / "telemetry.token").read_text() == token

        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        stop_s = time.monotonic() - t0
        assert proc.returncode == 0, "".join(out_lines) + proc.stdout.read()
        assert stop_s < 10.0
        until(lambda: _pids_mentioning(str(tmp_path)) == [], 5, message=lambda: _pids_mentioning(str(tmp_path)))
        until(lambda: not [p for p in ports + [ms + 1] if _listening(p)], 5,
              message=lambda: f"ports freed after stop (still bound: {[p for p in ports + [ms + 1] if _listening(p)]})")
        assert list(cwd.iterdir()) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _pids_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_busy_port_is_named(tmp_path):
    gw, tel, tel_http, dash = free_ports(4)
    ms = _contiguous_free_pair((gw, tel, tel_http, dash))
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", gw))
        blocker.listen()
        proc = subprocess.run(_up_cmd(tmp_path, [gw, tel, tel_http, dash, ms]), capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 1
    assert f"gateway: port {gw} is already in use" in proc.stderr
    assert "choose another with --port," in proc.stderr  # the flag that moves it
    assert _pids_mentioning(str(tmp_path)) == []


def _logs(tmp_path: Path) -> str:
    out = []
    for f in sorted((tmp_path / "state" / "logs").glob("*.log")):
        out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:]))
    return "\n".join(out)


def test_up_in_front_of_existing_endpoints_prints_a_curl_for_the_model_they_serve(tmp_path):
    """`up --endpoints` (servers it does not start, no demo load) suggests a curl whose model is the one the
    endpoints list in /v1/models, not the simulated servers' default name; that request succeeds as printed."""
    from helpers.procs import prefixroute_cmd, start_process

    gw, tel, tel_http, dash, ms = free_ports(5)
    with start_process(prefixroute_cmd("model-server", "--port", str(ms), "--id", "elsewhere", "--time-scale", "0.05",
                                       "--served-model-name", "org/served-elsewhere"),
                       ready_url=f"http://127.0.0.1:{ms}/health", log_dir=tmp_path):
        cmd = [sys.executable, "-m", "prefixroute", "up", "--endpoints", f"127.0.0.1:{ms}", "--ports", "random",
               "--port", str(gw), "--telemetry-port", str(tel), "--telemetry-http-port", str(tel_http),
               "--dashboard-port", str(dash), "--no-dashboard", "--state-dir", str(tmp_path / "state")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out_lines: list[str] = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                out_lines.append(line)
                if line.startswith("Ctrl-C stops everything"):
                    break
            summary = "".join(out_lines)
            m = re.search(r"try: curl (\S+) -H 'content-type: application/json' -d '(.*)'$", summary, re.M)
            assert m, summary + _logs(tmp_path)
            body = json.loads(m.group(2))
            assert body["model"] == "org/served-elsewhere", body
            req = urllib.request.Request(m.group(1), data=json.dumps({**body, "max_tokens": 2}).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200 and json.loads(r.read())["model"] == "org/served-elsewhere"
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=20)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)

"""The process manager (common/procs.py) with real child processes: process groups, logs, readiness that
fails fast, busy ports, stop order and bounds, restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixroute.procs import ManagedProcess, PortBusy, ProcessGroup, StartupError, stop_group, tcp_open


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent, which may be gone too) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


SERVE = """
import signal, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("listening", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True: time.sleep(1)
"""


def test_child_logs_and_is_ready_once_it_serves(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    p = ManagedProcess("srv", [*py(SERVE), str(port)], log_path=tmp_path / "logs" / "srv.log",
                       ready=lambda: tcp_open(port), ports=(port,))
    p.spawn().wait_ready(10)
    try:
        assert p.alive() and os.getpgid(p.pid) == p.pid  # leads its own process group
        wait_for(lambda: "listening" in p.log_tail())
        other = ManagedProcess("other", py("pass"), ports=(port,))
        with pytest.raises(PortBusy, match=rf"^other: port {port} is already in use"):
            other.spawn()
        assert other.popen is None  # nothing was started
    finally:
        assert p.stop() == 0  # its SIGTERM handler ran: a clean exit
    assert not p.alive() and not tcp_open(port)


def test_a_child_that_exits_while_starting_fails_fast_with_its_status_and_log_tail(tmp_path):
    p = ManagedProcess("broken", py("import sys; print('bad config: x'); sys.exit(3)"), log_path=tmp_path / "b.log",
                       ready=lambda: False)
    t0 = time.monotonic()
    with pytest.raises(StartupError) as info:
        p.spawn().wait_ready(30)
    assert time.monotonic() - t0 < 5  # not the 30 s timeout
    assert str(info.value).startswith("broken exited with status 3 while starting; last lines of ")
    assert "bad config: x" in str(info.value)


def test_a_child_that_never_gets_ready_times_out_naming_it(tmp_path):
    p = ManagedProcess("slow", py("import time; time.sleep(30)"), log_path=tmp_path / "s.log", ready=lambda: False)
    try:
        with pytest.raises(StartupError, match=r"^slow not ready after 0.3 s \(log .*s.log is empty\)"):
            p.spawn().wait_ready(0.3)
    finally:
        p.stop()


def test_stop_kills_the_whole_group_even_a_child_that_ignores_sigterm(tmp_path):
    # The child starts a grandchild and ignores SIGTERM: stop must SIGKILL both after the grace period.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(g.pid, flush=True); time.sleep(60)")
    p = ManagedProcess("stubborn", py(code), log_path=tmp_path / "st.log").spawn()
    wait_for(lambda: p.log_tail().strip().isdigit())
    grandchild = int(p.log_tail().strip())
    t0 = time.monotonic()
    assert p.stop(grace_s=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 5
    wait_for(lambda: not pid_alive(grandchild))


def test_a_group_stops_its_children_last_started_first_and_as_a_context_manager(tmp_path):
    order = tmp_path / "order"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye)\n"
            "print('up', flush=True)\n"
            "while True: time.sleep(1)\n")
    with pytest.raises(KeyError):  # leaving on an exception still stops every child
        with ProcessGroup(tmp_path / "logs", grace_s=5.0) as group:
            procs = [group.start(name, [*py(code), name], wait=False) for name in ("a", "b", "c")]
            for p in procs:
                wait_for(lambda p=p: "up" in p.log_tail())
            assert group.first_exited() is None
            raise KeyError("boom")
    assert order.read_text().split() == ["c", "b", "a"]
    assert not any(p.alive() for p in procs) and group.procs == []
    assert (tmp_path / "logs" / "a.log").read_text().strip() == "up"


def test_stop_all_stays_within_its_grace_period_when_children_hang(tmp_path):
    group = ProcessGroup(tmp_path, grace_s=0.5)
    hang = py("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
              "time.sleep(60)")
    procs = [group.start(f"h{i}", hang, wait=False) for i in range(3)]
    for p in procs:
        wait_for(lambda p=p: "up" in p.log_tail())
    t0 = time.monotonic()
    group.stop_all()
    assert time.monotonic() - t0 < 2.5  # one shared grace period, not one per child
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3


def test_first_exited_and_a_restart_in_place(tmp_path):
    with ProcessGroup(tmp_path) as group:
        keeper = group.start("keeper", py("import time; time.sleep(60)"))
        once = group.start("once", py("print('ran')"))
        wait_for(lambda: group.first_exited() is once)
        assert once.returncode == 0
        with pytest.raises(RuntimeError, match="already running"):
            keeper.spawn()
        group.add(once)  # spawned again: same argv, same log, same place in the stop order
        wait_for(lambda: once.returncode == 0)
        assert once.num_spawns == 2 and once.log_tail().split() == ["ran", "ran"]
        assert group.procs == [keeper, once]


def test_stop_group_stops_a_child_outside_its_own_group_without_touching_ours():
    # A plain Popen shares our process group: only the child may be signalled (killpg would hit this test).
    proc = subprocess.Popen(py("import time; time.sleep(60)"))
    assert os.getpgid(proc.pid) == os.getpgid(0)
    assert stop_group(proc, grace_s=5.0) == -signal.SIGTERM
    assert stop_group(proc) == -signal.SIGTERM  # idempotent

"""The process manager (common/procs.py) with real child processes: process groups, logs, readiness that
fails fast, busy ports, stop order and bounds, restarts, supervision with backoff, parent-death signals, stop signals."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.waiting import until
from prefixroute.procs import (ManagedProcess, PortBusy, ProcessGroup, RestartPolicy, StartupError, Stopped, Supervisor,
                               parent_death_preexec, stop_group, stop_on_signals, tcp_open)

pytestmark = pytest.mark.integration


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent, which may be gone too) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


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
        until(lambda: "listening" in p.log_tail(), 10, interval_s=0.02)
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
    until(lambda: p.log_tail().strip().isdigit(), 10, interval_s=0.02)
    grandchild = int(p.log_tail().strip())
    t0 = time.monotonic()
    assert p.stop(grace_s=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 5
    until(lambda: not pid_alive(grandchild), 10, interval_s=0.02)


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
                until(lambda p=p: "up" in p.log_tail(), 10, interval_s=0.02)
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
        until(lambda p=p: "up" in p.log_tail(), 10, interval_s=0.02)
    t0 = time.monotonic()
    group.stop_all()
    assert time.monotonic() - t0 < 2.5  # one shared grace period, not one per child
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 3


def test_first_exited_and_a_restart_in_place(tmp_path):
    with ProcessGroup(tmp_path) as group:
        keeper = group.start("keeper", py("import time; time.sleep(60)"))
        once = group.start("once", py("print('ran')"))
        until(lambda: group.first_exited() is once, 10, interval_s=0.02)
        assert once.returncode == 0
        with pytest.raises(RuntimeError, match="already running"):
            keeper.spawn()
        group.add(once)  # spawned again: same argv, same log, same place in the stop order
        until(lambda: once.returncode == 0, 10, interval_s=0.02)
        assert once.num_spawns == 2 and once.log_tail().split() == ["ran", "ran"]
        assert group.procs == [keeper, once]


def test_stop_group_stops_a_child_outside_its_own_group_without_touching_ours():
    # A plain Popen shares our process group: only the child may be signalled (killpg would hit this test).
    proc = subprocess.Popen(py("import time; time.sleep(60)"))
    assert os.getpgid(proc.pid) == os.getpgid(0)
    assert stop_group(proc, grace_s=5.0) == -signal.SIGTERM
    assert stop_group(proc) == -signal.SIGTERM  # idempotent


# ------------------------------------------------------------------------------------------- supervision

FAST = RestartPolicy(initial_delay_s=0.05, max_delay_s=0.2, reset_after_s=60.0, ready_timeout_s=5.0)


def supervise(group: ProcessGroup, policy: RestartPolicy, seconds: float, out: io.StringIO) -> Supervisor:
    """Run the supervisor for `seconds` on purpose: the tests read the delays it chose over that window."""
    sup = Supervisor(group, policy, label="test", out=out)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sup.poll()
        time.sleep(0.01)
    return sup


def test_a_crashing_child_is_restarted_with_doubling_delays_up_to_the_cap_and_never_given_up(tmp_path):
    out = io.StringIO()
    with ProcessGroup(tmp_path) as group:
        crasher = group.start("crasher", py("print('bad config: y'); raise SystemExit(3)"), wait=False)
        until(lambda: not crasher.alive(), 10, interval_s=0.02)
        sup = supervise(group, FAST, 1.5, out)
        lines = out.getvalue().splitlines()
        scheduled = [ln for ln in lines if " in " in ln and "restart" in ln and "exited" in ln]
        # 0.05, 0.1, 0.2, 0.2, ...: doubling, capped, and still retrying after many failures
        assert scheduled[0].startswith("test: crasher exited with status 3 after ")
        assert "restart 1 in 0.05 s; last lines of " in scheduled[0] and "bad config: y" in out.getvalue()
        assert "restart 2 in 0.1 s (crash loop: backing off)" in scheduled[1]
        assert all("in 0.2 s (crash loop" in ln for ln in scheduled[2:]), scheduled
        assert sup.num_restarts(crasher) >= 5 and crasher.num_spawns == sup.num_restarts(crasher) + 1
        assert "restarted (restart 1, pid " in out.getvalue()


def test_the_delay_resets_once_a_child_stayed_up_long_enough(tmp_path):
    out = io.StringIO()
    policy = dataclasses.replace(FAST, reset_after_s=0.3)
    # lives 0.5 s (longer than reset_after_s) then crashes: every restart is a first failure again
    with ProcessGroup(tmp_path) as group:
        group.start("flaky", py("import time; time.sleep(0.5); raise SystemExit(1)"), wait=False)
        supervise(group, policy, 2.0, out)
    delays = [ln.split(" in ")[-1].split(" s")[0] for ln in out.getvalue().splitlines() if "exited with" in ln]
    assert len(delays) >= 2 and set(delays) == {"0.05"}, out.getvalue()


def test_a_restart_counts_as_up_only_once_its_ready_check_passes(tmp_path):
    flag = tmp_path / "ready"
    out = io.StringIO()
    with ProcessGroup(tmp_path) as group:
        p = group.start("srv", py("import time; time.sleep(60)"), ready=flag.exists, wait=False)
        flag.touch()
        sup = Supervisor(group, FAST, label="test", out=out)
        sup.poll()
        os.kill(p.pid, signal.SIGKILL)  # a crash: from elsewhere, not ManagedProcess.kill
        flag.unlink()
        until(lambda: (sup.poll(), sup.num_restarts(p) == 1 and p.alive())[1], 10, interval_s=0.02)
        for _ in range(20):  # supervises a while on purpose: "is back" must not be said meanwhile
            sup.poll()
            time.sleep(0.01)
        assert "srv exited with signal SIGKILL" in out.getvalue()
        assert "is back" not in out.getvalue()  # restarted, but not ready
        flag.touch()
        sup.poll()
        assert "test: srv is back (restart 1, pid " in out.getvalue()


def test_a_restart_that_never_gets_ready_is_killed_and_retried(tmp_path):
    out = io.StringIO()
    with ProcessGroup(tmp_path) as group:
        p = group.start("stuck", py("import time; time.sleep(60)"), ready=lambda: False, wait=False)
        sup = Supervisor(group, dataclasses.replace(FAST, ready_timeout_s=0.2), label="test", out=out)
        sup.poll()
        os.kill(p.pid, signal.SIGKILL)
        until(lambda: (sup.poll(), sup.num_restarts(p) >= 2)[1], 10, interval_s=0.02)
    assert "stuck not ready 0.2 s after its restart (killed); restart 2 in 0.1 s" in out.getvalue()


def test_a_child_stopped_on_purpose_is_never_restarted(tmp_path):
    out = io.StringIO()
    with ProcessGroup(tmp_path) as group:
        a = group.start("a", py("import time; time.sleep(60)"))
        b = group.start("b", py("import time; time.sleep(60)"))
        sup = Supervisor(group, FAST, label="test", out=out)
        sup.poll()
        a.stop()
        b.kill()
        for _ in range(30):  # supervises a while on purpose: nothing may be restarted meanwhile
            sup.poll()
            time.sleep(0.01)
        assert not a.alive() and not b.alive() and a.num_spawns == b.num_spawns == 1
        group.add(a)  # its owner starts it again: watched again from here
        sup.poll()
        os.kill(a.pid, signal.SIGKILL)
        until(lambda: (sup.poll(), a.num_spawns == 3)[1], 10, interval_s=0.02)
    sup.poll()  # after stop_all: nothing to restart, nothing said
    assert out.getvalue().count("exited with") == 1 and a.returncode is not None


def test_children_die_with_their_parent_even_when_it_is_sigkilled(tmp_path):
    # A launcher (a Python process using ManagedProcess) starts a child, then is SIGKILLed: no cleanup code
    # runs, yet the child must go (PR_SET_PDEATHSIG).
    launcher = ("import sys, time; from prefixroute.procs import ManagedProcess; "
                "p = ManagedProcess('c', [sys.executable, '-c', 'import time; time.sleep(60)']).spawn(); "
                "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen(py(launcher), stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=5)
        until(lambda: not pid_alive(child), 5, interval_s=0.02)
    finally:
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(child, signal.SIGKILL)


def test_parent_death_signal_fires_even_if_the_parent_died_before_the_child_set_it():
    # The race the preexec closes: a "parent pid" that is not ours stands for a parent already gone.
    preexec = parent_death_preexec()
    assert preexec is not None  # Linux
    real_getpid = os.getpid
    os.getpid = lambda: 1  # noqa: E731 - what the child compares os.getppid() with
    try:
        racy = parent_death_preexec()
    finally:
        os.getpid = real_getpid
    proc = subprocess.Popen(py("import time; time.sleep(30)"), preexec_fn=racy)
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_stop_on_signals_raises_once_and_ignores_repeats_during_cleanup():
    cleaned = []
    with pytest.raises(Stopped) as info:
        with stop_on_signals((signal.SIGTERM, signal.SIGHUP)) as got:
            try:
                os.kill(os.getpid(), signal.SIGHUP)
                time.sleep(5)  # interrupted at once
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # ignored: the cleanup completes
                time.sleep(0.05)  # on purpose: the second signal arrives during the cleanup and is ignored
                cleaned.append(True)
    assert info.value.signum == signal.SIGHUP and got["signal"] == signal.SIGHUP and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_free_ports_are_distinct_outside_the_ephemeral_range_and_bindable():
    """Ports from bind(0) lie in the ephemeral range, where an outgoing connection can take one before the
    server binds it (a flaky "port busy" seen in CI): free_ports draws outside it, never twice."""
    import socket

    from prefixroute.procs import _ephemeral_port_range, free_ports

    lo, hi = _ephemeral_port_range()
    first, second = free_ports(30), free_ports(30)
    assert len(set(first + second)) == 60
    assert all(p < lo or p > hi for p in first + second)
    for p in first[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


# --- issue 27 ---------------------------------------------------------------------------------------------------
def test_a_member_that_runs_but_fails_its_live_probe_is_killed_and_restarted(tmp_path):
    """A process alive but no longer serving (Envoy after /drain_listeners) is treated as crashed."""
    out = io.StringIO()
    serving = {"ok": True}
    with ProcessGroup(tmp_path) as group:
        p = group.add(ManagedProcess("srv", py("import time; time.sleep(60)"), live=lambda: serving["ok"]),
                      wait=False)
        policy = dataclasses.replace(FAST, live_interval_s=0.02, live_failures=3)
        sup = Supervisor(group, policy, label="test", out=out)
        for _ in range(10):  # supervises a while on purpose: a serving member is left alone
            sup.poll()
            time.sleep(0.02)
        old = p.pid
        assert "stopped serving" not in out.getvalue()
        serving["ok"] = False
        until(lambda: (sup.poll(), "stopped serving (3 health probes in a row failed; killed)"
                          in out.getvalue())[1], 10, interval_s=0.02)
        serving["ok"] = True
        until(lambda: (sup.poll(), p.pid != old and p.alive())[1], 10, interval_s=0.02)
        assert not pid_alive(old)


def test_logs_are_private(tmp_path):
    log = tmp_path / "new" / "x.log"
    p = ManagedProcess("x", py("print('hi')"), log_path=log)
    p.spawn().popen.wait(5)
    assert (log.stat().st_mode & 0o777, log.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    log.chmod(0o644)
    p.spawn().popen.wait(5)  # an existing log is tightened
    assert log.stat().st_mode & 0o777 == 0o600 and log.read_text().count("hi") == 2


def test_a_held_listener_keeps_the_port_across_its_childs_death_and_resets_what_waits(tmp_path):
    from prefixroute.procs import held_listener, reset_pending

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = held_listener(port)
    try:
        code = ("import socket, sys; s = socket.socket(fileno=int(sys.argv[1])); c, _ = s.accept(); "
                "c.sendall(b'child'); c.close()")
        child = subprocess.Popen([*py(code), str(sock.fileno())], pass_fds=(sock.fileno(),))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            assert c.recv(10) == b"child"
        child.wait(5)
        with pytest.raises(PortBusy):  # the child is gone, the port is not free
            held_listener(port)
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        waiting = socket.create_connection(("127.0.0.1", port), timeout=5)
        time.sleep(0.05)  # on purpose: a moment for the kernel to queue it (no signal says when it has)
        assert reset_pending(sock) == 1
        with pytest.raises(ConnectionResetError):
            waiting.recv(10)  # as on a closed port: the client fails over at once
        waiting.close()
    finally:
        sock.close()

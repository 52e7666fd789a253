"""Restarting crashed children: `Supervisor` restarts the members of a `ProcessGroup` (procs.py) that crash, with
exponential backoff (`RestartPolicy`: 0.2 s, doubling to 15 s, reset once a child has stayed up 30 s; it never
gives up, like Kubernetes' CrashLoopBackOff), waiting for each restarted child's readiness check before counting it
up again, and says so on stderr. No thread: the launcher's loop calls `Supervisor.poll` a few times a second. A
child stopped on purpose (`stop`, `kill`, `stop_all`) is never restarted.

Liveness: a member may have a `live` probe (`ManagedProcess.live`, e.g. Envoy's health route through
its own listener); the supervisor runs it every `RestartPolicy.live_interval_s` while the member is up and restarts
a member that fails it `live_failures` times in a row: a process that runs but no longer serves (Envoy after an
admin ``/drain_listeners``) is treated as crashed.

Not thread-safe: a supervisor is driven from the launcher's thread.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TextIO

from prefixroute.procs import ManagedProcess, ProcessGroup, describe_status, stop_group


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a `Supervisor` restarts a crashed child: after `initial_delay_s`, doubling with each failure in a
    row (an exit, or a restart that exits or is not ready within `ready_timeout_s`) up to `max_delay_s`,
    and back to `initial_delay_s` once the child has stayed up `reset_after_s`. It never gives up.

    0.2 s: a one-off crash (the common case) costs well under a second of downtime; 15 s: a child that
    crashes at once in a loop (bad config, a port taken by someone else) costs a few spawns a minute and one
    line each; 30 s up counts as recovered (a child that crashes every minute still starts at 0.2 s)."""

    initial_delay_s: float = 0.2
    max_delay_s: float = 15.0
    reset_after_s: float = 30.0
    ready_timeout_s: float = 60.0
    live_interval_s: float = 1.0
    live_failures: int = 3
    """A member with a `live` probe is probed every `live_interval_s` while up; `live_failures` failures in a row
    (3 s by default: no restart on one slow answer) and it is killed and restarted like a crashed one."""

    def delay_s(self, num_failures: int) -> float:
        """The wait before the restart that follows `num_failures` (>= 1) failures in a row."""
        return min(self.max_delay_s, self.initial_delay_s * 2.0 ** max(0, num_failures - 1))


@dataclasses.dataclass
class _Watch:
    state: str  # "up" (ready), "waiting" (to restart at `due`), "starting" (spawned at `since`), "stopped"
    since: float
    due: float = 0.0
    num_failures: int = 0  # in a row: sets the delay
    num_restarts: int = 0  # in all
    next_probe: float = 0.0  # when its `live` probe runs next
    num_probe_failures: int = 0  # in a row


class Supervisor:
    """Restarts crashed members of `group` per `policy` and says so on `out` (default: stderr), each line
    starting with `label`. Call `poll` from the launcher's loop (every 0.1-0.25 s) once the members have
    started; it never blocks longer than one readiness check of a restarting child.

    A member that was stopped on purpose (`ManagedProcess.stop`/`kill`, `ProcessGroup.stop_all`) is left
    alone, and watched again once something spawns it. A restart kills what is left of the crashed child's
    process group first (a grandchild could hold its port), keeps its argv, log and place in the stop order,
    and counts it up again only when its readiness check passes."""

    def __init__(self, group: ProcessGroup, policy: RestartPolicy = RestartPolicy(), *, label: str = "prefixroute",
                 out: TextIO | None = None) -> None:
        self.group = group
        self.policy = policy
        self.label = label
        self.out = out
        self._watches: dict[int, _Watch] = {}

    def num_restarts(self, proc: ManagedProcess) -> int:
        """Restarts of `proc` so far (spawns by this supervisor, successful or not)."""
        w = self._watches.get(id(proc))
        return w.num_restarts if w is not None else 0

    def _say(self, msg: str) -> None:
        print(f"{self.label}: {msg}", file=self.out if self.out is not None else sys.stderr, flush=True)

    def poll(self) -> None:
        """Check every member once: note crashes, start restarts that are due, promote ready restarts."""
        now = time.monotonic()
        members = list(self.group.procs)
        live_ids = {id(p) for p in members}
        for key in [k for k in self._watches if k not in live_ids]:
            del self._watches[key]  # stop_all emptied the group: forget
        for proc in members:
            if proc.popen is None:
                continue  # never started
            w = self._watches.get(id(proc))
            if w is None:  # up since it was started (the launcher waited for it to be ready)
                w = self._watches[id(proc)] = _Watch("up", min(now, proc.started_at or now))
            if proc.stopped_on_purpose:
                w.state = "stopped"
                continue
            if w.state == "stopped":  # spawned again by its owner
                w.state, w.since, w.num_failures = "up", now, 0
                continue
            if w.state == "up":
                if not proc.alive():
                    up_s = now - w.since
                    if up_s >= self.policy.reset_after_s:
                        w.num_failures = 0
                    self._schedule(proc, w, now, f"exited with {describe_status(proc.returncode)} after "
                                                 f"{up_s:.1f} s up")
                elif proc.live is not None and now >= w.next_probe:
                    w.next_probe = now + self.policy.live_interval_s
                    if proc.live():
                        w.num_probe_failures = 0
                    else:
                        w.num_probe_failures += 1
                        if w.num_probe_failures >= self.policy.live_failures:
                            w.num_probe_failures = 0
                            stop_group(proc.popen, 0.0)  # runs but no longer serves: a crash, restarted as one
                            if now - w.since >= self.policy.reset_after_s:
                                w.num_failures = 0
                            self._schedule(proc, w, now, f"stopped serving ({self.policy.live_failures} health "
                                                         "probes in a row failed; killed)")
            elif w.state == "waiting":
                if now >= w.due:
                    self._restart(proc, w, now)
            elif w.state == "starting":
                if not proc.alive():
                    self._schedule(proc, w, now, f"exited with {describe_status(proc.returncode)} while "
                                                 "restarting")
                elif proc.ready is None or proc.ready():
                    w.state, w.since = "up", time.monotonic()
                    w.next_probe, w.num_probe_failures = w.since + self.policy.live_interval_s, 0
                    self._say(f"{proc.name} is back (restart {w.num_restarts}, pid {proc.pid}, ready "
                              f"{w.since - w.due:.1f} s after its restart)")
                elif now - w.since > self.policy.ready_timeout_s:
                    stop_group(proc.popen, 0.0)
                    self._schedule(proc, w, now, f"not ready {self.policy.ready_timeout_s:g} s after its restart "
                                                 "(killed)")

    def _schedule(self, proc: ManagedProcess, w: _Watch, now: float, what: str) -> None:
        w.num_failures += 1
        delay = self.policy.delay_s(w.num_failures)
        w.state, w.due = "waiting", now + delay
        # The log's tail once per streak of failures: it explains the first; the rest repeat it.
        detail = proc.log_excerpt() if w.num_failures == 1 else (f" (log {proc.log_path})" if proc.log_path else "")
        self._say(f"{proc.name} {what}; restart {w.num_restarts + 1} in {delay:.3g} s"
                  f"{' (crash loop: backing off)' if w.num_failures > 1 else ''}{detail}")

    def _restart(self, proc: ManagedProcess, w: _Watch, now: float) -> None:
        stop_group(proc.popen, 0.0)  # leftovers of its group; not proc.stop(): this is no stop on purpose
        w.num_restarts += 1
        try:
            proc.spawn()
        except (RuntimeError, OSError) as exc:  # PortBusy (someone took its port), an exec failure
            self._schedule(proc, w, now, f"could not be restarted: {exc}")
            return
        w.state, w.since, w.due = "starting", now, now
        self._say(f"{proc.name} restarted (restart {w.num_restarts}, pid {proc.pid}); waiting until it is ready")

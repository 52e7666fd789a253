"""`prefixroute up` as a child of a test, with every port fixed so each component can be found and faulted,
and a load generator that records what each request saw.

Contract:
- `LocalStack(tmp_path, num_servers=...)` is a context manager: it starts `prefixroute up` (its own session,
  no dashboard, no demo traffic unless asked), waits for the summary line, and on exit sends SIGINT, waits,
  then SIGKILLs whatever is left of the session and of the processes listening on its ports. `pid_of(port)`
  finds the process listening on a port through /proc (the stack's children are our grandchildren).
- `LoadGenerator` sends streamed chat requests open-loop at a fixed rate; each `Outcome` says whether the
  response had started (status 200 and headers received) before anything failed. "Lost" = failed before
  it started: what the reliability suite requires to be zero.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection
from pathlib import Path

from helpers.procs import free_ports

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _socket_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(inode)
    return inodes


def pid_of(port: int, exclude: frozenset[int] = frozenset()) -> int | None:
    """The pid of the process listening on 127.0.0.1/0.0.0.0 `port` (None when nothing listens), other than
    those in `exclude` (`prefixroute up` itself holds its model servers' listening sockets)."""
    inodes = _socket_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude:
            continue
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    if os.readlink(fd) in targets:
                        return int(entry.name)
                except OSError:
                    continue
        except OSError:
            continue
    return None


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`, in Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class LocalStack:
    """`prefixroute up` with fixed ports; see the module docstring."""

    def __init__(self, tmp_path: Path, *, num_servers: int = 3, time_scale: float = 0.2, extra: tuple[str, ...] = ()):
        self.tmp_path = tmp_path
        self.num_servers = num_servers
        (self.gateway_port, self.telemetry_port, self.telemetry_http_port, self.extproc_port, self.admin_port,
         self.metrics_port) = free_ports(6)
        self.server_ports = _contiguous_free(num_servers, avoid=self.ports_named())
        self.log_dir = tmp_path / "logs"
        self.db = tmp_path / "telemetry.db"
        self.argv = [sys.executable, "-m", "prefixroute", "up", "--servers", str(num_servers), "--ports", "random",
                     "--no-dashboard", "--port", str(self.gateway_port),
                     "--telemetry-port", str(self.telemetry_port), "--telemetry-http-port", str(self.telemetry_http_port),
                     "--extproc-port", str(self.extproc_port), "--admin-port", str(self.admin_port),
                     "--metrics-port", str(self.metrics_port), "--model-server-base-port", str(self.server_ports[0]),
                     "--log-dir", str(self.log_dir), "--db", str(self.db),
                     "--model-server-time-scale", str(time_scale), "--expose-served-endpoint", *extra]
        self.proc: subprocess.Popen | None = None
        self.output: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def ports_named(self) -> list[int]:
        """The ports passed by flag (free, not yet bound: a range chosen after them must step around them)."""
        return [self.gateway_port, self.telemetry_port, self.telemetry_http_port, self.extproc_port,
                self.admin_port, self.metrics_port]

    def ports(self) -> list[int]:
        return [*self.ports_named(), *self.server_ports]

    def __enter__(self) -> LocalStack:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line)
            if line.startswith("Ctrl-C stops everything"):
                break
        if not any(line.startswith("prefixroute is up") for line in self.output):
            self.__exit__(None, None, None)
            raise RuntimeError("prefixroute up did not start:\n" + "".join(self.output) + self.logs())
        # Keep reading its output (supervision messages) so the pipe never fills.
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for pid in [self.proc.pid, *[p for p in map(pid_of, self.ports()) if p]]:
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def pid(self, component: str) -> int | None:
        """pid of "envoy", "extproc", "telemetry" or "server-i"."""
        port = {"envoy": self.gateway_port, "extproc": self.extproc_port,
                "telemetry": self.telemetry_port}.get(component)
        if port is None:
            port = self.server_ports[int(component.rsplit("-", 1)[1])]
        return pid_of(port, frozenset({self.proc.pid}) if self.proc is not None else frozenset())

    def router_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def logs(self) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(out)


def _contiguous_free(n: int, avoid: Collection[int] = ()) -> list[int]:
    """`n` adjacent ports free now and none of `avoid` (ports already handed out but not bound yet: a bind test
    alone passes them, and `prefixroute up` then found its telemetry port inside the servers' range)."""
    import socket

    for _ in range(100):
        (base,) = free_ports(1)
        ok = not any(base <= p < base + n for p in avoid)
        for p in range(base, base + n) if ok else ():
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return list(range(base, base + n))
    raise RuntimeError(f"no {n} adjacent free ports")


@dataclasses.dataclass
class Outcome:
    sent_at: float
    status: int | None = None
    started: bool = False  # 200 and headers received
    completed: bool = False  # the stream ended with [DONE]
    error: str | None = None
    served: str | None = None
    ttft_s: float | None = None
    prefix_id: int | None = None  # which of the generator's shared prefixes the prompt starts with

    @property
    def lost(self) -> bool:
        """Failed before the response started."""
        return not self.started and not self.completed


class LoadGenerator:
    """Streamed chat requests at `rate_rps` (Poisson arrivals, seeded) to `url`; prompts share one of
    `num_prefixes` ~2k-character system prompts, so routing has affinity to keep."""

    def __init__(self, url: str, *, rate_rps: float, num_prefixes: int = 8, max_tokens: int = 16, seed: int = 7,
                 timeout_s: float = 60.0) -> None:
        self.url = url
        self.rate_rps = rate_rps
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.prefixes = [" ".join(f"doc{i}-word{j}" for j in range(300)) for i in range(num_prefixes)]
        self.outcomes: list[Outcome] = []

    def _body(self, out: Outcome | None = None) -> bytes:
        k = self.rng.randrange(len(self.prefixes))
        if out is not None:
            out.prefix_id = k
        return json.dumps({"model": MODEL, "stream": True, "max_tokens": self.max_tokens, "messages": [
            {"role": "system", "content": self.prefixes[k]},
            {"role": "user", "content": f"question {self.rng.randrange(10**9)}"}]}).encode()

    async def _one(self, session, out: Outcome, body: bytes) -> None:
        import aiohttp

        try:
            async with session.post(self.url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"},
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                out.status = r.status
                out.served = r.headers.get("x-gateway-destination-endpoint-served")
                if r.status != 200:
                    out.error = (await r.text())[:300]
                    return
                out.started = True
                async for line in r.content:
                    if out.ttft_s is None and line.startswith(b"data:"):
                        out.ttft_s = time.monotonic() - out.sent_at
                    if line.strip() == b"data: [DONE]":
                        out.completed = True
                if not out.completed:
                    out.error = "stream ended without [DONE]"
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome
            out.error = f"{type(exc).__name__}: {exc}"[:300]

    async def run(self, duration_s: float) -> list[Outcome]:
        import aiohttp

        tasks = []
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        async with aiohttp.ClientSession(connector=connector) as session:
            t_end = time.monotonic() + duration_s
            next_at = time.monotonic()
            while next_at < t_end:
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                out = Outcome(sent_at=time.monotonic())
                self.outcomes.append(out)
                tasks.append(asyncio.ensure_future(self._one(session, out, self._body(out))))
                next_at += self.rng.expovariate(self.rate_rps)
            await asyncio.gather(*tasks)
        return self.outcomes


def summarize(outcomes: list[Outcome]) -> str:
    lost = [o for o in outcomes if o.lost]
    broken = [o for o in outcomes if o.started and not o.completed]
    errors: dict[str, int] = {}
    for o in lost + broken:
        key = f"{o.status} {o.error}"[:160]
        errors[key] = errors.get(key, 0) + 1
    return (f"{len(outcomes)} requests, {sum(o.completed for o in outcomes)} completed, {len(lost)} lost before "
            f"starting, {len(broken)} broken after starting; errors: {errors}")

"""`prefixroute model-server-bench`: the simulated server's own cost, and whether a small fleet keeps up.

Three measurements (each prints figures and ratios; the machine is noisy, so compare ratios):

1. ``cpu``: one server with ``--time-scale 0`` (no modelled GPU time, so all its CPU is its own overhead)
   serves N streamed requests of ~4k prompt tokens and 64 output tokens at a fixed concurrency; CPU per
   request = (server utime + stime) / N, read from /proc. Target: <= 0.5 ms.
2. ``fleet``: 4 servers at calibrated time (``--time-scale 1``) serve S concurrent closed-loop streams
   (same request shape, prompts drawn from a few shared prefixes). "Keeps up" = the servers' steps end
   when the cost model says: (modelled + lag) / modelled step time < 1.1 and < 5% of steps end more
   than 5 ms late (from the servers' /metrics).
3. ``--cost-model-report``: the fitted formula and its error at every calibration point.

The load generator is a raw asyncio client (keep-alive, counts SSE events per read) so it costs less
CPU than the servers it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

from prefixroute.model_servers import cost_model
from prefixroute.model_servers.profiles import DEFAULT_PROFILE, get_profile
from prefixroute.procs import parent_death_preexec


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost-model-report", action="store_true", help="Print the cost-model fit and exit.")
    parser.add_argument("--only", choices=("cpu", "fleet"), help="Run one measurement only.")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="Server profile.")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="Prompt size, tokens.")
    parser.add_argument("--output-tokens", type=int, default=64, help="Tokens generated per request.")
    parser.add_argument("--cpu-requests", type=int, default=2000,
                        help="Requests for the CPU measurement (many: /proc CPU time has 10 ms ticks).")
    parser.add_argument("--cpu-repeats", type=int, default=3,
                        help="Measurements in the CPU run (the machine is noisy: median and min are printed).")
    parser.add_argument("--cpu-concurrency", type=int, default=16, help="Concurrent streams in the CPU run.")
    parser.add_argument("--fleet-servers", type=int, default=4, help="Servers in the fleet run.")
    parser.add_argument("--fleet-streams", type=int, default=50, help="Concurrent streams in the fleet run.")
    parser.add_argument("--fleet-duration-s", type=float, default=10.0, help="Length of the fleet run.")


def _cpu_s(pid: int, which: str = "both") -> float:
    """CPU seconds of a process from /proc: user, sys (kernel, incl. loopback TCP delivery) or both."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    user, sys_ = int(fields[11]), int(fields[12])
    ticks = {"user": user, "sys": sys_, "both": user + sys_}[which]
    return ticks / os.sysconf("SC_CLK_TCK")


def _start(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "prefixroute", "model-server", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=parent_death_preexec())
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("READY "):
            return proc, int(line.split(":")[-1])
    proc.kill()
    raise RuntimeError("model server did not start")


class _Stream(asyncio.Protocol):
    """Keep-alive client connection: one streamed request at a time; records token arrival times."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future | None = None
        self.tail = b""
        self.events = 0
        self.first_s = 0.0
        self.last_s = 0.0
        self.sent_s = 0.0

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        n = data.count(b"data: {")
        if n:
            if self.events == 0:
                self.first_s = now
            self.events += n
            self.last_s = now
        buf = self.tail + data
        if buf.endswith(b"0\r\n\r\n") and b"[DONE]" in buf and self.done is not None and not self.done.done():
            self.done.set_result(None)
        self.tail = buf[-16:]

    def connection_lost(self, exc):  # type: ignore[no-untyped-def]
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("closed"))

    async def request(self, raw: bytes) -> tuple[float, float, int]:
        """Send one request; returns (ttft_s, mean inter-token gap s, events)."""
        self.done = asyncio.get_running_loop().create_future()
        self.events = 0
        self.tail = b""
        self.sent_s = time.perf_counter()
        assert self.transport is not None
        self.transport.write(raw)
        await self.done
        gap = (self.last_s - self.first_s) / max(self.events - 2, 1)
        return self.first_s - self.sent_s, gap, self.events


def _raw_request(port: int, prompt: str, max_tokens: int) -> bytes:
    import orjson

    body = orjson.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True})
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (port, len(body), body))


def _prompt(rng: random.Random, prefix: str, num_tokens: int) -> str:
    """`prefix` (a shared part) + a random unique tail, exactly `num_tokens` tokens (4 ASCII bytes each)."""
    size = num_tokens * 4
    tail = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=max(size - len(prefix), 0)))
    return (prefix + tail)[:size]


async def _cpu_run(args: argparse.Namespace) -> list[dict]:
    """`args.cpu_repeats` measurements of `args.cpu_requests` requests each, on one warmed-up server."""
    proc, port = _start("--profile", args.profile, "--time-scale", "0")
    try:
        loop = asyncio.get_running_loop()
        rng = random.Random(1)
        prefixes = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=args.prompt_tokens * 4))
                    for _ in range(4)]
        conns = [(await loop.create_connection(_Stream, "127.0.0.1", port))[1] for _ in range(args.cpu_concurrency)]
        out = []
        for rep in range(args.cpu_repeats + 1):  # the first round warms the process up and is not reported
            n_req = args.cpu_concurrency * 4 if rep == 0 else args.cpu_requests
            # ~3/4 of each prompt is one of 4 shared prefixes (cache hits), the rest unique
            queue = [_raw_request(port, _prompt(rng, prefixes[i % 4][: -1024 - i % 256], args.prompt_tokens),
                                  args.output_tokens) for i in range(n_req)]
            cpu0, user0, t0 = _cpu_s(proc.pid), _cpu_s(proc.pid, "user"), time.perf_counter()
            counts: list[int] = []

            async def worker(c: _Stream) -> None:
                while queue:
                    counts.append((await c.request(queue.pop()))[2])  # noqa: B023

            await asyncio.gather(*(worker(c) for c in conns))
            wall = time.perf_counter() - t0
            cpu = _cpu_s(proc.pid) - cpu0
            user = _cpu_s(proc.pid, "user") - user0
            n = len(counts)
            if rep:
                out.append({"requests": n, "cpu_s": cpu, "wall_s": wall, "cpu_ms_per_request": cpu / n * 1e3,
                            "user_ms_per_request": user / n * 1e3, "sys_ms_per_request": (cpu - user) / n * 1e3,
                            "events_ok": all(k == args.output_tokens for k in counts)})
        for c in conns:
            c.transport.close()  # type: ignore[union-attr]
        return out
    finally:
        proc.terminate()
        proc.wait(10)


async def _fleet_run(args: argparse.Namespace) -> dict:
    servers = [_start("--profile", args.profile, "--time-scale", "1.0") for _ in range(args.fleet_servers)]
    try:
        loop = asyncio.get_running_loop()
        rng = random.Random(2)
        prefixes = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=args.prompt_tokens * 4))
                    for _ in range(8)]
        conns = []
        for i in range(args.fleet_streams):
            port = servers[i % len(servers)][1]
            conns.append((port, (await loop.create_connection(_Stream, "127.0.0.1", port))[1]))
        cpu0 = [_cpu_s(p.pid) for p, _ in servers]
        user0 = [_cpu_s(p.pid, "user") for p, _ in servers]
        t_end = time.perf_counter() + args.fleet_duration_s
        ttfts, gaps = [], []

        async def worker(port: int, c: _Stream) -> None:
            while time.perf_counter() < t_end:
                pre = prefixes[rng.randrange(len(prefixes))][: -1024]
                ttft, gap, _ = await c.request(_raw_request(port, _prompt(rng, pre, args.prompt_tokens),
                                                            args.output_tokens))
                ttfts.append(ttft)
                gaps.append(gap)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(p, c) for p, c in conns))
        wall = time.perf_counter() - t0
        cpu = sum(_cpu_s(p.pid) - c0 for (p, _), c0 in zip(servers, cpu0))
        user = sum(_cpu_s(p.pid, "user") - c0 for (p, _), c0 in zip(servers, user0))
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        steps = lag = busy = late = 0.0
        lag_max = 0.0
        for _, port in servers:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "prefixroute:engine_steps_total":
                        steps += s.value
                    elif s.name == "prefixroute:engine_step_lag_seconds_total":
                        lag += s.value
                    elif s.name == "prefixroute:engine_busy_seconds_total":
                        busy += s.value
                    elif s.name == "prefixroute:engine_late_steps_total":
                        late += s.value
                    elif s.name == "prefixroute:engine_step_lag_max_seconds":
                        lag_max = max(lag_max, s.value)
        for c in conns:
            c[1].transport.close()  # type: ignore[union-attr]
        modelled_step = busy / steps if steps else float("nan")
        return {"requests": len(ttfts), "wall_s": wall, "servers_cpu_ratio": cpu / wall,
                "cpu_ms_per_request": cpu / max(len(ttfts), 1) * 1e3, "user_ratio": user / cpu if cpu else 0.0,
                "ttft_p50_ms": statistics.median(ttfts) * 1e3, "gap_mean_ms": statistics.mean(gaps) * 1e3,
                "modelled_step_ms": modelled_step * 1e3,
                "step_time_ratio": (busy + lag) / busy if busy else float("nan"),
                "step_lag_mean_ms": lag / steps * 1e3 if steps else 0.0, "step_lag_max_ms": lag_max * 1e3,
                "late_steps_ratio": late / steps if steps else 0.0, "steps": steps}
    finally:
        for p, _ in servers:
            p.terminate()
        for p, _ in servers:
            p.wait(10)


def main(args: argparse.Namespace) -> int:
    if args.cost_model_report:
        print(cost_model.fit_report())
        tp = get_profile("llama-3.1-70b-h200-tp4").cost_model()
        print(f"TP4 70B: prefill 8192 = {tp.prefill_time_s(8192) * 1e3:.1f} ms, "
              f"decode batch 32 @2048 = {tp.decode_time_s(32, 2048) * 1e3:.2f} ms")
        return 0
    ok = True
    if args.only in (None, "cpu"):
        runs = asyncio.run(_cpu_run(args))
        print(f"[cpu] {args.cpu_repeats} x {args.cpu_requests} streamed requests, {args.prompt_tokens}-token prompts, "
              f"{args.output_tokens} tokens each, concurrency {args.cpu_concurrency}, --time-scale 0")
        for r in runs:
            print(f"[cpu] server CPU {r['cpu_s']:.2f} s over {r['wall_s']:.2f} s wall: "
                  f"{r['cpu_ms_per_request']:.3f} ms per request (user {r['user_ms_per_request']:.3f} + kernel "
                  f"{r['sys_ms_per_request']:.3f}); all streams complete: {r['events_ok']}")
        per = sorted(r["cpu_ms_per_request"] for r in runs)
        med = statistics.median(per)
        print(f"[cpu] CPU per request: median {med:.3f} ms, min {per[0]:.3f} ms; target 0.5 ms "
              f"(median ratio {med / 0.5:.2f}, min ratio {per[0] / 0.5:.2f})")
        ok &= med <= 0.5 and all(r["events_ok"] for r in runs)
    if args.only in (None, "fleet"):
        r = asyncio.run(_fleet_run(args))
        print(f"[fleet] {args.fleet_servers} servers (time scale 1.0), {args.fleet_streams} concurrent streams, "
              f"{r['requests']} requests in {r['wall_s']:.1f} s; servers used {r['servers_cpu_ratio']:.2f} cores "
              f"({r['cpu_ms_per_request']:.2f} ms CPU per request incl. idle wakeups, "
              f"{r['user_ratio'] * 100:.0f}% user)")
        print(f"[fleet] TTFT p50 {r['ttft_p50_ms']:.1f} ms; client inter-token gap {r['gap_mean_ms']:.2f} ms; "
              f"modelled mean step (prefill+decode) {r['modelled_step_ms']:.2f} ms")
        print(f"[fleet] step lag mean {r['step_lag_mean_ms']:.3f} ms, max {r['step_lag_max_ms']:.1f} ms, "
              f"late (>5 ms) steps {r['late_steps_ratio'] * 100:.2f}% of {r['steps']:.0f}; "
              f"achieved/modelled step time {r['step_time_ratio']:.3f}")
        keeps_up = r["step_time_ratio"] < 1.1 and r["late_steps_ratio"] < 0.05
        print(f"[fleet] keeps up: {keeps_up}")
        ok &= keeps_up
    return 0 if ok else 1

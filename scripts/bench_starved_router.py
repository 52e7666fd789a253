#!/usr/bin/env python3
"""Benchmark: a router on a starved host must not eject healthy endpoints (nor answer 503 "no healthy endpoint").

Runs `prefixroute gateway` (real Envoy + the ext_proc router) in front of simulated model servers while
`--busy` busy-loop processes (``python -c 'while 1: pass'``) take the host's cores, drives `--concurrency`
closed-loop clients of short chat requests (8 shared system prompts, so the router hashes and matches) for
`--duration-s`, and counts: requests by status, 503s, endpoints marked down (the router's log lines, which every
version writes), and, where the router exposes them, its pool counters (probes by outcome, ejections by cause,
panic-mode seconds, the loop's lag). Starvation beyond the busy loops, optional: `--router-nice` (the gateway at a
lower CPU priority), `--freeze STOP_S,RUN_S` (SIGSTOP/SIGCONT of the router process in turn, as a throttling CPU
quota), `--loop-stall STALL_S,ON_S,OFF_S` (the router's own event loop blocked STALL_S per iteration for ON_S,
then free for OFF_S: tests/helpers/loop_stall, the test's starvation). Each `--prefixroute` (a ``prefixroute``
console script, e.g. one per checkout's venv) runs in turn, alternating for `--rounds`, on the same host load, so
the figures compare within one run. Every process it starts is stopped at the end (the busy loops too).

Usage: .venv/bin/python scripts/bench_starved_router.py --prefixroute base=/path/.venv/bin/prefixroute \\
           --prefixroute new=.venv/bin/prefixroute [--duration-s 60] [--concurrency 10] [--busy 2] [--rounds 2] \\
           [--loop-stall 1.2,3,1.5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STALL_HELPER = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "loop_stall"
DOWN_RE = re.compile(r"endpoint (\S+) (?:is down after|marked down)")
METRIC_RE = re.compile(r"^(prefixroute_(?:pool|endpoint_ejections|endpoint_probes|router_loop)\S*?)(\{[^}]*\})? (\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.1)
    raise RuntimeError(f"{url} not up within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat(port: int, content: str, system: str) -> int:
    body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        m = METRIC_RE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def extproc_pid(gateway_pid: int) -> int:
    """The ext_proc router process among the gateway's children."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(gateway_pid)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, _, argv = line.strip().partition(" ")
        if " extproc" in argv:
            return int(pid)
    raise RuntimeError(f"no ext_proc child of {gateway_pid}: {out}")


def freeze_cycle(pid: int, stop_s: float, run_s: float, duration_s: float) -> None:
    """Starve `pid` from outside, as a CPU quota that throttles a container does: SIGSTOP for `stop_s`, SIGCONT
    for `run_s`, for `duration_s` (always left running)."""
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(run_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def stall_cycle(path: Path, stall_s: float, on_s: float, off_s: float, duration_s: float) -> None:
    """Stall the router's event loop (tests/helpers/loop_stall) `stall_s` per iteration for `on_s`, then let it
    run for `off_s`, in turn for `duration_s`."""
    end = time.monotonic() + duration_s
    try:
        while time.monotonic() < end:
            path.write_text(str(stall_s))
            time.sleep(on_s)
            path.unlink()
            time.sleep(off_s)
    finally:
        path.unlink(missing_ok=True)


def one_run(label: str, binary: str, args: argparse.Namespace, work: Path) -> dict:
    logs = work / f"{label}-{time.monotonic_ns()}"
    logs.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        endpoints = []
        for i in range(args.servers):
            port = free_port()
            endpoints.append(f"127.0.0.1:{port}")
            procs.append(subprocess.Popen([binary, "model-server", "--port", str(port), "--id", f"s{i}",
                                           "--time-scale", str(args.time_scale)],
                                          stdout=open(logs / f"s{i}.log", "w"), stderr=subprocess.STDOUT))
        for ep in endpoints:
            wait_http(f"http://{ep}/health", 60)
        gw_port, metrics_port = free_port(), free_port()
        gw_log = logs / "gateway.log"
        nice = ["nice", "-n", str(args.router_nice)] if args.router_nice else []
        env = dict(os.environ)
        stall_file = logs / "stall"
        if args.loop_stall:
            env["PYTHONPATH"] = f"{STALL_HELPER}:{env.get('PYTHONPATH', '')}"
            env["PREFIXROUTE_TEST_LOOP_STALL_FILE"] = str(stall_file)
        gw = subprocess.Popen([*nice, binary, "gateway", "--ports", "random", "--port", str(gw_port),
                               "--metrics-port", str(metrics_port), "--endpoints", ",".join(endpoints),
                               "--no-telemetry"],
                              stdout=open(gw_log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
        procs.append(gw)
        deadline = time.monotonic() + 120
        while "gateway ready" not in gw_log.read_text():
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {gw_log.read_text()[-2000:]}")
            time.sleep(0.2)
        before = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        freezer = None
        if args.freeze:
            stop_s, run_s = (float(x) for x in args.freeze.split(","))
            pid = extproc_pid(gw.pid)
            freezer = threading.Thread(target=freeze_cycle, args=(pid, stop_s, run_s, args.duration_s), daemon=True)
            freezer.start()
        elif args.loop_stall:
            stall_s, on_s, off_s = (float(x) for x in args.loop_stall.split(","))
            freezer = threading.Thread(target=stall_cycle, args=(stall_file, stall_s, on_s, off_s, args.duration_s),
                                       daemon=True)
            freezer.start()
        rng = random.Random(7)
        systems = [f"You are assistant number {k}. " + " ".join(f"rule-{k}-{j}" for j in range(400))
                   for k in range(8)]
        statuses: dict[int, int] = {}
        lock = threading.Lock()
        end = time.monotonic() + args.duration_s

        def client(c: int) -> None:
            r = random.Random(c)
            while time.monotonic() < end:
                st = chat(gw_port, f"question {r.random()}", systems[r.randrange(len(systems))])
                with lock:
                    statuses[st] = statuses.get(st, 0) + 1

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as ex:
            list(ex.map(client, range(args.concurrency)))
        took = time.monotonic() - t0
        if freezer is not None:
            freezer.join()
        after = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        del rng
        text = gw_log.read_text()
        downs = DOWN_RE.findall(text)
        counters = {k: v - before.get(k, 0.0) if "seconds_total" in k or k.endswith("_total") or "_total{" in k
                    else v for k, v in after.items()}
        return {"label": label, "requests": sum(statuses.values()), "statuses": statuses,
                "num_503": statuses.get(503, 0), "num_failed": sum(n for s, n in statuses.items() if s != 200),
                "endpoints_marked_down": len(downs), "seconds": round(took, 1),
                "router_counters": {k: v for k, v in counters.items() if v}}
    finally:
        for p in reversed(procs):
            stop(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefixroute", action="append", required=True, help="LABEL=PATH of a prefixroute script")
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes taking the cores during the runs")
    ap.add_argument("--router-nice", type=int, default=0,
                    help="run the gateway (Envoy and the router) at this niceness: the busy loops then take more of "
                         "the cores from it, as real engines on the same host did")
    ap.add_argument("--freeze", default="",
                    help="STOP_S,RUN_S: stop the router process (SIGSTOP) for STOP_S, let it run RUN_S, in turn "
                         "during the load: starvation from outside, as a throttling CPU quota does")
    ap.add_argument("--loop-stall", default="",
                    help="STALL_S,ON_S,OFF_S: block the router's event loop STALL_S per iteration for ON_S, then "
                         "not for OFF_S, in turn (a test-only sitecustomize, tests/helpers/loop_stall): a router "
                         "whose loop lags, as a starved one's did in front of real vLLM")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    routers = [tuple(s.split("=", 1)) for s in args.prefixroute]
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="starved-router-") as tmp:
            for r in range(args.rounds):
                for label, binary in routers:
                    res = one_run(label, binary, args, Path(tmp))
                    res["round"] = r
                    results.append(res)
                    print(json.dumps(res), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"\n{'router':<10} {'round':>5} {'requests':>8} {'503':>5} {'failed':>6} {'marked down':>11}")
    for res in results:
        print(f"{res['label']:<10} {res['round']:>5} {res['requests']:>8} {res['num_503']:>5} {res['num_failed']:>6} "
              f"{res['endpoints_marked_down']:>11}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "load": os.getloadavg(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

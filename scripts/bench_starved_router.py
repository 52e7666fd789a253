#!/usr/bin/env python3
"""Benchmark: a router on a starved host must not eject healthy endpoints (nor answer 503 "no healthy endpoint").

Runs `prefixroute gateway` (real Envoy + the ext_proc router) in front of simulated model servers while
`--busy` busy-loop processes (``python -c 'while 1: pass'``) take the host's cores, drives `--concurrency`
clients of short chat requests (8 shared system prompts, so the router hashes and matches) for `--duration-s`,
and counts: requests by status, 503s, endpoints marked down (the router's log lines, which every version writes),
and, where the router exposes them, its pool counters (ejections by cause, probes discounted for loop lag,
panic-mode seconds, the loop's lag). Each `--prefixroute` (a ``prefixroute`` console script, e.g. one per
checkout's venv) runs in turn, alternating for `--rounds`, on the same host load, so the figures compare within
one run. Every process it starts is stopped at the end (the busy loops too).

Usage: .venv/bin/python scripts/bench_starved_router.py --prefixroute base=/path/.venv/bin/prefixroute \\
           --prefixroute new=.venv/bin/prefixroute [--duration-s 60] [--concurrency 10] [--busy 2] [--rounds 2]
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
        gw = subprocess.Popen([binary, "gateway", "--ports", "random", "--port", str(gw_port),
                               "--metrics-port", str(metrics_port), "--endpoints", ",".join(endpoints),
                               "--no-telemetry"],
                              stdout=open(gw_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(gw)
        deadline = time.monotonic() + 120
        while "gateway ready" not in gw_log.read_text():
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start: {gw_log.read_text()[-2000:]}")
            time.sleep(0.2)
        before = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
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

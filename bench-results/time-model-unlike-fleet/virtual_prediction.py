"""The time model's prediction error on a virtual fleet unlike its prior: the H200 70B prior against servers
scaled by --time-scale. Prints the median |predicted - actual| / actual of the primaries' TTFT over the first 200
first tokens, after them and over the last 200, and the median bias after them.

    python virtual_prediction.py WORKLOAD PROFILE TIME_SCALE RATE_RPS [NUM_REQUESTS]
    python virtual_prediction.py shared-prompts llama-3.1-70b-h200-tp4 5 1.6
"""

import os
import statistics
import sys

os.environ["PREFIXROUTE_TTFT_PRIOR_TOKENS_PER_S"] = "12800"  # the prior the gateway has by default
os.environ["PREFIXROUTE_TTFT_PRIOR_BASE_S"] = "0.015"

from prefixroute.bench import virtual_run  # noqa: E402
from prefixroute.bench.cli import build_workload  # noqa: E402
from prefixroute.bench.settings import BenchSettings  # noqa: E402


def median_error(rows) -> float:  # noqa: ANN001
    errors = [abs(p - a) / a for _, p, a in rows if a > 0]
    return statistics.median(errors) if errors else float("nan")


def main() -> int:
    workload, profile, scale, rate = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 600
    wl = build_workload(BenchSettings(workload=workload, num_requests=n, rate_rps=rate))
    spec = virtual_run.engine_spec(profile, [f"--time-scale={scale}"])
    predictions: list = []
    virtual_run.simulate_policy(wl, "prefix", num_servers=4, spec=spec, seed=0, predictions=predictions)
    bias = statistics.median((p - a) / a for _, p, a in predictions[200:] if a > 0)
    print(f"{workload} {profile} time scale {scale} at {rate} req/s: {len(predictions)} first tokens, median error "
          f"first 200 {median_error(predictions[:200]):.3f}, after {median_error(predictions[200:]):.3f}, last 200 "
          f"{median_error(predictions[-200:]):.3f}; bias after {bias:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

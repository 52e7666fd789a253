#!/bin/bash
# Real processes, capacity-pressure at 80% load, 4 simulated 70B servers: our router without placement and
# sglang-router in one run, then our router with PREFIXROUTE_PLACEMENT_VICTIMS=all (same request sequence).
# Run it under the bench lock as a whole: flock /work/wt/bench.lock bench-results/placement-real-capacity-pressure/run.sh
cd "$(dirname "$0")/../.."
C="--workload capacity-pressure --servers 4 --profile llama-3.1-70b-h200-tp4 --server-args=--time-scale=1.6,--num-gpu-blocks=2498 --sweep-load-percents 80 --num-requests 300"
prefixroute bench $C --routers prefixroute:prefix@events,sglang-router --out bench-results/placement-real-capacity-pressure/off
PREFIXROUTE_PLACEMENT_VICTIMS=all prefixroute bench $C --routers prefixroute:prefix@events --out bench-results/placement-real-capacity-pressure/victims-all

"""Feedback mode with a CPU tier in the virtual fleet (issue 25): our prefix policy with each index source, the
same Poisson sequence per (set, rate). `-blind` = feedback with the router's own index sized to the GPU only (as
before the scrape of vllm:kv_offload_config_info). Calls `simulate_policy` with explicit routing settings (the
bench CLI's virtual runs did not apply a router name's @SOURCE at the time of writing). No flow control.

    python bench-results/tiers-virtual-feedback/run.py cp 4.00 events,feedback-blind,feedback   # 40% of 10.0 req/s
    python bench-results/tiers-virtual-feedback/run.py cp 8.01 events,feedback-blind,feedback   # 80%
    python bench-results/tiers-virtual-feedback/run.py 96 2.66 events,feedback-blind,feedback   # 96 x 6k, 40%
    python bench-results/tiers-virtual-feedback/run.py 96 5.33 events,feedback-blind,feedback   # 80%
"""
import sys
from prefixroute import settings as settings_mod
from prefixroute.bench import virtual_run as vr, workloads, results as br
from prefixroute.bench.workloads import apply_arrivals
from prefixroute.extproc.routing.settings import RoutingSettings
args = ["--time-scale=1.6", "--num-gpu-blocks=2498", "--kv-offloading-size=48.8"] if sys.argv[1] == "cp" else ["--time-scale=1.6", "--num-gpu-blocks=2304", "--kv-offloading-size=45"]
spec = vr.engine_spec("llama-3.1-70b-h200-tp4", args)
wl0 = workloads.capacity_pressure(num_requests=300) if sys.argv[1] == "cp" else workloads.capacity_pressure(num_groups=96, min_prefix_tokens=6144, max_prefix_tokens=6144, zipf_s=0, num_requests=576)
rate = float(sys.argv[2])
wl = apply_arrivals(wl0, "poisson", rate_rps=rate, seed=0)
prior = dict(zip(("ttft_prior_tokens_per_s", "ttft_prior_base_s"), spec.time_model_prior()))
import dataclasses
from prefixroute.extproc.routing.router import RouterCore
_cap = RouterCore.capacity_blocks
for src in sys.argv[3].split(","):
    blind = src.endswith("-blind")
    src = src.removesuffix("-blind")
    RouterCore.capacity_blocks = (lambda self, st: _cap(self, dataclasses.replace(st, num_cpu_blocks=None))) if blind else _cap
    routing = settings_mod.from_namespace(RoutingSettings, policy="prefix", rng_seed=0, index_source=src, tokenizer="sim", **prior)
    res, eps, cpu = vr.simulate_policy(wl, "prefix", num_servers=4, spec=spec, seed=0, routing=routing)
    ok = [r for r in res if r.ok]
    t = sorted(r.ttft_ms for r in ok)
    pt = sum(r.prompt_tokens for r in ok); ct = sum(r.cached_tokens for r in ok); cc = sum((r.cpu_cached_tokens or 0) for r in ok)
    print(f"{sys.argv[1]} {rate} {src + ('-blind' if blind else ''):15s} p50 {t[len(t)//2]/1000:.3f} p90 {t[int(len(t)*0.9)]/1000:.3f} hit {ct/pt:.3f} (cpu {cc/pt:.3f})")

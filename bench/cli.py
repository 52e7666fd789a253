"""`prefixroute bench`: compare routers and policies on a workload or a trace; write results and plots.

Examples::

    prefixroute bench --workload shared-prompts --routers prefixroute:random,prefixroute:prefix --servers 4
    prefixroute bench --trace trace.jsonl --trace-stop 300 --trace-time-scale 0.5 --max-output-tokens 64 --out out
    prefixroute bench --virtual --trace trace.jsonl --servers 64 --out out-virtual
    prefixroute bench --virtual --workload shared-prompts --num-groups 300 --sweep-load-percents 20,40,60,80,100,120 \
        --out sweep-virtual
    prefixroute bench --workload shared-prompts --num-groups 100 --num-requests 400 --sweep-load-percents 40,80,110 \
        --routers prefixroute:random,prefixroute:prefix,sglang-router --server-args=--time-scale=1.6 --out sweep-real

Output (DIR: --out, else a new folder under the state folder's bench/, printed): DIR/results.json, DIR/report.md, DIR/ttft_cdf.png, DIR/hit_ratio.png, DIR/endpoint_share.png and
DIR/logs/ (one log per process). A load sweep (`prefixroute.bench.sweep`) writes DIR/results.json (the sweep
document), DIR/report.md, DIR/ttft_vs_load.png, DIR/hit_ratio_vs_load.png and, on real processes,
DIR/points/PCT/ (each point's run document and logs). Exit code 0 when every requested router ran, 1 when one was skipped or
every request of a run failed, 2 for bad arguments, 128 + N when stopped by signal N.

SIGINT, SIGTERM and SIGHUP stop the run: every model server, router and Envoy it started is stopped before
it exits (nothing is written); further signals are ignored meanwhile so the cleanup completes. Killed with
SIGKILL, its children still go with it (their parent-death signal, `prefixroute.procs`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefixroute import settings as settings_mod
from prefixroute.bench import report, workloads
from prefixroute.bench.settings import BenchSettings
from prefixroute.bench.traces import load_trace, slice_trace, trace_workload
from prefixroute.bench.workload_spec import Workload
from prefixroute.procs import Stopped, stop_on_signals

if TYPE_CHECKING:  # the engine model is imported when a virtual run or a sweep needs it
    from prefixroute.model_servers.profiles import EngineSpec


HELP_ESSENTIALS = (
    "workload", "num_requests", "output_tokens", "seed",  # a synthetic workload (its shape: --help-all)
    "trace", "trace_time_scale", "max_output_tokens",  # or a trace
    "arrival", "rate_rps", "concurrency", "sweep_load_percents",  # how requests arrive
    "routers", "servers", "profile", "server_args", "gateway_args", "virtual",  # what runs them
    "max_duration_s", "out", "overhead",
)
"""The settings `prefixroute bench --help` lists; --help-all lists all of them."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    settings_mod.add_arguments(parser, BenchSettings)
    settings_mod.essential_help(parser, HELP_ESSENTIALS)


def build_workload(s: BenchSettings) -> Workload:
    """The workload the settings describe, arrivals applied. Raises ValueError / TraceFormatError / OSError."""
    if s.trace:
        if s.trace_block_tokens < 1:
            raise ValueError("--trace-block-tokens must be >= 1")
        recs = load_trace(s.trace, s.trace_block_tokens)
        slice_params = {"trace_start": s.trace_start, "trace_stop": s.trace_stop or None,
                        "trace_start_s": s.trace_start_s or None, "trace_end_s": s.trace_end_s or None}
        recs = slice_trace(recs, start=s.trace_start, stop=s.trace_stop or None,
                           start_s=s.trace_start_s or None, end_s=s.trace_end_s or None)
        if not recs:
            raise ValueError("the trace slice is empty (check --trace-start/--trace-stop/--trace-*-s)")
        wl = trace_workload(recs, seed=s.seed, time_scale=s.trace_time_scale,
                            max_output_tokens=s.max_output_tokens or None, source=Path(s.trace).name,
                            block_tokens=s.trace_block_tokens, slice_params=slice_params)
    else:
        try:
            tool_min, tool_max = (int(v) for v in s.agent_tool_output_tokens)
        except ValueError:
            raise ValueError("--agent-tool-output-tokens takes MIN,MAX (two integers)") from None
        wl = workloads.make_workload(s.workload, num_requests=s.num_requests, seed=s.seed,
                                     output_tokens=s.output_tokens, prefix_tokens=s.prefix_tokens,
                                     num_groups=s.num_groups, question_tokens=s.question_tokens,
                                     num_sessions=s.num_sessions, num_turns=s.num_turns,
                                     document_tokens=s.document_tokens, num_documents=s.num_documents,
                                     pressure_num_groups=s.pressure_num_groups,
                                     pressure_min_prefix_tokens=s.pressure_min_prefix_tokens,
                                     pressure_max_prefix_tokens=s.pressure_max_prefix_tokens,
                                     pressure_zipf_s=s.pressure_zipf_s, num_agents=s.num_agents,
                                     agent_num_apps=s.agent_num_apps, agent_max_active=s.agent_max_active,
                                     agent_tool_output_tokens=(tool_min, tool_max),
                                     agent_instructions_tokens=s.agent_instructions_tokens,
                                     agent_loop_args=s.agent_loop_args)
    arrival = s.arrival if s.arrival != "auto" else ("trace" if s.trace else "poisson")
    if arrival not in ("trace", "poisson", "closed"):
        raise ValueError(f"--arrival must be auto, trace, poisson or closed; got {s.arrival!r}")
    wl = workloads.apply_arrivals(wl, arrival, rate_rps=s.rate_rps, seed=s.seed)  # type: ignore[arg-type]
    if arrival == "closed":
        wl = Workload(wl.name, {**wl.params, "concurrency": s.concurrency}, wl.requests)
    elif arrival == "trace":
        wl = Workload(wl.name, {**wl.params, "arrival": "trace"}, wl.requests)
    return wl


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(args: argparse.Namespace) -> int:
    # The first stop signal raises `Stopped` wherever the run is (starting servers, replaying, scraping):
    # the context managers that own the children then stop them on the way out.
    with stop_on_signals(STOP_SIGNALS):
        try:
            return _main(args)
        except Stopped as stopped:
            _log(f"prefixroute bench: stopped by {signal.Signals(stopped.signum).name}; every process it "
                 "started is stopped")
            return 128 + stopped.signum


def _main(args: argparse.Namespace) -> int:
    try:
        s = settings_mod.from_namespace(BenchSettings, args)
        from prefixroute.bench.routers import parse_router

        for r in s.routers:
            if r.startswith("sim:"):
                from prefixroute.bench.virtual_run import SIM_ROUTERS

                if not s.virtual or r not in SIM_ROUTERS:
                    raise ValueError(f"router {r!r}: sim: models run only with --virtual; known: "
                                     f"{', '.join(SIM_ROUTERS)}")
                continue
            parse_router(r)
        if s.servers < 1:
            raise ValueError("--servers must be >= 1")
        sweep = parse_sweep_percents(s.sweep_load_percents)
        if sweep and s.trace:
            raise ValueError("--sweep-load-percents sets Poisson rates: it does not apply to --trace")
        if sweep and s.arrival not in ("auto", "poisson"):
            raise ValueError("--sweep-load-percents sets Poisson rates: it does not apply to --arrival "
                             f"{s.arrival}")
        if s.virtual or sweep:
            from prefixroute.bench import virtual_run

            # The model server's own settings parser: an unknown flag is an error here, and so is an
            # unsimulated one on the virtual fleet (a real sweep's servers do run it; its capacity ignores it).
            spec = virtual_run.engine_spec(s.profile, s.server_args, allow_unsimulated=not s.virtual)
        if not s.num_requests:
            s = dataclasses.replace(s, num_requests=resolve_num_requests(s.virtual, bool(sweep)))
        wl = build_workload(s)
        extra_args = pressure_server_args(s, wl)
        if extra_args:
            s = dataclasses.replace(s, server_args=(*s.server_args, *extra_args))
            _log(f"capacity-pressure: {' '.join(extra_args)} per server (--pressure-kv-ratio {s.pressure_kv_ratio:g} "
                 f"of the shared working set on {s.servers} servers; set --server-args=--num-gpu-blocks=N to choose)")
            if s.virtual or sweep:
                spec = virtual_run.engine_spec(s.profile, s.server_args, allow_unsimulated=not s.virtual)
        if not s.out:
            s = dataclasses.replace(s, out=str(default_out_dir(wl.name)))
        _log(f"writing results to {s.out}")
    except (ValueError, OSError) as exc:
        _log(f"prefixroute bench: error: {exc}")
        return 2
    if sweep:
        return _run_sweep(s, wl, spec, sweep)
    from prefixroute.bench.upper_bound import fleet_bounds

    # One tokenization of the sequence for both bounds (infinite cache, and MIN at the fleet's capacity).
    bounds = fleet_bounds(wl, s.servers, s.profile, s.server_args)
    bound_ratio = bounds["infinite_cache_hit_ratio"]
    _log(f"workload {wl.name}: {len(wl.requests)} requests, upper bound hit ratio {bound_ratio:.3f}; working set "
         f"{bounds['working_set_blocks']:,} blocks ({bounds['shared_working_set_blocks']:,} shared); "
         + (f"fleet KV {bounds['capacity_blocks']:,} blocks, Belady MIN bound {bounds['belady_hit_ratio']:.3f}"
            if bounds["capacity_blocks"] else bounds["note"]))
    out = Path(s.out)
    command = "prefixroute bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    if s.virtual:
        doc, ttfts = virtual_run.run_virtual(wl, bound_ratio, s.routers, num_servers=s.servers, spec=spec,
                                         seed=s.seed, concurrency=s.concurrency, server_args=s.server_args,
                                         log=_log)
    else:
        from prefixroute.bench.fleet import FleetConfig
        from prefixroute.bench.runner import run_bench

        fleet = FleetConfig(s.servers, s.profile, s.server_args, s.startup_timeout_s)
        doc, ttfts = run_bench(wl, bound_ratio, s.routers, fleet, out, log=_log, seed=s.seed,
                               concurrency=s.concurrency, max_connections=s.max_connections,
                               request_timeout_s=s.request_timeout_s, max_duration_s=s.max_duration_s,
                               gateway_args=s.gateway_args, progress=s.progress)
    doc["bounds"] = bounds
    files = report.write_outputs(out, doc, ttfts, command=command)
    print(report.render_markdown(doc, command).split("Plots:")[0].rstrip())
    _log("wrote " + ", ".join(str(p) for p in files.values()))
    if s.overhead:
        overhead_ok = run_overhead(out / "overhead.txt")
    else:
        overhead_ok = True
    failed = [r["router"] for r in doc["runs"] if r["requests"] and r["errors"] == r["requests"]]
    if failed:
        _log(f"every request failed for: {', '.join(failed)} (see {out / 'logs'})")
    # A peer router skipped by --virtual is expected; one that is missing or failed in a real run is not.
    return 1 if (doc.get("skipped") and not s.virtual) or failed or not doc["runs"] or not overhead_ok else 0


def default_out_dir(name: str, now: float | None = None) -> Path:
    """Where a run without --out writes: ``<state folder>/bench/<UTC time>-<workload>``, a new folder per run
    (never the current folder, which may be a checkout; `prefixroute.state`)."""
    from prefixroute.state import state_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(name).name) or "run"
    return state_dir() / "bench" / f"{stamp}-{safe}"


def pressure_server_args(s: BenchSettings, wl: Workload) -> tuple[str, ...]:
    """``--num-gpu-blocks=N`` sized for capacity-pressure (`upper_bound.gpu_blocks_for` at --pressure-kv-ratio)
    when --server-args gives none; nothing for other workloads, a trace, or --pressure-kv-ratio 0."""
    if (s.trace or s.workload != "capacity-pressure" or not s.pressure_kv_ratio > 0
            or any(a == "--num-gpu-blocks" or a.startswith("--num-gpu-blocks=") for a in s.server_args)):
        return ()
    from prefixroute.bench.upper_bound import gpu_blocks_for

    return (f"--num-gpu-blocks={gpu_blocks_for(wl, s.servers, s.pressure_kv_ratio)}",)


def parse_sweep_percents(values: tuple[str, ...]) -> list[float]:
    """--sweep-load-percents as numbers (> 0). ValueError naming the bad entry."""
    out = []
    for v in values:
        try:
            x = float(v.rstrip("%"))
        except ValueError:
            raise ValueError(f"--sweep-load-percents: {v!r} is not a number") from None
        if not x > 0:
            raise ValueError(f"--sweep-load-percents: {v!r} must be > 0")
        out.append(x)
    return out


def resolve_num_requests(virtual: bool, sweep: bool) -> int:
    """--num-requests 0 (the default): 1,500 per point for a virtual sweep (a P99 that means something), else
    300."""
    from prefixroute.bench.sweep import VIRTUAL_SWEEP_NUM_REQUESTS

    return VIRTUAL_SWEEP_NUM_REQUESTS if virtual and sweep else 300


def _run_sweep(s: BenchSettings, wl: Workload, spec: EngineSpec, percents: list[float]) -> int:
    from prefixroute.bench import sweep, sweep_report
    from prefixroute.bench.settings import DEFAULT_ROUTERS

    routers = sweep.default_routers(s.virtual) if tuple(s.routers) == DEFAULT_ROUTERS else tuple(s.routers)
    out = Path(s.out)
    command = "prefixroute bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 2 else ""
    if s.virtual:
        doc = sweep.run_virtual_sweep(wl, routers, num_servers=s.servers, spec=spec,
                                      load_percents=percents, seed=s.seed, server_args=s.server_args, log=_log)
    else:
        from prefixroute.bench.fleet import FleetConfig

        fleet = FleetConfig(s.servers, s.profile, s.server_args, s.startup_timeout_s)
        doc = sweep.run_real_sweep(wl, routers, fleet, out, spec=spec, load_percents=percents,
                                   seed=s.seed, log=_log, concurrency=s.concurrency,
                                   max_connections=s.max_connections, request_timeout_s=s.request_timeout_s,
                                   max_duration_s=s.max_duration_s, gateway_args=s.gateway_args,
                                   progress=s.progress)
    files = sweep_report.write_sweep_outputs(out, doc, command)
    print(sweep_report.render_report(doc, command).split("Plots:")[0].rstrip())
    _log("wrote " + ", ".join(str(p) for p in files.values()))
    ran = [r for p in doc["points"] for r in p["runs"].values()]
    failed = [r for r in ran if r["requests"] and r["errors"] == r["requests"]]
    # As a single run: a peer skipped by --virtual is expected; one missing or failed in a real sweep is not.
    return 1 if (doc.get("skipped") and not s.virtual) or failed or not ran else 0


def run_overhead(path: Path) -> bool:
    """Run `prefixroute overhead-bench` (the extproc component's measurement) with its defaults; its output,
    figures and ratios, goes to `path` and to stdout. True if it succeeded."""
    import subprocess

    from prefixroute.procs import parent_death_preexec, prefixroute_argv, stop_group

    _log("measuring router overhead (prefixroute overhead-bench) ...")
    child = subprocess.Popen(prefixroute_argv("overhead-bench"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                             preexec_fn=parent_death_preexec())
    try:
        stdout, stderr = child.communicate()
    except BaseException:
        # SIGINT first: overhead-bench stops what it started on KeyboardInterrupt (not on SIGTERM).
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=10.0)
        stop_group(child, 0.0)
        raise
    path.write_text(stdout + (f"\n[stderr]\n{stderr}" if child.returncode else ""))
    print(stdout)
    if child.returncode:
        _log(f"overhead-bench failed with code {child.returncode}: {stderr[-500:]}")
    return child.returncode == 0

"""Runs a benchmark: one workload, several routers, the same simulated fleet, fresh caches per run.

For every router, in order:
1. start ``--servers`` fresh model servers (`fleet.start_fleet`), so every run begins with empty KV caches and
   the same configuration;
2. start the router in front of them (our gateway with one policy, or a peer router: `start_router`);
3. replay the *same* request sequence with the streaming client and summarise it;
4. scrape each server's ``/metrics`` (requests served, prefix-cache hits) as a cross-check, stop everything.

Routers are named as `routers.parse_router` reads them. Peer routers (`sglang-router`, `vllm-router`) come from
the optional ``[peers]`` extra; one that is not installed is skipped with a message in the report. ``smg``
(1.13.0) runs from a venv of its own, made on first use under ``~/.cache/prefixroute/peers`` (`peer_script`).
vllm-router's ``kv_aware`` subscribes to the servers' KV events (`kv_event_source_args`).

KV events (bench/fleet.py): when the fleet publishes them, our gateway gets ``--endpoints
host:port@tcp://127.0.0.1:PUB`` and ``--tokenizer sim`` (it must tokenize as the servers do to match their
blocks) and subscribes; vllm-router:kv_aware gets each server's publisher and replay socket; other peers get the
plain endpoints. A router name ``prefixroute:POLICY@SOURCE`` passes
``--index-source SOURCE`` (events, feedback, approximate, auto); without ``@SOURCE`` the gateway's default
(auto: events where published). Servers that cannot publish: the runs go on as before, and ``@events`` runs
are skipped with the reason in the report. Every process is stopped on any failure, and on the `Stopped` that
`prefixroute bench` raises for SIGINT/SIGTERM/SIGHUP (context managers own every child).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixroute.bench import client as bench_client
from prefixroute.bench import results as bench_results
from prefixroute.bench.fleet import (FleetConfig, KVEventsPlan, distinct_free_ports, resolve_kv_events,
                                     scrape_server_counters, served_model, start_fleet)
from prefixroute.bench.routers import PEER_RELEASES, PRIOR_ENV, RouterSpec, parse_router
from prefixroute.bench.virtual_run import engine_spec
from prefixroute.bench.workload_spec import RequestSpec, Workload
from prefixroute.extproc.flow.metrics import parse_flow_counts
from prefixroute.procs import LOOPBACK as HOST
from prefixroute.procs import ProcessGroup, StartupError, free_port, http_get

if TYPE_CHECKING:  # the gateway (Envoy, ext_proc) is imported when our gateway is started
    from prefixroute.extproc.gateway import GatewayProcesses

SETTLE_S = 1.5
"""Wait after a router first answers, so its health probes have reached every endpoint (probe interval 1 s)."""


def _venv_script(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


PEER_VENVS_ENV = "PREFIXROUTE_PEER_VENVS"
SMG_ENV = "PREFIXROUTE_SMG"


def peer_venvs_dir() -> Path:
    """Where the bench keeps the venvs of peers that cannot share ours: ``$PREFIXROUTE_PEER_VENVS``, else
    ``$XDG_CACHE_HOME/prefixroute/peers`` (``~/.cache/prefixroute/peers``)."""
    if os.environ.get(PEER_VENVS_ENV):
        return Path(os.environ[PEER_VENVS_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "prefixroute" / "peers"


def peer_script(kind: str, *, install: bool = False, log: Callable[[str], None] = print) -> str | None:
    """The launcher script of a peer that lives in a venv of its own (smg: its ``smg`` script clashes with
    sglang-router 0.3.2's in ours). ``$PREFIXROUTE_SMG`` (a path to an ``smg`` script) wins; else
    ``<peer_venvs_dir>/smg-1.13.0/bin/smg``, created on first use when `install` (``python -m venv`` + ``pip
    install smg==1.13.0``: pip's cache makes a repeat quick; its output in ``install.log`` there). None when
    absent (or the install failed)."""
    if kind != "smg":
        raise ValueError(f"no venv of its own for {kind!r}")
    if os.environ.get(SMG_ENV):
        return os.environ[SMG_ENV] if os.access(os.environ[SMG_ENV], os.X_OK) else None
    requirement = PEER_RELEASES[kind]
    venv = peer_venvs_dir() / requirement.replace("==", "-")
    script = venv / "bin" / "smg"
    if script.exists() or not install:
        return str(script) if script.exists() else None
    log(f"installing {requirement} into {venv} (once; see {venv / 'install.log'})")
    venv.mkdir(parents=True, exist_ok=True)
    with open(venv / "install.log", "wb") as out:
        ok = (subprocess.run([sys.executable, "-m", "venv", str(venv)], stdout=out, stderr=out).returncode == 0
              and subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
                                 stdout=out, stderr=out).returncode == 0)
    return str(script) if ok and script.exists() else None


NO_EVENTS_REASON = ("the model servers do not publish KV events here (`prefixroute model-server --help` lists no "
                    "--kv-events-config), so an events-only index would match nothing")


def unavailable_reason(spec: RouterSpec, kv_events: bool = True) -> str | None:
    """Why `spec` cannot run here (peer router not installed; an events-only index on a fleet without KV events),
    None if it can."""
    if spec.index_source == "events" and not kv_events:
        return NO_EVENTS_REASON
    if spec.kind == "sglang-router" and importlib.util.find_spec("sglang_router") is None:
        return "not installed: pip install 'prefixroute[peers]' (sglang-router==0.3.2)"
    if spec.kind == "vllm-router" and _venv_script("vllm-router") is None:
        return "not installed: pip install 'prefixroute[peers]' (vllm-router==0.1.17)"
    if spec.kind == "vllm-router" and spec.policy == "kv_aware" and not kv_events:
        return "kv_aware reads the servers' KV events, and this fleet publishes none"
    if spec.kind == "smg" and peer_script("smg", install=True) is None:
        return (f"{PEER_RELEASES['smg']} could not be installed into {peer_venvs_dir()} (see install.log there); "
                f"or point ${SMG_ENV} at an smg script")
    return None


def gateway_event_args(spec: RouterSpec, kv_events: bool) -> tuple[str, ...]:
    """Flags our gateway gets for `spec`: ``--index-source`` when the name sets one, and ``--tokenizer sim`` (the
    simulated servers' own tokenizer: requests hash to the servers' token blocks, and cached-token feedback
    compares like with like) for every source but approximate, which keeps its text-block hashing.
    `kv_events`: the fleet publishes (unused here: without events auto is feedback, on token blocks too)."""
    del kv_events
    out: list[str] = []
    if spec.index_source:
        out += ["--index-source", spec.index_source]
    if spec.index_source != "approximate":
        out += ["--tokenizer", "sim"]
    return tuple(out)


# ---------------------------------------------------------------------------------------------- routers


def _start_gateway(stack: contextlib.ExitStack, spec: RouterSpec, endpoints: Sequence[str], port: int, *,
                   seed: int, gateway_args: Sequence[str], log_dir: Path | None) -> GatewayProcesses:
    """Our gateway (Envoy + ext_proc) through its Python API; `gateway_args` are `prefixroute gateway` flags.
    Returns its `GatewayProcesses` (``envoy``: the process clients talk to; ``metrics_port``: the router's
    /metrics)."""
    import argparse

    from prefixroute import settings as settings_mod
    from prefixroute.extproc.endpoints.settings import PoolSettings
    from prefixroute.extproc import gateway
    from prefixroute.extproc.peers.settings import PeerSettings
    from prefixroute.extproc.routing.settings import RoutingSettings

    parser = argparse.ArgumentParser(prog="prefixroute gateway", add_help=False)
    gateway.configure_parser(parser)
    try:
        ns = parser.parse_args(["--port", str(port), "--ports", "random", "--endpoints", ",".join(endpoints), "--policy", spec.policy,
                                "--extproc-replicas", str(spec.replicas),
                                # The bench attributes each request to the endpoint that served it (a testbed's
                                # private addresses: fine to show the bench's own client).
                                "--expose-served-endpoint",
                                *(["--routing-filter", spec.routing_filter] if spec.routing_filter else []), *gateway_args])
    except SystemExit:
        raise StartupError(f"bad --gateway-args {list(gateway_args)}") from None
    procs = gateway.GatewayProcesses(
        settings_mod.from_namespace(gateway.GatewaySettings, ns),
        # A fixed seed makes the random policy and tie breaks replayable (unless --gateway-args sets one).
        settings_mod.from_namespace(RoutingSettings, ns, **({} if ns.rng_seed is not None else {"rng_seed": seed})),
        settings_mod.from_namespace(PoolSettings, ns), log_dir=log_dir,
        peers=settings_mod.from_namespace(PeerSettings, ns),
        # +flow / -flow in the router's name: the ext_proc's flow control on / off (else its default: on).
        extra_extproc_args=[] if spec.flow is None else ["--flow-control" if spec.flow else "--no-flow-control"])
    # Registered before start (stop is idempotent): a stop signal in between still stops both children.
    stack.callback(procs.stop)
    try:
        procs.start()
    except (RuntimeError, OSError) as exc:
        raise StartupError(f"gateway for {spec.name}: {exc}") from exc
    assert procs.envoy is not None  # set by start()
    return procs


@dataclasses.dataclass(frozen=True)
class RouterHandle:
    """A started router: its base URL, and for our gateway the URLs of its replicas' /metrics (empty otherwise)."""

    base_url: str
    metrics_urls: tuple[str, ...] = ()


def _log_name(spec: RouterSpec) -> str:
    return spec.name.replace(":", "-").replace("@", "-").replace("/", "-").replace("#", "-")


def kv_event_source_args(gateway_endpoints: Sequence[str], block_size: int, model: str) -> list[str]:
    """vllm-router's ``kv_aware`` flags for endpoints in our ``--endpoints`` form (``host:port@tcp://H:P``): one
    ``--kv-event-source http://host:port=tcp://H:P`` and ``--kv-event-replay-source ...=tcp://H:P+1`` (the
    replay socket beside each publisher, as the bench's fleet and vLLM's example config place it) per worker,
    the servers' block size and the model they serve (0.1.17 refuses static sources without it)."""
    argv: list[str] = []
    for spec in gateway_endpoints:
        ep, at, address = spec.partition("@")
        if not at:
            raise ValueError(f"{spec!r}: no KV-event address (kv_aware needs the servers' events)")
        host, _, port = address.rpartition(":")
        argv += ["--kv-event-source", f"http://{ep}={address}",
                 "--kv-event-replay-source", f"http://{ep}={host}:{int(port) + 1}"]
    return [*argv, "--kv-event-block-size", str(block_size), "--kv-event-model", model]


def start_router(group: ProcessGroup, stack: contextlib.ExitStack, spec: RouterSpec, endpoints: Sequence[str], *,
                 seed: int, gateway_args: Sequence[str] = (), startup_timeout_s: float = 60.0,
                 gateway_endpoints: Sequence[str] | None = None, kv_block_size: int = 16,
                 model: str = "") -> RouterHandle:
    """Start `spec` in front of `endpoints`; returns its handle once it routes to the fleet.

    Ready means the router answers ``GET /v1/models`` with 200 (it has a healthy endpoint); sglang-router and
    smg additionally answer ``/readiness`` with 200 (every worker healthy; smg: at least one). `gateway_endpoints`
    (our gateway's --endpoints, e.g. with their KV-event addresses) replaces `endpoints` for our gateway, and
    gives vllm-router ``kv_aware`` its event sources (servers of `kv_block_size` tokens per block, serving
    `model`); other peers get the plain `endpoints`.
    """
    port = free_port()
    base = f"http://{HOST}:{port}"
    urls = [f"http://{e}" for e in endpoints]
    name = f"router-{_log_name(spec)}"
    metrics_urls: tuple[str, ...] = ()
    if spec.kind == "prefixroute":
        gw = _start_gateway(stack, spec, gateway_endpoints or endpoints, port, seed=seed, gateway_args=gateway_args,
                            log_dir=group.log_dir / name if group.log_dir is not None else None)
        proc = gw.envoy
        metrics_urls = tuple(f"http://{HOST}:{p}/metrics" for p in gw.metrics_ports if p > 0)

        def ready() -> bool:
            return http_get(f"{base}/v1/models")[0] == 200
    elif spec.kind == "sglang-router":
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
                "--worker-urls", *urls, "--policy", spec.policy, "--prometheus-host", HOST,
                "--prometheus-port", str(free_port()), "--log-level", "warn"]
        proc = group.start(name, argv, wait=False)

        def ready() -> bool:
            return http_get(f"{base}/readiness")[0] == 200 and http_get(f"{base}/v1/models")[0] == 200
    elif spec.kind == "smg":
        # smg 1.13.0, the SGLang Model Gateway (its own venv: peer_script). Without a tokenizer (the servers'
        # models are not on a hub it can reach) its cache_aware matches request text, as sglang-router's does.
        argv = [peer_script("smg") or "smg", "launch", "--host", HOST, "--port", str(port), "--worker-urls", *urls,
                "--policy", spec.policy, "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                "--disable-tokenizer-autoload", "--log-level", "warn"]
        proc = group.start(name, argv, wait=False)

        def ready() -> bool:
            return http_get(f"{base}/readiness")[0] == 200 and http_get(f"{base}/v1/models")[0] == 200
    else:
        # Its Prometheus exporter's own port too (default 29000, which sglang-router's takes as well): a busy
        # default port makes it exit at start.
        argv = [_venv_script("vllm-router") or "vllm-router", "--host", HOST, "--port", str(port),
                "--worker-urls", *urls, "--policy", spec.policy, "--prometheus-host", HOST,
                "--prometheus-port", str(free_port())]
        if spec.policy == "kv_aware":
            if not gateway_endpoints:
                raise StartupError(f"{spec.name}: kv_aware needs the servers' KV-event addresses")
            argv += kv_event_source_args(gateway_endpoints, kv_block_size, model or served_model(endpoints[0]))
        proc = group.start(name, argv, wait=False)

        def ready() -> bool:
            return http_get(f"{base}/v1/models")[0] == 200
    proc.wait_ready(startup_timeout_s, ready=ready)
    if spec.kind not in ("sglang-router", "smg"):
        # Answering means one endpoint is healthy; every endpoint gets its first health probe within ~1 s of
        # start (gateway and vllm-router alike). Settle so the run starts with the whole fleet eligible.
        time.sleep(SETTLE_S)
    return RouterHandle(base, metrics_urls)


_ROUTER_METRIC_RE = re.compile(r'^(prefixroute_prompt_tokens_total|prefixroute_predicted_hit_tokens_total|'
                               r'prefixroute_actual_hit_tokens_total|prefixroute_tier_predicted_prompt_tokens_total)'
                               r'(?:\{[^}]*\})?\s+([0-9.eE+-]+)$', re.M)
_TIER_METRIC_RE = re.compile(r'^prefixroute_predicted_tier_hit_tokens_total\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)
# An index-source-per-endpoint series, whatever its exact name (`..._index_source...{endpoint=..,source=..} 1`).
_SOURCE_METRIC_RE = re.compile(r'^prefixroute_\w*index_source\w*\{([^}]*)\}\s+([0-9.eE+-]+)$', re.M)
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_router_metrics(text: str) -> dict[str, Any]:
    """From our router's /metrics text: prompt, predicted-hit and actual-hit tokens summed over endpoints, the
    predicted and actual hit ratios they give (None without prompt tokens), and, where the router exposes one,
    the index source per endpoint (a ``prefixroute_*index_source*{endpoint, source}`` series at 1), and flow
    control's counters (``flow``: `extproc.flow.metrics.parse_flow_counts`) when it ran."""
    sums: dict[str, float] = {}
    for m in _ROUTER_METRIC_RE.finditer(text):
        key = m.group(1).removeprefix("prefixroute_").removesuffix("_total")
        sums[key] = sums.get(key, 0.0) + float(m.group(2))
    prompt = sums.get("prompt_tokens", 0.0)
    out: dict[str, Any] = {
        "prompt_tokens": int(prompt), "predicted_hit_tokens": round(sums.get("predicted_hit_tokens", 0.0), 1),
        "actual_hit_tokens": int(sums.get("actual_hit_tokens", 0.0)),
        "predicted_hit_ratio": round(sums.get("predicted_hit_tokens", 0.0) / prompt, 6) if prompt else None,
        "actual_hit_ratio": round(sums.get("actual_hit_tokens", 0.0) / prompt, 6) if prompt else None,
    }
    tier_prompt = sums.get("tier_predicted_prompt_tokens", 0.0)
    if tier_prompt:  # the hit prediction by KV tier (a tier-aware events index: lifecycle_listeners.py)
        by_tier: dict[str, float] = {}
        for m in _TIER_METRIC_RE.finditer(text):
            tier = dict(_LABEL_RE.findall(m.group(1))).get("tier", "")
            by_tier[tier] = by_tier.get(tier, 0.0) + float(m.group(2))
        out["predicted_by_tier"] = {t: round(by_tier.get(t, 0.0) / tier_prompt, 6) for t in ("gpu", "cpu")}
    sources: dict[str, str] = {}
    for m in _SOURCE_METRIC_RE.finditer(text):
        labels = dict(_LABEL_RE.findall(m.group(1)))
        if float(m.group(2)) > 0 and "source" in labels:
            sources[labels.get("endpoint", "")] = labels["source"]
    if sources:
        out["index_source_by_endpoint"] = sources
    flow = parse_flow_counts(text)  # flow control's held / released / shed counts, when it ran
    if flow is not None:
        out["flow"] = flow
    return out


def scrape_router_metrics(urls: Sequence[str]) -> dict[str, Any] | None:
    """`parse_router_metrics` of every replica's /metrics at `urls` together (its sums add up); None when there is
    none or one does not answer."""
    texts = []
    for url in urls:
        status, body = http_get(url)
        if status != 200:
            return None
        texts.append(body.decode(errors="replace"))
    return parse_router_metrics("\n".join(texts)) if texts else None


# ------------------------------------------------------------------------------------------------- runs


def host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU time of the whole host, all cores, in clock ticks (/proc/stat; None where there is
    none). Two readings give the host's busy share of its cores in between: client, Envoy, router, servers
    and anything else running (on a shared 2-core machine a run that keeps it high measures its own client)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is already counted in user


def _process_role(argv: list[str]) -> str:
    """The bench role of one process from its argv: ``servers`` (model servers), ``envoy``, ``router`` (our
    ext_proc replicas and the peers' router processes), ``other`` (anything else below the bench)."""
    head = " ".join(argv[:4])
    if "model-server" in head:
        return "servers"
    if argv and os.path.basename(argv[0]).startswith("envoy"):
        return "envoy"
    # sglang-router's process renames itself "sglang::router" once started.
    if "extproc" in head or "sglang" in head or "vllm-router" in head or "vllm_router" in head:
        return "router"
    return "other"


def process_cpu_s() -> dict[int, tuple[str, float]]:
    """{pid: (role, user+system CPU seconds)} of this process (role ``client``) and every process below it
    (/proc; empty where there is none). A process whose own argv names no role takes its nearest ancestor's (a
    router's worker processes are the router's). Two readings, per pid, give each role's CPU in between; a
    process that started or exited in between counts from or up to the reading that saw it."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    me = os.getpid()
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            continue
    roles: dict[int, str | None] = {me: "client"}  # None: not below this process

    def role_of(pid: int, depth: int = 0) -> str | None:
        if pid in roles:
            return roles[pid]
        parent = role_of(stats[pid][0], depth + 1) if pid in stats and depth < 64 else None
        role = None
        if parent is not None:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                argv = []
            mine = _process_role(argv)
            role = parent if mine == "other" and parent != "client" else mine
        roles[pid] = role
        return role

    out: dict[int, tuple[str, float]] = {}
    for pid, (_ppid, cpu_s) in stats.items():
        role = role_of(pid)
        if role:
            out[pid] = (role, cpu_s)
    return out


def cpu_by_role_ms(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                   num_requests: int) -> dict[str, float] | None:
    """Each role's CPU between two `process_cpu_s` readings, in ms per request (None: no requests or no
    readings)."""
    if not num_requests or not after:
        return None
    roles: dict[str, float] = {}
    for pid, (role, cpu_s) in after.items():
        roles[role] = roles.get(role, 0.0) + cpu_s - (before[pid][1] if pid in before else 0.0)
    return {role: round(v / num_requests * 1e3, 3) for role, v in sorted(roles.items())}


@dataclasses.dataclass
class RunOutput:
    summary: dict[str, Any]
    ttfts_ms: list[float]
    per_request: bench_results.PerRequest = dataclasses.field(default_factory=dict)


def prior_gateway_args(fleet: FleetConfig) -> tuple[str, ...]:
    """Our gateway's time-model prior for the simulated fleet it fronts: the servers' own speed
    (`EngineSpec.time_model_prior`, their profile and --time-scale), as an operator sets
    ``--ttft-prior-tokens-per-s`` for their GPUs. Nothing when the environment sets a prior (the operator's
    wins) or the server flags are not the fleet simulator's."""
    if any(os.environ.get(name) for name in PRIOR_ENV):
        return ()
    try:
        rate, base = engine_spec(fleet.profile, fleet.server_args, allow_unsimulated=True).time_model_prior()
    except ValueError:
        return ()
    return (f"--ttft-prior-tokens-per-s={rate:.6g}", f"--ttft-prior-base-s={base:.6g}")


def fleet_block_size(fleet: FleetConfig) -> int:
    """The servers' KV block size: ``--block-size`` in the fleet's --server-args, else the simulated server's
    default (16, vLLM's on CUDA)."""
    args = list(fleet.server_args)
    for i, a in enumerate(args):
        if a.startswith("--block-size="):
            return int(a.split("=", 1)[1])
        if a == "--block-size" and i + 1 < len(args):
            return int(args[i + 1])
    return 16


def run_router(spec: RouterSpec, requests: Sequence[RequestSpec], fleet: FleetConfig, log_dir: Path, *,
               seed: int, concurrency: int, max_connections: int, request_timeout_s: float, max_duration_s: float,
               gateway_args: Sequence[str] = (), progress: bool = True) -> RunOutput:
    """One router on a fresh fleet; every process stopped before returning (or raising). The fleet publishes KV
    events when ``fleet.kv_events`` (None is resolved here, see `resolve_kv_events`)."""
    fleet = resolve_kv_events(fleet)
    if spec.kind == "prefixroute":
        # the user's flags come last and win
        gateway_args = (*prior_gateway_args(fleet), *gateway_event_args(spec, bool(fleet.kv_events)), *gateway_args)
    events = KVEventsPlan.allocate(fleet.num_servers) if fleet.kv_events else None
    # Exit order: the router (stack) first, then the servers (group).
    with ProcessGroup(log_dir / _log_name(spec)) as group, contextlib.ExitStack() as stack:
        endpoints = start_fleet(group, fleet, events)
        model = served_model(endpoints[0])
        handle = start_router(group, stack, spec, endpoints, seed=seed, gateway_args=gateway_args,
                              startup_timeout_s=fleet.startup_timeout_s,
                              gateway_endpoints=events.gateway_endpoints(endpoints) if events else None,
                              kv_block_size=fleet_block_size(fleet), model=model)
        base = handle.base_url
        bar = bench_client.Progress(len(requests), label=f"{spec.name:<28}", enabled=progress)
        cpu0, procs0 = host_cpu_times(), process_cpu_s()
        t0 = time.perf_counter()
        res = asyncio.run(bench_client.run_workload(
            base, requests, model=model, concurrency=concurrency, max_connections=max_connections,
            timeout_s=request_timeout_s, max_duration_s=max_duration_s, progress=bar, api=spec.workload_api))
        wall_s = time.perf_counter() - t0
        cpu1, procs1 = host_cpu_times(), process_cpu_s()
        counters = scrape_server_counters(endpoints)
        router_metrics = scrape_router_metrics(handle.metrics_urls)
    # Attribute requests to endpoints from the response headers; peers that drop them fall back to the
    # servers' own request counters.
    if not any(r.endpoint for r in res):
        served = {ep: c.get("request_success", 0.0) for ep, c in counters.items()}
        total = sum(served.values())
        share = {ep: round(v / total, 6) if total else 0.0 for ep, v in served.items()}
        share_source = "server metrics"
    else:
        share = None
        share_source = "response headers"
    hits = sum(c.get("prefix_cache_hits", 0.0) for c in counters.values())
    queries = sum(c.get("prefix_cache_queries", 0.0) for c in counters.values())
    summary = bench_results.summarize_run(spec.name, res, endpoints, extra={
        "policy": spec.policy, "wall_s": round(wall_s, 3), "not_started": len(requests) - len(res),
        "endpoint_share_source": share_source,
        "server_hit_ratio": round(hits / queries, 6) if queries else None,
        "server_requests": {ep: c.get("request_success") for ep, c in counters.items()},
        "host_cpu_busy_ratio": (round((cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]), 3)
                                if cpu0 and cpu1 and cpu1[1] > cpu0[1] else None),
        "cpu_ms_per_request": cpu_by_role_ms(procs0, procs1, len(res)),
        "kv_events": bool(fleet.kv_events),
        **({"index_source": spec.index_source or "auto"} if spec.kind == "prefixroute" else {}),
        **({"router_metrics": router_metrics} if router_metrics is not None else {}),
        **({"agents": bench_results.agent_summary(res, spec.workload_api)}
           if any(r.responses is not None for r in requests) else {}),
    })
    tiers = tiers_from_servers(summary["extra"], counters, router_metrics)
    if tiers is not None:
        summary["extra"]["hit_ratio_by_tier"] = tiers
    if share is not None:
        summary["endpoint_share"] = share
        fair = 1.0 / len(share) if share else 0.0
        summary["extra"]["max_share_over_fair"] = round(max(share.values()) / fair, 3) if share and fair else None
    return RunOutput(summary, [r.ttft_ms for r in res if r.ok and r.ttft_ms is not None],
                     bench_results.per_request(res))


def tiers_from_servers(extra: Mapping[str, Any], counters: Mapping[str, Mapping[str, float]],
                       router_metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Real processes: the hit ratio by KV tier of one run (``extra["hit_ratio_by_tier"]``, as the virtual fleet
    writes it from each request's figures), from the servers' counters: CPU = tokens loaded from their host tier
    (``vllm:external_prefix_cache_hits``) over the prompt tokens the client sent, GPU = the client's cached tokens
    less those; ``predicted`` = the router's prediction by tier (its ``predicted_by_tier``), where it made one.
    None when no server loaded anything from a host tier (no tier, or never used). A server counts a request's
    external hits each time it schedules it (a preempted request twice), as vLLM does: under preemption the CPU
    share reads high."""
    cpu_tokens = sum(c.get("external_prefix_cache_hits", 0.0) for c in counters.values())
    prompt = extra.get("prompt_tokens") or 0
    if not cpu_tokens or not prompt:
        return None
    cpu = min(1.0, cpu_tokens / prompt)
    out: dict[str, Any] = {"gpu": round(max(0.0, (extra.get("cached_tokens") or 0) / prompt - cpu), 6),
                           "cpu": round(cpu, 6), "source": "server metrics"}
    pred = (router_metrics or {}).get("predicted_by_tier")
    if pred:
        out["predicted"] = dict(pred)
    return out


def run_bench(workload: Workload, upper_bound_hit_ratio: float | None, routers: Sequence[str], fleet: FleetConfig,
              out_dir: Path, *, log: Callable[[str], None] = print, **run_kw: Any) -> tuple[dict, dict]:
    """Run every router on the same request sequence; returns (results document, TTFTs per router)."""
    specs = [parse_router(r) for r in routers]
    if not fleet.ports:
        # Same ports for every run: endpoint ids (and so endpoint shares) compare across routers.
        fleet = dataclasses.replace(fleet, ports=distinct_free_ports(fleet.num_servers))
    fleet = resolve_kv_events(fleet)  # once: every router meets the same fleet
    runs, ttfts, skipped, rows = [], {}, {}, {}
    for spec in specs:
        reason = unavailable_reason(spec, bool(fleet.kv_events))
        if reason:
            log(f"skipping {spec.name}: {reason}")
            skipped[spec.name] = reason
            continue
        try:
            out = run_router(spec, workload.requests, fleet, out_dir / "logs", **run_kw)
        except StartupError as exc:
            log(f"skipping {spec.name}: failed to start: {exc}")
            skipped[spec.name] = f"failed to start: {str(exc).splitlines()[0]}"
            continue
        runs.append(out.summary)
        ttfts[spec.name] = out.ttfts_ms
        rows[spec.name] = out.per_request
    doc = bench_results.results_document(workload.describe(), upper_bound_hit_ratio, runs)
    doc["workload"]["num_servers"] = fleet.num_servers
    doc["workload"]["kv_events"] = bool(fleet.kv_events)
    if skipped:
        doc["skipped"] = skipped
    reference = bench_results.paired_reference(list(rows))
    if reference is not None and len(rows) > 1:
        doc["paired_ttft"] = bench_results.paired_ttft(rows, reference)
    return doc, ttfts
